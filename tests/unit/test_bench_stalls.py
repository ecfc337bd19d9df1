"""`bench --workload stalls`: its modes side by side, the gateways they start, and the
longest gap per stream the load client measures."""

from __future__ import annotations

import math
from typing import Any

import yaml

from gateway.bench.load import StreamScan
from gateway.bench.report import format_workload, stall_goals
from gateway.bench.rows import continuations
from gateway.bench.run import BenchPlan, plan_modes
from gateway.bench.subject import gateway_config
from gateway.bench.workloads import WORKLOADS
from gateway.settings import StallSettings
from gateway.settings.load import parse_settings

STALLS = next(w for w in WORKLOADS if w.name == "stalls")


def test_the_stalls_workload_runs_direct_and_continuations_off_and_on() -> None:
    assert plan_modes(BenchPlan(workloads=(STALLS,)), STALLS) == [
        "direct", "no-faults", "continuation-off", "continuation-on"]
    profile = STALLS.profile
    assert (profile.tokens, profile.inter_token, profile.stall_probability,
            profile.stall_length, profile.break_probability) == (200, 0.02, 0.03, 5.0, 0.01)


def test_continuation_modes_make_backends_that_continue() -> None:
    for on in (True, False):
        pool = yaml.safe_load(gateway_config(1, [2, 3], True, continuation=on))["pools"][0]
        assert pool["hedging"]["stall"] == {"enabled": on}
        assert {b["continuation"] for b in pool["backends"]} == {"prefill"}
    plain = yaml.safe_load(gateway_config(1, [2, 3], True))["pools"][0]
    assert "hedging" not in plain and all("continuation" not in b for b in plain["backends"])


def test_the_stalls_gateways_get_the_workloads_stall_delay_floor() -> None:
    """The continuation modes' gateways are started with the workload's `hedging.stall.min`
    (and the configuration loads: the floor is the one the gateway runs with)."""
    assert STALLS.stall_min is not None
    for on in (True, False):
        text = gateway_config(1, [2, 3], True, continuation=on, stall_min=STALLS.stall_min)
        settings = parse_settings(yaml.safe_load(text), {})
        stall = settings.pools[0].hedging.stall
        assert (stall.enabled, stall.min) == (on, STALLS.stall_min)


def test_the_stalls_goal_on_total_time_is_reachable_with_its_stall_delay_floor() -> None:
    """A stalled stream ends at least the stall delay (never under its floor) plus a
    continuation's first token later than its unstalled self, and 3 % of the streams stall,
    so at the default sample the total-time p99 is a stalled stream's: the floor plus the
    simulators' TTFT p99 must fit in the goal's 25 % of a stream, with room to spare for
    the gateway and the machine (here a fifth of it)."""
    profile = STALLS.profile
    stream = profile.ttft_median + (profile.tokens - 1) * profile.inter_token
    ttft_p99 = profile.ttft_median * math.exp(profile.ttft_sigma * 2.326)
    floor = StallSettings().min if STALLS.stall_min is None else STALLS.stall_min
    assert profile.stall_probability > 0.01  # more than 1 % stall: the p99 is a stalled one
    assert floor + ttft_p99 <= 0.8 * (0.25 * stream)


def test_the_load_client_measures_each_streams_longest_gap() -> None:
    now = [0.0]
    scan = StreamScan(0.0, clock=lambda: now[0])
    scan.head(200, {})
    token = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    for at in (0.1, 0.2, 5.3, 5.4):
        now[0] = at
        assert scan.body(token)
    now[0] = 5.5
    scan.body(b"data: [DONE]\n\n")
    sample = scan.sample(0)
    assert sample.ok and sample.ttft == 0.1
    assert sample.longest_gap is not None and abs(sample.longest_gap - 5.1) < 1e-9


def _stats(started: int, refused: dict[str, int]) -> dict[str, Any]:
    return {"pools": {"bench": {"lifetime": {
        "continuations": {"started": started, "won": started, "stalls": 20,
                          "breaks_continued": 0, "breaks_ended": 0, "input_tokens": 9,
                          "refused": refused},
        "tokens": {"input": 10, "output": 100}}}}}


def test_a_rows_refused_continuations_are_read_and_printed_by_reason() -> None:
    """A stall not continued is waited out: why (the budget, the bound...) is in the row,
    the warm-up's refusals left out, and the printed line says it."""
    counted = continuations(_stats(4, {"budget": 17, "no_backend": 0}),
                            _stats(0, {"budget": 1}), "bench")
    assert counted is not None
    assert (counted["started"], counted["refused.budget"], counted["refused.no_backend"]) \
        == (4, 16, 0)
    row = {"mode": "no-faults", "ok": 1, "errors": 0, "requests": 1,
           "ttft_ms": {q: 1.0 for q in ("p50", "p90", "p99", "p99.9")},
           "total_ms": {"p50": 1.0, "p99": 1.0}, "upstream": {"extra_pct": 0.0},
           "requests_per_s": 1.0, "longest_gap_ms": {"p50": 1.0, "p99": 2.0},
           "continuations": counted}
    text = format_workload({"name": "stalls", "description": "", "requests": 1,
                            "concurrency": 1, "seed": 1, "modes": [row], "comparison": {},
                            "targets": []})
    assert "ended 0, refused budget 16; input tokens resent" in text


def _goal_row(total_p99: float, gap_p99: float, ok: int = 600) -> dict[str, Any]:
    """A row as the bench writes it, with what the goals read (two backends' TTFT p99)."""
    backends = {name: {"lifetime": {"ttft_ms": {"p99": p99}}}
                for name, p99 in (("sim-a", 244.0), ("sim-b", 259.0))}
    return {"ok": ok, "requests": 600, "total_ms": {"p99": total_p99},
            "longest_gap_ms": {"p99": gap_p99},
            "hedge_stats": {"pools": {"bench": {"backends": backends}}},
            "continuations": {"input_tokens": 4131, "workload_tokens": 124273}}


def test_the_stalls_goals_are_read_off_the_rows_each_with_its_bound() -> None:
    """Total p99 against 1.25 x the no-faults row, the longest gap against the stall floor
    plus the slower backend's TTFT p99, the resent input against 6 %: each says met or not."""
    calm = _goal_row(4305.0, 97.0)
    met = stall_goals(calm, _goal_row(4872.0, 653.0), 0.5)
    assert met == ("complete 600/600 met; total p99 x1.132 <= 1.25 met; longest gap p99 653 "
                   "<= stall floor 500 + TTFT p99 259 = 759 ms met; input resent 3.3 % <= "
                   "6 % met")
    missed = stall_goals(calm, _goal_row(5633.0, 1228.0, ok=599), 0.5)
    assert missed is not None and missed.count("NOT MET") == 3
    assert stall_goals(calm, {"ok": 600}, 0.5) is None  # a row without its numbers
    paused = {**calm, "continuations": {**calm["continuations"], "stalls": 20}}
    said = stall_goals(paused, _goal_row(4872.0, 653.0), 0.5)
    assert said is not None and said.endswith("(no-faults row: 20 stalls, a pause of the machine)")
