"""`hedge-gateway bench`: the report's arithmetic on plain numbers, the per-request seeded draws,
and one tiny end-to-end run over real loopback servers (child processes).

No test asserts a timing: the end-to-end run checks the report's structure and that every
request is accounted for in every mode.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.bench import report
from gateway.bench.load import Sample, is_content_token
from gateway.bench.report import (
    compare,
    format_workload,
    outage_phases,
    paired_added_ms,
    public,
    targets,
)
from gateway.bench.rows import gateway_hedges, quantile, summarize_mode, upstream_view
from gateway.bench.upstream import Outage, profile_from_json, profile_to_json, request_ttft
from gateway.settings import BudgetSettings, SimProfile

# --------------------------------------------------------------------------- pure parts


def test_quantile_interpolates_between_ranks() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0], 1.0) == 4.0


def test_content_token_detection() -> None:
    role = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    token = b'{"choices":[{"index":0,"delta":{"content":" "}}]}'
    assert is_content_token(role) is False
    assert is_content_token(token) is True
    assert is_content_token(b'{"choices":[],"usage":{"total_tokens":3}}') is False
    assert is_content_token(b'{"error":{"message":"x"}}') is None
    with pytest.raises(ValueError):
        is_content_token(b"not json")


def test_upstream_view_finds_hedges_and_who_won() -> None:
    a = [["bench-0", 1.0, 200, True], ["bench-1", 2.0, 200, False], ["bench-2", 3.0, 200, True]]
    b = [["bench-1", 2.3, 200, True], ["bench-2", 3.4, 200, False]]
    view = upstream_view([a, b])
    assert (view.attempts, view.logical, view.extra, view.multi) == (5, 3, 2, 2)
    assert view.later_won == 1  # bench-1: the later attempt (the hedge) completed
    assert dict(view.extra_by_index) == {1: 1, 2: 1}


def test_gateway_hedges_reads_known_shapes_only() -> None:
    assert gateway_hedges({"pools": {"bench": {"hedges": {"started": 4, "won": 3}}}},
                          "bench") == (4, 3)
    assert gateway_hedges({"pools": [{"name": "bench", "lifetime": {
        "hedges": {"started": 2, "won": 1}}}]}, "bench") == (2, 1)
    assert gateway_hedges({"pools": {}}, "bench") is None
    assert gateway_hedges(None, "bench") is None


def _sample(i: int, ttft: float, *, backend: str | None = None, attempts: int | None = None,
            ok: bool = True) -> Sample:
    return Sample(i, ok, ttft if ok else None, ttft + 0.1, None if ok else "status 502",
                  attempts, backend)


def test_summary_comparison_and_targets() -> None:
    direct = [_sample(i, 0.100 + i / 1000) for i in range(10)]
    off = [_sample(i, 0.105 + i / 1000 + (1.5 if i == 9 else 0), backend="sim-a", attempts=1)
           for i in range(10)]
    on = [_sample(i, 0.106 + i / 1000, backend="sim-a", attempts=1) for i in range(9)]
    on.append(_sample(9, 0.0, ok=False))
    logs_on = [[[f"bench-{i}", float(i), 200, True] for i in range(10)],
               [["bench-9", 9.5, 200, False]]]
    rows = {
        "direct": summarize_mode("direct", direct, 1.0, [[]]),
        "hedging-off": summarize_mode("hedging-off", off, 1.0, [[]]),
        "hedging-on": summarize_mode("hedging-on", on, 1.0, logs_on,
                                     process={"cpu_s": 0.5, "peak_rss_mb": 60.0}),
    }
    assert rows["hedging-on"]["ok"] + rows["hedging-on"]["errors"] == 10
    assert rows["hedging-on"]["error_kinds"] == {"status 502": 1}
    assert rows["hedging-on"]["hedges"] == {"started": 1, "won": 0, "win_rate": 0.0,
                                            "source": "sim request logs"}
    assert rows["hedging-on"]["upstream"]["extra_pct"] == 10.0
    c = compare(rows)
    assert c["hedging-off_paired_added"]["pairs"] == 10
    assert c["hedging-off_paired_added"]["ttft_p50_ms"] == pytest.approx(5.0)
    assert c["hedging_ttft_p99_reduction_pct"] > 0
    got = {t["target"]: t for t in targets("stragglers", rows, c, BudgetSettings())}
    # 1 extra attempt in 10 requests: 10 % could be 2 % or 40 %; a p99 of 10 says nothing
    extra = got["extra attempts <= 12 % of requests"]
    assert (extra["value"], extra["met"]) == (10.0, None)
    assert extra["not_judged"].startswith("sample too small: n=10; its 95 % interval")
    cut = got["TTFT p99 >= 70 % below hedging off"]
    assert cut["met"] is None and "a p99 needs n >= 1000" in cut["not_judged"]
    phases = outage_phases(rows["hedging-on"], 10, (0.5, 1.0))
    assert phases["outage_second_half"] == {"requests": 3, "extra": 1}
    result = {"name": "t", "description": "d", "requests": 10, "concurrency": 2, "seed": 1,
              "modes": list(rows.values()), "comparison": c, "targets": []}
    assert "hedging-on" in format_workload(result)
    json.dumps(public(result))  # the private fields (samples) are dropped


def test_pushback_reports_the_share_served_side_by_side() -> None:
    off = [_sample(i, 0.1, ok=i != 0) for i in range(20)]
    on = [_sample(i, 0.1) for i in range(20)]
    rows = {"hedging-off": summarize_mode("hedging-off", off, 1.0, [[]]),
            "hedging-on": summarize_mode("hedging-on", on, 1.0, [[]])}
    c = compare(rows)
    assert (c["hedging-off_served_pct"], c["hedging-on_served_pct"]) == (95.0, 100.0)
    met = {t["target"]: (t["value"], t["met"])
           for t in targets("pushback", rows, c, BudgetSettings())}
    # 20 requests cannot tell 95 % served from 90 % or 100 %
    assert met == {"hedging-off: >= 95 % of requests served": (95.0, None),
                   "hedging-on: >= 95 % of requests served": (100.0, None)}
    many = [_sample(i, 0.1, ok=i % 100 != 0) for i in range(1000)]  # 99 % served
    rows["hedging-on"] = summarize_mode("hedging-on", many, 1.0, [[]])
    judged = {t["target"]: t["met"] for t in targets("pushback", rows, compare(rows),
                                                     BudgetSettings())}
    assert judged["hedging-on: >= 95 % of requests served"] is True
    result = {"name": "pushback", "description": "d", "requests": 20, "concurrency": 2,
              "seed": 1, "modes": list(rows.values()), "comparison": c, "targets": []}
    assert "requests served: hedging-off 95.0 %, hedging-on 100.0 %" in format_workload(result)


def test_paired_differences_skip_hedged_and_other_backend() -> None:
    direct = {0: _sample(0, 0.1), 1: _sample(1, 0.2), 2: _sample(2, 0.3)}
    gateway = {0: _sample(0, 0.102, backend="sim-a", attempts=1),
               1: _sample(1, 0.5, backend="sim-b", attempts=1),
               2: _sample(2, 0.9, backend="sim-a", attempts=2)}
    paired = paired_added_ms(direct, gateway)
    assert paired["pairs"] == 1
    assert paired["ttft_p50_ms"] == pytest.approx(2.0)


def test_request_ttft_is_a_function_of_seed_backend_and_index() -> None:
    profile = SimProfile(ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.03)
    a = [request_ttft(profile, 1, "a", i) for i in range(200)]
    assert a == [request_ttft(profile, 1, "a", i) for i in range(200)]
    assert a != [request_ttft(profile, 1, "b", i) for i in range(200)]
    outage = Outage(start=10, end=20, extra=1.5)
    with_outage = [request_ttft(profile, 1, "a", i, outage) for i in range(200)]
    assert [w - x for w, x in zip(with_outage, a, strict=True)][9:21] == pytest.approx(
        [0.0] + [1.5] * 10 + [0.0])
    assert profile_from_json(profile_to_json(profile)) == profile


def test_the_spread_over_repeated_runs_names_each_mode_and_the_cut() -> None:
    def run(seed: int, off: float, on: float) -> dict[str, Any]:
        return {"seed": seed, "modes": [{"mode": "hedging-off", "ttft_ms": {"p99": off}},
                                        {"mode": "hedging-on", "ttft_ms": {"p99": on}}]}

    spread = report.spread([run(1, 1600.0, 400.0), run(2, 1700.0, 1650.0),
                            run(3, 1650.0, 420.0)])
    assert spread["runs"] == 3 and spread["seeds"] == [1, 2, 3]
    assert spread["ttft_p99_ms"]["hedging-on"] == {"min": 400.0, "median": 420.0, "max": 1650.0}
    cut = spread["p99_on_over_off"]
    assert cut["min"] == 0.25 and cut["max"] == pytest.approx(1650 / 1700)
    printed = report.format_spread("stragglers", spread)
    assert "spread over 3 runs (seeds 1..3)" in printed and "hedging-on" in printed
