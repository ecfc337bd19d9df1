"""The race with delays per size class, the cold rule and the budget in input tokens, in
virtual time.

The world: two backends whose time to first token is 150 ms plus 60 ms per 1,000 uncached
tokens; a conversation's home backend (the first of its key's order) holds its history, any
other backend must prefill the whole prompt. One primary in STRAGGLER straggles by
1.5 s (seeded). Conversations of short turns (200 new tokens) and long ones (30,000) alternate; the
pool's delays are refreshed between requests, as the app's refresher does, and every race is
a real `Race` over the real pool objects: only the upstreams are scripted.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from gateway.hedge.affinity import AffinityRoute
from gateway.hedge.attempt import AttemptRecord, open_until_first_token
from gateway.hedge.budget import SuppressReason
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import Race
from gateway.settings import (
    BudgetSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
)
from gateway.wire.chat import CHAT
from providers.base import UpstreamCall
from tests.harness.builders import backends_for
from tests.harness.raceworld import FakeProvider, Step, World
from tests.harness.virtualtime import VirtualLoop, run_virtual

BASE, RATE, STRAGGLE, STRAGGLER = 0.150, 60e-6, 1.5, 20
SHORT, LONG = 200, 30_000
SYSTEM = 1_000
#: virtual seconds between two requests (the refresher runs in between)
GAP = 0.5


def pool_for(*, by_size: bool = True, skip_cold: bool = True,
             budget: BudgetSettings | None = None, backends: int = 2) -> PoolRuntime:
    settings = PoolSettings(
        name="pool", backends=backends_for(["http://127.0.0.1:9/v1"] * backends),
        hedging=HedgingSettings(
            max_attempts=2, skip_cold=skip_cold,
            delay=DelaySettings(quantile=0.9, window=600.0, min_samples=20, by_size=by_size),
            budget=budget or BudgetSettings(ratio=1.0, burst=100.0, min_per_second=10.0,
                                            burst_input_tokens=10**7)))
    return PoolRuntime.build(settings, {}, global_hedging=True, now=0.0, rng=random.Random(1))


def route_home(pool: PoolRuntime, home: str, tag: str) -> AffinityRoute:
    """A conversation key whose order starts at `home`."""
    weights = {b.name: b.weight for b in pool.settings.backends}
    for n in range(1000):
        route = AffinityRoute.of(f"{tag}-{n}", weights, 1.25)
        if route.order[0] == home:
            return route
    raise AssertionError("no key found")


@dataclass
class Played:
    """One request: its size, its race, what the world did."""

    tokens: int
    new: int
    straggler: bool
    race: Race
    kinds: list[str] = field(default_factory=list)
    winner: str = ""
    delay: float = 0.0


async def play_one(loop: VirtualLoop, pool: PoolRuntime, route: AffinityRoute | None,
                   tokens: int, straggler: bool,
                   ttft: Callable[[str, int, bool], float] | None = None) -> Played:
    world = World(loop)
    size = pool.size_of(tokens * 4, route)
    assert size is not None
    delays, cold = pool.sized(size, "chat/completions", True)

    def world_ttft(backend: str, uncached: int, primary: bool) -> float:
        return BASE + RATE * uncached + (STRAGGLE if primary and straggler else 0.0)

    take = ttft or world_ttft

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        at = take(backend, size.uncached(backend), record.kind == "primary")
        provider = FakeProvider(world, record.index, Step("token", at))
        call = UpstreamCall("chat/completions", {}, True, "req", 60.0)
        return await open_until_first_token(provider, call, lambda: record.outcome is not None,
                                            CHAT)

    options = RaceOptions(loop.time() + 60.0, delays, True, None, affinity=route, cold=cold,
                          input_tokens=size.tokens)
    race = Race(pool, runner, options, loop.time)
    primary_delay = 0.0
    if route is not None:
        primary_delay = delays[route.order[0]].delay(loop.time())
    result = await race.run()
    await result.prefix.aclose()
    await race.aclose()
    played = Played(size.tokens, size.new, straggler, race, delay=primary_delay)
    played.kinds = [a.kind for a in race.attempts]
    played.winner = result.winner.kind
    return played


async def conversations(loop: VirtualLoop, pool: PoolRuntime, turns: int,
                        count: int, seed: int = 1) -> list[Played]:
    """`count` conversations of `turns` turns, short and long alternating, one request at a
    time, the base TTFT jittered by up to 20 % and the prefill by 3 %; one primary in
    STRAGGLER straggles (seeded)."""
    rng = random.Random(seed)
    out: list[Played] = []
    homes = [b.name for b in pool.settings.backends]
    routes = [route_home(pool, homes[(c // 2) % 2], f"c{c}") for c in range(count)]

    def jittered(backend: str, uncached: int, primary: bool) -> float:
        return BASE * rng.uniform(0.8, 1.2) + RATE * uncached * rng.uniform(0.97, 1.03) + \
            (STRAGGLE if primary and straggler else 0.0)

    for turn in range(turns):
        for c, route in enumerate(routes):
            new = SHORT if c % 2 == 0 else LONG
            tokens = SYSTEM + (turn + 1) * new
            straggler = rng.random() < 1 / STRAGGLER
            out.append(await play_one(loop, pool, route, tokens, straggler, ttft=jittered))
            await asyncio.sleep(GAP)
            pool.refresh_delays(loop.time())
    return out


TURNS, COUNT = 8, 24
#: the last turns, by when every class of every backend has learnt
LEARNT = 2 * COUNT


def test_long_prompts_are_not_hedged_cold_and_short_stragglers_are_saved() -> None:
    async def main(loop: VirtualLoop) -> tuple[PoolRuntime, list[Played], float]:
        pool = pool_for()
        played = await conversations(loop, pool, turns=TURNS, count=COUNT)
        return pool, played, loop.time()

    pool, played, now = run_virtual(main)
    learnt = played[-LEARNT:]
    long_stragglers = [p for p in learnt if p.new > 1000 and p.straggler]
    short_stragglers = [p for p in learnt if p.new <= 1000 and p.straggler]
    assert long_stragglers and short_stragglers
    # a long turn's copy would prefill 60,000 tokens and more on the cold backend, a prefill
    # far past the primary's tail: never sent
    assert all(p.kinds == ["primary"] for p in learnt if p.new > 1000)
    assert all(SuppressReason.COLD in p.race.suppressed for p in long_stragglers)
    # a short turn's straggling primary is hedged, and the hedge wins
    for p in short_stragglers:
        assert p.kinds == ["primary", "hedge"] and p.winner == "hedge", p
    # each class learnt its own delay: the short one's far below the long one's
    for classes in pool.classes.values():
        assert classes.delay(SHORT, now) < 0.3 < 1.5 < classes.delay(LONG, now)
        assert classes.fit is not None and classes.fit.ms_per_1k == pytest.approx(60, rel=0.1)


def test_without_the_cold_rule_long_stragglers_get_hedges_that_lose() -> None:
    async def main(loop: VirtualLoop) -> list[Played]:
        return await conversations(loop, pool_for(skip_cold=False), turns=TURNS, count=COUNT)

    played = run_virtual(main)[-LEARNT:]
    long_stragglers = [p for p in played if p.new > 1000 and p.straggler]
    assert long_stragglers
    assert all(p.kinds == ["primary", "hedge"] for p in long_stragglers)
    assert all(p.winner == "primary" for p in long_stragglers)  # the copy could not win


def test_one_delay_for_all_sizes_hedges_long_turns_that_are_merely_prefilling() -> None:
    async def main(loop: VirtualLoop) -> list[Played]:
        return await conversations(loop, pool_for(by_size=False, skip_cold=False),
                                   turns=TURNS, count=COUNT)

    played = run_virtual(main)[-LEARNT:]
    # the one q90 over a half-and-half mixture lands below the long turns' normal prefill:
    # long turns that did not straggle get hedged all the same
    assert any(p.kinds == ["primary", "hedge"] for p in played
               if p.new > 1000 and not p.straggler)


def test_a_sparse_size_borrows_its_delay_from_its_neighbours() -> None:
    async def main(loop: VirtualLoop) -> tuple[Played, float, float]:
        pool = pool_for()
        await conversations(loop, pool, turns=TURNS, count=COUNT)
        classes = pool.classes["b0"]
        now = loop.time()
        assert classes.fit is not None
        # 6,000 new tokens: a class nothing was sent in, between the short and long ones
        route = route_home(pool, "b0", "new-size")
        pool.memory.turn(route.key, 1_000)
        first = await play_one(loop, pool, route, 7_000, straggler=True)
        return first, classes.delay(SHORT, now), classes.delay(LONG, now)

    first, short, long = run_virtual(main)
    assert first.new == 6_000
    assert short < first.delay < long
    # borrowed from the long class, shifted down by the fitted rate: near the q90 this size
    # has in this world (a base of 150 ms +-20 %, 360 ms of prefill +-3 %)
    assert first.delay == pytest.approx(BASE * 1.16 + RATE * 6_000 * 1.024, rel=0.15)
    # the hedge started one borrowed delay after the primary
    primary, hedge = first.race.attempts
    assert hedge.started - primary.started == pytest.approx(first.delay, rel=1e-6)


def test_a_spilled_long_turn_is_hedged_back_home_where_it_is_warm() -> None:
    async def main(loop: VirtualLoop) -> tuple[Played, float]:
        pool = pool_for()
        await conversations(loop, pool, turns=TURNS, count=COUNT)
        route = route_home(pool, "b0", "c1")  # a long conversation whose home is b0
        pool.memory.turn(route.key, SYSTEM + 4 * LONG)
        pool.balancer.pause("b0", 1.0, loop.time())  # home paused: the primary spills to b1

        def ttft(backend: str, uncached: int, primary: bool) -> float:
            return BASE + RATE * uncached

        home_delay = pool.classes["b0"].delay(LONG, loop.time())
        played = await play_one(loop, pool, route, SYSTEM + 5 * LONG, straggler=False,
                                ttft=ttft)
        return played, home_delay

    played, home_delay = run_virtual(main)
    # the cold primary (b1 prefills 151,000 tokens, 9 s) is hedged home at the home's own
    # delay for the new 30,000 tokens (its pause over by then), not at its own cold class's;
    # home prefills only the new part and wins
    assert [a.backend for a in played.race.attempts] == ["b1", "b0"]
    primary, hedge = played.race.attempts
    assert hedge.started - primary.started == pytest.approx(home_delay, rel=1e-6)
    assert home_delay < 2.5
    assert played.winner == "hedge"
    assert SuppressReason.COLD not in played.race.suppressed


def test_the_budget_in_input_tokens_refuses_a_long_copy_and_grants_a_short_one() -> None:
    tight = BudgetSettings(ratio=0.0, burst=100.0, min_per_second=0.0,
                           burst_input_tokens=10_000)

    async def main(loop: VirtualLoop) -> list[Played]:
        pool = pool_for(budget=tight, skip_cold=False)

        def slow_primary(backend: str, uncached: int, primary: bool) -> float:
            return 5.0 if primary else BASE

        return [await play_one(loop, pool, None, tokens, straggler=True, ttft=slow_primary)
                for tokens in (2_000, 30_000, 2_000)]

    short, long, again = run_virtual(main)
    assert short.kinds == ["primary", "hedge"] and short.winner == "hedge"
    # 8,000 input tokens left: a 30,000-token copy is refused (the attempt bucket is full)
    assert long.kinds == ["primary"] and set(long.race.suppressed) == {SuppressReason.BUDGET}
    assert again.kinds == ["primary", "hedge"] and again.winner == "hedge"


def _held(skip_cold: bool, slow_short_home: bool) -> list[Played]:
    """After the conversations, four turns whose home b0 is loaded past its bound: a long
    later turn, a long first turn, a short later turn, a short first turn. `slow_short_home`:
    one short request in ten at b0 took 1.5 s more (its spread at that size is wide)."""
    async def main(loop: VirtualLoop) -> list[Played]:
        pool = pool_for(skip_cold=skip_cold)
        await conversations(loop, pool, turns=TURNS, count=COUNT)
        if slow_short_home:
            for n in range(200):
                for tokens in (SHORT, SYSTEM + SHORT):  # a later and a first short turn
                    pool.classes["b0"].observe(
                        tokens, BASE + RATE * tokens + (STRAGGLE if n % 10 == 0 else 0.0),
                        loop.time())
            pool.refresh_delays(loop.time())
        later_long = route_home(pool, "b0", "held-long")
        later_short = route_home(pool, "b0", "held-short")
        pool.memory.turn(later_long.key, SYSTEM + 3 * LONG)
        pool.memory.turn(later_short.key, SYSTEM + 1 * SHORT)
        first_long = route_home(pool, "b0", "first-long")
        first_short = route_home(pool, "b0", "first-short")
        for _ in range(4):  # four streams of other conversations already on b0
            pool.balancer.on_start("b0")
        return [await play_one(loop, pool, route, tokens, straggler=False)
                for route, tokens in ((later_long, SYSTEM + 4 * LONG),
                                      (first_long, SYSTEM + LONG),
                                      (later_short, SYSTEM + 2 * SHORT),
                                      (first_short, SYSTEM + SHORT))]

    return run_virtual(main)


def _stayed(played: Played) -> bool:
    placement = played.race.placement
    home = played.race.attempts[0].backend == "b0"
    assert placement.held_home is home and placement.affinity == ("hit" if home else "spill")
    return home


@pytest.mark.parametrize("skip_cold", [True, False])
def test_a_loaded_home_keeps_its_conversations_while_a_spill_would_cost_more(
        skip_cold: bool) -> None:
    """Bounded load spills a primary off its loaded home; the cold rule keeps it home when
    prefilling its input elsewhere (where its next turns will not go) costs more than the
    wait it could dodge there, at most the home's spread at its size (q99 over median). A
    calm home's is tens of milliseconds: every turn stays, the long first turn too (its
    31,000 tokens would be cached where the next turns do not go)."""
    played = _held(skip_cold, slow_short_home=False)
    assert played[1].new == played[1].tokens  # no history: a first turn
    assert [_stayed(p) for p in played] == [skip_cold] * 4


def test_a_home_slow_at_a_size_lets_short_turns_spill_and_keeps_long_ones() -> None:
    """At a home whose short requests straggle (a spread of 1.5 s), a short turn's cold
    prefill elsewhere (84 ms) is worth the wait it dodges; a long one's (seconds) is not."""
    played = _held(True, slow_short_home=True)
    assert [_stayed(p) for p in played] == [True, True, False, False]


def test_before_anything_is_learnt_a_long_input_is_held_and_a_short_one_spills() -> None:
    """A pool just started knows no prefill rate: a spill of 16,384 input tokens or more is
    taken as cold (a long first turn stays home, where its next turns go), a shorter one is
    not."""
    async def main(loop: VirtualLoop) -> list[Played]:
        pool = pool_for()
        routes = [route_home(pool, "b0", f"fresh-{n}") for n in range(2)]
        for _ in range(4):
            pool.balancer.on_start("b0")
        return [await play_one(loop, pool, route, tokens, straggler=False)
                for route, tokens in zip(routes, (SYSTEM + LONG, SYSTEM + 4 * SHORT),
                                         strict=True)]

    long, short = run_virtual(main)
    assert [_stayed(long), _stayed(short)] == [True, False]


def test_a_home_past_twice_its_bound_spills_even_a_long_conversation() -> None:
    """The cold-spill rule holds a conversation on a loaded home, not on a pile-up: past twice
    its bounded load the home spills whatever the cold prefill costs."""
    async def main(loop: VirtualLoop) -> Played:
        pool = pool_for(backends=3)
        await conversations(loop, pool, turns=TURNS, count=COUNT)
        route = route_home(pool, "b0", "piled")
        pool.memory.turn(route.key, SYSTEM + 3 * LONG)
        for _ in range(12):  # b0 holds every attempt in flight: past twice its share x 1.25
            pool.balancer.on_start("b0")
        return await play_one(loop, pool, route, SYSTEM + 4 * LONG, straggler=False)

    assert not _stayed(run_virtual(main))


def test_a_session_key_shared_by_a_main_loop_and_its_sub_agent_counts_each_ones_growth() -> None:
    """Claude Code sends one session key for its main loop and its sub-agents: the main
    loop's 50,400-token turn after its 50,000 and a sub-agent's 5,000 is 400 new tokens."""
    pool = pool_for()
    route = route_home(pool, "b0", "agent")
    news = []
    for tokens in (50_000, 5_000, 50_400, 50_800):
        size = pool.size_of(tokens * 4, route)
        assert size is not None and size.home == "b0"
        news.append(size.new)
    assert news == [50_000, 5_000, 400, 400]


def test_a_spilled_primary_whose_hedge_would_not_go_home_waits_for_its_own_delay() -> None:
    """A spilled primary reads its home's short delay because its hedge was to go home; with
    the home still loaded when that delay passes, the hedge would go to a third backend as
    cold as the primary: it waits for the primary's own delay at its size instead of
    sending a 31,000-token copy two seconds early."""
    async def main(loop: VirtualLoop) -> tuple[Played, tuple[str, ...], float, float]:
        pool = pool_for(backends=3, skip_cold=False)
        now = loop.time()
        for classes in pool.classes.values():  # every backend: 150 ms + 60 ms per 1k tokens
            for tokens in (300, 1_000, 4_000, 16_000, 32_000):
                for i in range(30):
                    seconds = BASE + RATE * tokens * (1 + i / 300)
                    classes.overall.observe(seconds, now)
                    classes.observe(tokens, seconds, now)
        pool.refresh_delays(now)
        route = route_home(pool, "b0", "spilled")
        pool.memory.turn(route.key, 30_000)
        for _ in range(8):  # the home holds eight streams, past twice its bound: a spill
            pool.balancer.on_start("b0")
        own = pool.classes[route.order[1]].delay(31_025, now)  # where the primary spills
        home = pool.classes["b0"].delay(1_025, now)

        def ttft(backend: str, uncached: int, primary: bool) -> float:
            return 5.0 if primary else BASE + RATE * uncached

        played = await play_one(loop, pool, route, 31_025, False, ttft=ttft)
        return played, route.order, own, home

    played, order, own, home = run_virtual(main)
    assert played.new == 1_025 and home < 0.5 < 1.5 < own
    primary, hedge = played.race.attempts
    assert (primary.backend, hedge.backend) == order[1:]
    assert played.race.placement.affinity == "spill"
    # not at the home's delay: at the primary's own, where b2's copy still beats it
    assert hedge.started - primary.started == pytest.approx(own, rel=1e-6)
    assert played.winner == "hedge"

