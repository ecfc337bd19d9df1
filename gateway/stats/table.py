"""`hedge-gateway stats [URL]`: a running gateway's `/hedge/stats` as tables.

Reads the JSON once with a short timeout and prints, per pool, a summary table for the recent
window and the lifetime, then one row per backend. Exit status 0 on success, 1 when the
gateway cannot be reached or answers with something that is not its stats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import httpx

TIMEOUT = 5.0
SCOPES = ("window", "lifetime")


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}{unit}" if unit == "ms" else f"{value:.3g}{unit}"
    return f"{value}{unit}"


def _delay_cell(backend: Mapping[str, Any]) -> str:
    """`232.0ms adaptive p92 auto`: the delay in force, its mode, quantile and rule."""
    parts = [_fmt(backend.get("hedge_delay_ms"), "ms"), str(backend.get("hedge_delay_mode", ""))]
    quantile = backend.get("hedge_delay_quantile")
    if isinstance(quantile, int | float):
        parts.append(f"p{quantile * 100:g}")
    if backend.get("hedge_delay_rule") == "auto":
        parts.append("auto")
    return " ".join(p for p in parts if p)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line.rstrip(), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _suppressed(counts: dict[str, int]) -> str:
    parts = [f"{reason}={n}" for reason, n in counts.items() if n]
    return ",".join(parts) or "-"


def _errors(counts: dict[str, int]) -> str:
    return ",".join(f"{cls}={n}" for cls, n in counts.items()) or "-"


def _pool_rows(pool: dict[str, Any]) -> list[list[str]]:
    rows = []
    for scope in SCOPES:
        v = pool.get(scope, {})
        hedges, ttft = v.get("hedges", {}), v.get("ttft_ms", {})
        per = v.get("attempts_per_request", {})
        losers = v.get("losers", {})
        rows.append([
            scope,
            _fmt(v.get("requests")),
            _fmt(per.get("mean")),
            _fmt(hedges.get("started")),
            _fmt(hedges.get("won")),
            _pct(hedges.get("win_rate")),
            _pct(hedges.get("issue_rate")),
            _suppressed(hedges.get("suppressed", {})),
            _fmt(v.get("failovers")),
            _fmt(ttft.get("p50"), "ms"),
            _fmt(ttft.get("p99"), "ms"),
            _fmt(losers.get("cancelled")),
            _fmt(losers.get("close_ms", {}).get("p99"), "ms"),
            _fmt(v.get("panic")),
            _fmt(v.get("refused_no_backend")),
            _errors(v.get("errors", {})),
        ])
    return rows


def _backend_rows(backends: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, b in backends.items():
        w, life = b.get("window", {}), b.get("lifetime", {})
        state = b.get("state", "?")
        if b.get("seconds_left") is not None:
            state = f"{state} {b['seconds_left']:.1f}s"
        if b.get("reason"):
            state = f"{state} ({b['reason']})"
        rows.append([
            name,
            state,
            _delay_cell(b),
            _fmt(b.get("inflight")),
            _fmt(w.get("ttft_ms", {}).get("p50"), "ms"),
            _fmt(w.get("ttft_ms", {}).get("p99"), "ms"),
            _fmt(w.get("attempts")),
            _fmt(life.get("attempts")),
            _fmt(life.get("won")),
            _fmt(life.get("failed")),
            _fmt(life.get("ttft_censored")),
        ])
    return rows


def render(stats: dict[str, Any], out: TextIO) -> None:
    """Print the stats document as tables."""
    print(f"window {_fmt(stats.get('window_s'))}s, uptime {_fmt(stats.get('uptime_s'))}s",
          file=out)
    config = stats.get("config")
    if isinstance(config, dict):
        print(f"config: {config.get('source')}, sha256 {str(config.get('sha256'))[:16]}, "
              f"loaded {config.get('loaded_at')} ({_fmt(config.get('loaded_s_ago'))}s ago), "
              f"generation {_fmt(config.get('generation'))}, failed reloads "
              f"{_fmt(config.get('failed_reloads'))}", file=out)
    workers = stats.get("workers")
    if isinstance(workers, list) and workers:  # the whole server: every process in the view
        print(f"processes: {len(workers)} (" + ", ".join(
            f"worker {w.get('worker')} pid {w.get('pid')} {_fmt(w.get('age_s'))}s old"
            for w in workers if isinstance(w, dict)) + ")", file=out)
    for name, pool in stats.get("pools", {}).items():
        budget = pool.get("budget", {})
        print(file=out)
        print(
            f"pool {name}: in flight {_fmt(pool.get('inflight_requests'))}, budget "
            f"{_fmt(budget.get('tokens'))}/{_fmt(budget.get('burst'))} tokens "
            f"(ratio {_fmt(budget.get('ratio'))}, extra in flight "
            f"{_fmt(budget.get('extra_in_flight'))}, ineffective "
            f"{_fmt(budget.get('ineffective'))})",
            file=out,
        )
        tokens = pool.get("lifetime", {}).get("tokens", {})
        spend = pool.get("lifetime", {}).get("spend", {})
        print(
            f"tokens (lifetime): input {_fmt(tokens.get('input'))}, output "
            f"{_fmt(tokens.get('output'))}, hedge cost {_fmt(tokens.get('hedge_input'))} "
            "input tokens" + (f"; spend {spend['usd']:.6f} USD" if spend.get("usd") else ""),
            file=out,
        )
        _table(
            ["scope", "requests", "att/req", "hedges", "won", "win%", "issue%", "suppressed",
             "failovers", "ttft p50", "ttft p99", "losers", "close p99", "panic", "no backend",
             "errors"],
            _pool_rows(pool),
            out,
        )
        print(file=out)
        _table(
            ["backend", "state", "hedge delay", "inflight", "ttft p50", "ttft p99",
             "attempts (window)", "attempts (lifetime)", "won", "failed", "censored"],
            _backend_rows(pool.get("backends", {})),
            out,
        )


def print_stats(url: str, out: TextIO, err: TextIO) -> int:
    """GET `{url}/hedge/stats` and print it; 0 on success, 1 with a message on `err`."""
    target = url.rstrip("/") + "/hedge/stats"
    try:
        response = httpx.get(target, timeout=TIMEOUT, follow_redirects=False, trust_env=False)
    except httpx.HTTPError as exc:
        print(f"hedge-gateway stats: cannot reach {target}: {type(exc).__name__}: {exc}",
              file=err)
        return 1
    if response.status_code != 200:
        print(f"hedge-gateway stats: {target} answered {response.status_code}", file=err)
        return 1
    try:
        stats = response.json()
    except ValueError:
        print(f"hedge-gateway stats: {target} did not return JSON", file=err)
        return 1
    if not isinstance(stats, dict) or not isinstance(stats.get("pools"), dict):
        print(f"hedge-gateway stats: {target} is not a hedge-gateway stats document", file=err)
        return 1
    render(stats, out)
    return 0
