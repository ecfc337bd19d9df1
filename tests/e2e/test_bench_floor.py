"""`hedge-gateway bench --workload overhead` end to end, with no flag: a row per feature
switched off, one with 1,000 named keys, one translated, a row for nginx (when installed) and
one for the pass-through (uvicorn and aiohttp alone), side by side in one run, each gateway
mode's cost printed over both floors'. Rows and their order, not their timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.bench.servers import nginx_binary
from gateway.cli import main

FEATURES = ["no-affinity", "no-size-classes", "no-prefill-fit", "no-input-budget",
            "no-headroom", "all-off"]
#: keys-1000 (1,000 named keys) is on by default too, right after hedging-on, then translated
#: (the same simulators in Messages)
GATEWAYS = ["hedging-off", "hedging-on", "keys-1000", "translated", *FEATURES]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(nginx_binary() is None,
                    reason="nginx is not installed (Debian: apt-get install nginx-light)")
def test_overhead_prints_a_row_per_feature_off_and_nginx_with_the_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = main(["bench", "--workload", "overhead", "--requests", "12", "--concurrency", "3",
                 "--quick", "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    (workload,) = json.loads(out.read_text())["workloads"]
    rows = {row["mode"]: row for row in workload["modes"]}
    assert list(rows) == ["direct", "nginx", "passthrough", *GATEWAYS]
    for mode, row in rows.items():
        assert row["ok"] == row["requests"] == 12, (mode, row["error_kinds"])
        assert row["c1"]["ok"] == row["c1"]["requests"] == 100
        # every mode but direct has a process of its own, metered
        assert (row["cost"]["cpu_ms_per_request"] is not None) == (mode != "direct")
        # the same stream through every mode: what direct delivers, all of it
        assert row["events_delivered"] == rows["direct"]["events_delivered"]
    # nginx and the pass-through answered, not a gateway: the simulators saw one attempt per
    # request, they have no /hedge/stats; the gateway modes have theirs
    # (each request by its id: both pass the client's headers on, as a proxy does)
    for floor in ("nginx", "passthrough"):
        assert rows[floor]["upstream"]["attempts"] == 12, floor
        assert rows[floor]["upstream"]["extra"] == 0 and "gateway_counted" not in rows[floor]
    assert all(rows[mode]["gateway_counted"]["requests"] == 12 for mode in GATEWAYS)
    table = [line.split()[0] for line in printed.splitlines()
             if line.split() and line.split()[0] in rows]
    assert table[:len(rows)] == list(rows)  # the table's rows, in the run's order
    over = [line.split()[0] for line in printed.splitlines() if " / nginx: CPU" in line]
    assert over == ["passthrough", *GATEWAYS]
    over = [line.split()[0] for line in printed.splitlines() if " / passthrough: CPU" in line]
    assert over == GATEWAYS
    comparison = workload["comparison"]
    if comparison["nginx_cpu_ms_per_request"]:  # 12 requests may take nginx under a tick
        # every gateway mode is put over nginx's figure; its size is the benchmark's to show
        # (12 requests may take a gateway mode under a tick of the CPU clock too: no ratio)
        assert all(comparison.get(f"{mode}_cpu_ms_per_request_over_nginx", 1) > 0
                   for mode in GATEWAYS)
    # every gateway mode's added TTFT over each floor's, when the floor's is above zero
    for floor in ("nginx", "passthrough"):
        if comparison[f"{floor}_added_ttft_c1_p50_ms"] > 0:
            assert all(f"{mode}_added_ttft_c1_p50_ms_over_{floor}" in comparison
                       for mode in GATEWAYS), floor
    assert {t["target"] for t in workload["targets"]} >= {
        "gateway CPU per request at c=50 <= 5 x nginx's",
        "added median TTFT at c=1 <= 2 x nginx's"}
