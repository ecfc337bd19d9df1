"""`hedge-gateway bench` end to end: real child processes on loopback, every request accounted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.bench import run as bench
from gateway.bench.rows import MODES
from gateway.bench.workloads import Workload
from gateway.settings import SimProfile

# --------------------------------------------------------------------------- end to end

TINY = Workload(
    "tiny", "fast profile for tests",
    SimProfile(ttft_median=0.01, ttft_sigma=0.25, straggler_probability=0.1,
               straggler_extra=0.15, tokens=5, inter_token=0.001),
    requests=20, concurrency=4, quick_requests=20, outage_extra=0.05,
)


def _check_modes(workload: dict[str, Any], requests: int,
                 modes: tuple[str, ...] = MODES) -> None:
    assert [row["mode"] for row in workload["modes"]] == list(modes)
    for row in workload["modes"]:
        assert row["requests"] == requests
        assert row["ok"] + row["errors"] == requests, row["error_kinds"]
        assert set(row["ttft_ms"]) == {"p50", "p90", "p99", "p99.9", "max"}
        assert set(row["total_ms"]) == {"p50", "p99"}
        assert row["upstream"]["attempts"] >= row["ok"]
        gateway = row["mode"] in ("hedging-off", "hedging-on")
        assert (row["gateway_process"] is not None) == gateway
        assert (row["hedges"] is not None) == gateway
    by_mode = {row["mode"]: row for row in workload["modes"]}
    assert by_mode["direct"]["upstream"]["extra"] == 0
    if "oracle" in by_mode:
        # a loser cancelled before its request went out never reaches its upstream
        assert requests <= by_mode["oracle"]["upstream"]["attempts"] <= 2 * requests
    assert by_mode["hedging-off"]["hedges"]["started"] == 0
    for row in workload["modes"]:  # the gateway's own cost, from its CPU counters
        gateway = row["mode"] in ("hedging-off", "hedging-on")
        assert (row["cost"]["cpu_ms_per_request"] is not None) == gateway
        assert row["events_delivered"] is not None


@pytest.mark.timeout(120)
def test_tiny_bench_end_to_end_accounts_for_every_request() -> None:
    plan = bench.BenchPlan(workloads=(TINY,), seed=3)
    report = bench.run_bench(plan)
    assert set(report) >= {"machine", "workloads", "seed", "duration_s"}
    (workload,) = report["workloads"]
    _check_modes(workload, 20)
    assert workload["outage_phases"]["before"]["requests"] == 6
    assert {t["target"] for t in workload["targets"]} == set()  # targets only for named ones


@pytest.mark.timeout(120)
def test_cli_writes_json_and_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main

    out = tmp_path / "r.json"
    code = main(["bench", "--workload", "overhead", "--requests", "12", "--concurrency", "3",
                 "--quick", "--out", str(out), "--no-progress", "--no-features", "--no-nginx",
                 "--no-passthrough", "--no-keys", "--no-translated"])
    # those rows: tests/e2e/test_bench_keys.py, tests/e2e/test_bench_translated.py,
    # tests/e2e/test_bench_floor.py
    assert code == 0
    printed = capsys.readouterr().out
    assert "== overhead" in printed and "hedging-on" in printed
    assert "ms/request" in printed and "at c=1: median TTFT" in printed
    data = json.loads(out.read_text())
    (workload,) = data["workloads"]
    _check_modes(workload, 12, ("direct", "hedging-off", "hedging-on"))
    for row in workload["modes"]:  # the pass at concurrency 1, before the main one
        assert row["c1"]["requests"] == 100 and row["c1"]["ok"] == 100
    assert {t["target"] for t in workload["targets"]} == {
        "gateway CPU <= 1.2 ms per request at c=50", ">= 700 req/s at c=50",
        "added median TTFT at c=1 <= 1.0 ms", "gateway peak RSS <= 100 MB at c=50"}
    assert all(t["value"] is not None for t in workload["targets"])
    if len(os.sched_getaffinity(0)) >= 2:  # the gateway alone on its core
        assert len(data["pinning"]["gateway"]) == 1
        assert data["pinning"]["gateway"][0] not in data["pinning"]["client_and_simulators"]
    assert '"_samples"' not in json.dumps(data)


def test_cli_refuses_sizes_below_one_before_starting_anything(
    capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main

    for option in ("--requests", "--concurrency"):
        with pytest.raises(SystemExit) as info:
            main(["bench", option, "0"])
        assert info.value.code == 2
        assert "0 is not at least 1" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_slow_share_workload_runs_off_and_on_and_reports_the_single_hedge_bound() -> None:
    import dataclasses

    share = dataclasses.replace(TINY, name="stragglers-6", outage_extra=0.0,
                                modes=("hedging-off", "hedging-on"), delay_window=5.0,
                                single_hedge=True)
    report = bench.run_bench(bench.BenchPlan(workloads=(share,), seed=3))
    (workload,) = report["workloads"]
    assert [row["mode"] for row in workload["modes"]] == ["hedging-off", "hedging-on"]
    for row in workload["modes"]:
        assert row["ok"] + row["errors"] == 20
    best = workload["comparison"]["single_hedge"]
    assert best["ratio"] == 0.1 and best["hedged"] == 2  # 10 % of 20 requests
    assert [t["target"] for t in workload["targets"]] == [
        "TTFT p99 <= 1.15 x best single hedge", "TTFT p99 hedging on - off <= 0 ms",
        "extra attempts <= 12 % of requests"]


@pytest.mark.timeout(120)
def test_a_tiny_stalls_workload_runs_its_gateways_with_its_floor_and_prints_the_goals(
        tmp_path: Path) -> None:
    """The `stalls` workload's shape in small (streams that stall and break, the four modes,
    a stall floor of its own): the continuation modes' gateways are started with the
    workload's `hedging.stall.min`, the stalls are continued, and the printed table ends with
    the goals read off the rows."""
    from gateway.bench.report import format_workload

    stalls = Workload(
        "tiny-stalls", "streams that stall and break, in small",
        SimProfile(ttft_median=0.01, ttft_sigma=0.0, straggler_probability=0.0, tokens=20,
                   inter_token=0.005, usage=False, stall_probability=0.3, stall_length=2.0,
                   break_probability=0.1),
        requests=20, concurrency=4, quick_requests=20,
        modes=("direct", "no-faults", "continuation-off", "continuation-on"), stall_min=0.2)
    report = bench.run_bench(bench.BenchPlan(workloads=(stalls,), seed=3))
    (workload,) = report["workloads"]
    assert [row["mode"] for row in workload["modes"]] == list(stalls.modes or ())
    assert workload["stall_min_s"] == 0.2
    by_mode = {row["mode"]: row for row in workload["modes"]}
    assert by_mode["continuation-on"]["continuations"]["started"] >= 1
    assert by_mode["continuation-off"]["continuations"]["started"] == 0
    goals = [line for line in format_workload(workload).splitlines() if "goals:" in line]
    assert len(goals) == 1 and "stall floor 200 +" in goals[0]


@pytest.mark.timeout(120)
def test_tiny_soak_runs_both_gateways_through_the_faults(tmp_path: Path) -> None:
    """A few seconds of the soak: every child really starts, sim-a is really killed and
    restarted, and every request is accounted as ok or an explicit error (none silent, none
    hung), with the gateways' RSS and descriptors sampled."""
    from gateway.bench import soak

    plan = soak.SoakPlan(duration=4.0, concurrency=2, interval=0.1, pushback=0.1, stall=0.1,
                         sample_every=0.5, request_timeout=30.0, settle=0.0)
    result = soak.run_soak(plan, str(tmp_path))
    assert [m["mode"] for m in result["modes"]] == list(soak.MODES)
    assert [e["event"] for e in result["events"]] == ["sim-a killed", "sim-a restarted"]
    for mode in result["modes"]:
        assert mode["requests"] > 0
        assert mode["ok"] + mode["explicit"] + mode["silent"] + mode["hung"] == mode["requests"]
        assert len(mode["series"]) >= 2
        assert mode["rss_mb"]["max"] > 0 and mode["fds"]["max"] > 0
        assert mode["after_idle"]["fds"] > 0
    # with no idle period here, pooled connections whose backend closed them can still sit
    # in CLOSE_WAIT: `soak.clean`'s socket check is for the full run; this is the requests'
    assert all(m["silent"] == 0 and m["hung"] == 0 for m in result["modes"]), \
        soak.format_soak(result)
    assert "no socket left in CLOSE_WAIT:" in soak.format_soak(result)


@pytest.mark.timeout(120)
def test_bench_with_two_gateway_workers_counts_every_request_once() -> None:
    """`bench --workers 2`: the gateway under test serves with two workers, and its
    whole-server `/hedge/stats` lists both and counts each measured request once."""
    plan = bench.BenchPlan(workloads=(TINY,), seed=3, modes=("direct", "hedging-off"),
                           workers=2)
    (workload,) = bench.run_bench(plan)["workloads"]
    assert workload["gateway_workers"] == 2
    row = next(r for r in workload["modes"] if r["mode"] == "hedging-off")
    assert row["ok"] == 20
    assert row["gateway_counted"] == {"requests": 20, "workers": 2}
    assert row["gateway_process"]["cpu_s"] > 0


@pytest.mark.timeout(120)
def test_a_granian_mode_serves_the_same_gateway_and_is_metered() -> None:
    """`--servers uvicorn,granian`: the same app under granian, every stream complete, its
    CPU from the gateway's whole process tree (granian's main process and its worker)."""
    pytest.importorskip("granian", reason="optional: pip install 'hedge-gateway[granian]'")
    plan = bench.BenchPlan(workloads=(TINY,), seed=3, modes=("direct", "hedging-on"),
                           servers=("uvicorn", "granian"))
    report = bench.run_bench(plan)
    assert report["servers"] == ["uvicorn", "granian"]
    (workload,) = report["workloads"]
    rows = {row["mode"]: row for row in workload["modes"]}
    assert list(rows) == ["direct", "hedging-on", "granian"]
    granian = rows["granian"]
    assert granian["ok"] == granian["requests"] == 20, granian["error_kinds"]
    assert granian["events_delivered"] == rows["hedging-on"]["events_delivered"]
    assert granian["cost"]["cpu_ms_per_request"] is not None
    # the gateway counted them: the requests went through the app, not around it
    assert granian["gateway_counted"]["requests"] == 20
    assert "granian_cpu_ms_per_request" in workload["comparison"]
