"""`hedge-gateway bench --workload overhead` end to end with its `keys-1000` row: the same
gateway as hedging-on with 1,000 named keys (each with all four limits) and a client sending
one of them, right after hedging-on, its CPU per request printed over hedging-on's and judged
against 1.10. Rows, their order and what the gateway counted, not their timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from tests.harness.benchrows import check_row_over_hedging_on

MODES = ["direct", "hedging-off", "hedging-on", "keys-1000"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overhead_has_a_keys_row_after_hedging_on_with_its_ratio_and_every_request_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = main(["bench", "--workload", "overhead", "--requests", "12", "--concurrency", "3",
                 "--quick", "--no-features", "--no-nginx", "--no-passthrough", "--no-translated",
                 "--out", str(out), "--no-progress"])
    # the translated row: tests/e2e/test_bench_translated.py; the floors':
    # tests/e2e/test_bench_floor.py
    assert code == 0
    printed = capsys.readouterr().out
    (workload,) = json.loads(out.read_text())["workloads"]
    rows = {row["mode"]: row for row in workload["modes"]}
    assert list(rows) == MODES  # on by default for the overhead workload, after hedging-on
    for mode, row in rows.items():
        # none refused by a limit (nor anything else): measured, warm-up and c=1 alike
        assert row["ok"] == row["requests"] == 12, (mode, row["error_kinds"])
        assert row["warmup"]["errors"] == 0, mode
        assert row["c1"]["ok"] == row["c1"]["requests"] == 100, mode
        assert row["events_delivered"] == rows["direct"]["events_delivered"], mode
    keys = rows["keys-1000"]["keys"]
    # the gateway ran the configuration with the 1,000 keys (its /hedge/stats names that
    # file's digest), and counted every request of the run under the client's key: the c=1
    # pass (a warm-up and 100), the main pass's warm-up (one per worker, 3) and its 12
    assert keys["configured"] == 1000 and keys["gateway_loaded_it"] is True
    assert keys["client_key"] == "tenant-0500"
    assert keys["requests_sent"] == 1 + 100 + 3 + 12
    # it stopped on its own terms (SIGTERM, exit 0), writing its last batch of usage
    assert keys["gateway_exit"] == 0, keys
    assert keys["requests_counted"] == keys["requests_sent"], keys
    assert "keys" not in rows["hedging-on"]  # the yardstick has none
    table = [line.split()[0] for line in printed.splitlines()
             if line.split() and line.split()[0] in rows]
    assert table[:len(rows)] == MODES  # the table's rows, in the run's order
    check_row_over_hedging_on(workload, printed, "keys-1000")
