"""The benchmark's verdicts: comparisons between modes, targets, tables, the JSON report.

Pure functions over the rows `gateway.bench.rows` makes of each mode (and the process
samples): no I/O except `write_json`, so the arithmetic can be tested with plain numbers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.bench import judge
from gateway.bench.load import Sample
from gateway.bench.rows import GATEWAY_MODES, MODES, ms, quantile
from gateway.settings import BudgetSettings


def ttft_estimate(row: Mapping[str, Any] | None, q: float,
                  confidence: float = judge.CONFIDENCE) -> judge.Estimate:
    """A mode's TTFT q-quantile in ms with its interval, from the sorted TTFTs (seconds) the
    row keeps (`_ttfts`: a table row, or a c=1 pass's summary). Requests that all started
    together count as one draw (`gateway.bench.judge`, rule 2)."""
    if not row or row.get("_ttfts") is None:
        return judge.Estimate(None, None, 0, "no samples")
    requests, concurrency = row.get("requests"), row.get("concurrency")
    n_draws = (judge.draws(int(requests), int(concurrency))
               if isinstance(requests, int) and isinstance(concurrency, int) else None)
    return judge.quantile_estimate(row["_ttfts"], q, n_draws=n_draws, confidence=confidence,
                                   scale=1000.0)


def share_of(rows: Mapping[str, Mapping[str, Any]], mode: str, *path: str) -> judge.Estimate:
    """A count of `mode`'s row (at `path`) as a percentage of its requests, with Wilson's
    interval; no value without the count."""
    count, n = _get(rows, mode, *path), _get(rows, mode, "requests")
    if count is None or not n:
        return judge.Estimate(None, None, 0, "no samples")
    return judge.share_estimate(count, int(n))


def outage_phases(
    row: Mapping[str, Any], requests: int, span: tuple[float, float]
) -> dict[str, Any]:
    """Extra attempts before, in the first and second half of, and after the outage."""
    start, end = int(requests * span[0]), int(requests * span[1])
    mid = (start + end) // 2
    bounds = {"before": (0, start), "outage_first_half": (start, mid),
              "outage_second_half": (mid, end), "after": (end, requests)}
    extra: Mapping[int, int] = row.get("_extra_by_index", {})
    return {
        name: {"requests": hi - lo, "extra": sum(v for k, v in extra.items() if lo <= k < hi)}
        for name, (lo, hi) in bounds.items()
    }


def _get(rows: Mapping[str, Mapping[str, Any]], mode: str, *path: str) -> float | None:
    node: Any = rows.get(mode)
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return float(node) if isinstance(node, int | float) else None


def paired_added_ms(direct: Mapping[int, Sample], gateway: Mapping[int, Sample],
                    backend: str = "sim-a") -> dict[str, Any]:
    """Per-request TTFT and total-time differences, gateway minus direct, over the requests
    the gateway served from `backend` (the one `direct` uses) with a single attempt: both
    sides drew the same latency, so the difference is the gateway's own cost."""
    ttft: list[float] = []
    total: list[float] = []
    for index, g in gateway.items():
        d = direct.get(index)
        if (d is None or not (d.ok and g.ok) or g.backend != backend or g.attempts != 1
                or d.ttft is None or g.ttft is None):
            continue
        ttft.append(g.ttft - d.ttft)
        total.append(g.total - d.total)
    ttft.sort()
    total.sort()
    return {"pairs": len(ttft), "ttft_p50_ms": ms(quantile(ttft, 0.5)),
            "ttft_p90_ms": ms(quantile(ttft, 0.9)), "total_p50_ms": ms(quantile(total, 0.5))}


def compare(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The workload's headline numbers, all from one run (same machine, same minute)."""
    out: dict[str, Any] = {}
    direct_samples = rows.get("direct", {}).get("_samples")
    for mode in GATEWAY_MODES:
        gateway_samples = rows.get(mode, {}).get("_samples")
        if direct_samples is not None and gateway_samples is not None:
            out[f"{mode}_paired_added"] = paired_added_ms(direct_samples, gateway_samples)
    direct = _get(rows, "direct", "ttft_ms", "p50")
    direct_rps = _get(rows, "direct", "requests_per_s")
    for mode in GATEWAY_MODES:
        p50 = _get(rows, mode, "ttft_ms", "p50")
        rps = _get(rows, mode, "requests_per_s")
        if direct is not None and p50 is not None:
            out[f"{mode}_added_ttft_p50_ms"] = round(p50 - direct, 3)
            out[f"{mode}_ttft_p50_ratio"] = round(p50 / direct, 3) if direct > 0 else None
        if direct_rps and rps:
            out[f"{mode}_throughput_ratio_direct_over_gateway"] = round(direct_rps / rps, 3)
    for mode, row in rows.items():
        if row.get("requests"):
            out[f"{mode}_served_pct"] = round(100.0 * row["ok"] / row["requests"], 2)
    for q in ("p99", "p99.9"):
        off, on = _get(rows, "hedging-off", "ttft_ms", q), _get(rows, "hedging-on", "ttft_ms", q)
        if off and on is not None:
            out[f"hedging_ttft_{q}_reduction_pct"] = round(100.0 * (1.0 - on / off), 1)
    return out


def targets(
    workload: str,
    rows: Mapping[str, Mapping[str, Any]],
    comparison: Mapping[str, Any],
    budget: BudgetSettings,
) -> list[dict[str, Any]]:
    """The workload's hedging targets, each with its value and met, missed, or not judged
    when this run's sample cannot decide it (`gateway.bench.judge`)."""
    result: list[dict[str, Any]] = []
    if workload == "stragglers":
        pair = judge.PAIR_CONFIDENCE
        result.append(judge.target(
            "TTFT p99 >= 70 % below hedging off",
            judge.cut(ttft_estimate(rows.get("hedging-on"), 0.99, pair),
                      ttft_estimate(rows.get("hedging-off"), 0.99, pair)), 70.0, at_most=False))
        result.append(judge.target("extra attempts <= 12 % of requests",
                                   share_of(rows, "hedging-on", "upstream", "extra"), 12.0,
                                   at_most=True))
    elif workload == "outage":
        # the budget's guarantee, not an estimate: it holds for every run, however short
        n = _get(rows, "hedging-on", "requests") or 0.0
        wall = _get(rows, "hedging-on", "wall_s") or 0.0
        extra = _get(rows, "hedging-on", "upstream", "extra")
        bound = budget.ratio * n + budget.burst + budget.min_per_second * wall
        result.append(judge.measured(
            f"extra attempts <= ratio*N + burst + reserve*t = {bound:.1f}", extra,
            None if extra is None else extra <= bound))
    elif workload == "pushback":
        for mode in GATEWAY_MODES:
            result.append(judge.target(f"{mode}: >= 95 % of requests served",
                                       share_of(rows, mode, "ok"), 95.0, at_most=False))
    return result


def _cell(value: object, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_workload(result: Mapping[str, Any]) -> str:
    """The printed table of one workload, with its comparison and targets."""
    head = (f"{'mode':<15} {'ok':>5} {'err':>4} | {'TTFT p50':>8} {'p90':>7} {'p99':>7} "
            f"{'p99.9':>7} | {'total p50':>9} {'p99':>7} | {'extra%':>6} {'win%':>5} "
            f"{'req/s':>7} | {'gw cpu s':>8} {'gw rss MB':>9}")
    lines = [f"== {result['name']}: {result['description']}",
             f"   {result['requests']} requests per mode, concurrency {result['concurrency']}, "
             f"seed {result['seed']} (times in ms)", head, "-" * len(head)]
    for row in result["modes"]:
        ttft, total, hedges = row["ttft_ms"], row["total_ms"], row.get("hedges")
        proc = row.get("gateway_process") or {}
        win = hedges.get("win_rate") if hedges else None
        lines.append(
            f"{row['mode']:<15} {row['ok']:>5} {row['errors']:>4} | {_cell(ttft['p50']):>8} "
            f"{_cell(ttft['p90']):>7} {_cell(ttft['p99']):>7} {_cell(ttft['p99.9']):>7} | "
            f"{_cell(total['p50']):>9} {_cell(total['p99']):>7} | "
            f"{_cell(row['upstream']['extra_pct']):>6} "
            f"{_cell(None if win is None else 100.0 * win, 0):>5} "
            f"{_cell(row['requests_per_s']):>7} | {_cell(proc.get('cpu_s'), 2):>8} "
            f"{_cell(proc.get('peak_rss_mb')):>9}")
    for row in result["modes"]:
        gap, counted = row.get("longest_gap_ms"), row.get("continuations")
        if counted is not None and gap is not None:
            lines.append(f"   {row['mode']}: longest gap per stream p50 {_cell(gap['p50'])}"
                         f" p99 {_cell(gap['p99'])}; continuations started "
                         f"{counted.get('started')}, won {counted.get('won')}, stalls "
                         f"{counted.get('stalls')}, breaks continued "
                         f"{counted.get('breaks_continued')}, ended "
                         f"{counted.get('breaks_ended')}{_refused(counted)}; input tokens resent "
                         f"{counted.get('input_tokens')} of the workload's "
                         f"{counted.get('workload_tokens')}")
        elif gap is not None and gap["p99"] is not None and row["mode"] == "direct" \
                and any(r.get("continuations") is not None for r in result["modes"]):
            lines.append(f"   direct: longest gap per stream p50 {_cell(gap['p50'])} p99 "
                         f"{_cell(gap['p99'])}")
    by_mode = {row["mode"]: row for row in result["modes"]}
    calm, cont = by_mode.get("no-faults"), by_mode.get("continuation-on")
    if calm is not None and cont is not None and calm["total_ms"]["p99"] \
            and cont["total_ms"]["p99"] is not None:
        lines.append(f"   continuation-on vs no-faults: total p99 x"
                     f"{cont['total_ms']['p99'] / calm['total_ms']['p99']:.3f}; complete "
                     f"{cont['ok']}/{cont['requests']}; extra attempts "
                     f"{_cell(cont['upstream']['extra_pct'])} % (no-faults "
                     f"{_cell(calm['upstream']['extra_pct'])} %)")
        goals = stall_goals(calm, cont, result.get("stall_min_s"))
        if goals is not None:
            lines.append(f"   goals: {goals}")
    for row in result["modes"]:
        procs = row.get("processes") or {}
        ours = ", ".join(f"{name} {p['cpu_s']:.2f}" for name, p in procs.items()
                         if name != "machine")
        if "machine" in procs:
            lines.append(f"   {row['mode']}: CPU s {ours}; all CPUs busy "
                         f"{procs['machine']['busy_pct']:.0f} % "
                         f"({procs['machine']['cpu_s']:.2f} CPU s, every process)")
    c = result["comparison"]
    for mode in GATEWAY_MODES:
        if f"{mode}_added_ttft_p50_ms" in c:
            ratio = c.get(f"{mode}_throughput_ratio_direct_over_gateway")
            lines.append(f"   gateway ({mode}) vs direct: median TTFT "
                         f"{c[f'{mode}_added_ttft_p50_ms']:+.2f} ms "
                         f"(x{_cell(c.get(f'{mode}_ttft_p50_ratio'), 3)}), throughput "
                         f"direct/gateway x{_cell(ratio, 2)}")
        paired = c.get(f"{mode}_paired_added")
        if paired and paired["pairs"]:
            lines.append(f"     same draws, per request ({paired['pairs']} pairs): TTFT "
                         f"+{_cell(paired['ttft_p50_ms'], 2)} ms median, "
                         f"+{_cell(paired['ttft_p90_ms'], 2)} ms p90; total "
                         f"+{_cell(paired['total_p50_ms'], 2)} ms median")
    served = [f"{mode} {c[f'{mode}_served_pct']:.1f} %" for mode in MODES
              if f"{mode}_served_pct" in c]
    if served:
        lines.append(f"   requests served: {', '.join(served)}")
    if c.get("single_hedge"):
        best = c["single_hedge"]
        lines.append(f"   best single hedge at ratio {best['ratio']} (same draws): delay "
                     f"{_cell(best['delay_ms'])} ms, {best['hedged']} hedged, TTFT p50 "
                     f"{_cell(best['ttft_p50_ms'])} ms, p99 {_cell(best['ttft_p99_ms'])} ms")
    if "hedging_ttft_p99_reduction_pct" in c:
        p99 = -c["hedging_ttft_p99_reduction_pct"]
        p999 = -c.get("hedging_ttft_p99.9_reduction_pct", math.nan)
        lines.append(f"   hedging on vs off: TTFT p99 {p99:+.1f} %, p99.9 {p999:+.1f} %")
    for row in result["modes"]:
        if row.get("hedges"):
            h = row["hedges"]
            lines.append(f"   {row['mode']}: hedges {h['started']} started, {h['won']} won "
                         f"(source: {h['source']})")
    if result.get("outage_phases"):
        parts = ", ".join(f"{k} {v['extra']}/{v['requests']}"
                          for k, v in result["outage_phases"].items())
        lines.append(f"   hedging-on extra attempts by phase: {parts}")
    for t in result["targets"]:
        lines.append(f"   target: {t['target']}: {_cell(t['value'], 2)} -> {judge.state(t)}")
    return "\n".join(lines)


def public(result: Mapping[str, Any]) -> dict[str, Any]:
    """`result` without the private helper fields (keys starting with `_`), for JSON."""
    def clean(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {k: clean(v) for k, v in node.items() if not str(k).startswith("_")}
        if isinstance(node, list):
            return [clean(v) for v in node]
        return node
    cleaned: dict[str, Any] = clean(result)
    return cleaned


def write_json(path: str, report: Mapping[str, Any]) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(public(report), file, indent=2, sort_keys=False)
        file.write("\n")


def spread(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """TTFT p99 of each mode over repeated runs of one workload (seed after seed), and the
    hedging cut (p99 hedging on / off) of each run: min, median, max. One run's p99 is one
    draw; this says whether the cut holds every time."""
    def summary(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}

    p99: dict[str, list[float]] = {}
    cuts: list[float] = []
    for run in runs:
        by_mode = {row["mode"]: row["ttft_ms"]["p99"] for row in run["modes"]}
        for mode, value in by_mode.items():
            if value is not None:
                p99.setdefault(mode, []).append(value)
        off, on = by_mode.get("hedging-off"), by_mode.get("hedging-on")
        if off and on is not None:
            cuts.append(on / off)
    return {"runs": len(runs), "seeds": [run["seed"] for run in runs],
            "ttft_p99_ms": {mode: summary(values) for mode, values in p99.items()},
            "p99_on_over_off": summary(cuts) if cuts else None}


def format_spread(name: str, spread: Mapping[str, Any]) -> str:
    """The spread's printed lines."""
    lines = [f"== {name}: spread over {spread['runs']} runs (seeds "
             f"{spread['seeds'][0]}..{spread['seeds'][-1]}), TTFT p99 ms min / median / max"]
    for mode, s in spread["ttft_p99_ms"].items():
        lines.append(f"   {mode:<12} {s['min']:>8.1f} {s['median']:>8.1f} {s['max']:>8.1f}")
    cut = spread["p99_on_over_off"]
    if cut is not None:
        lines.append(f"   p99 on / off  {cut['min']:.2f} / {cut['median']:.2f} / "
                     f"{cut['max']:.2f}")
    return "\n".join(lines) + "\n"


def _refused(counted: Mapping[str, Any]) -> str:
    """A row's refused continuations by reason (`rows.continuations`), or nothing."""
    refused = {k.removeprefix("refused."): v for k, v in counted.items()
               if k.startswith("refused.") and v}
    return "" if not refused else ", refused " + ", ".join(
        f"{reason} {n}" for reason, n in sorted(refused.items()))


def stall_goals(calm: Mapping[str, Any], cont: Mapping[str, Any], stall_min: object
                ) -> str | None:
    """The `stalls` workload's goals read off its rows, each with its bound: every answer
    complete, the continuation-on total p99 at most 1.25 x the no-faults one, its longest
    gap p99 at most the stall delay (its floor, `stall_min`: the learnt delay of these
    streams is under it) plus the slower backend's TTFT p99 at the gateway, and the input
    the continuations resent at most 6 % of the workload's tokens. None without the
    numbers (a row that failed to run)."""
    try:
        ratio = cont["total_ms"]["p99"] / calm["total_ms"]["p99"]
        gap = float(cont["longest_gap_ms"]["p99"])
        floor = 1000.0 * float(stall_min)  # type: ignore[arg-type]
        backends = cont["hedge_stats"]["pools"]["bench"]["backends"].values()
        ttft = max(float(b["lifetime"]["ttft_ms"]["p99"]) for b in backends)
        counted = cont["continuations"]
        extra = 100.0 * counted["input_tokens"] / counted["workload_tokens"]
    except (TypeError, KeyError, ValueError, ZeroDivisionError, AttributeError):
        return None

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT MET"

    complete = cont["ok"] == cont["requests"]
    # the no-faults simulators never stall: a stall declared there is a pause of the
    # machine, which moved the yardstick
    paused = (calm.get("continuations") or {}).get("stalls")
    caveat = f" (no-faults row: {paused} stalls, a pause of the machine)" if paused else ""
    return (f"complete {cont['ok']}/{cont['requests']} {verdict(complete)}; total p99 "
            f"x{ratio:.3f} <= 1.25 {verdict(ratio <= 1.25)}; longest gap p99 {gap:.0f} <= "
            f"stall floor {floor:.0f} + TTFT p99 {ttft:.0f} = {floor + ttft:.0f} ms "
            f"{verdict(gap <= floor + ttft)}; input resent {extra:.1f} % <= 6 % "
            f"{verdict(extra <= 6.0)}{caveat}")
