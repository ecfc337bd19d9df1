"""The hedge delay (SPEC §5.2), driven by a plain-number clock."""

from __future__ import annotations

import pytest

from gateway.policy import MIN_USEFUL_FLOOR, HedgeDelay, min_useful
from gateway.settings import DelaySettings

SETTINGS = DelaySettings(quantile=0.95, min=0.05, max=5.0, initial=0.5, window=60.0, min_samples=20)


def feed(delay: HedgeDelay, values: list[float], start: float, step: float = 0.01) -> float:
    """Observe `values` one per `step` seconds from `start`; return the last time used."""
    now = start
    for value in values:
        delay.observe(value, now)
        now += step
    return now - step


def test_initial_until_min_samples() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=1)
    assert delay.delay(0.0) == 0.5
    assert not delay.adaptive(0.0)
    feed(delay, [0.2] * 19, start=0.0)
    assert delay.samples(1.0) == 19
    assert delay.delay(0.19) == 0.5
    assert not delay.adaptive(0.19)
    delay.observe(0.2, 0.2)
    assert delay.adaptive(0.2)
    assert delay.delay(0.2) == pytest.approx(0.2, rel=0.02)


def test_delay_is_the_configured_quantile() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=1)
    # 1..100 ms in order: p95 is about 95 ms
    feed(delay, [i / 1000 for i in range(1, 101)], start=0.0)
    assert delay.delay(1.0) == pytest.approx(0.095, rel=0.03)
    assert delay.adaptive(1.0)
    p50 = delay.median(1.0)
    assert p50 is not None
    assert p50 == pytest.approx(0.050, rel=0.03)


def test_clamped_to_min() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=1)
    feed(delay, [0.001] * 40, start=0.0)
    assert delay.delay(0.5) == SETTINGS.min
    assert delay.adaptive(0.5)


def test_clamped_to_max() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=1)
    feed(delay, [30.0] * 40, start=0.0)
    assert delay.delay(0.5) == SETTINGS.max


def test_window_expiry_returns_to_initial_once_refreshed() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=1, refresh_interval=1.0)
    feed(delay, [1.0] * 40, start=0.0)
    assert delay.delay(1.0) == pytest.approx(1.0, rel=0.02)
    # long silence: the window empties; the next delay() call is past refresh_interval
    assert delay.samples(100.0) == 0
    assert delay.delay(100.0) == SETTINGS.initial
    assert not delay.adaptive(100.0)
    assert delay.median(100.0) is None


def test_threshold_does_not_change_between_refreshes() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=16, refresh_interval=1.0)
    feed(delay, [0.1] * 32, start=0.0, step=0.001)  # two refreshes by count
    assert delay.delay(0.031) == pytest.approx(0.1, rel=0.02)
    # 15 slow observations: one short of the next count-based refresh
    feed(delay, [4.0] * 15, start=0.032, step=0.001)
    assert delay.delay(0.05) == pytest.approx(0.1, rel=0.02)
    # still within refresh_interval of the last refresh: unchanged
    assert delay.delay(1.0) == pytest.approx(0.1, rel=0.02)
    # the 16th observation triggers the refresh: p95 of 32 fast + 16 slow is slow
    delay.observe(4.0, 0.05)
    assert delay.delay(0.05) == pytest.approx(4.0, rel=0.02)


def test_first_call_refreshes_then_interval_governs() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=1000, refresh_interval=1.0)
    assert delay.delay(0.0) == SETTINGS.initial  # refresh at t=0: empty
    feed(delay, [0.2] * 40, start=0.0)
    assert delay.delay(0.5) == SETTINGS.initial  # no refresh yet (0.5 s since the last)
    assert delay.delay(1.0) == SETTINGS.initial  # exactly the interval: not more than it
    assert delay.delay(1.01) == pytest.approx(0.2, rel=0.02)


def test_fixed_mode_always_returns_value() -> None:
    fixed = DelaySettings(mode="fixed", value=0.3, min_samples=20)
    delay = HedgeDelay(fixed, refresh_every=1)
    assert delay.delay(0.0) == 0.3
    feed(delay, [2.0] * 50, start=0.0)
    assert delay.delay(1.0) == 0.3
    assert not delay.adaptive(1.0)
    # observations are still kept for the median (min_useful) and stats
    assert delay.samples(1.0) == 50
    median = delay.median(1.0)
    assert median is not None
    assert median == pytest.approx(2.0, rel=0.02)


def test_censored_observations_count_and_enter_the_sketch() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=1)
    feed(delay, [0.1] * 20, start=0.0)
    # 5 attempts cancelled at 3 s without a first token: lower bounds, kept
    for i in range(5):
        delay.observe(3.0, 0.3 + i * 0.01, censored=True)
    assert delay.censored_count == 5
    assert delay.observations == 25
    assert delay.samples(1.0) == 25
    # dropping them would give a 0.1 s threshold; keeping them keeps the tail visible
    assert delay.delay(1.0) == pytest.approx(3.0, rel=0.02)


def test_quantiles_for_stats() -> None:
    delay = HedgeDelay(SETTINGS)
    feed(delay, [0.1] * 10, start=0.0)
    p50, p99 = delay.quantiles([0.5, 0.99], now=1.0)
    assert p50 == pytest.approx(0.1, rel=0.02)
    assert p99 == pytest.approx(0.1, rel=0.02)


def test_median_available_before_min_samples() -> None:
    delay = HedgeDelay(SETTINGS, refresh_every=1)
    delay.observe(0.4, 0.0)
    median = delay.median(0.0)
    assert median is not None
    assert median == pytest.approx(0.4, rel=0.02)
    assert delay.delay(0.0) == SETTINGS.initial


def test_min_useful() -> None:
    assert min_useful(None) == MIN_USEFUL_FLOOR == 0.01
    assert min_useful(0.001) == 0.01
    assert min_useful(0.0) == 0.01
    assert min_useful(0.25) == 0.25
