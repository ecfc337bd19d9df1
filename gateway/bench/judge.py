"""Which of the bench's targets a run's sample can decide, and which way.

A target compares a measured figure with a bound ("TTFT p99 <= 460 ms"). A figure taken from
a sample is an estimate, and MET or MISSED for an estimate whose uncertainty spans the bound
is a coin toss printed as a verdict: the p99 of 100 requests is their second-largest TTFT, and
one straggler more or less moves it by the whole straggler delay. So a statistical target is
judged only when its sample can settle it. The rule:

1. **Enough tail.** A q-quantile is judged only when at least `MIN_BEYOND` (10) of the
   samples are expected beyond it on either side: `n * min(q, 1 - q) >= 10`, so a p99 needs
   n >= 1,000 and a median n >= 20. With fewer, the estimate and its interval both rest on
   the few most extreme values, and a target would flip on one request.
2. **Independent draws.** Requests that start at the same instant are one draw of how that
   burst is taken in, not n draws: a pass whose concurrency is at least its number of
   requests has n = 1 for its TTFT quantiles, however many requests it holds (the 1,000
   streams of `streams` are one burst; their p99 moves by more than a hundred ms from run
   to run, far more than an interval over 1,000 independent samples would say).
3. **An interval on one side of the bound.** The figure's 95 % confidence interval must lie
   wholly on one side of the bound: on the good side the target is met, on the bad side it
   is missed. A quantile's interval is the distribution-free one from order statistics (the
   number of samples at or below the true q-quantile is Binomial(n, q), so two order
   statistics bracket it with a known probability); a share (extra attempts, requests
   served) gets Wilson's interval. A figure made of two estimates (a cut of one p99 against
   another, a difference of medians) takes each at 97.5 % and combines the ends, so the pair
   still covers at least 95 %.

A target that fails 1, 2 or 3 is printed "not judged (sample too small: n=...)". Figures
that are not estimates from a sample (a count that must hold exactly, a peak RSS, CPU seconds
from the kernel's counters) are judged as measured, with one exception:

4. **A throughput the run can show.** Requests per second over a closed-loop pass are judged
   only when the pass holds at least `MIN_ROUNDS` (10) rounds (requests >= 10 x concurrency:
   the last round drains with fewer requests in flight, which a short pass counts as
   slowness), and only when the load side reached the bound without the gateway (`direct`):
   a load client and simulators that cannot send that rate to a bare simulator cannot show
   whether the gateway carries it.

Pure: plain numbers in, plain numbers out; `gateway.bench.report` feeds it the samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

#: samples expected beyond a quantile, on either side, before it is judged (rule 1)
MIN_BEYOND = 10
#: closed-loop rounds a throughput's pass needs (rule 4)
MIN_ROUNDS = 10
#: the coverage of an interval a verdict rests on (rule 3)
CONFIDENCE = 0.95
#: the coverage of each of two estimates combined into one figure: the pair covers >= 95 %
PAIR_CONFIDENCE = 1.0 - (1.0 - CONFIDENCE) / 2


def needed(q: float) -> int:
    """The smallest sample that rule 1 accepts for a q-quantile (1,000 for a p99)."""
    return math.ceil(MIN_BEYOND / min(q, 1.0 - q) - 1e-9)


def draws(requests: int, concurrency: int) -> int:
    """Independent draws in a closed-loop pass (rule 2): 1 when every request starts at once."""
    return 1 if requests > 1 and concurrency >= requests else requests


def quantile_name(q: float) -> str:
    """0.99 -> 'p99', 0.5 -> 'p50', 0.999 -> 'p99.9'."""
    return f"p{100.0 * q:g}"


def _binomial_cdf(n: int, p: float) -> list[float]:
    """P(B <= k) for k = 0..n, B ~ Binomial(n, p), 0 < p < 1 (log space: n may be large)."""
    log_p, log_q = math.log(p), math.log1p(-p)
    lgn = math.lgamma(n + 1)
    total, out = 0.0, []
    for k in range(n + 1):
        total += math.exp(lgn - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                          + k * log_p + (n - k) * log_q)
        out.append(min(total, 1.0))
    return out


def order_statistic_ranks(n: int, q: float, confidence: float = CONFIDENCE
                          ) -> tuple[int, int] | None:
    """1-based ranks (l, u) with P(x_(l) <= true q-quantile < x_(u)) >= `confidence` for n
    independent samples of any continuous distribution; None when n is too small for the
    ranks to fall inside 1..n (the sample cannot bound the quantile on one side)."""
    if n < 1 or not 0.0 < q < 1.0:
        return None
    tail = (1.0 - confidence) / 2.0
    cdf = _binomial_cdf(n, q)
    # the number of samples at or below the quantile, B, is Binomial(n, q);
    # x_(l) <= quantile iff B >= l, and x_(u) > quantile iff B <= u - 1
    lower = max((rank for rank in range(1, n + 1) if cdf[rank - 1] <= tail), default=0)
    upper = min((rank for rank in range(1, n + 1) if cdf[rank - 1] >= 1.0 - tail),
                default=n + 1)
    return None if lower < 1 or upper > n else (lower, upper)


@dataclass(frozen=True, slots=True)
class Estimate:
    """A figure taken from a sample: its value, the interval it lies in at the chosen
    confidence (None: this sample cannot bound it, `short` says why), and the number of
    independent draws it rests on."""

    value: float | None
    interval: tuple[float, float] | None
    n: int
    short: str | None = None


def quantile_estimate(sorted_values: Sequence[float], q: float, *, n_draws: int | None = None,
                      confidence: float = CONFIDENCE, scale: float = 1.0) -> Estimate:
    """The q-quantile of `sorted_values` (linear interpolation between closest ranks, as the
    tables print it) with its order-statistic interval, both times `scale` (1000 for ms);
    `n_draws` below the sample size applies rule 2."""
    n = len(sorted_values)
    if n == 0:
        return Estimate(None, None, 0, "no samples")
    pos = q * (n - 1)
    low = math.floor(pos)
    high = min(low + 1, n - 1)
    value = scale * (sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low))
    independent = n if n_draws is None else min(n, n_draws)
    if independent < n:
        return Estimate(value, None, independent,
                        f"{n} requests started together are {independent} burst")
    if n < needed(q):
        return Estimate(value, None, n, f"a {quantile_name(q)} needs n >= {needed(q)}")
    ranks = order_statistic_ranks(n, q, confidence)
    if ranks is None:  # rule 1 holds but the ranks still fall outside (very high confidence)
        return Estimate(value, None, n, f"its {quantile_name(q)} has no interval at n={n}")
    return Estimate(value, (scale * sorted_values[ranks[0] - 1],
                            scale * sorted_values[ranks[1] - 1]), n)


def share_estimate(count: float, n: int, *, confidence: float = CONFIDENCE) -> Estimate:
    """`count` of `n` as a percentage, with Wilson's interval (in percent too)."""
    if n <= 0:
        return Estimate(None, None, 0, "no samples")
    p = min(max(count / n, 0.0), 1.0)
    z = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)
    denominator = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n)) / denominator
    return Estimate(100.0 * count / n, (100.0 * max(0.0, centre - half),
                                        100.0 * min(1.0, centre + half)), n)


def _pair(a: Estimate, b: Estimate, value: float | None,
          interval: tuple[float, float] | None) -> Estimate:
    short = a.short or b.short
    return Estimate(value, None if short else interval, min(a.n, b.n), short)


def difference(a: Estimate, b: Estimate) -> Estimate:
    """a - b; the interval from the ends of both (take each at `PAIR_CONFIDENCE`)."""
    value = None if a.value is None or b.value is None else a.value - b.value
    interval = None
    if a.interval is not None and b.interval is not None:
        interval = (a.interval[0] - b.interval[1], a.interval[1] - b.interval[0])
    return _pair(a, b, value, interval)


def cut(on: Estimate, off: Estimate) -> Estimate:
    """How far `on` is below `off`, in percent: 100 * (1 - on / off); the interval from the
    ends of both (take each at `PAIR_CONFIDENCE`). No interval when `off`'s reaches 0."""
    value = None if on.value is None or not off.value else 100.0 * (1.0 - on.value / off.value)
    interval = None
    if on.interval is not None and off.interval is not None and off.interval[0] > 0:
        interval = (100.0 * (1.0 - on.interval[1] / off.interval[0]),
                    100.0 * (1.0 - on.interval[0] / off.interval[1]))
    result = _pair(on, off, value, interval)
    if result.short is None and interval is None:
        return Estimate(value, None, result.n, "hedging off's interval reaches 0")
    return result


def ratio_to(a: Estimate, reference: float) -> Estimate:
    """a / reference, for a reference that is exact (not drawn from this sample)."""
    if reference <= 0:
        return Estimate(None, None, a.n, "no reference")
    return Estimate(None if a.value is None else a.value / reference,
                    None if a.interval is None else (a.interval[0] / reference,
                                                     a.interval[1] / reference),
                    a.n, a.short)


def decide(interval: tuple[float, float] | None, bound: float, *, at_most: bool) -> bool | None:
    """Rule 3: True when the whole interval is on the met side of `bound`, False when it is
    wholly on the missed side, None when it spans the bound or there is none."""
    if interval is None:
        return None
    low, high = interval
    if at_most:
        return True if high <= bound else False if low > bound else None
    return True if low >= bound else False if high < bound else None


def _number(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def target(name: str, estimate: Estimate, bound: float, *, at_most: bool) -> dict[str, Any]:
    """A statistical target's record: the value, its interval, the verdict (None when the
    sample cannot decide) and, then, why (`not_judged`)."""
    met = decide(estimate.interval, bound, at_most=at_most)
    why: str | None = None
    if estimate.value is None:
        why = None  # nothing measured: shown as n/a
    elif estimate.interval is None:
        why = f"sample too small: n={estimate.n}; {estimate.short}"
    elif met is None:
        low, high = estimate.interval
        why = (f"sample too small: n={estimate.n}; its {100 * CONFIDENCE:g} % interval "
               f"{_number(low)}..{_number(high)} spans {_number(bound)}")
    return {"target": name, "value": None if estimate.value is None else round(estimate.value, 3),
            "met": met, "n": estimate.n,
            "interval": None if estimate.interval is None
            else [round(estimate.interval[0], 3), round(estimate.interval[1], 3)],
            "not_judged": why}


def throughput_short(requests: int, concurrency: int, direct_rate: float | None,
                     bound: float) -> str | None:
    """Rule 4: why a requests-per-second target cannot be judged on this pass (None: it can)."""
    rounds = requests / max(1, concurrency)
    if rounds < MIN_ROUNDS:
        return (f"sample too small: n={requests} at concurrency {concurrency} is "
                f"{rounds:.0f} rounds; a rate needs >= {MIN_ROUNDS}")
    if direct_rate is not None and direct_rate < bound:
        return (f"the load side reached only {direct_rate:.0f} req/s without the gateway, "
                f"under the {bound:.0f} to show")
    return None


def measured(name: str, value: float | None, met: bool | None,
             not_judged: str | None = None) -> dict[str, Any]:
    """A target on a figure that is not an estimate from a sample: judged as measured, or
    not at all when the run could not measure it fairly (`not_judged` says why)."""
    return {"target": name, "value": value, "met": None if not_judged else met,
            "not_judged": not_judged}


def state(record: dict[str, Any]) -> str:
    """How a target's verdict is printed."""
    if record.get("not_judged"):
        return f"not judged ({record['not_judged']})"
    return {True: "MET", False: "MISSED", None: "n/a"}[record["met"]]
