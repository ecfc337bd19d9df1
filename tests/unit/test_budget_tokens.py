"""The hedge budget priced in input tokens, on a plain-number clock."""

from __future__ import annotations

import pytest

from gateway.hedge.budget import HedgeBudget, SuppressReason
from gateway.settings import BudgetSettings

#: a bucket that refills nothing by itself, so that every grant below is a deposit's
PRICED = BudgetSettings(ratio=0.1, burst=1000.0, min_per_second=0.0,
                        burst_input_tokens=30_000)


def spend(budget: HedgeBudget, tokens: int, now: float = 0.0) -> SuppressReason | None:
    refused = budget.try_spend(now, inflight_requests=1000, hedge=True, tokens=tokens)
    if refused is None:
        budget.release()
    return refused


def test_one_long_hedge_costs_what_many_short_ones_do() -> None:
    short, long = HedgeBudget(PRICED, 0.0), HedgeBudget(PRICED, 0.0)
    granted_short = 0
    while spend(short, 200) is None:
        granted_short += 1
    assert granted_short == 150  # the full bucket, 30,000 tokens, in 200-token copies
    assert spend(long, 30_000) is None
    assert spend(long, 200) is SuppressReason.BUDGET  # one 30,000-token copy spent it all
    assert long.tokens(0.0) == pytest.approx(999.0)  # the attempt bucket hardly noticed


def test_deposits_are_ratio_times_the_input() -> None:
    budget = HedgeBudget(PRICED, 0.0)
    assert spend(budget, 30_000) is None
    for _ in range(9):
        budget.on_request(0.0, 30_000)  # 9 x 3,000
    assert budget.input_tokens(0.0) == pytest.approx(27_000)
    assert spend(budget, 30_000) is SuppressReason.BUDGET
    budget.on_request(0.0, 30_000)  # the tenth long request pays for one long copy
    assert spend(budget, 30_000) is None
    # short requests pay little: 150 of them for one 3,000-token copy
    for _ in range(149):
        budget.on_request(0.0, 200)
    assert spend(budget, 3_000) is SuppressReason.BUDGET
    budget.on_request(0.0, 200)
    assert spend(budget, 3_000) is None


def test_an_attempt_larger_than_the_bucket_goes_only_from_a_full_one_and_empties_it() -> None:
    budget = HedgeBudget(PRICED, 0.0)
    assert spend(budget, 100_000) is None  # full bucket: let through ...
    assert budget.input_tokens(0.0) == 0.0  # ... charged the whole bucket, no debt
    for _ in range(29):
        budget.on_request(0.0, 10_000)  # 29 x 1,000 refill it ...
    assert budget.input_tokens(0.0) == pytest.approx(29_000)
    assert spend(budget, 100_000) is SuppressReason.BUDGET  # ... not full again yet
    budget.on_request(0.0, 10_000)
    assert spend(budget, 100_000) is None


def failover(budget: HedgeBudget, tokens: int, now: float) -> SuppressReason | None:
    """Ask for a replacement of a failed attempt of `tokens` input tokens (released at once)."""
    refused = budget.try_spend(now, inflight_requests=1, hedge=False, tokens=tokens)
    if refused is None:
        budget.release()
    return refused


def test_one_huge_failover_does_not_refuse_the_small_ones_after_it() -> None:
    """A 3 MiB body's failover (786,432 estimated tokens, eight buckets: a base64 screenshot
    counts about 100 times its real tokens) empties the bucket and leaves no debt, so the
    small failovers after it wait only for their own price: with the defaults (100,000
    tokens, refilled in 20 s) a 500-token one is granted 0.2 s later and ten small
    requests' deposits pay for one, where a debt of 686,432 tokens refused them for minutes
    while another backend was healthy."""
    budget = HedgeBudget(BudgetSettings(), 0.0)
    assert failover(budget, 786_432, 0.0) is None
    assert budget.input_tokens(0.0) == 0.0
    assert failover(budget, 500, 0.0) is SuppressReason.BUDGET  # nothing left this instant
    assert failover(budget, 500, 0.2) is None  # the reserve's 1,000 tokens
    for _ in range(10):
        budget.on_request(0.2, 500)  # ten small requests deposit 10 x 50
    assert failover(budget, 500, 0.2) is None


def test_the_reserve_refills_both_buckets_in_the_same_time() -> None:
    settings = BudgetSettings(ratio=0.0, burst=10.0, min_per_second=0.5,
                              burst_input_tokens=20_000)
    budget = HedgeBudget(settings, 0.0)
    assert spend(budget, 20_000) is None
    assert budget.input_tokens(0.0) == pytest.approx(0.0)
    # burst / min_per_second = 20 s for the whole bucket: 1,000 input tokens a second
    assert budget.input_tokens(5.0) == pytest.approx(5_000)
    assert budget.input_tokens(60.0) == pytest.approx(20_000)


def test_counting_input_tokens_can_be_turned_off() -> None:
    budget = HedgeBudget(BudgetSettings(ratio=0.1, burst=3.0, min_per_second=0.0,
                                        input_tokens=False, burst_input_tokens=1), 0.0)
    granted = 0
    while spend(budget, 1_000_000) is None:
        granted += 1
    assert granted == 3  # attempts only: the bucket's three tokens


def test_a_refusal_for_input_tokens_changes_nothing() -> None:
    budget = HedgeBudget(PRICED, 0.0)
    assert spend(budget, 25_000) is None
    tokens, level = budget.tokens(0.0), budget.input_tokens(0.0)
    assert budget.try_spend(0.0, inflight_requests=1000, hedge=True, tokens=10_000) \
        is SuppressReason.BUDGET
    assert (budget.tokens(0.0), budget.input_tokens(0.0), budget.extra_in_flight) == \
        (tokens, level, 0)


def test_reload_keeps_the_level_capped_at_the_new_bucket() -> None:
    budget = HedgeBudget(PRICED, 0.0)
    budget.reconfigure(BudgetSettings(ratio=0.1, burst=1000.0, min_per_second=0.0,
                                      burst_input_tokens=5_000), 0.0)
    assert budget.input_tokens(0.0) == pytest.approx(5_000)
    assert spend(budget, 5_000) is None
    budget.reconfigure(PRICED, 0.0)  # a larger bucket is no fresh burst
    assert budget.input_tokens(0.0) == pytest.approx(0.0)
