"""One row of the benchmark's table per mode: what a mode's run measured.

Pure functions over what the bench collected for one mode (client samples, the simulators'
request logs, the gateway's `/hedge/stats` when it has one): the TTFT quantiles, the upstream
attempts joined by request id, and the hedges started and won. `gateway.bench.report` compares
the rows, judges the targets and prints the tables.

Where each number comes from:
- TTFT and total time: the client (`gateway.bench.load`), successful requests only;
- upstream attempts: the simulators' own logs, i.e. what the upstreams really received,
  whatever the gateway believes it sent;
- hedges and wins: `/hedge/stats` when the gateway serves it in a recognised shape, else the
  simulators' logs joined by request id (the later arrival of a request is the hedge; the
  attempt that completed won). `hedges.source` says which.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.bench.load import Sample

MODES = ("direct", "hedging-off", "hedging-on", "oracle")
GATEWAY_MODES = ("hedging-off", "hedging-on")
#: the `stalls` workload's gateway modes (hedging on): continuations off and on, and on with
#: simulators that neither stall nor break (`FAULTLESS_MODES`: the goals' yardstick)
CONTINUATION_MODES = {"no-faults": True, "continuation-off": False, "continuation-on": True}
FAULTLESS_MODES = frozenset({"no-faults"})
TTFT_QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("p99.9", 0.999))


def quantile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


@dataclass(frozen=True, slots=True)
class UpstreamView:
    """What the simulators saw of one run, joined by request id."""

    attempts: int
    logical: int
    #: logical requests that reached more than one backend
    multi: int
    #: attempts beyond the first, i.e. hedges plus failure replacements
    extra: int
    #: logical requests won by a later attempt (one that arrived after the first)
    later_won: int
    #: extra attempts by request index, for the phase breakdown of an outage
    extra_by_index: Mapping[int, int]


def _index_of(request_id: str) -> int | None:
    _, _, tail = request_id.rpartition("-")
    return int(tail) if tail.isdigit() else None


def upstream_view(logs: Iterable[Sequence[Sequence[Any]]]) -> UpstreamView:
    """Join every backend's `[request_id, arrival, status, completed]` entries."""
    by_request: dict[str, list[tuple[float, bool]]] = {}
    for log in logs:
        for request_id, arrival, _status, completed in log:
            if not str(request_id).startswith("bench-"):
                continue  # warm-up requests are not part of the run
            by_request.setdefault(str(request_id), []).append((float(arrival), bool(completed)))
    attempts = sum(len(v) for v in by_request.values())
    multi = later_won = 0
    extra_by_index: dict[int, int] = {}
    for request_id, entries in by_request.items():
        if len(entries) < 2:
            continue
        multi += 1
        entries.sort()
        if any(done for _, done in entries[1:]) and not entries[0][1]:
            later_won += 1
        index = _index_of(request_id)
        if index is not None:
            extra_by_index[index] = len(entries) - 1
    return UpstreamView(attempts, len(by_request), multi, attempts - len(by_request), later_won,
                        extra_by_index)


def gateway_hedges(stats: object, pool: str) -> tuple[int, int] | None:
    """(hedges started, hedges won) of `pool` from a `/hedge/stats` document, or None when
    the document does not have them in a shape we recognise (the stats document leaves the nesting
    to
    the implementation: a pool map or list, optionally under a lifetime section)."""
    if not isinstance(stats, Mapping):
        return None
    pools = stats.get("pools")
    entry: object = None
    if isinstance(pools, Mapping):
        entry = pools.get(pool)
    elif isinstance(pools, list):
        entry = next((p for p in pools if isinstance(p, Mapping) and p.get("name") == pool), None)
    if not isinstance(entry, Mapping):
        return None
    for section in (entry, entry.get("lifetime"), entry.get("total")):
        hedges = section.get("hedges") if isinstance(section, Mapping) else None
        if isinstance(hedges, Mapping):
            started, won = hedges.get("started"), hedges.get("won")
            if isinstance(started, int) and isinstance(won, int):
                return started, won
    return None


def continuations(stats: object, before: object, pool: str) -> dict[str, int] | None:
    """The pool's lifetime continuation counts of the measured requests (`/hedge/stats` at
    the end less after the warm-up), or None without them."""
    def read(doc: object) -> dict[str, int] | None:
        try:
            life = doc["pools"][pool]["lifetime"]  # type: ignore[index]
            counted = life["continuations"]
            counts = {k: int(v) for k, v in counted.items() if isinstance(v, int)}
            # why a stall or a break was not continued (a stall refused waits it out)
            refused = counted.get("refused")
            if isinstance(refused, Mapping):
                counts.update({f"refused.{k}": int(v) for k, v in refused.items()
                               if isinstance(v, int)})
            # the workload's own tokens, as the winners reported them: the yardstick of
            # what the continuations resent
            counts["workload_tokens"] = int(life["tokens"]["input"]) \
                + int(life["tokens"]["output"])
            return counts
        except (TypeError, KeyError, ValueError, AttributeError):
            return None

    end, start = read(stats), read(before)
    if end is None:
        return None
    return {k: v - (start or {}).get(k, 0) for k, v in end.items()}


def summarize_mode(
    mode: str,
    samples: Sequence[Sample],
    wall: float,
    logs: Sequence[Sequence[Sequence[Any]]],
    *,
    hedge_stats: object = None,
    hedge_stats_before: object = None,
    pool: str = "bench",
    process: Mapping[str, float] | None = None,
    concurrency: int | None = None,
) -> dict[str, Any]:
    """One row of the table, JSON-ready. Times in ms. `hedge_stats_before` is the gateway's
    `/hedge/stats` after the warm-up, subtracted from `hedge_stats` (taken at the end).
    `concurrency` is kept so the targets know whether the requests started together
    (`gateway.bench.judge`, rule 2); the sorted TTFTs are kept for their intervals."""
    ok = [s for s in samples if s.ok]
    ttfts = sorted(s.ttft for s in ok if s.ttft is not None)
    totals = sorted(s.total for s in ok)
    gaps = sorted(s.longest_gap for s in samples if s.longest_gap is not None)
    kinds = Counter(s.error or "failed" for s in samples if not s.ok)
    view = upstream_view(logs)
    n = len(samples)
    hedges: dict[str, Any] | None = None
    if mode in GATEWAY_MODES or mode in CONTINUATION_MODES:
        from_gateway = gateway_hedges(hedge_stats, pool)
        baseline = gateway_hedges(hedge_stats_before, pool)
        if from_gateway is not None and baseline is not None:  # leave out the warm-up
            from_gateway = (from_gateway[0] - baseline[0], from_gateway[1] - baseline[1])
        started, won = from_gateway or (view.extra, view.later_won)
        hedges = {
            "started": started,
            "won": won,
            "win_rate": won / started if started else None,
            "source": "/hedge/stats" if from_gateway else "sim request logs",
        }
    return {
        "mode": mode,
        "requests": n,
        "concurrency": concurrency,
        "ok": len(ok),
        "errors": n - len(ok),
        "error_kinds": dict(kinds),
        "ttft_ms": {name: ms(quantile(ttfts, q)) for name, q in TTFT_QUANTILES}
        | {"max": ms(ttfts[-1] if ttfts else None)},
        "total_ms": {"p50": ms(quantile(totals, 0.5)), "p99": ms(quantile(totals, 0.99))},
        # each stream's longest gap between reads after its first token, over the streams
        # that got one (a stalled stream's stall, a continued one's switch)
        "longest_gap_ms": {"p50": ms(quantile(gaps, 0.5)), "p99": ms(quantile(gaps, 0.99))},
        "continuations": continuations(hedge_stats, hedge_stats_before, pool)
        if mode in CONTINUATION_MODES else None,
        "wall_s": round(wall, 3),
        "requests_per_s": round(n / wall, 2) if wall > 0 else None,
        "upstream": {
            "attempts": view.attempts,
            "extra": view.extra,
            "extra_pct": round(100.0 * view.extra / n, 2) if n else None,
            "requests_reaching_two_or_more": view.multi,
            "won_by_later_attempt": view.later_won,
        },
        "hedges": hedges,
        "gateway_process": dict(process) if process is not None else None,
        "_extra_by_index": dict(view.extra_by_index),
        "_samples": {s.index: s for s in samples},
        "_ttfts": ttfts,
    }
