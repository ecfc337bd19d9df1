"""The best single-hedge policy at a budget: the limit the adaptive delay is judged against.

Pure: plain numbers in, plain numbers out (SPEC §20). For each request the bench knows both
backends' TTFTs, because they are seeded draws (`gateway.bench.upstream.request_ttft`). The
policy simulated here sends every request to the primary and, after one fixed delay `d`, a
copy to the other backend; the request's TTFT is `min(primary, d + hedge)`. It may hedge at
most `ratio x N` requests.

Which `d` is best: for each request the result can only get later as `d` grows (a later hedge,
or none), so every quantile of the results, p99 included, is non-decreasing in `d`. The best
`d` is therefore the smallest one that stays within the budget: the primary TTFT with exactly
`floor(ratio x N)` requests slower than it. No search is needed. This ignores what a real
gateway adds (its own overhead, the hedge's connection set-up) and knows the future, so it is
a bound, not a target to beat.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SingleHedge:
    """The best single-hedge policy for one workload (times in seconds)."""

    #: the fixed hedge delay
    delay: float
    #: requests hedged (primary slower than `delay`)
    hedged: int
    requests: int
    #: TTFT quantiles of the results, from `quantiles` (same order)
    ttft: tuple[float, ...]


def _rank(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (as `gateway.bench.report.quantile`)."""
    pos = q * (len(sorted_values) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def best_single_hedge(
    pairs: Sequence[tuple[float, float]], ratio: float, quantiles: Sequence[float] = (0.99,)
) -> SingleHedge:
    """The single-hedge policy that minimises every TTFT quantile of `pairs` (primary TTFT,
    hedge-target TTFT) while hedging at most `ratio x len(pairs)` requests."""
    if not pairs:
        raise ValueError("no requests")
    n = len(pairs)
    allowed = min(n, max(0, math.floor(ratio * n + 1e-9)))
    primaries = sorted(p for p, _ in pairs)
    # the smallest delay with at most `allowed` primaries strictly slower than it
    delay = primaries[n - allowed - 1] if allowed < n else 0.0
    results = sorted(p if p <= delay else min(p, delay + h) for p, h in pairs)
    hedged = sum(p > delay for p, _ in pairs)
    return SingleHedge(delay, hedged, n, tuple(_rank(results, q) for q in quantiles))
