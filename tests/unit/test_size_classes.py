"""Delays per size class, the prefill fit, the cold rule and the conversation memory: pure
parts, on a plain-number clock."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from gateway.hedge.classes import ClassDelays
from gateway.hedge.delay import HedgeDelay
from gateway.hedge.prefill import (
    MAX_CLASS,
    MIN_CLASS,
    ConversationMemory,
    PrefillFit,
    cold_hedge,
    estimate_tokens,
    new_tokens,
    size_class,
)
from gateway.hedge.sizing import ColdRule, RequestSize, SizedDelays
from gateway.settings import DelaySettings

SETTINGS = DelaySettings(quantile=0.9, min=0.01, max=10.0, initial=0.5, window=60.0,
                         min_samples=20)
#: the simulated backend: 150 ms, plus 60 ms per 1,000 uncached tokens
BASE, RATE = 0.150, 60e-6


def ttft(tokens: int, rng: random.Random) -> float:
    return (BASE + RATE * tokens) * rng.uniform(0.9, 1.1)


#: one observation in STRAGGLE_EVERY of each size straggles by STRAGGLE seconds
STRAGGLE_EVERY, STRAGGLE = 20, 1.5


def taught(sizes: dict[int, int], *, seed: int = 1, settings: DelaySettings = SETTINGS,
           straggle_every: int = STRAGGLE_EVERY) -> tuple[ClassDelays, float]:
    """A backend's classes after `count` observations of each size (tokens -> count), the
    way the race feeds them (the one delay over all requests too), then one refresh."""
    rng = random.Random(seed)
    classes = ClassDelays(HedgeDelay(settings))
    now = 0.0
    for tokens, count in sizes.items():
        for i in range(count):
            value = ttft(tokens, rng) + (STRAGGLE if i % straggle_every == 10 else 0.0)
            classes.overall.observe(value, now)
            classes.observe(tokens, value, now)
            now += 0.01
    classes.overall.refresh(now)
    classes.refresh(now)
    return classes, now


def test_size_classes_are_log2_buckets() -> None:
    assert size_class(0) == size_class(1) == size_class(255) == MIN_CLASS
    assert size_class(256) == 8 and size_class(511) == 8 and size_class(512) == 9
    assert size_class(30_000) == 14 and size_class(32_768) == 15
    assert size_class(10**9) == MAX_CLASS
    assert estimate_tokens(4_003) == 1_000 and estimate_tokens(-5) == 0


def test_prefill_fit_is_the_line_through_the_points() -> None:
    fit = PrefillFit.of([(1_000, 0.21, 10), (10_000, 0.75, 10), (30_000, 1.95, 5)])
    assert fit is not None
    assert fit.ms_per_1k == pytest.approx(60, rel=1e-6)
    assert fit.base == pytest.approx(0.15, rel=1e-6)
    assert fit.ttft(20_000) == pytest.approx(1.35, rel=1e-6)


def test_prefill_fit_stays_physical() -> None:
    assert PrefillFit.of([(1_000, 0.2, 3)]) is None  # one size: no slope to read
    assert PrefillFit.of([(1_000, 0.2, 3), (1_000, 0.4, 3)]) is None
    flat = PrefillFit.of([(1_000, 0.3, 1), (9_000, 0.2, 1)])  # longer is faster: noise
    assert flat is not None and flat.rate == 0 and flat.base == pytest.approx(0.25)
    steep = PrefillFit.of([(1_000, 0.01, 1), (2_000, 1.0, 1)])  # base below 0: through 0
    assert steep is not None and steep.base == 0.0 and steep.rate > 0


def test_each_class_learns_its_own_delay() -> None:
    classes, now = taught({200: 60, 30_000: 60})
    short, long = classes.delay(200, now), classes.delay(30_000, now)
    assert short == pytest.approx((BASE + RATE * 200) * 1.1, rel=0.05)
    assert long == pytest.approx((BASE + RATE * 30_000) * 1.1, rel=0.05)
    # the one delay over both sizes is neither: what every request used to wait
    mixed = classes.overall.delay(now)
    assert short * 2 < mixed
    median = classes.median(30_000, now)
    assert median is not None and median == pytest.approx(BASE + RATE * 30_000, rel=0.05)


def test_the_prefill_rate_is_fitted_from_the_class_medians() -> None:
    classes, _ = taught({200: 40, 4_000: 40, 30_000: 40})
    assert classes.fit is not None
    assert classes.fit.ms_per_1k == pytest.approx(RATE * 1e6, rel=0.1)
    assert classes.fit.base == pytest.approx(BASE, rel=0.25)
    # a straggling share does not tilt it: the points are medians
    rng = random.Random(7)
    for i in range(8):
        classes.observe(200, ttft(200, rng) + 1.5, 2.0 + i * 0.01)
    classes.refresh(2.1)
    assert classes.fit is not None and classes.fit.ms_per_1k == pytest.approx(60, rel=0.1)


def test_a_sparse_class_borrows_from_its_nearest_neighbour_scaled_by_the_rate() -> None:
    classes, now = taught({200: 60, 30_000: 60, 8_000: 3})
    # 8,000 tokens: class 12, three observations (under min_samples); its nearest learnt
    # class is 30,000's (two doublings up), shifted down by 22,000 tokens of prefill
    expected = classes.median(30_000, now)
    assert expected is not None and classes.fit is not None
    expected += classes.fit.rate * (8_000 - 30_000)
    borrowed = classes.median(8_000, now)
    assert borrowed == pytest.approx(expected, rel=1e-6)
    assert borrowed == pytest.approx(BASE + RATE * 8_000, rel=0.15)
    delay = classes.delay(8_000, now)
    assert classes.delay(200, now) < delay < classes.delay(30_000, now)
    # once it has min_samples of its own, it uses them
    rng = random.Random(3)
    for i in range(20):
        classes.observe(8_000, 5.0 + rng.uniform(0, 0.01), now + i * 0.01)
    classes.refresh(now + 1)
    assert classes.median(8_000, now + 1) == pytest.approx(5.0, rel=0.02)


def test_borrowing_between_equal_neighbours_averages_them() -> None:
    classes, now = taught({1_000: 40, 4_000: 40})  # classes 9 and 11; 2,500 is class 11
    assert size_class(2_000) == 10
    d9, d11 = classes.median(1_000, now), classes.median(4_000, now)
    assert d9 is not None and d11 is not None and classes.fit is not None
    rate = classes.fit.rate
    got = classes.median(2_000, now)
    # each neighbour shifted to 2,000 tokens by the rate, from its running mean of tokens
    assert got == pytest.approx((d9 + rate * 1_000 + d11 - rate * 2_000) / 2, rel=0.02)


def test_without_a_fit_nothing_is_borrowed() -> None:
    classes, now = taught({30_000: 40})
    assert classes.fit is None
    # a neighbour's value cannot be moved to another size without a rate: the one delay
    assert classes.median(8_000, now) == classes.overall.median(now)
    assert classes.delay(8_000, now) == classes.overall.delay(now)
    assert classes.cold_prefill(8_000) is None


def test_a_class_far_from_any_learnt_one_reads_the_backend_without_its_prefill() -> None:
    # 200 and 30,000 tokens learnt: the fit is drawn at the first refresh, so a second round
    # of the same traffic feeds the sketch of every TTFT with its prefill taken off
    classes, now = taught({200: 40, 30_000: 40})
    assert classes.fit is not None
    rng = random.Random(5)
    for tokens in (200, 30_000):
        for _ in range(40):
            value = ttft(tokens, rng)
            classes.overall.observe(value, now)
            classes.observe(tokens, value, now)
            now += 0.01
    classes.refresh(now)
    assert classes.unprefilled.learnt(now)
    # 2,000,000 tokens: seven classes above the longest learnt one, nothing to borrow nearby
    base = classes.unprefilled.median(now)
    assert base is not None and base == pytest.approx(BASE, rel=0.15)
    expected = base + classes.fit.rate * 2_000_000
    assert classes.median(2_000_000, now) == pytest.approx(expected, rel=1e-9)
    assert classes.median(2_000_000, now) == pytest.approx(BASE + RATE * 2_000_000, rel=0.1)


def test_a_size_beyond_anything_answered_waits_the_longest_delay_until_known() -> None:
    # short requests only: no rate, so nothing can say when a 30,000-token prompt is late
    classes, now = taught({200: 40})
    assert classes.fit is None
    assert classes.delay(30_000, now) == SETTINGS.max
    assert classes.delay(200, now) < 0.3  # its own class
    classes.observe(30_000, 2.0, now)  # once such a size was answered, the one delay
    assert classes.delay(30_000, now) == classes.overall.delay(now)
    # a backend that answered nothing yet keeps the one delay (`initial` at a pool's start)
    fresh = ClassDelays(HedgeDelay(SETTINGS))
    assert fresh.delay(30_000, 0.0) == SETTINGS.initial


def test_before_any_class_learns_the_one_delay_applies() -> None:
    classes, now = taught({200: 5, 30_000: 5})
    assert not classes.learnt(now)
    assert classes.delay(30_000, now) == classes.overall.delay(now) == SETTINGS.initial
    assert classes.tail(30_000, now) is None


def test_fixed_mode_keeps_its_value_but_the_classes_still_learn() -> None:
    fixed = DelaySettings(mode="fixed", value=0.3, min_samples=20)
    classes, now = taught({200: 40, 30_000: 40}, settings=fixed)
    assert classes.delay(30_000, now) == 0.3
    assert classes.fit is not None and classes.tail(30_000, now) is not None


def test_the_delay_is_clamped() -> None:
    tight = DelaySettings(quantile=0.9, min=0.5, max=1.0, min_samples=20)
    classes, now = taught({200: 40, 30_000: 40}, settings=tight)
    assert classes.delay(200, now) == 0.5 and classes.delay(30_000, now) == 1.0


def test_reload_keeps_what_the_classes_learnt() -> None:
    classes, now = taught({200: 40, 30_000: 40})
    wider = DelaySettings(quantile=0.9, min=0.01, max=20.0, min_samples=20)
    overall = classes.overall.adopt(wider, budget_ratio=0.1, now=now)
    moved = classes.adopt(overall, budget_ratio=0.1, now=now)
    assert moved.settings is wider and moved.fit == classes.fit
    assert moved.delay(30_000, now) == pytest.approx(classes.delay(30_000, now), rel=1e-6)


# -- the request's view and the cold rule ------------------------------------------------------


def pool_of(*sizes: dict[int, int], straggle_every: int = STRAGGLE_EVERY
            ) -> dict[str, ClassDelays]:
    return {name: taught(s, seed=i, straggle_every=straggle_every)[0]
            for i, (name, s) in enumerate(zip("ab", sizes, strict=True))}


def test_a_request_reads_each_backend_at_its_own_uncached_size() -> None:
    learnt = {200: 40, 4_000: 40, 30_000: 40}
    classes = pool_of(learnt, learnt)
    # turn 3 of a conversation: 92,000 tokens, of which 30,000 are new since turn 2
    size = RequestSize(tokens=92_000, new=30_000, home="a")
    assert size.uncached("a") == 30_000 and size.uncached("b") == 92_000
    view = SizedDelays(classes, size)
    now = 10.0
    assert view["a"].delay(now) == classes["a"].delay(30_000, now)
    assert view["b"].median(now) == classes["b"].median(92_000, now)
    assert classes["b"].delay(92_000, now) > classes["a"].delay(30_000, now)
    # away from its warm home the request is hedged no later than the home's own delay: the
    # hedge goes home, where only the new 30,000 tokens need prefilling
    assert view["b"].delay(now) == view["a"].delay(now)
    first_turn = SizedDelays(classes, RequestSize(tokens=92_000, new=92_000, home="a"))
    assert first_turn["b"].delay(now) == classes["b"].delay(92_000, now)  # no warm home
    assert set(view) == {"a", "b"} and len(view) == 2
    # observing feeds the backend's one delay and the request's class there
    before = classes["a"].overall.observations
    view["a"].observe(1.9, now)
    assert classes["a"].overall.observations == before + 1
    # per-class delays off: the one delay is read, the classes still learn
    flat = SizedDelays(classes, size, by_size=False)
    assert flat["b"].delay(now) == classes["b"].overall.delay(now)


def test_cold_hedge_rule() -> None:
    # the copy's prefill takes 2 s; the primary has almost surely answered by 3.5 s
    assert cold_hedge(elapsed=2.0, primary_tail=3.5, cold_prefill=2.0)
    assert not cold_hedge(elapsed=1.0, primary_tail=3.5, cold_prefill=2.0)
    # past its tail the primary is beyond anything its class showed: hedge
    assert not cold_hedge(elapsed=3.6, primary_tail=3.5, cold_prefill=20.0)
    # at its tail (a narrow distribution: q90 and q99 in one sketch bin) it is about to answer
    assert cold_hedge(elapsed=3.5, primary_tail=3.5, cold_prefill=0.5)


def test_a_long_prompt_is_cold_away_from_home_and_a_short_one_is_not() -> None:
    learnt = {200: 40, 4_000: 40, 30_000: 40}
    classes = pool_of(learnt, learnt)
    now = 10.0
    long_turn = ColdRule(classes, RequestSize(62_000, 31_000, home="a"))
    delay = classes["a"].delay(31_000, now)
    assert long_turn.cold("b", "a", delay, now)  # b must prefill 62,000 tokens
    short_turn = ColdRule(classes, RequestSize(1_400, 230, home="a"))
    assert not short_turn.cold("b", "a", classes["a"].delay(230, now), now)
    # a spilled primary hedged back to the conversation's home: warm, never cold
    assert not long_turn.cold("a", "b", classes["b"].delay(62_000, now), now)
    # a first turn (nothing seen): home is as cold as any other backend
    first = ColdRule(classes, RequestSize(62_000, 62_000, home="a"))
    assert first.cold("a", "b", classes["b"].delay(62_000, now), now)


def test_nothing_is_cold_without_a_fitted_rate() -> None:
    classes = pool_of({200: 40}, {200: 40})
    rule = ColdRule(classes, RequestSize(62_000, 62_000))
    assert not rule.cold("b", "a", 3.0, 10.0)
    assert not rule.cold("zzz", "a", 3.0, 10.0)  # a backend unknown to the rule


def test_new_tokens_and_the_conversation_memory() -> None:
    assert new_tokens(10_000, None) == 10_000
    assert new_tokens(10_000, 6_000) == 4_000
    assert new_tokens(5_000, 6_000) == 5_000  # shorter than the last turn: no continuation
    memory = ConversationMemory(capacity=2)
    assert memory.turn("x", 100) is None
    assert memory.turn("x", 300) == 100
    memory.turn("y", 1)
    memory.turn("z", 1)  # over capacity: x, the least recently seen, goes
    assert len(memory) == 2
    assert memory.turn("x", 500) is None


def test_the_memory_holds_a_digest_of_each_key_not_the_key() -> None:
    """Keys are what clients send: 100 keys of 64 KiB each (6.4 MiB of key) leave the
    memory holding a few hundred bytes a key."""
    memory = ConversationMemory()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(100):
            memory.turn(f"{n:04d}" + "k" * 65_536, 1_000 + n)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(memory) == 100
    assert held < 100 * 1_024
    # the same key still finds its sizes, a surrogate in it included
    assert memory.turn("0007" + "k" * 65_536, 2_000) == 1_007
    assert memory.turn("conv-\ud800", 10) is None
    assert memory.turn("conv-\ud800", 30) == 10


def test_streams_that_share_a_key_keep_their_own_sizes() -> None:
    """An agent's main loop and its sub-agent under one session key: each turn continues the
    largest remembered size not above it, so the main loop's 50,400-token turn after a
    5,000-token sub-agent turn is 400 new tokens, not 45,400."""
    memory = ConversationMemory()
    seen = []
    for tokens in (50_000, 5_000, 50_400, 5_300, 50_800):
        seen.append(new_tokens(tokens, memory.turn("session", tokens)))
    assert seen == [50_000, 5_000, 400, 300, 400]
    # a resend of the same size continues nothing (as with one size a key)
    assert new_tokens(50_800, memory.turn("session", 50_800)) == 50_800
    # five streams, each shorter than every one before: each starts a stream of its own,
    # and past four (`MEMORY_SIZES`) the least recently seen, 5,000, is forgotten
    many = ConversationMemory()
    for tokens in (5_000, 4_000, 3_000, 2_000, 1_000):
        assert many.turn("k", tokens) is None
    assert many.turn("k", 5_100) == 4_000


def test_where_nothing_straggles_even_a_short_copy_cannot_win() -> None:
    # no straggler at all: by the q90 delay the primary is about to answer (its q99), and a
    # copy starting from nothing cannot beat it
    classes = pool_of({200: 40, 30_000: 40}, {200: 40, 30_000: 40}, straggle_every=10**9)
    rule = ColdRule(classes, RequestSize(1_400, 230, home="a"))
    assert rule.cold("b", "a", classes["a"].delay(230, 10.0), 10.0)
