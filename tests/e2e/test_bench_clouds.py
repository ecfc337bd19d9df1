"""`hedge-gateway bench --workload claude-everywhere`, small: three cloud simulators and the
gateway as real child processes, every request answered, each cloud taking part."""

from __future__ import annotations

import pytest

from gateway.bench import clouds


@pytest.mark.timeout(120)
def test_the_three_cloud_race_answers_every_request_in_both_modes() -> None:
    plan = clouds.CloudsPlan(requests=30, concurrency=4, warmup=12, seed=2)
    rows = clouds.run_clouds(plan)
    assert [row["mode"] for row in rows] == ["hedging-off", "hedging-on"]
    for row in rows:
        assert (row["requests"], row["ok"], row["errors"], row["warmup_errors"]) == (30, 30, [], 0)
        assert sum(row["served"].values()) == 30
        # Anthropic's SSE, Bedrock's signed event stream and Vertex behind OAuth all answered
        assert set(row["providers"].values()) == {"anthropic", "bedrock", "vertex"}
        assert all(n > 0 for n in row["served"].values()), row["served"]
        assert row["ttft_p50_ms"] is not None and row["ttft_p99_ms"] is not None
    off = rows[0]["gateway"]
    assert off["hedges_started"] == 0 and off["hedges_won"] == 0
    assert "hedging cuts TTFT p99" in clouds.format_table(rows)
