"""The claude-everywhere workload's pieces: the example's pool pointed at the simulators (and
nothing else of it changed), the seeded draws of the cloud simulators, the table."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.bench import clouds, cloudsims
from gateway.bench.upstream import request_ttft
from gateway.settings.load import parse_settings

SIMS = {"anthropic": "http://127.0.0.1:1", "bedrock": "http://127.0.0.1:2",
        "vertex": "http://127.0.0.1:3"}


def example() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(clouds.CONFIG.read_text(encoding="utf-8"))
    return loaded


@pytest.mark.parametrize("hedging", [False, True])
def test_the_example_pool_runs_on_the_simulators_as_configured(hedging: bool,
                                                               tmp_path: Any) -> None:
    key_file = tmp_path / "sa.json"
    key_file.write_text("{}")
    config = clouds.gateway_config(example(), 4000, SIMS, str(key_file), hedging=hedging)
    settings = parse_settings(config, {})  # loads as it is: no ${VAR} left
    (pool,) = settings.pools
    (original,) = example()["pools"]
    assert pool.name == original["name"] == "claude-sonnet-4-5"
    assert [b.provider for b in pool.backends] == ["anthropic", "bedrock", "vertex"]
    assert [b.base_url for b in pool.backends] == [SIMS["anthropic"], SIMS["bedrock"],
                                                   SIMS["vertex"]]
    assert [b.model for b in pool.backends] == [b["model"] for b in original["backends"]]
    assert pool.hedging.max_attempts == original["hedging"]["max_attempts"]  # the file's
    assert pool.hedging.delay.min == 0.3 and pool.hedging.budget.ratio == 0.05
    assert settings.hedging_enabled is hedging
    bedrock, vertex = pool.backends[1], pool.backends[2]
    assert bedrock.aws is not None and bedrock.aws.access_key_id == \
        cloudsims.AWS_KEY.access_key_id
    assert vertex.google is not None and vertex.google.credentials_file == str(key_file)
    assert settings.server.api_keys == ()


def test_a_variable_left_in_the_config_is_refused() -> None:
    with pytest.raises(ValueError, match="environment"):
        clouds._no_variables({"pools": [{"api_key": "${X}"}]})


def test_the_cloud_simulators_draw_what_the_bench_upstream_draws() -> None:
    for index in (0, 7, 123):
        for backend in ("a", "b", "c"):
            assert cloudsims.ttft_of(f"bench-{index}", 4, backend) == request_ttft(
                cloudsims.PROFILE, 4, backend, index)
    assert cloudsims.ttft_of("warmup-3", 4, "a") == request_ttft(
        cloudsims.PROFILE, 4, "a", 3, warmup=True)
    assert cloudsims.ttft_of("something-else", 4, "a") == 0.0
    draws = [cloudsims.ttft_of(f"bench-{i}", 1, "b") for i in range(2000)]
    stragglers = sum(1 for d in draws if d > 1.0)
    assert 20 < stragglers < 100  # about 3 %


def test_the_table_shows_each_cloud_and_the_cut() -> None:
    def row(mode: str, p99: float, hedges: int) -> dict[str, Any]:
        names = ("anthropic", "bedrock-us-east-1", "vertex-europe-west1")
        return {"mode": mode, "ok": 10, "ttft_p50_ms": 160.0, "ttft_p99_ms": p99,
                "providers": dict.fromkeys(names, "x"), "served": dict.fromkeys(names, 3),
                "gateway": {"hedges_started": hedges, "hedges_won": hedges,
                            "backends": {n: {"hedges_won": hedges} for n in names}}}

    table = clouds.format_table([row("hedging-off", 1600.0, 0), row("hedging-on", 480.0, 2)])
    assert "bedrock-us-east-1" in table and "vertex-europe-west1" in table
    assert "hedging cuts TTFT p99 by 70 % (1,600 -> 480 ms)" in table
