"""The hedge budget, driven by a plain-number clock."""

from __future__ import annotations

import itertools

import pytest

from gateway.hedge.budget import HedgeBudget, SuppressReason, wilson_upper
from gateway.settings import BudgetSettings

#: no time-based reserve, so token arithmetic is exact unless a test wants the reserve
NO_RESERVE = BudgetSettings(ratio=0.1, burst=10.0, min_per_second=0.0)


def drain(budget: HedgeBudget, now: float) -> int:
    """Spend every whole token (releasing each at once); return how many were granted."""
    granted = 0
    while budget.try_spend(now, inflight_requests=0, hedge=False) is None:
        budget.release()
        granted += 1
    return granted


def test_reason_values_are_the_stats_keys() -> None:
    assert [r.value for r in SuppressReason] == [
        "max_attempts",
        "no_backend",
        "budget",
        "deadline",
        "ineffective",
        "disabled",
        "cold",
        "key_budget",
    ]
    assert str(SuppressReason.BUDGET) == "budget"
    assert isinstance(SuppressReason.BUDGET, str)
    assert f"{SuppressReason.INEFFECTIVE}" == "ineffective"


def test_starts_full_and_spends_one_token_per_grant() -> None:
    budget = HedgeBudget(NO_RESERVE, now=0.0)
    assert budget.tokens(0.0) == 10.0
    assert budget.try_spend(0.0, inflight_requests=1, hedge=True) is None
    assert budget.tokens(0.0) == 9.0
    assert budget.extra_in_flight == 1
    budget.release()
    assert budget.extra_in_flight == 0
    budget.release()  # an extra release never goes negative
    assert budget.extra_in_flight == 0


def test_refuses_below_one_token() -> None:
    budget = HedgeBudget(NO_RESERVE, now=0.0)
    assert drain(budget, 0.0) == 10
    assert budget.try_spend(0.0, inflight_requests=0, hedge=True) is SuppressReason.BUDGET
    assert budget.try_spend(0.0, inflight_requests=0, hedge=False) is SuppressReason.BUDGET
    assert budget.tokens(0.0) == 0.0  # a refusal spends nothing


def test_deposits_ratio_per_request() -> None:
    budget = HedgeBudget(NO_RESERVE, now=0.0)
    drain(budget, 0.0)
    for _ in range(9):
        budget.on_request(0.0)
    assert budget.tokens(0.0) == pytest.approx(0.9)
    assert budget.try_spend(0.0, inflight_requests=0, hedge=True) is SuppressReason.BUDGET
    budget.on_request(0.0)
    assert budget.try_spend(0.0, inflight_requests=0, hedge=True) is None


def test_burst_caps_deposits() -> None:
    budget = HedgeBudget(NO_RESERVE, now=0.0)
    for _ in range(1000):
        budget.on_request(0.0)
    assert budget.tokens(0.0) == 10.0


def test_reserve_accrues_with_time_up_to_burst() -> None:
    settings = BudgetSettings(ratio=0.1, burst=10.0, min_per_second=0.5)
    budget = HedgeBudget(settings, now=100.0)
    drain(budget, 100.0)
    assert budget.tokens(100.0) == pytest.approx(0.0)
    assert budget.tokens(101.0) == pytest.approx(0.5)
    assert budget.try_spend(101.0, inflight_requests=0, hedge=True) is SuppressReason.BUDGET
    assert budget.tokens(104.0) == pytest.approx(2.0)
    assert budget.try_spend(104.0, inflight_requests=0, hedge=True) is None
    assert budget.tokens(104.0) == pytest.approx(1.0)
    assert budget.tokens(1000.0) == 10.0
    # the reserve and deposits add up, still under the cap
    budget2 = HedgeBudget(settings, now=0.0)
    drain(budget2, 0.0)
    budget2.on_request(2.0)
    assert budget2.tokens(2.0) == pytest.approx(1.1)


def test_in_flight_cap_is_at_least_three() -> None:
    budget = HedgeBudget(NO_RESERVE, now=0.0)
    for _ in range(3):
        assert budget.try_spend(0.0, inflight_requests=1, hedge=True) is None
    assert budget.try_spend(0.0, inflight_requests=1, hedge=True) is SuppressReason.BUDGET
    assert budget.tokens(0.0) == 7.0
    budget.release()
    assert budget.try_spend(0.0, inflight_requests=1, hedge=False) is None


def test_in_flight_cap_is_a_fifth_of_requests_in_flight() -> None:
    budget = HedgeBudget(NO_RESERVE, now=0.0)
    # 40 requests in flight: up to 8 extra attempts at once
    granted = 0
    while budget.try_spend(0.0, inflight_requests=40, hedge=True) is None:
        granted += 1
    assert granted == 8
    assert budget.extra_in_flight == 8
    # 26 requests: 5.2, so the 6th is allowed only while fewer than 5.2 run
    budget2 = HedgeBudget(NO_RESERVE, now=0.0)
    granted = 0
    while budget2.try_spend(0.0, inflight_requests=26, hedge=False) is None:
        granted += 1
    assert granted == 6


def trip_guard(budget: HedgeBudget, now: float, losses: int = 20) -> None:
    for _ in range(losses):
        budget.record_hedge(False, now)


def test_win_rate_over_the_recent_window() -> None:
    budget = HedgeBudget(BudgetSettings(win_window=20), now=0.0)
    assert budget.win_rate() is None
    budget.record_hedge(True, 0.0)
    budget.record_hedge(False, 0.0)
    assert budget.win_rate() == 0.5
    for _ in range(20):
        budget.record_hedge(False, 0.0)
    assert budget.win_rate() == 0.0  # the early win fell out of the window
    for _ in range(20):
        budget.record_hedge(True, 0.0)
    assert budget.win_rate() == 1.0


def test_guard_needs_evidence_not_a_chance_run() -> None:
    """The guard engages when the outcomes show a win rate below `min_win_rate` with 95 %
    confidence: 16 straight losses do; 15 do not, nor does one win in a window of 20."""
    budget = HedgeBudget(BudgetSettings(win_window=20, min_win_rate=0.15), now=0.0)
    trip_guard(budget, 0.0, losses=15)
    assert not budget.ineffective(0.0)
    budget.record_hedge(False, 0.0)
    assert budget.ineffective(0.0)
    # a healthy pool's chance run: 2 wins in 20 (a point estimate of 0.10 < 0.15) is not
    # evidence enough, and neither is 1
    for wins in (2, 1):
        chance = HedgeBudget(BudgetSettings(win_window=20, min_win_rate=0.15), now=0.0)
        for index in range(20):
            chance.record_hedge(index < wins, 0.0)
        assert not chance.ineffective(0.0), wins


def test_wilson_upper_bound() -> None:
    assert wilson_upper(0, 20) == pytest.approx(0.1192, abs=1e-4)
    assert wilson_upper(1, 20) == pytest.approx(0.1960, abs=1e-4)
    assert wilson_upper(10, 20) > 0.5 > wilson_upper(2, 20)
    assert wilson_upper(0, 10_000) < 0.001


def test_guard_limits_hedges_to_the_probe_rate_and_probes_spend_tokens() -> None:
    settings = BudgetSettings(min_per_second=0.0, win_window=20, probe_interval=5.0)
    budget = HedgeBudget(settings, now=0.0)
    trip_guard(budget, 0.0)
    # the first probe goes through at once and spends a token
    assert budget.try_spend(0.0, inflight_requests=1, hedge=True) is None
    budget.release()
    assert budget.tokens(0.0) == 9.0
    assert budget.try_spend(1.0, inflight_requests=1, hedge=True) is SuppressReason.INEFFECTIVE
    assert budget.try_spend(4.9, inflight_requests=1, hedge=True) is SuppressReason.INEFFECTIVE
    assert budget.tokens(4.9) == 9.0  # refusals spend nothing
    assert budget.try_spend(5.0, inflight_requests=1, hedge=True) is None
    budget.release()
    assert budget.tokens(5.0) == 8.0


def test_failure_replacements_bypass_the_guard_but_not_the_budget() -> None:
    budget = HedgeBudget(NO_RESERVE, now=0.0)
    trip_guard(budget, 0.0)
    assert budget.try_spend(0.0, inflight_requests=1, hedge=True) is None  # the probe
    budget.release()
    assert budget.try_spend(0.1, inflight_requests=1, hedge=True) is SuppressReason.INEFFECTIVE
    # replacements do not use up the probe slot, nor wait for it
    for _ in range(9):
        assert budget.try_spend(0.1, inflight_requests=1, hedge=False) is None
        budget.release()
    assert budget.try_spend(0.1, inflight_requests=1, hedge=False) is SuppressReason.BUDGET


def test_probe_refused_for_budget_does_not_use_the_probe_slot() -> None:
    budget = HedgeBudget(NO_RESERVE, now=0.0)
    drain(budget, 0.0)
    trip_guard(budget, 0.0)
    assert budget.try_spend(0.0, inflight_requests=1, hedge=True) is SuppressReason.BUDGET
    for _ in range(10):
        budget.on_request(0.5)
    # the slot is still free: a probe can go now, not only after probe_interval
    assert budget.try_spend(0.5, inflight_requests=1, hedge=True) is None


def test_winning_probes_recover_the_win_rate() -> None:
    settings = BudgetSettings(min_per_second=0.0, win_window=20, min_win_rate=0.15)
    budget = HedgeBudget(settings, now=0.0)
    trip_guard(budget, 0.0)
    now = 0.0
    wins = 0
    while budget.ineffective(now):
        assert budget.try_spend(now, inflight_requests=1, hedge=True) is None
        budget.release()
        budget.record_hedge(True, now)  # the backends got better: probes win
        wins += 1
        now += settings.probe_interval
    assert wins == 1  # 1 of 20: no longer evidence of a win rate below min_win_rate
    assert budget.win_rate() == pytest.approx(0.05)
    # the guard is off: hedges again limited by tokens only
    for _ in range(3):
        assert budget.try_spend(now, inflight_requests=1, hedge=True) is None
        budget.release()


def test_outage_consequence() -> None:
    """Every backend slow at once, so every request reaches its hedge delay and every
    hedge loses. Extra attempts stay within ratio * N + burst (+ reserve * elapsed), and once
    the guard trips, at most one per probe_interval."""
    settings = BudgetSettings()  # the defaults: ratio 0.1, burst 10, reserve 0.5/s
    start = 1000.0
    budget = HedgeBudget(settings, now=start)
    rate = 50.0  # logical requests per second
    duration = 300.0
    hedge_after = 0.5  # each request asks for a hedge this long after it arrived
    hedge_lasts = 2.0  # a hedge loses (slow like everything else) and ends this much later
    n = int(rate * duration)

    granted: list[float] = []
    running: list[float] = []  # end times of granted hedges
    tripped_at: float | None = None
    suppressed: dict[SuppressReason, int] = {}
    for i in range(n):
        arrival = start + i / rate
        budget.on_request(arrival)
        now = arrival + hedge_after
        # hedges that ended by now report their (lost) outcome and release
        for end in [e for e in running if e <= now]:
            running.remove(end)
            budget.release()
            budget.record_hedge(False, end)
        if tripped_at is None and budget.ineffective(now):
            tripped_at = now
        reason = budget.try_spend(now, inflight_requests=int(rate * hedge_lasts), hedge=True)
        if reason is None:
            granted.append(now)
            running.append(now + hedge_lasts)
        else:
            suppressed[reason] = suppressed.get(reason, 0) + 1

    elapsed = duration + hedge_after
    bound = settings.ratio * n + settings.burst + settings.min_per_second * elapsed
    assert len(granted) <= bound
    # without the guard the budget bound itself would be about 1660 hedges
    assert tripped_at is not None
    after = [t for t in granted if t >= tripped_at]
    assert len(after) <= (granted[-1] - tripped_at) / settings.probe_interval + 1
    assert len(after) >= 2  # probes keep testing the water
    # consecutive post-trip hedges are at least probe_interval apart
    assert all(b - a >= settings.probe_interval for a, b in itertools.pairwise(after))
    assert suppressed[SuppressReason.INEFFECTIVE] > suppressed.get(SuppressReason.BUDGET, 0)
    assert len(granted) < 0.02 * n


def test_outage_budget_bound_without_the_guard() -> None:
    """The budget bound alone (guard never trips because hedges are not recorded, e.g. still
    running): grants stay within ratio * N + burst + reserve * elapsed."""
    settings = BudgetSettings(ratio=0.1, burst=10.0, min_per_second=0.5)
    budget = HedgeBudget(settings, now=0.0)
    n = 5000
    granted = 0
    for i in range(n):
        now = i * 0.01
        budget.on_request(now)
        if budget.try_spend(now, inflight_requests=10_000, hedge=True) is None:
            granted += 1
    elapsed = (n - 1) * 0.01
    assert granted <= settings.ratio * n + settings.burst + settings.min_per_second * elapsed
    # and the bucket is actually used, not starved
    assert granted >= settings.ratio * n


def test_hedge_outcomes_are_counted_for_readers_of_the_win_rate() -> None:
    budget = HedgeBudget(BudgetSettings(), now=0.0)
    assert (budget.hedges_recorded, budget.win_rate()) == (0, None)
    for won in (True, False, False):
        budget.record_hedge(won, 1.0)
    assert budget.hedges_recorded == 3
    assert budget.win_rate() == pytest.approx(1 / 3)
