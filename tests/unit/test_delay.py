"""The hedge delay, driven by a plain-number clock."""

from __future__ import annotations

import pytest

from gateway.hedge.delay import MIN_USEFUL_FLOOR, HedgeDelay, auto_quantile, min_useful
from gateway.hedge.latency import WindowedSketch
from gateway.settings import DelaySettings

SETTINGS = DelaySettings(quantile=0.95, min=0.05, max=5.0, initial=0.5, window=60.0, min_samples=20)


def feed(delay: HedgeDelay, values: list[float], start: float, step: float = 0.01) -> float:
    """Observe `values` one per `step` seconds from `start`; return the last time used."""
    now = start
    for value in values:
        delay.observe(value, now)
        now += step
    return now - step


def fed(settings: DelaySettings, values: list[float], start: float = 0.0,
        step: float = 0.01) -> tuple[HedgeDelay, float]:
    """A delay that observed `values` and was refreshed once after the last one."""
    delay = HedgeDelay(settings)
    now = feed(delay, values, start, step)
    delay.refresh(now)
    return delay, now


def test_initial_until_min_samples() -> None:
    delay = HedgeDelay(SETTINGS)
    assert delay.delay(0.0) == 0.5
    assert not delay.adaptive(0.0)
    feed(delay, [0.2] * 19, start=0.0)
    delay.refresh(0.19)
    assert delay.samples(1.0) == 19
    assert delay.delay(0.19) == 0.5
    assert not delay.adaptive(0.19)
    delay.observe(0.2, 0.2)
    delay.refresh(0.2)
    assert delay.adaptive(0.2)
    assert delay.delay(0.2) == pytest.approx(0.2, rel=0.02)


def test_delay_is_the_configured_quantile() -> None:
    # 1..100 ms in order: p95 is about 95 ms
    delay, _ = fed(SETTINGS, [i / 1000 for i in range(1, 101)])
    assert delay.quantile == 0.95
    assert delay.delay(1.0) == pytest.approx(0.095, rel=0.03)
    assert delay.adaptive(1.0)
    p50 = delay.median(1.0)
    assert p50 is not None
    assert p50 == pytest.approx(0.050, rel=0.03)


def test_clamped_to_min() -> None:
    delay, _ = fed(SETTINGS, [0.001] * 40)
    assert delay.delay(0.5) == SETTINGS.min
    assert delay.adaptive(0.5)


def test_clamped_to_max() -> None:
    delay, _ = fed(SETTINGS, [30.0] * 40)
    assert delay.delay(0.5) == SETTINGS.max


class CountingSketch:
    """Wraps a sketch and counts its merges (the work kept off the request path)."""

    def __init__(self, inner: WindowedSketch) -> None:
        self.inner = inner
        self.merges = 0

    def add(self, value: float, now: float) -> None:
        self.inner.add(value, now)

    def quantiles(self, qs: list[float], now: float) -> list[float | None]:
        self.merges += 1
        return self.inner.quantiles(qs, now)

    def count(self, now: float) -> int:
        return self.inner.count(now)

    def epoch(self, now: float) -> int:
        return self.inner.epoch(now)


def test_request_path_reads_never_compute_a_quantile() -> None:
    """observe(), delay(), median() and adaptive() run per request; only
    refresh() (the shell's periodic task) merges the window."""
    delay = HedgeDelay(SETTINGS)
    counting = CountingSketch(WindowedSketch(SETTINGS.window))
    delay._sketch = counting  # type: ignore[assignment]
    now = 0.0
    for i in range(500):
        now = i * 0.01
        delay.observe(0.1 + (i % 10) / 100, now)
        delay.delay(now)
        delay.median(now)
        delay.adaptive(now)
    assert counting.merges == 0
    assert delay.delay(now) == SETTINGS.initial  # nothing learnt until a refresh
    delay.refresh(now)
    assert counting.merges == 1
    assert delay.adaptive(now)
    assert delay.delay(now) == pytest.approx(0.19, rel=0.03)
    # a refresh with nothing new in the same window slice does no work either
    delay.refresh(now + 0.001)
    assert counting.merges == 1


def test_threshold_moves_only_at_a_refresh() -> None:
    delay, _ = fed(SETTINGS, [0.1] * 32, step=0.001)
    assert delay.delay(0.031) == pytest.approx(0.1, rel=0.02)
    feed(delay, [4.0] * 16, start=0.032, step=0.001)
    assert delay.delay(5.0) == pytest.approx(0.1, rel=0.02)
    delay.refresh(0.05)  # p95 of 32 fast + 16 slow is slow
    assert delay.delay(0.05) == pytest.approx(4.0, rel=0.02)


def test_fixed_mode_always_returns_value() -> None:
    fixed = DelaySettings(mode="fixed", value=0.3, min_samples=20)
    delay = HedgeDelay(fixed)
    assert delay.delay(0.0) == 0.3
    feed(delay, [2.0] * 50, start=0.0)
    delay.refresh(1.0)
    assert delay.delay(1.0) == 0.3
    assert not delay.adaptive(1.0)
    # observations are still kept for the median (min_useful) and stats
    assert delay.samples(1.0) == 50
    median = delay.median(1.0)
    assert median is not None
    assert median == pytest.approx(2.0, rel=0.02)


def test_censored_lower_bounds_above_the_threshold_are_kept() -> None:
    delay, _ = fed(SETTINGS, [0.1] * 20)
    assert delay.delay(0.2) == pytest.approx(0.1, rel=0.02)
    # 5 attempts cancelled at 3 s without a first token: lower bounds above the threshold
    for i in range(5):
        delay.observe(3.0, 0.3 + i * 0.01, censored=True)
    assert (delay.censored_count, delay.censored_dropped, delay.observations) == (5, 0, 25)
    delay.refresh(1.0)
    # dropping them would give a 0.1 s threshold; keeping them keeps the tail visible
    assert delay.delay(1.0) == pytest.approx(3.0, rel=0.02)


def test_censored_lower_bounds_below_the_threshold_are_dropped() -> None:
    """a loser cancelled at 10 ms or a client gone at 5 ms says nothing
    about the tail, and recorded, it would pull the delay (and the median) down."""
    delay, _ = fed(SETTINGS, [0.2] * 19 + [0.3] * 1)
    before = delay.delay(0.2)
    assert before == pytest.approx(0.2, rel=0.02)
    for i in range(30):
        delay.observe(0.005 + i * 0.001, 0.3 + i * 0.01, censored=True)
    assert (delay.censored_dropped, delay.censored_count, delay.observations) == (30, 0, 20)
    delay.refresh(1.0)
    assert delay.delay(1.0) == before
    assert delay.median(1.0) == pytest.approx(0.2, rel=0.02)


def test_initial_threshold_also_filters_censored_samples() -> None:
    delay = HedgeDelay(SETTINGS)  # initial 500 ms in force
    delay.observe(0.2, 0.0, censored=True)
    delay.observe(0.7, 0.0, censored=True)
    assert (delay.censored_dropped, delay.censored_count, delay.samples(0.0)) == (1, 1, 1)


def test_a_quiet_pool_leaves_initial_and_keeps_what_it_learnt() -> None:
    """at 10 requests a minute the 60 s window never holds min_samples
    (20), yet the delay must become adaptive after 20 requests and stay so while idle."""
    delay = HedgeDelay(SETTINGS)
    now = 0.0
    for i in range(30):
        now = i * 6.0  # one request every 6 s
        delay.observe(0.2 + (i % 5) / 100, now)
        delay.refresh(now)
        assert delay.samples(now) <= 11
        assert delay.adaptive(now) == (i >= 19)
    assert delay.delay(now) == pytest.approx(0.24, rel=0.03)
    # an hour of silence: the window is empty, the last 20+ samples still say ~0.2 s
    delay.refresh(now + 3600.0)
    assert delay.samples(now + 3600.0) == 0
    assert delay.adaptive(now + 3600.0)
    assert delay.delay(now + 3600.0) == pytest.approx(0.24, rel=0.03)
    median = delay.median(now + 3600.0)
    assert median is not None
    assert median == pytest.approx(0.22, rel=0.03)


def test_a_busy_window_wins_over_the_old_samples() -> None:
    delay, now = fed(SETTINGS, [1.0] * 40)
    assert delay.delay(now) == pytest.approx(1.0, rel=0.02)
    later = now + 120.0  # the old samples left the window; 20 fresh ones fill it
    feed(delay, [0.1] * 20, start=later)
    delay.refresh(later + 1.0)
    assert delay.delay(later + 1.0) == pytest.approx(0.1, rel=0.02)


@pytest.mark.parametrize(
    ("ratio", "quantile"),
    [(0.1, 0.92), (0.05, 0.96), (0.2, 0.84), (0.0, 0.995), (0.001, 0.995), (1.0, 0.5)],
)
def test_auto_quantile_follows_the_budget(ratio: float, quantile: float) -> None:
    assert auto_quantile(ratio) == pytest.approx(quantile)
    delay = HedgeDelay(DelaySettings(quantile="auto"), budget_ratio=ratio)
    assert delay.quantile == pytest.approx(quantile)


def test_a_numeric_quantile_is_pinned_whatever_the_budget() -> None:
    assert HedgeDelay(SETTINGS, budget_ratio=0.5).quantile == 0.95


def test_quantiles_for_stats() -> None:
    delay = HedgeDelay(SETTINGS)
    feed(delay, [0.1] * 10, start=0.0)
    p50, p99 = delay.quantiles([0.5, 0.99], now=1.0)
    assert p50 == pytest.approx(0.1, rel=0.02)
    assert p99 == pytest.approx(0.1, rel=0.02)


def test_median_available_before_min_samples() -> None:
    delay = HedgeDelay(SETTINGS)
    delay.observe(0.4, 0.0)
    delay.refresh(0.0)
    median = delay.median(0.0)
    assert median is not None
    assert median == pytest.approx(0.4, rel=0.02)
    assert delay.delay(0.0) == SETTINGS.initial


def test_min_useful() -> None:
    assert min_useful(None) == MIN_USEFUL_FLOOR == 0.01
    assert min_useful(0.001) == 0.01
    assert min_useful(0.0) == 0.01
    assert min_useful(0.25) == 0.25


def test_auto_steers_later_on_losing_hedges_and_back_on_winning_ones() -> None:
    delay = HedgeDelay(DelaySettings(quantile="auto"), budget_ratio=0.1)
    assert delay.quantile == pytest.approx(0.92)
    delay.steer(0.1, recorded=5)  # hedges mostly lose: hedge fewer requests, later
    assert delay.quantile == pytest.approx(1 - 0.08 * 0.85)
    delay.steer(0.1, recorded=5)  # no new outcome since: no step
    assert delay.quantile == pytest.approx(1 - 0.08 * 0.85)
    for n in range(6, 100):
        delay.steer(0.0, recorded=n)
    assert delay.quantile == pytest.approx(0.995)  # the top of the range
    delay.steer(0.45, recorded=100)  # inside the band: hold
    assert delay.quantile == pytest.approx(0.995)
    for n in range(101, 200):
        delay.steer(0.9, recorded=n)  # hedges win: back to the budget's quantile, no further
    assert delay.quantile == pytest.approx(0.92)
    delay.steer(None, recorded=300)  # no hedge outcome yet
    assert delay.quantile == pytest.approx(0.92)


def test_a_pinned_quantile_is_not_steered() -> None:
    delay = HedgeDelay(SETTINGS)
    delay.steer(0.0, recorded=10)
    assert delay.quantile == 0.95


def test_a_steered_quantile_takes_effect_at_the_next_refresh() -> None:
    delay, now = fed(DelaySettings(quantile="auto"), [i / 1000 for i in range(1, 1001)],
                     step=0.001)
    assert delay.delay(now) == pytest.approx(0.92, rel=0.02)
    delay.steer(0.0, recorded=1)
    assert delay.delay(now) == pytest.approx(0.92, rel=0.02)
    delay.refresh(now)  # nothing new in the window, but the quantile moved
    assert delay.delay(now) == pytest.approx(1 - 0.08 * 0.85, rel=0.02)
