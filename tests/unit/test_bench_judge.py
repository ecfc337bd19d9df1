"""The rule that says whether a bench sample can decide a target (`gateway.bench.judge`), on
plain numbers: how much tail a quantile needs, bursts as one draw, the intervals, the verdicts
and what is printed when there is none."""

from __future__ import annotations

import math
import random

import pytest

from gateway.bench.judge import (
    PAIR_CONFIDENCE,
    Estimate,
    _binomial_cdf,
    cut,
    decide,
    difference,
    draws,
    measured,
    needed,
    order_statistic_ranks,
    quantile_estimate,
    ratio_to,
    share_estimate,
    state,
    target,
    throughput_short,
)


def test_a_quantile_needs_ten_samples_beyond_it() -> None:
    assert needed(0.99) == 1000
    assert needed(0.5) == 20
    assert needed(0.999) == 10000
    assert needed(0.9) == 100
    ramp = [i / 1000 for i in range(1000)]
    assert quantile_estimate(ramp[:999], 0.99).interval is None
    assert quantile_estimate(ramp[:999], 0.99).short == "a p99 needs n >= 1000"
    assert quantile_estimate(ramp, 0.99).interval is not None


def test_requests_started_together_are_one_draw() -> None:
    assert draws(1000, 1000) == 1
    assert draws(1000, 2000) == 1
    assert draws(1000, 999) == 1000  # a closed loop: later requests start as others end
    assert draws(1, 1) == 1
    burst = quantile_estimate([i / 1000 for i in range(5000)], 0.99, n_draws=1)
    assert (burst.interval, burst.n) == (None, 1)
    assert burst.short == "5000 requests started together are 1 burst"


def test_the_order_statistic_ranks_are_the_textbook_ones() -> None:
    # the classic table: a 95 % interval for the median of 100 is the 40th to the 61st value
    assert order_statistic_ranks(100, 0.5) == (40, 61)
    assert order_statistic_ranks(20, 0.5) == (6, 15)
    # too few values beyond the quantile: no rank above it is inside the sample
    assert order_statistic_ranks(300, 0.99) is None
    assert order_statistic_ranks(0, 0.5) is None


@pytest.mark.parametrize(("n", "q"), [(100, 0.5), (1000, 0.99), (4000, 0.99), (250, 0.9)])
def test_the_ranks_cover_and_are_the_tightest_equal_tailed_pair(n: int, q: float) -> None:
    ranks = order_statistic_ranks(n, q)
    assert ranks is not None
    low, high = ranks
    cdf = _binomial_cdf(n, q)
    # P(low <= B <= high - 1) for B ~ Binomial(n, q): the number at or below the quantile
    assert cdf[high - 1] - cdf[low - 1] >= 0.95
    # each end is as tight as its tail allows: one rank further in leaves more than 2.5 % out
    assert cdf[low] > 0.025
    assert cdf[high - 2] < 0.975


def test_the_p99_interval_covers_the_true_p99_about_95_percent_of_the_time() -> None:
    """Seeded draws from an exponential distribution, whose p99 is known exactly."""
    rng = random.Random(7)
    truth = -math.log(0.01)
    trials, covered = 300, 0
    for _ in range(trials):
        sample = sorted(rng.expovariate(1.0) for _ in range(1000))
        estimate = quantile_estimate(sample, 0.99)
        assert estimate.interval is not None
        covered += estimate.interval[0] <= truth <= estimate.interval[1]
    assert 0.91 <= covered / trials <= 0.99


def test_wilson_interval_of_a_share() -> None:
    none = share_estimate(0, 10)
    assert none.value == 0.0 and none.interval is not None
    assert none.interval[0] == pytest.approx(0.0, abs=1e-9)
    assert none.interval[1] == pytest.approx(27.75, abs=0.01)  # the known 0-of-10 bound
    half = share_estimate(50, 100)
    assert half.interval is not None
    assert half.interval[0] == pytest.approx(40.38, abs=0.01)
    assert half.interval[1] == pytest.approx(59.62, abs=0.01)
    assert share_estimate(3, 0).interval is None


def test_decide_needs_the_whole_interval_on_one_side() -> None:
    assert decide((300.0, 450.0), 460.0, at_most=True) is True
    assert decide((470.0, 900.0), 460.0, at_most=True) is False
    assert decide((400.0, 500.0), 460.0, at_most=True) is None
    assert decide((96.3, 99.9), 95.0, at_most=False) is True
    assert decide((80.0, 94.0), 95.0, at_most=False) is False
    assert decide((93.0, 99.0), 95.0, at_most=False) is None
    assert decide(None, 95.0, at_most=False) is None
    assert decide((460.0, 460.0), 460.0, at_most=True) is True  # at the bound is within


def test_figures_of_two_estimates_combine_the_ends() -> None:
    on = Estimate(350.0, (300.0, 400.0), 1000)
    off = Estimate(1600.0, (1500.0, 1700.0), 1000)
    reduction = cut(on, off)
    assert reduction.value == pytest.approx(78.125)
    assert reduction.interval == pytest.approx((100 * (1 - 400 / 1500), 100 * (1 - 300 / 1700)))
    assert decide(reduction.interval, 70.0, at_most=False) is True
    added = difference(on, Estimate(200.0, (190.0, 210.0), 1000))
    assert added.value == 150.0 and added.interval == (90.0, 210.0)
    assert ratio_to(on, 400.0).interval == (0.75, 1.0)
    # one part that cannot be bounded leaves the whole figure unbounded, and says why
    short = cut(on, Estimate(1600.0, None, 100, "a p99 needs n >= 1000"))
    assert (short.interval, short.n, short.short) == (None, 100, "a p99 needs n >= 1000")
    assert cut(on, Estimate(1600.0, (0.0, 1700.0), 1000)).interval is None
    assert round(PAIR_CONFIDENCE, 9) == 0.975


def test_what_a_target_prints() -> None:
    small = target("TTFT p99 <= 460 ms", Estimate(616.4, None, 100, "a p99 needs n >= 1000"),
                   460.0, at_most=True)
    assert small["met"] is None
    assert state(small) == "not judged (sample too small: n=100; a p99 needs n >= 1000)"
    spans = target("extra attempts <= 12 % of requests", share_estimate(37, 300), 12.0,
                   at_most=True)
    assert state(spans) == ("not judged (sample too small: n=300; its 95 % interval "
                            "9.08..16.5 spans 12.0)")
    met = target("extra attempts <= 12 % of requests", share_estimate(3, 100), 12.0,
                 at_most=True)
    assert (met["met"], state(met), met["n"]) == (True, "MET", 100)
    missed = target("TTFT p99 <= 460 ms", Estimate(900.0, (800.0, 1000.0), 4000), 460.0,
                    at_most=True)
    assert state(missed) == "MISSED"
    assert state(target("x", Estimate(None, None, 0, "no samples"), 1.0, at_most=True)) == "n/a"


def test_measured_figures_and_rates() -> None:
    assert state(measured("peak RSS <= 100 MB", 71.2, True)) == "MET"
    assert state(measured("peak RSS <= 100 MB", 171.2, False)) == "MISSED"
    assert throughput_short(2000, 50, 1160.0, 700.0) is None
    assert throughput_short(300, 50, 1160.0, 700.0) == (
        "sample too small: n=300 at concurrency 50 is 6 rounds; a rate needs >= 10")
    assert throughput_short(2000, 50, 494.0, 700.0) == (
        "the load side reached only 494 req/s without the gateway, under the 700 to show")
    unfair = measured(">= 700 req/s", 569.0, False, throughput_short(2000, 50, 494.0, 700.0))
    assert unfair["met"] is None and state(unfair).startswith("not judged (the load side")
