"""`hedge-gateway bench --workload overhead` end to end with its `translated` row: the same
gateway as hedging-on whose pool reaches the same simulators in Messages (`anthropic`), the
same streamed chat requests, right after hedging-on and keys-1000, its CPU per request
printed over hedging-on's and judged against 1.10. Rows, their order and what the gateway
counted, not their timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from tests.harness.benchrows import check_row_over_hedging_on

MODES = ["direct", "hedging-off", "hedging-on", "keys-1000", "translated"]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_overhead_has_a_translated_row_after_keys_with_its_ratio_and_every_request_translated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = main(["bench", "--workload", "overhead", "--requests", "12", "--concurrency", "3",
                 "--quick", "--no-features", "--no-nginx", "--no-passthrough", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    (workload,) = json.loads(out.read_text())["workloads"]
    rows = {row["mode"]: row for row in workload["modes"]}
    assert list(rows) == MODES  # on by default for the overhead workload, after keys-1000
    for mode, row in rows.items():
        # measured, warm-up and c=1 alike: every request answered, in either API upstream
        assert row["ok"] == row["requests"] == 12, (mode, row["error_kinds"])
        assert row["warmup"]["errors"] == 0, mode
        assert row["c1"]["ok"] == row["c1"]["requests"] == 100, mode
    # the simulators answered the translated row in Messages (they log both APIs' streams
    # by the client's request id), one attempt or more per measured request
    assert rows["translated"]["upstream"]["attempts"] >= 12, rows["translated"]["upstream"]
    seen = rows["translated"]["translated"]
    # every request of the run took chat -> messages, by the gateway's own /hedge/stats: the
    # c=1 pass (a warm-up and 100), the main pass's warm-up (one per worker, 3) and its 12
    assert seen["route"] == "chat->messages"
    assert seen["requests_sent"] == 1 + 100 + 3 + 12
    assert seen["requests_translated"] == seen["requests_sent"], seen
    assert "translated" not in rows["hedging-on"]  # the yardstick translates nothing
    assert rows["hedging-on"]["hedge_stats"]["pools"]["bench"]["lifetime"]["translated"][
        "chat->messages"] == 0
    table = [line.split()[0] for line in printed.splitlines()
             if line.split() and line.split()[0] in rows]
    assert table[:len(rows)] == MODES  # the table's rows, in the run's order
    assert (f"   translated: chat->messages counted by the gateway {seen['requests_sent']} "
            f"of {seen['requests_sent']} sent") in printed.splitlines()
    check_row_over_hedging_on(workload, printed, "translated")
