"""A request's TTFT objective drives its hedge (`gateway.hedge.deadline`): the pure rule with
times as numbers, the key's share of the budget, and the race in virtual time.

- a primary whose learnt tail would miss the objective is hedged as late as still meets it
  (the objective less the second backend's typical TTFT), never later than the normal delay;
- a primary that would meet it, or that has learnt nothing, changes nothing;
- the early hedge is paid from the key's own share: one the share cannot pay is not sent
  (counted `key_budget`), and the request is hedged at the normal delay like any other;
- the objective is the tighter of the key's and the header's; a malformed header is ignored.
"""

from __future__ import annotations

import pytest

from gateway.api.terms import deadline_of
from gateway.hedge.deadline import (
    SHARE_BURST,
    KeyShare,
    deadline_delay,
    header_objective,
    objective,
)
from gateway.settings.tenants import TenantHedging, TenantKeySettings
from gateway.tenants.registry import Tenant, Tenants
from tests.harness.raceworld import Seen, Setup, Step, play
from tests.harness.virtualtime import VirtualLoop, run_virtual

#: 18 quick first tokens and 2 slow ones: median 0.1 s, tail (q99) 1.0 s
BIMODAL = [0.1] * 18 + [1.0] * 2


def test_a_primary_whose_tail_would_miss_is_hedged_as_late_as_still_meets_it() -> None:
    assert deadline_delay(normal=0.8, objective=0.4, primary_tail=1.0,
                          second_ttft=0.1) == pytest.approx(0.3)


def test_a_primary_that_would_meet_the_objective_changes_nothing() -> None:
    assert deadline_delay(normal=0.8, objective=1.5, primary_tail=1.0, second_ttft=0.1) is None
    assert deadline_delay(normal=0.8, objective=1.0, primary_tail=1.0, second_ttft=0.1) is None


def test_nothing_learnt_at_the_primary_changes_nothing() -> None:
    assert deadline_delay(normal=0.8, objective=0.4, primary_tail=None,
                          second_ttft=0.1) is None


def test_never_later_than_the_normal_delay() -> None:
    assert deadline_delay(normal=0.2, objective=0.4, primary_tail=1.0, second_ttft=0.1) is None


def test_a_second_backend_too_slow_or_unknown_means_at_once() -> None:
    assert deadline_delay(normal=0.8, objective=0.4, primary_tail=1.0, second_ttft=0.5) == 0.0
    assert deadline_delay(normal=0.8, objective=0.4, primary_tail=1.0, second_ttft=None) == 0.0


def test_the_objective_is_the_tighter_and_a_header_never_loosens_the_keys() -> None:
    assert objective(0.8, None) == 0.8
    assert objective(None, 0.3) == 0.3
    assert objective(0.8, 0.3) == 0.3
    assert objective(0.8, 2.0) == 0.8
    assert objective(None, None) is None


@pytest.mark.parametrize("raw", ["abc", "", "-5", "0", "nan", "inf", "1e999"])
def test_a_malformed_header_is_ignored(raw: str) -> None:
    assert header_objective(raw) is None


def test_the_header_is_milliseconds() -> None:
    assert header_objective("250") == pytest.approx(0.25)
    assert header_objective(None) is None


def test_a_keys_share_fills_from_its_own_requests_and_is_bounded() -> None:
    share = KeyShare()
    for _ in range(int(SHARE_BURST)):
        assert share.can_pay()
        share.spend()
    assert not share.can_pay()
    for _ in range(9):
        share.deposit(0.1)
    assert not share.can_pay()
    share.deposit(0.1)  # ten requests at ratio 0.1 pay for one hedge
    assert share.can_pay()
    for _ in range(1000):
        share.deposit(1.0)
    assert share.level == SHARE_BURST


SLOW_PRIMARY = (Step("token", at=2.0), Step("token", at=0.05))


def race(**kwargs: object) -> Setup:
    base: dict[str, object] = dict(script=SLOW_PRIMARY, backends=2, delay=0.8,
                                   learnt={0: BIMODAL, 1: BIMODAL})
    base.update(kwargs)
    return Setup(**base)  # type: ignore[arg-type]


def test_the_race_sends_a_deadline_hedge_early_and_marks_it() -> None:
    share = KeyShare()

    async def main(loop: VirtualLoop) -> Seen:
        return await play(race(objective=0.4, share=share), loop)

    seen = run_virtual(main)
    (first, _), (kind, at) = seen.starts
    # the objective less the second backend's learnt median (the sketch's 0.1)
    assert (first, kind) == ("primary", "hedge") and at == pytest.approx(0.3, abs=0.005)
    assert seen.outcome == "commit 1"
    assert [a.deadline for a in seen.race.attempts] == [False, True]
    assert share.level == pytest.approx(SHARE_BURST - 1)  # full: the deposit was capped


@pytest.mark.parametrize("setup", [
    race(),  # no objective
    race(objective=1.5, share=KeyShare()),  # the primary's tail meets it
    race(objective=0.4),  # no key's share to pay: no early hedge
    race(objective=0.4, share=KeyShare(), learnt={}),  # nothing learnt
])
def test_otherwise_the_hedge_goes_at_the_normal_delay(setup: Setup) -> None:
    async def main(loop: VirtualLoop) -> Seen:
        return await play(setup, loop)

    seen = run_virtual(main)
    assert seen.starts == [("primary", 0.0), ("hedge", 0.8)]
    assert not any(a.deadline for a in seen.race.attempts)
    assert seen.suppressed == {}


def test_an_early_hedge_the_keys_share_cannot_pay_is_not_sent_and_counted() -> None:
    share = KeyShare()
    share.level = 0.0

    async def main(loop: VirtualLoop) -> Seen:
        return await play(race(objective=0.4, share=share), loop)

    seen = run_virtual(main)
    assert seen.starts == [("primary", 0.0), ("hedge", 0.8)]
    assert seen.suppressed == {"key_budget": 1}
    assert not any(a.deadline for a in seen.race.attempts)
    assert seen.budget.spent == 1  # the normal hedge only


def tenant(objective: float | None = 0.8, ratio: float | None = None, name: str = "team-a",
           previous: Tenants | None = None) -> Tenant:
    key = TenantKeySettings(name, key="team-a-secret", ttft_objective=objective,
                            hedging=TenantHedging(ratio=ratio))
    return next(iter(Tenants([key], 0.0, previous).by_digest.values()))


def test_a_requests_objective_from_its_key_and_header_goes_upstream() -> None:
    keyed = tenant(0.8, ratio=0.3)
    assert deadline_of(keyed, {}) == (0.8, keyed.share, 0.3, {"x-slo-ttft-ms": "800"})
    assert deadline_of(keyed, {"x-slo-ttft-ms": "250"}).objective == pytest.approx(0.25)
    assert deadline_of(keyed, {"x-slo-ttft-ms": "5000"}).forward == {"x-slo-ttft-ms": "800"}
    assert deadline_of(keyed, {"x-slo-ttft-ms": "soon"}).objective == 0.8
    plain = tenant(None)
    assert deadline_of(plain, {}) == (None, plain.share, None, {})
    unnamed = deadline_of(None, {"x-slo-ttft-ms": "300"})
    assert unnamed == (0.3, None, None, {"x-slo-ttft-ms": "300"})  # no share: no early hedge
    assert deadline_of(None, {}) == (None, None, None, {})


def test_a_reload_keeps_a_keys_share_and_a_new_key_starts_full() -> None:
    registry = Tenants([tenant().settings], 0.0)
    old = next(iter(registry.by_digest.values()))
    old.share.spend()
    again = tenant(objective=0.5, previous=registry)  # same name and digest, new objective
    assert again.share is old.share and again.share.level == SHARE_BURST - 1
    renamed = tenant(name="team-z", previous=registry)
    assert renamed.share is not old.share


def test_a_failover_before_the_early_hedge_restarts_the_timer_at_the_normal_delay() -> None:
    """The primary fails at 0.1 s, before its early hedge was due (0.3 s): the replacement's
    own delay applies from its start, and no hedge is taken for a deadline hedge."""
    share = KeyShare()
    script = (Step("503", at=0.1), Step("token", at=2.0), Step("token", at=0.05))

    async def main(loop: VirtualLoop) -> Seen:
        return await play(race(script=script, backends=3, max_attempts=3, objective=0.4,
                               share=share, learnt={0: BIMODAL, 1: BIMODAL, 2: BIMODAL}),
                          loop)

    seen = run_virtual(main)
    assert seen.starts == [("primary", 0.0), ("failover", 0.1), ("hedge", 0.9)]
    assert not any(a.deadline for a in seen.race.attempts)
    assert share.level == SHARE_BURST
