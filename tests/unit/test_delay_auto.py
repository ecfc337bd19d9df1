"""The adaptive delay's rule in virtual time: HedgeDelay and HedgeBudget driven
by a plain-number clock and synthetic TTFT streams, the way the race feeds them.

The simulation is a model of the race, not the race: requests come one after another at a
fixed rate; the primary alternates between two independent backends; a hedge starts at the
primary's delay if the budget grants it, and the first token wins. What each attempt records
is what `gateway.hedge.race` records: the winner its TTFT, the loser its elapsed time at the commit
as a censored lower bound; a client that leaves early censors its primary. The delays are
refreshed once a virtual second, like the app's refresher. Nothing here sleeps or reads a
wall clock.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from gateway.bench.oracle import best_single_hedge
from gateway.hedge.pool import PoolRuntime
from gateway.settings import (
    BackendSettings,
    BudgetSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
)

BODY_MEDIAN, BODY_SIGMA, STRAGGLE = 0.150, 0.25, 1.5
RATE = 50.0  # requests per virtual second
WINDOW = 30.0


@dataclass(frozen=True, slots=True)
class Phase:
    requests: int
    share: float
    #: virtual seconds between requests (default 1 / RATE)
    gap: float = 1.0 / RATE
    #: share of clients that leave 5 ms after sending (their primary is censored at 5 ms)
    leave: float = 0.0


@dataclass(slots=True)
class PhaseResult:
    requests: int = 0
    hedges: int = 0
    results: list[float] = field(default_factory=list)
    unhedged: list[float] = field(default_factory=list)
    pairs: list[tuple[float, float]] = field(default_factory=list)
    #: backend a's delay at every refresh of the phase
    delays: list[float] = field(default_factory=list)
    #: requests that arrived while the efficacy guard was on
    guarded: int = 0

    @property
    def hedge_rate(self) -> float:
        return self.hedges / self.requests

    def p99(self, values: Sequence[float] | None = None) -> float:
        ordered = sorted(self.results if values is None else values)
        return ordered[math.floor(0.99 * (len(ordered) - 1))]

    def settled(self) -> float:
        """The mean delay over the second half of the phase."""
        tail = self.delays[len(self.delays) // 2:]
        return sum(tail) / len(tail)


def draw(rng: random.Random, share: float) -> float:
    ttft = BODY_MEDIAN * math.exp(BODY_SIGMA * rng.gauss(0.0, 1.0))
    return ttft + STRAGGLE if rng.random() < share else ttft


def simulate(
    phases: Sequence[Phase],
    *,
    ratio: float = 0.1,
    quantile: float | str = "auto",
    seed: int = 1,
) -> list[PhaseResult]:
    pool = PoolRuntime.build(
        PoolSettings("p", tuple(BackendSettings(b, "sim", "m") for b in "ab"), hedging=(
            HedgingSettings(delay=DelaySettings(quantile=quantile, window=WINDOW),  # type: ignore[arg-type]
                            budget=BudgetSettings(ratio=ratio)))),
        {}, global_hedging=True, now=0.0, rng=random.Random(seed))
    delays, budget = pool.delays, pool.budget
    rng = random.Random(seed)
    now, next_refresh, index = 0.0, 0.0, 0
    out: list[PhaseResult] = []
    for phase in phases:
        result = PhaseResult()
        out.append(result)
        for _ in range(phase.requests):
            now += phase.gap
            while next_refresh <= now:
                pool.refresh_delays(next_refresh)
                result.delays.append(delays["a"].delay(next_refresh))
                next_refresh += 1.0
            primary, other = ("a", "b") if index % 2 == 0 else ("b", "a")
            index += 1
            budget.on_request(now)
            result.guarded += budget.ineffective(now)
            p, h = draw(rng, phase.share), draw(rng, phase.share)
            result.requests += 1
            result.pairs.append((p, h))
            result.unhedged.append(p)
            if rng.random() < phase.leave:
                delays[primary].observe(0.005, now + 0.005, censored=True)
                result.results.append(p)
                continue
            d = delays[primary].delay(now)
            granted = p > d and budget.try_spend(now + d, inflight_requests=20, hedge=True) is None
            if not granted:
                delays[primary].observe(p, now + p)
                result.results.append(p)
                continue
            result.hedges += 1
            budget.release()
            if d + h < p:  # the hedge wins; the primary is cancelled at d + h
                delays[other].observe(h, now + d + h)
                delays[primary].observe(d + h, now + d + h, censored=True)
            else:  # the primary wins; the hedge is cancelled at p - d
                delays[primary].observe(p, now + p)
                delays[other].observe(p - d, now + p, censored=True)
            budget.record_hedge(d + h < p, now + min(p, d + h))
            result.results.append(min(p, d + h))
    return out


def body_quantile(share: float, hedge_rate: float) -> float:
    """The delay at which `hedge_rate` of the requests are slower: share + (1 - share) x the
    body's tail above it (the body is lognormal)."""
    tail = (hedge_rate - share) / (1.0 - share)
    z = _inverse_normal_tail(tail)
    return BODY_MEDIAN * math.exp(BODY_SIGMA * z)


def _inverse_normal_tail(p: float) -> float:
    low, high = -10.0, 10.0
    for _ in range(100):
        mid = (low + high) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2)) > p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


# ------------------------------------------------------------------------- one slow share

#: share, where the auto delay should settle (None: inside the slow mode). At ratio 0.1 the
#: budget's quantile is q92; with no stragglers at all, hedges never win and the win-rate
#: feedback moves the quantile to the top of its range, q99.5
SHARES = [
    (0.00, body_quantile(0.0, 0.005)),
    (0.03, body_quantile(0.03, 0.08)),
    (0.06, body_quantile(0.06, 0.08)),
    (0.10, None),
    (0.15, None),
]


@pytest.mark.parametrize(("share", "expected"), SHARES)
def test_auto_settles_where_the_budget_says(share: float, expected: float | None) -> None:
    """6,000 requests at 50 a virtual second: 4 windows of 30 s."""
    (run,) = simulate([Phase(6000, share)])
    duration = 6000 / RATE
    if expected is not None:
        # the delay is the budget's quantile of the TTFT: 1 - 0.8 x 0.1
        assert run.settled() == pytest.approx(expected, rel=0.06)
    if share == 0.0:
        # no stragglers: the q92 hedges rarely win, and the efficacy guard stops them
        assert run.hedge_rate < 0.02
    elif expected is not None:
        # the hedge rate is what the budget pays for minus the failover share (0.8 x 0.1),
        # and the tail is within 15 % of the best single-hedge policy that spends it all
        assert 0.065 <= run.hedge_rate <= 0.095
        best = best_single_hedge(run.pairs, ratio=0.1).ttft[0]
        assert run.p99() <= 1.15 * best
    else:
        # more stragglers than the budget can hedge: no delay in the body reaches the budget's
        # rate, so the delay climbs into the slow mode (slowly: the stragglers are censored)
        # or stays there; the tail is no worse than without hedging
        assert run.settled() > 0.3
        assert run.p99() <= run.p99(run.unhedged)
    # the budget holds: ratio x N + burst + reserve x duration
    assert run.hedges <= 0.1 * 6000 + 10 + 0.5 * duration


def test_no_creep_over_a_long_run() -> None:
    """12 windows at a constant 6 % share (the hardest that the budget can still cover: the
    quantile sits just below the slow mode): the last third's delay is the second third's."""
    share = 0.06
    (run,) = simulate([Phase(18000, share)])
    third = len(run.delays) // 3
    middle = run.delays[third:2 * third]
    last = run.delays[2 * third:]
    assert sum(last) / len(last) == pytest.approx(sum(middle) / len(middle), rel=0.04)
    assert sum(last) / len(last) == pytest.approx(body_quantile(share, 0.08), rel=0.06)


def test_a_share_that_changes_mid_run_moves_the_delay_both_ways() -> None:
    runs = simulate([Phase(6000, 0.03), Phase(6000, 0.06), Phase(6000, 0.03)])
    low, high, back = (run.settled() for run in runs)
    assert low == pytest.approx(body_quantile(0.03, 0.08), rel=0.08)
    assert high == pytest.approx(body_quantile(0.06, 0.08), rel=0.08)
    assert back == pytest.approx(low, rel=0.05)
    for run in runs:
        assert 0.065 <= run.hedge_rate <= 0.095


def test_a_pool_that_goes_quiet_keeps_its_delay_and_hedges_at_the_same_rate() -> None:
    busy, silence, trickle = simulate([
        Phase(6000, 0.03),
        Phase(1, 0.03, gap=600.0),  # ten minutes of silence
        Phase(400, 0.03, gap=10.0),  # then one request every 10 s: 6 per window
    ])
    learnt = busy.settled()
    # the window empties; the newest 100+ samples keep the delay (not `initial`, 500 ms)
    assert silence.delays and all(d == pytest.approx(learnt, rel=0.15) for d in silence.delays)
    # the window never holds min_samples again; the newest samples still set the delay, and
    # the win-rate feedback, fed by few hedges, moves it within the body of the TTFT
    assert 0.8 * learnt <= trickle.settled() <= 2.0 * learnt < 0.5
    assert 0.02 <= trickle.hedge_rate <= 0.1


@pytest.mark.parametrize("ratio", [0.0, 0.005])
def test_a_budget_near_zero(ratio: float) -> None:
    """The auto quantile tops out at 0.995; the bucket and its reserve bound the hedges."""
    (run,) = simulate([Phase(3000, 0.03)], ratio=ratio)
    assert run.settled() > 1.0  # q99.5 of a 3 % slow share is a straggler
    reserve = 0.5 * 3000 / RATE  # min_per_second x the run's duration
    assert run.hedges <= ratio * 3000 + 10 + reserve


def test_clients_leaving_early_do_not_pull_the_delay_down() -> None:
    """a fifth of the clients leave after 5 ms; their primaries' 5 ms lower
    bounds are dropped, so the delay is where it is without them."""
    (calm,) = simulate([Phase(6000, 0.03)])
    (leaving,) = simulate([Phase(6000, 0.03, leave=0.2)])
    assert leaving.settled() == pytest.approx(calm.settled(), rel=0.05)


def test_a_pinned_quantile_keeps_the_old_behaviour() -> None:
    """q95 at a 6 % share: more requests straggle than the
    quantile leaves out, so the delay creeps up through the gap towards the slow mode, and
    the tail with it; auto stays put."""
    (auto,) = simulate([Phase(6000, 0.06)])
    (pinned,) = simulate([Phase(6000, 0.06)], quantile=0.95)
    third = len(pinned.delays) // 3
    early, late = pinned.delays[:third], pinned.delays[2 * third:]
    assert sum(late) / len(late) > 1.1 * sum(early) / len(early)
    assert auto.settled() < 0.3 < pinned.settled()
    assert auto.p99() < pinned.p99()


@pytest.mark.parametrize("share", [0.03, 0.06])
def test_the_guard_never_engages_on_a_healthy_pool_and_the_cut_holds_every_time(
    share: float,
) -> None:
    """A healthy pool's hedges win about half the time; the efficacy guard must not take a
    chance run of losses for shared slowness and switch hedging off. 20 seeded runs of 10,000
    requests: the guard is never on, and every run cuts the p99 below a third of hedging
    off's (the bench's stragglers target is a 50 % cut)."""
    cuts = []
    for seed in range(20):
        (run,) = simulate([Phase(10_000, share)], seed=seed)
        assert run.guarded == 0, (seed, run.guarded)
        cuts.append(run.p99() / run.p99(run.unhedged))
    assert max(cuts) < 1 / 3, cuts
