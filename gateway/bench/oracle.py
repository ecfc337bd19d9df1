"""The best single-hedge policy at a budget: the limit the adaptive delay is judged against.

Pure: plain numbers in, plain numbers out. For each request the bench knows both
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

Also here: the targets of the slow-share workloads (`stragglers-3`, `-6`, `-10`) and their
summary table, which compare the gateway's runs with this bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.bench import judge
from gateway.bench.report import _cell, share_of, ttft_estimate


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
    """Linear interpolation between closest ranks (as `gateway.bench.rows.quantile`)."""
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


#: the target: at these slow shares, p99 within this factor of the best single-hedge policy
SHARE_P99_FACTOR = 1.15
SHARES_NEAR_THE_LIMIT = ("stragglers-3", "stragglers-6")


def share_targets(workload: str, rows: Mapping[str, Mapping[str, Any]],
                  comparison: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The targets of a slow-share stragglers workload (shaped as `report.targets`), each met,
    missed, or not judged when the run's sample cannot decide it (`gateway.bench.judge`)."""
    result: list[dict[str, Any]] = []
    on_row, off_row = rows.get("hedging-on"), rows.get("hedging-off")
    best = comparison.get("single_hedge", {}).get("ttft_p99_ms")
    if workload in SHARES_NEAR_THE_LIMIT:
        on = ttft_estimate(on_row, 0.99)
        ratio = (judge.ratio_to(on, float(best)) if best
                 else judge.Estimate(None, None, on.n, "no single-hedge bound"))
        result.append(judge.target(f"TTFT p99 <= {SHARE_P99_FACTOR} x best single hedge",
                                   ratio, SHARE_P99_FACTOR, at_most=True))
    pair = judge.PAIR_CONFIDENCE
    result.append(judge.target(
        "TTFT p99 hedging on - off <= 0 ms",
        judge.difference(ttft_estimate(on_row, 0.99, pair), ttft_estimate(off_row, 0.99, pair)),
        0.0, at_most=True))
    result.append(judge.target("extra attempts <= 12 % of requests",
                               share_of(rows, "hedging-on", "upstream", "extra"), 12.0,
                               at_most=True))
    return result


def format_shares(workloads: Sequence[Mapping[str, Any]]) -> str:
    """the summary: one row per slow-share workload ('' when none ran)."""
    rows = [w for w in workloads if w["comparison"].get("single_hedge")]
    if not rows:
        return ""
    head = (f"{'workload':<14} {'requests':>8} | {'p99 off':>8} {'p99 on':>8} {'extra %':>7} | "
            f"{'best single hedge p99':>21} {'on / best':>9}")
    lines = ["== slow shares (budget ratio 0.1; best single hedge: the oracle of "
             "gateway/bench/oracle.py over the same draws)", head, "-" * len(head)]
    for w in rows:
        by_mode = {row["mode"]: row for row in w["modes"]}
        on = by_mode.get("hedging-on", {}).get("ttft_ms", {}).get("p99")
        off = by_mode.get("hedging-off", {}).get("ttft_ms", {}).get("p99")
        extra = by_mode.get("hedging-on", {}).get("upstream", {}).get("extra_pct")
        best = w["comparison"]["single_hedge"]["ttft_p99_ms"]
        ratio = None if on is None or not best else on / best
        lines.append(f"{w['name']:<14} {w['requests']:>8} | {_cell(off):>8} {_cell(on):>8} "
                     f"{_cell(extra):>7} | {_cell(best):>21} {_cell(ratio, 2):>9}")
    return "\n".join(lines)
