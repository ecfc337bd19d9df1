"""`bench --features`, `bench --nginx` and `bench --passthrough`: the modes they add and where,
the configuration each feature mode's gateway gets, nginx's configuration, the
pass-through's command, and each mode over the floors; and the
instruction count's variants (`python -m gateway.bench.instructions --variant`), which switch
the same features through the same public configuration."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml

from gateway.bench import instructions, servers, speed, variants
from gateway.bench.run import BenchPlan, plan_modes
from gateway.bench.subject import gateway_config
from gateway.bench.workloads import WORKLOADS
from gateway.cli import build_parser, main
from gateway.settings import parse_settings

OVERHEAD = next(w for w in WORKLOADS if w.name == "overhead")
STRAGGLERS = next(w for w in WORKLOADS if w.name == "stragglers")
FEATURES = ["no-affinity", "no-size-classes", "no-prefill-fit", "no-input-budget",
            "no-headroom", "all-off"]


def test_features_add_a_mode_per_feature_after_hedging_on_and_all_off_last() -> None:
    plan = BenchPlan(workloads=(OVERHEAD,), features=True)
    assert plan_modes(plan, OVERHEAD) == ["direct", "hedging-off", "hedging-on", *FEATURES]
    assert list(variants.feature_modes()) == FEATURES


def test_nginx_comes_right_after_direct_and_before_every_gateway_mode() -> None:
    plan = BenchPlan(workloads=(OVERHEAD,), nginx="/usr/sbin/nginx", features=True,
                     servers=("uvicorn", "granian"), baseline_src="/elsewhere")
    assert plan_modes(plan, OVERHEAD) == [
        "direct", "nginx", "hedging-off", "hedging-on", *FEATURES, "baseline", "granian"]
    # a workload without `direct` (a quick outage run) still gets its floor, first
    outage = next(w for w in WORKLOADS if w.name == "outage")
    assert plan_modes(BenchPlan(workloads=(outage,), nginx="nginx"), outage, quick=True) == [
        "nginx", "hedging-off", "hedging-on"]
    # the pass-through, this stack's floor, right after nginx's (or direct, or first)
    both = BenchPlan(workloads=(OVERHEAD,), nginx="nginx", passthrough=True)
    assert plan_modes(both, OVERHEAD) == [
        "direct", "nginx", "passthrough", "hedging-off", "hedging-on"]
    assert plan_modes(BenchPlan(workloads=(OVERHEAD,), passthrough=True), OVERHEAD) == [
        "direct", "passthrough", "hedging-off", "hedging-on"]
    assert plan_modes(BenchPlan(workloads=(outage,), passthrough=True), outage, quick=True) == [
        "passthrough", "hedging-off", "hedging-on"]
    # neither flag: the modes as before
    assert plan_modes(BenchPlan(workloads=(STRAGGLERS,)), STRAGGLERS) == [
        "direct", "hedging-off", "hedging-on", "oracle"]


def _loaded(text: str) -> Any:
    return parse_settings(yaml.safe_load(text), {})


def test_each_feature_mode_switches_its_feature_off_in_a_config_the_gateway_loads() -> None:
    on = _loaded(gateway_config(8000, [9001, 9002], hedging=True))
    (pool,) = on.pools
    assert pool.affinity.enabled and pool.hedging.delay.by_size and pool.hedging.skip_cold
    assert pool.hedging.budget.input_tokens and pool.health.min_headroom > 0

    def pool_of(mode: str) -> Any:
        config = _loaded(gateway_config(8000, [9001, 9002], hedging=True,
                                        variant=variants.VARIANTS[mode]))
        assert [b.base_url for b in config.pools[0].backends] == [
            "http://127.0.0.1:9001/v1", "http://127.0.0.1:9002/v1"]
        return config, config.pools[0]

    assert not pool_of("no-affinity")[1].affinity.enabled
    assert not pool_of("no-size-classes")[1].hedging.delay.by_size
    assert not pool_of("no-prefill-fit")[1].hedging.skip_cold
    assert not pool_of("no-input-budget")[1].hedging.budget.input_tokens
    assert pool_of("no-headroom")[1].health.min_headroom == 0
    config, pool = pool_of("all-off")
    assert not pool.affinity.enabled and not config.hedging_enabled
    assert not pool.hedging.delay.by_size and not pool.hedging.skip_cold
    assert not pool.hedging.budget.input_tokens and pool.health.min_headroom == 0
    # what the variant leaves alone stays the mode's own (the workload's delay window)
    windowed = yaml.safe_load(gateway_config(8000, [9001], hedging=True, delay_window=20.0,
                                             variant=variants.VARIANTS["no-size-classes"]))
    assert windowed["pools"][0]["hedging"]["delay"] == {"window": 20.0, "by_size": False}


def test_the_instruction_variants_configure_the_same_features() -> None:
    base = _loaded(instructions.gateway_config(9000))
    assert [p.name for p in base.pools] == ["chat", "claude"]
    off = _loaded(instructions.gateway_config(9000, variants.VARIANTS["all-off"].top,
                                              variants.VARIANTS["all-off"].pool))
    assert not off.hedging_enabled and all(not p.affinity.enabled for p in off.pools)
    assert all(not p.hedging.delay.by_size and p.health.min_headroom == 0 for p in off.pools)
    traced = _loaded(instructions.gateway_config(9000, variants.VARIANTS["tracing-on"].top))
    assert traced.server.tracing.exporter == "console"
    assert variants.VARIANTS["no-request-log"].serve_args == ("--log-level", "warning")
    assert set(variants.VARIANTS["all-off"].serve_args) == {"--log-level", "warning"}
    assert not variants.VARIANTS["tracing-on"].default_on
    swapped = _loaded(instructions.gateway_config(9000, translated=True))
    chat, claude = swapped.pools
    assert {b.provider for b in chat.backends} == {"anthropic"}
    assert {(b.provider, b.apis) for b in claude.backends} == {("openai", ("chat",))}
    assert variants.VARIANTS["translated"].translated


def test_instruction_bodies_are_the_guards_unless_a_prompt_length_is_given() -> None:
    import json

    plain = instructions.bodies()
    assert set(plain) == set(instructions.KINDS)
    for kind, (path, body) in plain.items():
        assert (path, json.loads(body)) == instructions.KINDS[kind]
    long = instructions.bodies(4000)
    for _, body in long.values():
        assert len(json.loads(body)["messages"][0]["content"]) == 4000


def test_profile_lines_show_each_variants_difference_from_the_default() -> None:
    counts = {"default": {"chat_stream": 1000, "messages_stream": 2000, "chat_whole": 500},
              "no-affinity": {"chat_stream": 900, "messages_stream": 1950, "chat_whole": 480}}
    lines = instructions.profile_lines(counts, {"default": {"chat_stream": 400.0},
                                                "no-affinity": {"chat_stream": 380.0}})
    assert lines[0].split() == ["variant", *instructions.KINDS]
    assert lines[1].split()[0] == "default" and "+" not in lines[1]
    assert lines[2].split()[:4] == ["no-affinity", "900", "-100", "380us"]


def test_nginx_config_is_a_plain_unbuffered_proxy_on_loopback() -> None:
    text = servers.nginx_config(8123, [9001, 9002], "/tmp/x")
    assert "listen 127.0.0.1:8123" in text
    assert "server 127.0.0.1:9001;" in text and "server 127.0.0.1:9002;" in text
    assert "proxy_buffering off;" in text and "access_log off;" in text
    assert "daemon off;" in text and "worker_processes 1;" in text
    assert servers.nginx_command("/usr/sbin/nginx", "/tmp/x/nginx.conf", "/tmp/x")[:5] == [
        "/usr/sbin/nginx", "-p", "/tmp/x", "-c", "/tmp/x/nginx.conf"]
    assert servers.nginx_binary(lambda name: None) is None
    assert servers.nginx_binary(
        lambda name: name if name == "/usr/sbin/nginx" else None) == "/usr/sbin/nginx"


def test_the_flags_parse_and_nginx_missing_is_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ns = build_parser().parse_args(["bench", "--workload", "overhead", "--features", "--nginx"])
    assert ns.features and ns.nginx
    assert build_parser().parse_args(["bench"]).features is None  # the workload decides
    assert build_parser().parse_args(["bench", "--no-features"]).features is False
    assert build_parser().parse_args(["bench"]).passthrough is None  # the workload decides
    assert build_parser().parse_args(["bench", "--no-passthrough"]).passthrough is False
    monkeypatch.setattr(servers, "nginx_binary", lambda which=None: None)
    assert main(["bench", "--workload", "overhead", "--nginx", "--no-progress"]) == 2
    assert "nginx is not installed" in capsys.readouterr().err


def _row(mode: str, cpu_s: float, c1_p50: float | None) -> dict[str, Any]:
    return {"mode": mode, "requests": 1000, "cost": {"cpu_ms_per_request": cpu_s,
                                                     "peak_rss_mb": 50.0},
            "c1": None if c1_p50 is None else {"ttft_p50_ms": c1_p50, "ttft_p99_ms": c1_p50,
                                               "ok": 300, "requests": 300}}


def test_every_mode_is_divided_by_the_floor_when_the_run_has_it() -> None:
    rows = {"direct": _row("direct", 0.0, 1.0), "nginx": _row("nginx", 0.2, 1.5),
            "hedging-on": _row("hedging-on", 1.0, 3.0),
            "no-affinity": _row("no-affinity", 0.9, 2.5)}
    costs = speed.compare_costs(rows)
    assert costs["hedging-on_cpu_ms_per_request_over_nginx"] == 5.0
    assert costs["hedging-on_added_ttft_c1_p50_ms_over_nginx"] == 4.0
    assert costs["no-affinity_cpu_ms_per_request_over_nginx"] == 4.5
    assert "nginx_cpu_ms_per_request_over_nginx" not in costs
    lines = speed.format_lines({"modes": list(rows.values()), "comparison": costs})
    over = [line.strip() for line in lines if "/ nginx" in line]
    assert over == ["hedging-on / nginx: CPU per request x5.00, added TTFT at c=1 x4.00",
                    "no-affinity / nginx: CPU per request x4.50, added TTFT at c=1 x3.00"]
    # without the floor: no ratios, no floor targets
    del rows["nginx"]
    assert not [k for k in speed.compare_costs(rows) if k.endswith("_over_nginx")]


def test_the_gateway_modes_are_divided_by_the_stack_floor_and_it_by_nginx() -> None:
    rows = {"direct": _row("direct", 0.0, 1.0), "nginx": _row("nginx", 0.2, 1.25),
            "passthrough": _row("passthrough", 0.5, 1.5),
            "hedging-on": _row("hedging-on", 1.0, 2.0), "keys-1000": _row("keys-1000", 0.0, 2.5)}
    costs = speed.compare_costs(rows)
    # the pass-through over nginx, like a gateway mode; the gateway over each floor
    assert costs["passthrough_cpu_ms_per_request_over_nginx"] == 2.5
    assert costs["passthrough_added_ttft_c1_p50_ms_over_nginx"] == 2.0
    assert costs["hedging-on_cpu_ms_per_request_over_passthrough"] == 2.0
    assert costs["hedging-on_added_ttft_c1_p50_ms_over_passthrough"] == 2.0
    # neither floor over the pass-through; a CPU reading of zero ticks over neither floor
    assert not [k for k in costs if k.startswith(("nginx_", "passthrough_"))
                and k.endswith("_over_passthrough")]
    assert "keys-1000_cpu_ms_per_request_over_passthrough" not in costs
    assert "keys-1000_cpu_ms_per_request_over_nginx" not in costs
    assert costs["keys-1000_added_ttft_c1_p50_ms_over_passthrough"] == 3.0
    # an added TTFT of zero or less is a measurement (only a zero CPU reading is not one)
    rows["keys-1000"]["c1"]["ttft_p50_ms"] = 0.75  # 0.25 ms under direct's
    assert speed.compare_costs(rows)["keys-1000_added_ttft_c1_p50_ms_over_nginx"] == -1.0
    lines = [line.strip() for line in
             speed.format_lines({"modes": list(rows.values()), "comparison": costs})]
    assert [line for line in lines if "/ passthrough" in line] == [
        "hedging-on / passthrough: CPU per request x2.00, added TTFT at c=1 x2.00",
        "keys-1000 / passthrough: CPU per request xn/a, added TTFT at c=1 x3.00"]
    assert "passthrough / nginx: CPU per request x2.50, added TTFT at c=1 x2.00" in lines
    # the targets are judged against nginx, the floor, not the pass-through
    judged = {t["target"] for t in speed.targets("overhead", rows, costs)}
    assert "added median TTFT at c=1 <= 2 x nginx's" in judged
    assert not [t for t in judged if "passthrough" in t]


def test_the_passthrough_is_served_by_its_module_on_loopback_to_each_upstream() -> None:
    argv = servers.passthrough_command(8123, ["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    assert argv[1:] == ["-m", "gateway.bench.passthrough", "--port", "8123",
                        "--upstream", "http://127.0.0.1:9001",
                        "--upstream", "http://127.0.0.1:9002"]


def test_keys_come_right_after_hedging_on_and_only_when_asked() -> None:
    plan = BenchPlan(workloads=(OVERHEAD,), nginx="nginx", features=True, keys=True)
    assert plan_modes(plan, OVERHEAD) == [
        "direct", "nginx", "hedging-off", "hedging-on", "keys-1000", *FEATURES]
    # a workload without hedging-on (the stalls' continuation modes) gets it last
    stalls = next(w for w in WORKLOADS if w.name == "stalls")
    assert plan_modes(BenchPlan(workloads=(stalls,), keys=True), stalls)[-1] == "keys-1000"
    assert "keys-1000" not in plan_modes(BenchPlan(workloads=(OVERHEAD,)), OVERHEAD)
    # the overhead workload has it unless --no-keys; another only with --keys
    assert build_parser().parse_args(["bench"]).keys is None  # the workload decides
    assert build_parser().parse_args(["bench", "--no-keys"]).keys is False
    assert build_parser().parse_args(["bench", "--keys"]).keys is True


def test_the_keys_mode_is_the_instruction_variants_configuration_with_its_client_key() -> None:
    config = _loaded(gateway_config(8000, [9001, 9002], hedging=True,
                                     variant=variants.VARIANTS["keys-1000"]))
    assert len(config.keys) == 1000
    assert all(min(dataclasses.astuple(key.limits)) >= 10**6 for key in config.keys)
    assert variants.VARIANTS["keys-1000"].headers["authorization"].startswith("Bearer ")


def _keyed_rows(on_cpu_s: float, keys_cpu_s: float) -> dict[str, dict[str, Any]]:
    rows = {mode: _row(mode, cpu_s / 2, None) | {"gateway_process": {"cpu_s": cpu_s}}
            for mode, cpu_s in (("hedging-on", on_cpu_s), ("keys-1000", keys_cpu_s))}
    rows["hedging-on"] |= {"requests_per_s": 800.0, "concurrency": 50}
    return rows


def _keys_target(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    costs = speed.compare_costs(rows)
    (target,) = [t for t in speed.targets("overhead", rows, costs)
                 if t["target"] == "keys-1000 CPU per request <= 1.10 x hedging-on's"]
    return target


def test_the_keys_row_is_divided_by_hedging_on_and_judged_against_ten_percent() -> None:
    rows = _keyed_rows(2.0, 2.1)
    costs = speed.compare_costs(rows)
    assert costs["keys-1000_cpu_ms_per_request_over_hedging-on"] == 1.05
    lines = speed.format_lines({"modes": list(rows.values()), "comparison": costs})
    assert "   keys-1000 / hedging-on: CPU per request x1.050" in lines
    assert _keys_target(rows) == {
        "target": "keys-1000 CPU per request <= 1.10 x hedging-on's", "value": 1.05,
        "met": True, "not_judged": None}
    assert _keys_target(_keyed_rows(2.0, 2.4))["met"] is False  # x1.2
    # a pass of under a second of gateway CPU is too few ticks of the clock to tell 10 %
    short = _keys_target(_keyed_rows(0.5, 0.5))
    assert short["met"] is None and "hedging-on 0.50" in short["not_judged"]
    # a row whose gateway CPU read zero ticks was not measured: no ratio (not x0.000, which
    # would claim the keys cost nothing), and its target reads "-", not judged
    unread = _keyed_rows(0.5, 0.0)
    assert "keys-1000_cpu_ms_per_request_over_hedging-on" not in speed.compare_costs(unread)
    assert _keys_target(unread)["value"] is None and _keys_target(unread)["met"] is None
    # without the keys row: no ratio, no target
    del rows["keys-1000"]
    costs = speed.compare_costs(rows)
    assert not [k for k in costs if "keys-1000" in k]
    assert not [t for t in speed.targets("overhead", rows, costs) if "keys" in t["target"]]


def test_translated_comes_after_keys_right_after_hedging_on_and_only_when_asked() -> None:
    both = BenchPlan(workloads=(OVERHEAD,), nginx="nginx", features=True, keys=True,
                     translated=True)
    assert plan_modes(both, OVERHEAD) == [
        "direct", "nginx", "hedging-off", "hedging-on", "keys-1000", "translated", *FEATURES]
    alone = BenchPlan(workloads=(OVERHEAD,), translated=True)
    assert plan_modes(alone, OVERHEAD) == ["direct", "hedging-off", "hedging-on", "translated"]
    # a workload without hedging-on gets both last, in the same order
    stalls = next(w for w in WORKLOADS if w.name == "stalls")
    assert plan_modes(BenchPlan(workloads=(stalls,), keys=True, translated=True),
                      stalls)[-2:] == ["keys-1000", "translated"]
    assert "translated" not in plan_modes(BenchPlan(workloads=(OVERHEAD,), keys=True), OVERHEAD)
    # the overhead workload has it unless --no-translated; another only with --translated
    assert build_parser().parse_args(["bench"]).translated is None  # the workload decides
    assert build_parser().parse_args(["bench", "--no-translated"]).translated is False
    assert build_parser().parse_args(["bench", "--translated"]).translated is True


def test_the_translated_mode_speaks_messages_to_the_same_simulators() -> None:
    plain = _loaded(gateway_config(8000, [9001, 9002], hedging=True))
    config = _loaded(gateway_config(8000, [9001, 9002], hedging=True,
                                    variant=variants.VARIANTS["translated"]))
    (pool,), (plain_pool,) = config.pools, plain.pools
    assert [b.provider for b in plain_pool.backends] == ["openai", "openai"]
    assert [b.provider for b in pool.backends] == ["anthropic", "anthropic"]
    # the same simulators (the Anthropic SDK's base URL: no /v1), the same names and groups
    assert [b.base_url for b in pool.backends] == ["http://127.0.0.1:9001",
                                                  "http://127.0.0.1:9002"]
    assert [(b.name, b.group) for b in pool.backends] == [
        (b.name, b.group) for b in plain_pool.backends]
    # the same hedging and health as hedging-on's (affinity's prefix floor follows the
    # provider's own cache minimum: Anthropic's is larger)
    assert pool.hedging == plain_pool.hedging and pool.health == plain_pool.health


def _beside_rows(on_cpu_s: float, **others: float) -> dict[str, dict[str, Any]]:
    rows = {mode: _row(mode, cpu_s / 2, None) | {"gateway_process": {"cpu_s": cpu_s}}
            for mode, cpu_s in (("hedging-on", on_cpu_s), *others.items())}
    rows["hedging-on"] |= {"requests_per_s": 800.0, "concurrency": 50}
    return rows


def _target(rows: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    costs = speed.compare_costs(rows)
    (target,) = [t for t in speed.targets("overhead", rows, costs) if t["target"] == name]
    return target


TRANSLATED_TARGET = "translated CPU per request <= 1.10 x hedging-on's"


def test_the_translated_row_is_divided_by_hedging_on_and_judged_like_the_keys_row() -> None:
    rows = _beside_rows(2.0, **{"keys-1000": 2.1, "translated": 2.16})
    rows["translated"]["translated"] = {"route": "chat->messages", "requests_sent": 300,
                                        "requests_translated": 299}
    costs = speed.compare_costs(rows)
    assert costs["translated_cpu_ms_per_request_over_hedging-on"] == 1.08
    assert costs["keys-1000_cpu_ms_per_request_over_hedging-on"] == 1.05  # each its own
    lines = speed.format_lines({"modes": list(rows.values()), "comparison": costs})
    # each row's ratio, then the line that says it ran its change, in the rows' order
    at = lines.index("   keys-1000 / hedging-on: CPU per request x1.050")
    assert lines[at + 2:at + 4] == [
        "   translated / hedging-on: CPU per request x1.080",
        "   translated: chat->messages counted by the gateway 299 of 300 sent"]
    assert _target(rows, TRANSLATED_TARGET) == {
        "target": TRANSLATED_TARGET, "value": 1.08, "met": True, "not_judged": None}
    assert _target(_beside_rows(2.0, translated=2.3), TRANSLATED_TARGET)["met"] is False
    short = _target(_beside_rows(2.0, translated=0.5), TRANSLATED_TARGET)
    assert short["met"] is None and "translated 0.50" in short["not_judged"]
    assert "hedging-on" not in short["not_judged"]  # hedging-on's 2 s is long enough
    # without the translated row: no ratio, no target
    del rows["translated"]
    costs = speed.compare_costs(rows)
    assert not [k for k in costs if k.startswith("translated")]
    assert not [t for t in speed.targets("overhead", rows, costs)
                if t["target"].startswith("translated")]


def test_the_translated_count_is_read_from_the_bench_pools_lifetime() -> None:
    from gateway.bench.run import translated_count

    stats = {"pools": {"bench": {"lifetime": {"translated": {"chat->messages": 7,
                                                             "messages->chat": 0}}}}}
    assert translated_count(stats) == 7
    assert translated_count(None) is None and translated_count({"pools": {}}) is None
