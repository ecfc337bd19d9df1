"""The best single-hedge oracle and the slow-share targets of `hedge-gateway bench`,
on plain numbers."""

from __future__ import annotations

import pytest

from gateway.bench.oracle import best_single_hedge, format_shares, share_targets
from gateway.bench.subject import gateway_config
from gateway.bench.workloads import WORKLOAD_GROUPS, WORKLOADS


def test_the_best_delay_is_the_smallest_the_budget_allows() -> None:
    # 10 requests, ratio 0.2: two hedges. Primaries 1..10 (s); hedges answer in 0.5 s.
    pairs = [(float(p), 0.5) for p in range(1, 11)]
    best = best_single_hedge(pairs, 0.2, (0.5, 1.0))
    assert (best.delay, best.hedged, best.requests) == (8.0, 2, 10)
    # requests 9 and 10 are hedged at 8 s and answer at 8.5 s
    assert best.ttft == (5.5, 8.5)


def test_a_later_delay_never_beats_the_oracle() -> None:
    pairs = [(0.15 + (1.5 if i % 17 == 0 else 0.0) + i % 7 / 100, 0.15 + i % 5 / 100)
             for i in range(400)]
    best = best_single_hedge(pairs, 0.1).ttft[0]
    for delay in (0.2, 0.25, 0.5, 1.0):
        hedged = sum(p > delay for p, _ in pairs)
        if hedged > 40:
            continue  # over the budget
        results = sorted(min(p, delay + h) if p > delay else p for p, h in pairs)
        assert results[round(0.99 * 399)] >= best - 1e-9


def test_no_budget_means_no_hedge_and_a_full_budget_hedges_all() -> None:
    pairs = [(1.0, 0.1), (2.0, 0.1)]
    assert best_single_hedge(pairs, 0.0, (1.0,)).hedged == 0
    everything = best_single_hedge(pairs, 1.0, (1.0,))
    assert (everything.delay, everything.hedged, everything.ttft) == (0.0, 2, (0.1,))
    with pytest.raises(ValueError):
        best_single_hedge([], 0.1)


def _ttfts(n: int, p99_ms: float) -> list[float]:
    """n sorted TTFTs (seconds), evenly spread, whose p99 is `p99_ms`."""
    return [p99_ms / 1000.0 * (i + 1) / (0.99 * (n - 1) + 1) for i in range(n)]


def _rows(off: float, on: float, extra: float, n: int = 4000) -> dict[str, dict[str, object]]:
    return {"hedging-off": {"mode": "hedging-off", "requests": n, "concurrency": 20,
                            "ttft_ms": {"p99": off}, "_ttfts": _ttfts(n, off)},
            "hedging-on": {"mode": "hedging-on", "requests": n, "concurrency": 20,
                           "ttft_ms": {"p99": on}, "_ttfts": _ttfts(n, on),
                           "upstream": {"extra_pct": extra, "extra": extra * n / 100}}}


def test_share_targets() -> None:
    comparison = {"single_hedge": {"ttft_p99_ms": 400.0}}
    met = {t["target"]: t["met"]
           for t in share_targets("stragglers-6", _rows(1700.0, 455.0, 8.0), comparison)}
    assert met == {"TTFT p99 <= 1.15 x best single hedge": True,
                   "TTFT p99 hedging on - off <= 0 ms": True,
                   "extra attempts <= 12 % of requests": True}
    missed = share_targets("stragglers-3", _rows(1700.0, 470.0, 14.0), comparison)
    assert [t["met"] for t in missed] == [False, True, False]
    # at 10 % the single hedge cannot cut the tail: only "no worse than off" and the budget
    ten = share_targets("stragglers-10", _rows(1700.0, 1750.0, 9.0), comparison)
    assert [(t["target"], t["met"]) for t in ten] == [
        ("TTFT p99 hedging on - off <= 0 ms", False), ("extra attempts <= 12 % of requests", True)]


def test_share_targets_on_a_quick_runs_sample_are_not_judged() -> None:
    """300 requests per mode: a p99 needs 1,000, and 12.3 % extra attempts of 300 cannot be
    told from 12 % (the interval spans it), so none of the three is printed MET or MISSED."""
    comparison = {"single_hedge": {"ttft_p99_ms": 400.0}}
    targets = share_targets("stragglers-6", _rows(1700.0, 600.0, 12.3, n=300), comparison)
    assert [t["met"] for t in targets] == [None, None, None]
    assert all(t["not_judged"].startswith("sample too small: n=300") for t in targets)
    assert "a p99 needs n >= 1000" in targets[0]["not_judged"]
    assert "interval" in targets[2]["not_judged"] and "spans 12.0" in targets[2]["not_judged"]


def test_the_summary_table_has_one_row_per_share() -> None:
    rows = _rows(1700.0, 455.0, 8.0)
    workload = {"name": "stragglers-6", "requests": 3000, "modes": list(rows.values()),
                "comparison": {"single_hedge": {"ttft_p99_ms": 400.0}}}
    table = format_shares([workload, {"name": "overhead", "comparison": {}}])
    assert "stragglers-6" in table and "1.14" in table and "overhead" not in table
    assert format_shares([]) == ""


def test_the_share_workloads_and_their_config() -> None:
    shares = {w.name: w for w in WORKLOADS if w.single_hedge}
    assert set(shares) == set(WORKLOAD_GROUPS["slow-shares"]) == {
        "stragglers-3", "stragglers-6", "stragglers-10"}
    assert [shares[n].profile.straggler_probability for n in sorted(shares)] == [
        0.1, 0.03, 0.06]
    config = gateway_config(8080, [1, 2], hedging=True, delay_window=10.0)
    assert "window: 10.0" in config
    assert "window" not in gateway_config(8080, [1, 2], hedging=True)
