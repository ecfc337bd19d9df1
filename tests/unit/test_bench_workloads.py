"""What `hedge-gateway bench` runs: with `--quick`, which workloads and which modes of each;
and what a warm-up request asks for."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.bench.run import BenchPlan, plan_modes, warm_or
from gateway.bench.workloads import WORKLOAD_GROUPS, WORKLOADS, Workload, selected


def names(workloads: Sequence[Workload]) -> list[str]:
    return [w.name for w in workloads]


def test_quick_leaves_the_slow_shares_out_unless_they_are_named() -> None:
    assert names(selected("all", quick=True)) == [
        "stragglers", "outage", "overhead", "streams", "pushback"]
    assert names(selected("all", quick=False)) == [w.name for w in WORKLOADS]
    assert names(selected("slow-shares", quick=True)) == list(WORKLOAD_GROUPS["slow-shares"])
    assert names(selected("stragglers-6", quick=True)) == ["stragglers-6"]
    assert names(selected("streams", quick=False)) == ["streams"]


def test_quick_runs_fewer_modes_only_where_a_workload_says_so() -> None:
    by_name = {w.name: w for w in WORKLOADS}
    plan = BenchPlan(workloads=tuple(WORKLOADS))
    assert plan_modes(plan, by_name["stragglers"], quick=True) == [
        "direct", "hedging-off", "hedging-on", "oracle"]
    assert plan_modes(plan, by_name["outage"], quick=True) == ["hedging-off", "hedging-on"]
    assert plan_modes(plan, by_name["outage"]) == ["direct", "hedging-off", "hedging-on",
                                                   "oracle"]
    assert plan_modes(plan, by_name["pushback"], quick=True) == ["hedging-off", "hedging-on"]
    assert plan_modes(plan, by_name["streams"], quick=True) == ["direct", "hedging-on"]
    # a baseline checkout and other front servers still come after, quick or not
    extra = BenchPlan(workloads=tuple(WORKLOADS), baseline_src="/tmp/base",
                      servers=("uvicorn", "granian"))
    assert plan_modes(extra, by_name["outage"], quick=True) == [
        "hedging-off", "hedging-on", "baseline", "granian"]


def test_a_warm_up_asks_for_one_token_and_a_measured_request_for_the_workload() -> None:
    body = {"model": "bench", "stream": True, "messages": []}
    assert warm_or(body, -3) == {**body, "max_tokens": 1}
    assert warm_or(body, 0) is body
    assert "max_tokens" not in body
