"""Configuration loading: every shipped example loads, and every mistake an operator can make
is reported with its key path, all at once, without ever showing a key."""

from __future__ import annotations

import dataclasses
import io
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import (
    AffinitySettings,
    BackendSettings,
    BudgetSettings,
    DelaySettings,
    HealthSettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
    Timeouts,
)
from gateway.settings import parse as cv
from gateway.settings.fields import yaml_layout
from gateway.settings.load import (
    ConfigError,
    check_config,
    default_settings,
    describe_pools,
    load_settings,
    parse_settings,
)
from gateway.settings.model import AwsSettings, GoogleSettings
from gateway.settings.tenants import (
    TenantBudget,
    TenantHedging,
    TenantKeySettings,
    TenantLimits,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
EXAMPLE_ENV = {"GATEWAY_KEY": "gw-test-key", "OPENAI_API_KEY": "sk-test-openai",
               "ANTHROPIC_API_KEY": "sk-test-anthropic"}
SECRET = "sk-very-secret-0123456789"

MINIMAL = """
pools:
  - name: chat
    backends:
      - {name: a, base_url: "http://127.0.0.1:9001/v1"}
"""


def parse(text: str, env: Mapping[str, str] | None = None) -> Settings:
    return parse_settings(yaml.safe_load(textwrap.dedent(text)), env or {})


def errors(text: str, env: Mapping[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse(text, env)
    return list(caught.value.errors)


def pool_with(body: str) -> str:
    """A one-pool config; `body` is indented pool keys (backends included if given)."""
    return "pools:\n  - name: chat\n" + textwrap.indent(textwrap.dedent(body), "    ")


ONE_BACKEND = 'backends: [{name: a, base_url: "http://127.0.0.1:9001/v1"}]\n'


# --------------------------------------------------------------------------- shipped files


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(path, EXAMPLE_ENV)
    assert settings.pools
    for name, value in EXAMPLE_ENV.items():
        monkeypatch.setenv(name, value)
    out, err = io.StringIO(), io.StringIO()
    assert check_config(str(path), out, err) == 0, err.getvalue()
    assert "sk-test-openai" not in out.getvalue()


def test_there_are_examples() -> None:
    names = {path.name for path in CONFIG_DIR.glob("*.yaml")}
    assert {"demo.yaml", "vllm-pair.yaml", "openai-azure.yaml", "full-reference.yaml",
            "azure-classic.yaml", "anthropic-pair.yaml", "claude-everywhere.yaml",
            "gemini-google.yaml"} <= names


def test_classic_azure_example() -> None:
    settings = load_settings(CONFIG_DIR / "azure-classic.yaml",
                             {**EXAMPLE_ENV, "AZURE_API_KEY": "az"})
    azure = settings.pools[0].backends[1]
    assert azure.auth == "api-key" and azure.api_key == "az"
    assert azure.query == (("api-version", "2024-10-21"),)
    assert azure.base_url == (
        "https://my-resource.openai.azure.com/openai/deployments/gpt-4o-mini")
    assert settings.pools[0].backends[0].auth == "bearer"


def test_anthropic_example() -> None:
    settings = load_settings(CONFIG_DIR / "anthropic-pair.yaml", EXAMPLE_ENV)
    first, second = settings.pools[0].backends
    assert first.provider == second.provider == "anthropic"
    assert first.auth == "x-api-key" and first.anthropic_version == "2023-06-01"
    assert first.api_key == "sk-test-anthropic" and second.api_key is None
    assert second.headers == (("x-team", "gateway"),)


def test_demo_yaml_is_the_embedded_default() -> None:
    assert load_settings(CONFIG_DIR / "demo.yaml", {}) == default_settings()


def test_default_settings_shape() -> None:
    settings = default_settings()
    (pool,) = settings.pools
    assert pool.name == "demo"
    assert [b.provider for b in pool.backends] == ["sim", "sim", "sim"]
    assert len({b.group for b in pool.backends}) == 3
    seeds = [b.sim.seed for b in pool.backends if b.sim is not None]
    assert len(set(seeds)) == 3
    assert pool.hedging.enabled and settings.hedging_enabled
    assert pool.hedging.delay.mode == "adaptive"
    assert pool.hedging.delay.initial == pytest.approx(0.3)
    for backend in pool.backends:
        assert backend.sim is not None
        assert backend.sim.ttft_median == pytest.approx(0.15)
        assert backend.sim.straggler_probability == pytest.approx(0.03)
        assert backend.sim.straggler_extra == pytest.approx(1.5)
        assert backend.sim.tokens == 30


def test_full_reference_shows_the_defaults() -> None:
    settings = load_settings(CONFIG_DIR / "full-reference.yaml", {})
    assert settings.server == ServerSettings()
    assert settings.hedging_enabled is True
    (pool,) = settings.pools
    assert pool.timeout == 60.0
    assert pool.timeouts == Timeouts()
    assert pool.hedging == HedgingSettings()
    assert pool.health == HealthSettings()
    openai_backend, sim_backend, bedrock_backend, vertex_backend = pool.backends
    assert openai_backend.api_key is None  # ${UPSTREAM_KEY:-} unset
    assert openai_backend.weight == 1.0 and openai_backend.max_concurrency is None
    assert sim_backend.sim == SimProfile()
    assert bedrock_backend.aws == AwsSettings()  # every key empty: the standard chain
    assert bedrock_backend.anthropic_version == "bedrock-2023-05-31"
    assert vertex_backend.google == GoogleSettings()
    assert vertex_backend.anthropic_version == "vertex-2023-10-16"


def test_full_reference_lists_every_key() -> None:
    def keys(cls: type[Any]) -> set[str]:
        """The YAML keys of one settings class, as the model declares them."""
        return set(yaml_layout(cls)[None])

    tree = yaml.safe_load((CONFIG_DIR / "full-reference.yaml").read_text())
    pool = tree["pools"][0]
    assert set(tree) == {"server", "hedging", "affinity", "pools", "keys"} == keys(Settings)
    assert set(tree["hedging"]) == set(yaml_layout(Settings)["hedging"])
    assert set(tree["affinity"]) == set(yaml_layout(Settings)["affinity"])
    assert set(tree["server"]) == keys(ServerSettings)
    assert set(pool) == keys(PoolSettings)
    assert set(pool["timeouts"]) == keys(Timeouts)
    assert set(pool["hedging"]) == keys(HedgingSettings)
    assert set(pool["hedging"]["delay"]) == keys(DelaySettings)
    assert set(pool["hedging"]["budget"]) == keys(BudgetSettings)
    assert set(pool["health"]) == keys(HealthSettings)
    assert set(pool["affinity"]) == keys(AffinitySettings)
    cloud = {"region", "project", "aws", "google"}
    assert set(pool["backends"][0]) == keys(BackendSettings) - {"sim"} - cloud
    assert set(pool["backends"][1]["sim"]) == keys(SimProfile)
    assert cloud <= set(pool["backends"][2]) | set(pool["backends"][3])
    assert set(pool["backends"][2]["aws"]) == keys(AwsSettings)
    assert set(pool["backends"][3]["google"]) == keys(GoogleSettings)
    key = tree["keys"][0]
    assert set(key) == keys(TenantKeySettings)
    assert set(key["limits"]) == keys(TenantLimits)
    assert set(key["budget"]) == keys(TenantBudget)
    assert set(key["hedging"]) == keys(TenantHedging)


def test_openai_example_needs_its_key() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(CONFIG_DIR / "openai-azure.yaml", {"GATEWAY_KEY": "g"})
    assert "pools[0].backends[0].api_key: environment variable OPENAI_API_KEY is not set" in (
        caught.value.errors
    )


def test_openai_example_optional_second_key() -> None:
    settings = load_settings(CONFIG_DIR / "openai-azure.yaml", EXAMPLE_ENV)
    first, second = settings.pools[0].backends
    assert first.api_key == "sk-test-openai"
    assert second.api_key is None
    assert second.base_url == "https://my-resource.openai.azure.com/openai/v1"
    env = {**EXAMPLE_ENV, "SECOND_API_KEY": "az-key", "AZURE_RESOURCE": "contoso"}
    second = load_settings(CONFIG_DIR / "openai-azure.yaml", env).pools[0].backends[1]
    assert second.api_key == "az-key"
    assert second.base_url == "https://contoso.openai.azure.com/openai/v1"


# --------------------------------------------------------------------------- defaults


def test_minimal_config_takes_defaults() -> None:
    settings = parse(MINIMAL)
    (pool,) = settings.pools
    (backend,) = pool.backends
    assert backend.provider == "openai"
    assert backend.model == "chat"  # the pool name
    assert backend.api_key is None and backend.group == "" and backend.weight == 1.0
    assert pool.hedging == HedgingSettings() and pool.timeouts == Timeouts()
    assert settings.server == ServerSettings()


def test_sim_backend_without_profile_gets_default_profile() -> None:
    settings = parse(pool_with("backends: [{name: s, provider: sim}]"))
    assert settings.pools[0].backends[0].sim == SimProfile()


def test_base_url_trailing_slash_is_dropped() -> None:
    settings = parse(pool_with('backends: [{name: a, base_url: "https://h.example/v1/"}]'))
    assert settings.pools[0].backends[0].base_url == "https://h.example/v1"


def test_server_section() -> None:
    settings = parse(
        "server: {host: 0.0.0.0, port: 0, api_keys: [k1, k2], max_body: 1MiB, "
        "max_headers: 8KiB, max_concurrent_requests: 10, keepalive: 5s, shutdown_grace: 0}\n"
        "hedging: {enabled: false}\n" + MINIMAL
    )
    server = settings.server
    assert (server.host, server.port, server.api_keys) == ("0.0.0.0", 0, ("k1", "k2"))
    assert (server.max_body_bytes, server.max_header_bytes) == (1024 * 1024, 8192)
    assert (server.max_concurrent_requests, server.keepalive, server.shutdown_grace) == (10, 5, 0)
    assert settings.hedging_enabled is False


def test_fixed_delay() -> None:
    settings = parse(pool_with("hedging: {delay: {mode: fixed, value: 250ms}}\n" + ONE_BACKEND))
    delay = settings.pools[0].hedging.delay
    assert (delay.mode, delay.value) == ("fixed", 0.25)


def test_stall_settings_and_continuation_defaults_by_provider() -> None:
    """`hedging.stall` per pool and `continuation` per backend, with each provider's default:
    OpenAI does not continue an answer, the Messages providers and the simulator prefill."""
    settings = parse(pool_with(
        "hedging: {stall: {min: 500ms, max: 10s, max_continuations: 1}}\n"
        "backends:\n"
        '  - {name: o, base_url: "http://127.0.0.1:9001/v1"}\n'
        '  - {name: v, base_url: "http://127.0.0.1:9002/v1", '
        "continuation: continue_final_message}\n"
        '  - {name: a, provider: anthropic, base_url: "http://127.0.0.1:9003"}\n'
        "  - {name: s, provider: sim}\n"))
    pool = settings.pools[0]
    stall = pool.hedging.stall
    assert (stall.enabled, stall.min, stall.max, stall.max_continuations) == (
        True, 0.5, 10.0, 1)
    assert [b.continuation for b in pool.backends] == [
        "none", "continue_final_message", "prefill", "prefill"]
    assert "continuations on 3 of 4 backends, at most 1" in describe_pools(settings)[0]
    assert any("min" in e for e in errors(pool_with(
        "hedging: {stall: {min: 40s, max: 30s}}\n" + ONE_BACKEND)))
    assert errors(pool_with('backends: [{name: a, base_url: "http://127.0.0.1:9/v1", '
                            "continuation: resume}]\n"))
    assert "continuations off (no backend continues" in describe_pools(parse(MINIMAL))[0]


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("50ms", 0.05), ("2s", 2.0), ("1.5s", 1.5), ("10m", 600.0), ("1h", 3600.0),
        ("0.5ms", 0.0005), ("1500ms", 1.5), (" 3 s ", 3.0), ("250", 250.0), (".5s", 0.5),
        (2, 2.0), (0.25, 0.25), (1500, 1500.0),
    ],
)
def test_duration_parses(raw: object, seconds: float) -> None:
    assert cv.duration()(raw) == seconds


@pytest.mark.parametrize(
    "raw", ["abc", "-1s", "1d", "", "ms", "1.5.2s", "nan", "1 000s", True, None, [1], -2,
            float("inf"), float("nan"), 0, "0s", "0ms"],
)
def test_duration_rejects(raw: object) -> None:
    with pytest.raises(cv.Invalid):
        cv.duration()(raw)


def test_duration_zero_only_where_allowed() -> None:
    assert cv.duration(zero=True)("0s") == 0.0
    assert cv.duration(zero=True)(0) == 0.0
    assert parse(pool_with("hedging: {delay: {min: 0}}\n" + ONE_BACKEND))
    assert errors(pool_with("timeout: 0s\n" + ONE_BACKEND)) == [
        "pools[0].timeout: must be > 0, got '0s'"
    ]


@pytest.mark.parametrize(
    ("raw", "size"),
    [("4MiB", 4 * 1024 * 1024), (4194304, 4194304), ("512KiB", 512 * 1024),
     ("1MB", 1_000_000), ("16kib", 16384), ("1.5KiB", 1536), ("100", 100), ("2GiB", 2 << 30)],
)
def test_size_parses(raw: object, size: int) -> None:
    assert cv.size(raw) == size


@pytest.mark.parametrize("raw", ["4XB", 0, "0.5B", -1, "MiB", 1.5, True, "4 M"])
def test_size_rejects(raw: object) -> None:
    with pytest.raises(cv.Invalid):
        cv.size(raw)


def test_either_takes_a_word_or_a_number() -> None:
    """What `delay.quantile: auto` will use: one parser, two forms, both in the schema."""
    number = cv.number(0, 1, open_low=True, open_high=True)
    quantile = cv.either(cv.choice(("auto",)), number)
    assert quantile("auto") == "auto" and quantile(0.9) == 0.9
    assert quantile(cv.Substituted("auto")) == "auto"
    with pytest.raises(cv.Invalid, match=r"must be one of auto, got 1\.5; or must be in \(0, 1\)"):
        quantile(1.5)
    assert quantile.schema == {"anyOf": [cv.choice(("auto",)).schema, number.schema]}


def test_bad_duration_names_path() -> None:
    found = errors(pool_with("timeouts: {first_token: soon}\n" + ONE_BACKEND))
    assert found == [
        "pools[0].timeouts.first_token: must be a duration like 50ms, 2s, 1.5s or 10m, "
        "got 'soon'"
    ]


# --------------------------------------------------------------------------- ${VAR}


def test_env_substitution_whole_and_inside_strings() -> None:
    text = pool_with(
        'backends: [{name: a, base_url: "http://${HOST}:${PORT:-8000}/v1", api_key: "${KEY}"}]'
    )
    settings = parse(text, {"HOST": "10.0.0.5", "KEY": "k-1"})
    backend = settings.pools[0].backends[0]
    assert backend.base_url == "http://10.0.0.5:8000/v1"
    assert backend.api_key == "k-1"
    assert type(backend.api_key) is str


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, "fallback"), ({"VAR": ""}, "fallback"), ({"VAR": "set"}, "set")],
)
def test_env_default(env: dict[str, str], expected: str) -> None:
    text = pool_with('backends: [{name: a, group: "${VAR:-fallback}", base_url: "http://h/v1"}]')
    assert parse(text, env).pools[0].backends[0].group == expected


def test_env_empty_default_means_no_api_key() -> None:
    text = pool_with('backends: [{name: a, base_url: "http://h/v1", api_key: "${K:-}"}]')
    assert parse(text).pools[0].backends[0].api_key is None


def test_env_literal_dollar_brace() -> None:
    text = pool_with('backends: [{name: a, base_url: "http://h/v1", group: "$${NOT_A_VAR}x$y"}]')
    assert parse(text).pools[0].backends[0].group == "${NOT_A_VAR}x$y"


def test_missing_env_var_names_it_and_the_path() -> None:
    text = pool_with(
        'backends:\n'
        '  - {name: a, base_url: "http://h/v1"}\n'
        '  - {name: b, base_url: "http://h/v1"}\n'
        '  - {name: c, base_url: "http://h/v1", api_key: "${OPENAI_API_KEY}"}\n'
    )
    assert errors(text) == [
        "pools[0].backends[2].api_key: environment variable OPENAI_API_KEY is not set"
    ]


def test_malformed_reference() -> None:
    text = pool_with('backends: [{name: a, base_url: "http://h/v1", group: "${1BAD}"}]')
    (message,) = errors(text)
    assert message.startswith("pools[0].backends[0].group: malformed reference")


def test_numbers_and_booleans_from_env() -> None:
    text = "server: {port: '${PORT:-9000}'}\nhedging: {enabled: '${HEDGE}'}\n" + MINIMAL
    settings = parse(text, {"HEDGE": "false"})
    assert settings.server.port == 9000
    assert settings.hedging_enabled is False


def test_bad_number_from_env_is_not_echoed() -> None:
    (message,) = errors("server: {port: '${PORT}'}\n" + MINIMAL, {"PORT": "sk-oops"})
    assert message.startswith("server.port: must be an integer")
    assert "sk-oops" not in message


def test_plain_strings_are_not_numbers() -> None:
    (message,) = errors("server: {port: '8080'}\n" + MINIMAL)
    assert message == "server.port: must be an integer, got a string"


# --------------------------------------------------------------------------- errors


def test_unknown_key_suggests_the_close_one() -> None:
    found = errors(pool_with("hedging: {dealy: {}}\n" + ONE_BACKEND))
    assert found == ["pools[0].hedging.dealy: unknown key; did you mean 'delay'?"]


def test_unknown_key_without_close_match_lists_keys() -> None:
    (message,) = errors("colour: blue\n" + MINIMAL)
    assert message == "colour: unknown key; expected one of server, hedging, affinity, pools, keys"


def test_bad_url() -> None:
    text = pool_with('backends: [{name: a}, {name: b, base_url: "ftp://h/v1"}]')
    assert errors(text) == [
        "pools[0].backends[0].base_url: required",
        "pools[0].backends[1].base_url: must be an http(s) URL such as http://10.0.0.5:8000/v1",
    ]


@pytest.mark.parametrize(
    "url", ["http://", "localhost:8000", "http://h:99999/v1", "http://h/v1?x=1", "http://h /v1"]
)
def test_more_bad_urls(url: str) -> None:
    (message,) = errors(pool_with(f'backends: [{{name: a, base_url: "{url}"}}]'))
    assert message.startswith("pools[0].backends[0].base_url: ")


def test_credentials_in_url_rejected_without_echo() -> None:
    text = pool_with(f'backends: [{{name: a, base_url: "https://user:{SECRET}@h/v1"}}]')
    (message,) = errors(text)
    assert message.startswith("pools[0].backends[0].base_url: must not contain credentials")
    assert SECRET not in message


def test_duplicate_names() -> None:
    text = (
        "pools:\n"
        "  - {name: p, backends: [{name: a, provider: sim}, {name: a, provider: sim}]}\n"
        "  - {name: p, backends: [{name: a, provider: sim}]}\n"
    )
    assert errors(text) == [
        "pools[0].backends[1].name: duplicate backend name 'a' in this pool "
        "(also pools[0].backends[0])",
        "pools[1].name: duplicate pool name 'p' (also pools[0])",
    ]


def test_max_attempts_six() -> None:
    found = errors(pool_with("hedging: {max_attempts: 6}\n" + ONE_BACKEND))
    assert found == ["pools[0].hedging.max_attempts: must be between 1 and 5, got 6"]


def test_quantile_auto_is_the_default_and_a_number_pins_it() -> None:
    def delay(body: str) -> DelaySettings:
        return parse(pool_with(body + ONE_BACKEND)).pools[0].hedging.delay

    assert delay("").quantile == "auto"
    assert delay("hedging: {delay: {quantile: auto}}\n").quantile == "auto"
    assert delay("hedging: {delay: {quantile: 0.99}}\n").quantile == 0.99
    found = errors(pool_with("hedging: {delay: {quantile: fast}}\n" + ONE_BACKEND))
    assert found == ["pools[0].hedging.delay.quantile: must be auto or a number in (0, 1), "
                     "got 'fast'"]


def test_quantile_one_and_a_half() -> None:
    found = errors(pool_with("hedging: {delay: {quantile: 1.5}}\n" + ONE_BACKEND))
    assert found == ["pools[0].hedging.delay.quantile: must be in (0, 1), got 1.5"]


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ("hedging: {delay: {quantile: 0}}", "pools[0].hedging.delay.quantile"),
        ("hedging: {delay: {min: 2s, max: 1s}}", "pools[0].hedging.delay.min"),
        ("hedging: {budget: {ratio: -0.1}}", "pools[0].hedging.budget.ratio"),
        ("hedging: {budget: {burst: 0.5}}", "pools[0].hedging.budget.burst"),
        ("hedging: {budget: {win_window: 19}}", "pools[0].hedging.budget.win_window"),
        ("hedging: {max_attempts: 0}", "pools[0].hedging.max_attempts"),
        ("hedging: {enabled: yes please}", "pools[0].hedging.enabled"),
        ("health: {cooldown: 2m, max_cooldown: 1m}", "pools[0].health.cooldown"),
        ("health: {eject_after: 0}", "pools[0].health.eject_after"),
        ("hedging: [1, 2]", "pools[0].hedging"),
    ],
)
def test_range_errors_name_the_path(body: str, path: str) -> None:
    (message,) = errors(pool_with(body + "\n" + ONE_BACKEND))
    assert message.startswith(path + ": ")


@pytest.mark.parametrize(
    ("backend", "path"),
    [
        ("{name: a, base_url: 'http://h/v1', weight: 0}", "weight"),
        ("{name: a, base_url: 'http://h/v1', max_concurrency: 0}", "max_concurrency"),
        ("{name: a, base_url: 'http://h/v1', provider: vllm}", "provider"),
        ("{name: a, base_url: 'http://h/v1', sim: {}}", "sim"),
        ("{name: a, provider: sim, base_url: 'http://h/v1'}", "base_url"),
        ("{name: a, provider: sim, api_key: k}", "api_key"),
        ("{name: a, provider: sim, sim: {straggler_probability: 2}}", "sim.straggler_probability"),
        ("{name: a, provider: sim, sim: {fail_status: 200}}", "sim.fail_status"),
        ("{name: a, provider: sim, sim: {ttft_mediam: 1s}}", "sim.ttft_mediam"),
        ("{name: 'has space', provider: sim}", "name"),
        ("{provider: sim}", "name"),
    ],
)
def test_backend_errors_name_the_path(backend: str, path: str) -> None:
    (message,) = errors(pool_with(f"backends: [{backend}]"))
    assert message.startswith(f"pools[0].backends[0].{path}: ")


@pytest.mark.parametrize("name", ["../x", "/abs", "a..b", "has space", "", "ok?no", "x" * 201])
def test_unsafe_pool_names(name: str) -> None:
    text = f"pools:\n  - name: {name!r}\n    {ONE_BACKEND}"
    (message,) = errors(text)
    assert message.startswith("pools[0].name: ")


@pytest.mark.parametrize("name", ["gpt-4o-mini", "meta-llama/Llama-3.1-8B", "org:model_v2"])
def test_safe_pool_names(name: str) -> None:
    assert parse(f"pools:\n  - name: {name!r}\n    {ONE_BACKEND}").pools[0].name == name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("server: {}", "pools: required; list at least one pool"),
        ("pools: []", "pools: must list at least one pool"),
        ("pools: {name: x}", "pools: must be a list of pools, got a mapping"),
        ("pools: [{name: x}]", "pools[0].backends: required; list at least one backend"),
        ("pools: [{name: x, backends: []}]", "pools[0].backends: must list at least one backend"),
        ("[1, 2]", "(top level): must be a mapping, got a list"),
    ],
)
def test_structure_errors(text: str, expected: str) -> None:
    assert expected in errors(text)


def test_empty_document() -> None:
    with pytest.raises(ConfigError, match="empty"):
        parse_settings(None, {})


@pytest.mark.parametrize(
    ("server", "path"),
    [
        ("{port: 70000}", "server.port"),
        ("{port: -1}", "server.port"),
        ("{api_keys: ['']}", "server.api_keys"),
        ("{api_keys: key}", "server.api_keys"),
        ("{max_body: 4XB}", "server.max_body"),
        ("{max_concurrent_requests: 0}", "server.max_concurrent_requests"),
        ("{host: ''}", "server.host"),
    ],
)
def test_server_errors(server: str, path: str) -> None:
    (message,) = errors(f"server: {server}\n" + MINIMAL)
    assert message.startswith(path + ": ")


def test_several_errors_reported_together() -> None:
    text = (
        "server: {port: 70000}\n"
        "pools:\n"
        "  - name: chat\n"
        "    timeout: forever\n"
        "    hedging: {max_attempts: 6, delay: {quantile: 1.5}}\n"
        "    backends:\n"
        "      - {name: a, base_url: 'ftp://x', api_key: '${MISSING}'}\n"
    )
    with pytest.raises(ConfigError) as caught:
        parse(text)
    found = caught.value.errors
    assert len(found) == 6
    for path in ("server.port", "pools[0].timeout", "pools[0].hedging.max_attempts",
                 "pools[0].hedging.delay.quantile", "pools[0].backends[0].base_url",
                 "pools[0].backends[0].api_key"):
        assert any(line.startswith(path + ": ") for line in found), path
    assert str(caught.value) == "\n".join(found)
    assert isinstance(caught.value, ValueError)


# --------------------------------------------------------------------------- files


def write(tmp_path: Path, text: str, name: str = "gateway.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_yaml_syntax_error_gives_position_not_content(tmp_path: Path) -> None:
    path = write(tmp_path, f"pools:\n  - name: a\n    api_key: {SECRET}\n  x: [\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, {})
    message = str(caught.value)
    assert "YAML syntax error at line" in message and str(path) in message
    assert SECRET not in message


def test_yaml_duplicate_key_is_an_error_alongside_others(tmp_path: Path) -> None:
    path = write(tmp_path, "server: {port: 1}\nserver: {port: 2}\npools: []\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, {})
    found = caught.value.errors
    assert any("line 2: key 'server' is written twice" in line for line in found)
    assert "pools: must list at least one pool" in found


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    text = (
        "pools:\n  - name: p\n    backends:\n"
        "      - &a {name: a, provider: sim, group: zone-a}\n"
        "      - {<<: *a, name: b}\n"
    )
    path = write(tmp_path, text)
    backends = load_settings(path, {}).pools[0].backends
    assert [(b.name, b.group) for b in backends] == [("a", "zone-a"), ("b", "zone-a")]


def test_yaml_object_tags_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "pools: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_settings(path, {})


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_settings(tmp_path / "missing.yaml", {})
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(tmp_path / "binary.yaml", {})


def test_env_defaults_to_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HG_TEST_GROUP", "zone-q")
    path = write(tmp_path, pool_with("backends: [{name: s, provider: sim, "
                                     "group: '${HG_TEST_GROUP}'}]"))
    assert load_settings(path).pools[0].backends[0].group == "zone-q"


# --------------------------------------------------------------------------- secrets, check


SECRET_CONFIG = f"""
server: {{api_keys: ["{SECRET}-client"]}}
pools:
  - name: chat
    backends:
      - {{name: a, base_url: "https://api.example.com/v1", api_key: "{SECRET}"}}
      - {{name: b, base_url: "https://other.example.com/v1", api_key: "${{KEY_B}}"}}
"""


def test_api_keys_not_in_repr() -> None:
    settings = parse(SECRET_CONFIG, {"KEY_B": SECRET + "-b"})
    assert settings.pools[0].backends[0].api_key == SECRET
    assert settings.server.api_keys == (SECRET + "-client",)
    assert SECRET not in repr(settings)
    assert SECRET not in str(settings)
    assert all(SECRET not in line for line in describe_pools(settings))


def test_check_config_good_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEY_B", SECRET + "-b")
    path = write(tmp_path, SECRET_CONFIG)
    out, err = io.StringIO(), io.StringIO()
    assert check_config(str(path), out, err) == 0
    assert err.getvalue() == ""
    text = out.getvalue()
    assert "pool chat: 2 backends, hedging on" in text and "delay adaptive" in text
    assert SECRET not in text


def test_check_config_summary_variants(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "hedging: {enabled: false}\n"
        "pools:\n"
        "  - {name: one, hedging: {delay: {mode: fixed, value: 250ms}},"
        " backends: [{name: s, provider: sim}]}\n",
    )
    out = io.StringIO()
    assert check_config(str(path), out, io.StringIO()) == 0
    assert "pool one: 1 backend, hedging off (global switch)" in out.getvalue()
    assert "delay fixed 250ms" in out.getvalue()


def test_check_config_broken_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEY_B", raising=False)
    broken = SECRET_CONFIG.replace("https://other.example.com", f"http://u:{SECRET}@other")
    broken = broken.replace("name: chat", f"name: chat\n    hedgin: {{}}\n    x: ['{SECRET}']")
    path = write(tmp_path, broken)
    out, err = io.StringIO(), io.StringIO()
    assert check_config(str(path), out, err) == 1
    assert out.getvalue() == ""
    text = err.getvalue()
    assert str(path) in text
    assert "pools[0].hedgin: unknown key; did you mean 'hedging'?" in text
    assert "pools[0].backends[1].base_url: must not contain credentials" in text
    assert "pools[0].backends[1].api_key: environment variable KEY_B is not set" in text
    assert SECRET not in text


def test_check_config_missing_file(tmp_path: Path) -> None:
    err = io.StringIO()
    assert check_config(str(tmp_path / "nope.yaml"), io.StringIO(), err) == 1
    assert "nope.yaml" in err.getvalue()


def test_substituted_value_where_a_mapping_belongs() -> None:
    (message,) = errors("server: '${S}'\n" + MINIMAL, {"S": "x"})
    assert message == "server: must be a mapping, got a string"


def test_non_string_keys_are_unknown_keys() -> None:
    (message,) = errors("pools: [{1: x, name: a, backends: [{name: s, provider: sim}]}]")
    assert message.startswith("pools[0].1: unknown key")


# --------------------------------------------------------------------------- built in code


def sim_backend(name: str) -> BackendSettings:
    return BackendSettings(name=name, provider="sim", model="m")


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: DelaySettings(min=2.0, max=1.0), "min: must be <= max"),
        (lambda: HealthSettings(cooldown=120.0, max_cooldown=60.0),
         "cooldown: must be <= max_cooldown"),
        (lambda: PoolSettings(name="p", backends=(sim_backend("a"), sim_backend("a"))),
         "backends[1].name: duplicate backend name 'a' in this pool (also backends[0])"),
        (lambda: Settings(pools=(PoolSettings(name="p", backends=(sim_backend("a"),)),) * 2),
         "pools[1].name: duplicate pool name 'p' (also pools[0])"),
        (lambda: BackendSettings(name="a"), "base_url: required"),
        (lambda: BackendSettings(name="a", provider="sim", base_url="http://h/v1"),
         "base_url: not used by provider sim"),
        (lambda: BackendSettings(name="a", provider="sim", api_key="k"),
         "api_key: not used by provider sim"),
        (lambda: BackendSettings(name="a", base_url="http://h/v1", sim=SimProfile()),
         "sim: only used by provider sim"),
    ],
)
def test_cross_field_rules_hold_for_settings_built_in_code(build: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.errors == (expected,)


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: DelaySettings(quantile=1.5), "quantile: must be in (0, 1), got 1.5"),
        (lambda: HedgingSettings(max_attempts=6), "max_attempts: must be between 1 and 5, got 6"),
        (lambda: dataclasses.replace(ServerSettings(), port=70000),
         "port: must be between 0 and 65535, got 70000"),
        (lambda: BackendSettings(name="has space", provider="sim"), "name: must be 1-200"),
        (lambda: BackendSettings(name="a", base_url=f"http://u:{SECRET}@h/v1"),
         "base_url: must not contain credentials"),
        (lambda: PoolSettings(name="p", backends=()), "backends: must list at least one backend"),
        (lambda: Settings(pools=()), "pools: must list at least one pool"),
    ],
)
def test_value_checks_hold_for_settings_built_in_code(build: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    (message,) = caught.value.errors
    assert message.startswith(expected)
    assert SECRET not in message


def test_settings_built_in_code_equal_the_loaded_ones() -> None:
    built = Settings(pools=(PoolSettings(name="chat", backends=(
        BackendSettings(name="a", base_url="http://127.0.0.1:9001/v1/", weight=1, api_key=""),
        BackendSettings(name="s", provider="sim"),
    )),))
    loaded = parse(pool_with(
        "backends:\n"
        "  - {name: a, base_url: 'http://127.0.0.1:9001/v1', api_key: '${KEY:-}'}\n"
        "  - {name: s, provider: sim}\n"
    ))
    assert built == loaded
    assert Settings(built.pools) == built  # positional construction keeps working
    a, s = built.pools[0].backends
    assert (a.model, s.model) == ("chat", "chat")  # the pool name
    assert a.base_url == "http://127.0.0.1:9001/v1" and a.api_key is None
    assert type(a.weight) is float
    assert s.sim == SimProfile()
    replaced = dataclasses.replace(built, server=dataclasses.replace(built.server, port=0))
    assert replaced.server.port == 0 and replaced.pools == built.pools


def test_claude_everywhere_example() -> None:
    """One Claude pool over three clouds, each its own group so a hedge changes cloud; with
    no AWS keys in the environment, bedrock takes the standard credential chain."""
    settings = load_settings(CONFIG_DIR / "claude-everywhere.yaml", EXAMPLE_ENV)
    (pool,) = settings.pools
    anthropic, bedrock, vertex = pool.backends
    assert [b.provider for b in pool.backends] == ["anthropic", "bedrock", "vertex"]
    assert len({b.group for b in pool.backends}) == 3
    assert bedrock.region == "us-east-1" and bedrock.aws == AwsSettings()
    assert bedrock.anthropic_version == "bedrock-2023-05-31"
    assert vertex.project == "my-project" and vertex.google is None
    assert anthropic.api_key == "sk-test-anthropic"
    env = {**EXAMPLE_ENV, "AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "s",
           "AWS_REGION": "eu-west-1", "GOOGLE_CLOUD_PROJECT": "prod-123"}
    settings = load_settings(CONFIG_DIR / "claude-everywhere.yaml", env)
    _, bedrock, vertex = settings.pools[0].backends
    assert bedrock.aws == AwsSettings(access_key_id="AKID", secret_access_key="s")
    assert bedrock.region == "eu-west-1" and vertex.project == "prod-123"


def test_cloud_backends_say_what_they_miss_and_what_they_do_not_take() -> None:
    found = errors("""
        pools:
          - name: p
            backends:
              - {name: a, provider: bedrock, api_key: k, aws: {access_key_id: AKID}}
              - {name: b, provider: vertex, region: europe-west1}
              - {name: c, base_url: "http://127.0.0.1:9001/v1", region: us-east-1,
                 google: {}}
              - {name: d, provider: vertex, project: p1, region: "Bad Region"}
    """)
    assert found == [
        "pools[0].backends[0].aws.access_key_id: access_key_id and secret_access_key go "
        "together (both empty: the standard credential chain)",
        "pools[0].backends[0].region: required",
        "pools[0].backends[0].api_key: not used by provider bedrock (see `aws`)",
        "pools[0].backends[1].project: required",
        "pools[0].backends[2].region: only used by provider bedrock and vertex",
        "pools[0].backends[2].google: only used by provider vertex",
        "pools[0].backends[3].region: must be a region such as us-east-1 or europe-west1, "
        "got 'Bad Region'",
    ]
