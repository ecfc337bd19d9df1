"""Load and validate the YAML configuration (SPEC §11) into frozen `Settings`.

An operator should fix a broken file in one pass, so validation never stops at the first
problem: every error is collected with its key path (`pools[0].backends[1].base_url: ...`) and
all are raised together in one `ConfigError`, one per line.

Rules worth knowing when writing a file (config/full-reference.yaml shows every key):
- `${VAR}` anywhere inside a string value is replaced by the environment variable at load
  time; a missing variable is an error naming it. `${VAR:-default}` uses `default` when VAR is
  unset or empty (shell semantics). `$${` writes a literal `${`. Numeric and boolean keys
  accept a substituted string, so `port: ${PORT:-8080}` works.
- Durations are seconds as numbers, or strings with a unit: `50ms`, `2s`, `1.5s`, `10m`, `1h`.
- Sizes are bytes as integers, or strings such as `4MiB`, `512KiB`, `1MB`.
- A backend's `provider` defaults to `openai`, its `model` to the pool name, and a `sim`
  backend without a `sim:` profile gets the default `SimProfile`.
- An empty `api_key` (e.g. from `${KEY:-}`) means "send no key".
- A key written twice in one mapping is an error (plain YAML keeps the last one silently).

Messages never echo an api key: type errors name only the type, values that came from the
environment are never shown, and YAML syntax errors give a position but no excerpt.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, TextIO, cast

import yaml

from gateway.settings import parse as cv
from gateway.settings.model import (
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

Parser = Callable[[object], object]


class ConfigError(ValueError):
    """The configuration is unusable. `errors` holds one message per problem, each starting
    with the key path it concerns; `str()` joins them one per line."""

    def __init__(self, errors: str | Sequence[str]) -> None:
        self.errors: tuple[str, ...] = (errors,) if isinstance(errors, str) else tuple(errors)
        super().__init__("\n".join(self.errors))


# --------------------------------------------------------------------------- the schema


def _api_keys(value: object) -> tuple[str, ...]:
    """Client keys. An empty entry is refused rather than dropped: an unset variable must not
    quietly turn authentication off."""
    if not isinstance(value, list):
        raise cv.Invalid(f"must be a list of keys, got {cv.type_name(value)}")
    for index, key in enumerate(value):
        if not isinstance(key, str) or not key.strip():
            raise cv.Invalid(f"entry [{index}] must be a non-empty string "
                             "(remove api_keys to serve without authentication)")
    return tuple(str(key) for key in value)


_probability = cv.number(0, 1)
_SERVER: Mapping[str, Parser] = MappingProxyType({
    "host": cv.nonempty_text, "port": cv.integer(0, 65535), "api_keys": _api_keys,
    "max_body": cv.size, "max_headers": cv.size, "max_concurrent_requests": cv.integer(1),
    "keepalive": cv.duration(), "shutdown_grace": cv.duration(zero=True),
    "body_timeout": cv.duration(), "max_connections": cv.integer(1),
})
#: YAML keys whose dataclass field has another name
_FIELD_NAMES = MappingProxyType({"max_body": "max_body_bytes", "max_headers": "max_header_bytes"})
_TIMEOUTS: Mapping[str, Parser] = MappingProxyType({
    key: cv.duration() for key in ("connect", "first_token", "idle", "max_stream", "stuck_client")
})
_HEDGING: Mapping[str, Parser] = MappingProxyType(
    {"enabled": cv.boolean, "max_attempts": cv.integer(1, 5)}
)
_open_unit = cv.number(0, 1, open_low=True, open_high=True)


def _quantile(value: object) -> float | Literal["auto"]:
    """`delay.quantile`: `auto` (follow the budget, SPEC §20) or a number in (0, 1)."""
    if value == "auto":
        return "auto"
    if isinstance(value, str) and not value.strip()[:1].isdigit():
        raise cv.Invalid(f"must be auto or a number in (0, 1), got {cv.show(value)}")
    return _open_unit(value)


_DELAY: Mapping[str, Parser] = MappingProxyType({
    "mode": cv.choice(("adaptive", "fixed")),
    "quantile": _quantile,
    "min": cv.duration(zero=True), "max": cv.duration(), "initial": cv.duration(zero=True),
    "window": cv.duration(), "min_samples": cv.integer(1), "value": cv.duration(zero=True),
})
_BUDGET: Mapping[str, Parser] = MappingProxyType({
    "ratio": cv.number(0), "burst": cv.number(1), "min_per_second": cv.number(0),
    "min_win_rate": _probability, "win_window": cv.integer(20), "probe_interval": cv.duration(),
})
_HEALTH: Mapping[str, Parser] = MappingProxyType({
    "eject_after": cv.integer(1), "cooldown": cv.duration(), "max_cooldown": cv.duration(),
    "max_pause": cv.duration(), "panic_below": _probability,
})
_SIM: Mapping[str, Parser] = MappingProxyType({
    "ttft_median": cv.duration(zero=True), "ttft_sigma": cv.number(0),
    "straggler_probability": _probability, "straggler_extra": cv.duration(zero=True),
    "tokens": cv.integer(1), "inter_token": cv.duration(zero=True), "usage": cv.boolean,
    "fail_probability": _probability, "fail_status": cv.integer(400, 599),
    "hang_probability": _probability, "midstream_error_probability": _probability,
    "seed": cv.optional(cv.integer(0)),
})
_POOL_KEYS = ("name", "timeout", "timeouts", "hedging", "health", "backends")
_BACKEND_KEYS = ("name", "provider", "base_url", "model", "api_key", "group", "weight",
                 "max_concurrency", "sim")
#: instances whose fields give the defaults of the two dataclasses that have required fields
_DEFAULT_POOL = PoolSettings(name="", backends=())
_DEFAULT_BACKEND = BackendSettings(name="", provider="openai", model="")
_provider = cast(Callable[[object], Literal["openai", "sim"]], cv.choice(("openai", "sim")))


# --------------------------------------------------------------------------- parsing


def parse_settings(data: object, env: Mapping[str, str]) -> Settings:
    """Validate an already-loaded YAML tree; raise `ConfigError` listing every problem."""
    if data is None:
        raise ConfigError("(top level): the configuration is empty; it needs at least `pools`")
    errors: list[str] = []
    top = cv.Section(cv.substitute(data, "", env, errors), "", ("server", "hedging", "pools"),
                     errors)
    server = top.sub("server", ServerSettings(), _SERVER, _FIELD_NAMES)
    hedging_enabled = top.section("hedging", ("enabled",)).get("enabled", cv.boolean, True)
    pools: list[PoolSettings] = []
    seen: dict[str, str] = {}
    for path, node in top.items("pools", "pool"):
        pool = _pool(cv.Section(node, path, _POOL_KEYS, errors))
        if pool.name in seen:
            errors.append(f"{path}.name: duplicate pool name {pool.name!r} "
                          f"(also {seen[pool.name]})")
        elif pool.name:
            seen[pool.name] = path
        pools.append(pool)
    if errors:
        raise ConfigError(errors)
    return Settings(pools=tuple(pools), server=server, hedging_enabled=hedging_enabled)


def _pool(pool: cv.Section) -> PoolSettings:
    name = pool.require("name", cv.name, "")
    timeout = pool.get("timeout", cv.duration(), _DEFAULT_POOL.timeout)
    timeouts = pool.sub("timeouts", Timeouts(), _TIMEOUTS)
    section = pool.section("hedging", (*_HEDGING, "delay", "budget"))
    hedging = section.fill(HedgingSettings(), _HEDGING)
    delay = section.sub("delay", DelaySettings(), _DELAY)
    if delay.min > delay.max:
        pool.errors.append(f"{section.at('delay')}.min: must be <= max")
    hedging = dataclasses.replace(
        hedging, delay=delay, budget=section.sub("budget", BudgetSettings(), _BUDGET)
    )
    health = pool.sub("health", HealthSettings(), _HEALTH)
    if health.cooldown > health.max_cooldown:
        pool.errors.append(f"{pool.at('health')}.cooldown: must be <= max_cooldown")
    backends: list[BackendSettings] = []
    seen: dict[str, str] = {}
    for path, node in pool.items("backends", "backend"):
        backend = _backend(cv.Section(node, path, _BACKEND_KEYS, pool.errors), name)
        if backend.name in seen:
            pool.errors.append(f"{path}.name: duplicate backend name {backend.name!r} in this "
                               f"pool (also {seen[backend.name]})")
        elif backend.name:
            seen[backend.name] = path
        backends.append(backend)
    return PoolSettings(name=name, backends=tuple(backends), timeout=timeout, timeouts=timeouts,
                        hedging=hedging, health=health)


def _backend(backend: cv.Section, pool_name: str) -> BackendSettings:
    name = backend.require("name", cv.name, "")
    provider = backend.get("provider", _provider, None) if backend.has("provider") else "openai"
    base_url: str | None = None
    sim: SimProfile | None = None
    if provider == "openai":
        base_url = backend.require("base_url", cv.http_url, None)
        if backend.has("sim"):
            backend.error("sim", "only used by provider sim")
    elif provider == "sim":
        for key in ("base_url", "api_key"):
            if backend.has(key):
                backend.error(key, "not used by provider sim")
        sim = backend.sub("sim", SimProfile(), _SIM)
    return BackendSettings(
        name=name,
        provider=provider or "openai",
        model=backend.get("model", cv.nonempty_text, pool_name),
        base_url=base_url,
        api_key=backend.get("api_key", cv.optional(cv.text), None) or None,
        group=backend.get("group", cv.text, _DEFAULT_BACKEND.group),
        weight=backend.get("weight", cv.number(0, open_low=True), _DEFAULT_BACKEND.weight),
        max_concurrency=backend.get("max_concurrency", cv.optional(cv.integer(1)), None),
        sim=sim,
    )


# --------------------------------------------------------------------------- files


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also notes keys written twice in one mapping."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = (key_node.tag, key_node.value)
                if key in seen:
                    mark = key_node.start_mark
                    self.duplicates.append(f"line {mark.line + 1}: key {key_node.value!r} is "
                                           "written twice in the same mapping")
                seen.add(key)
        return super().construct_mapping(node, deep)


def _load_yaml(source: str, name: str) -> tuple[object, list[str]]:
    """Parse YAML safely (no object tags); return the tree and the duplicate-key problems.
    Syntax errors raise a `ConfigError` with the position but never an excerpt of the line,
    which could hold a key."""
    loader = _StrictLoader(source)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"{name}: YAML syntax error{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: YAML error ({type(exc).__name__})") from None
    finally:
        loader.dispose()
    return data, [f"{name}: {duplicate}" for duplicate in loader.duplicates]


def load_settings(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Settings:
    """Read, substitute and validate a YAML file. `env` defaults to `os.environ`."""
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as file:
            source = file.read()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: cannot read the file: it is not UTF-8 text") from None
    data, duplicates = _load_yaml(source, name)
    try:
        settings = parse_settings(data, os.environ if env is None else env)
    except ConfigError as exc:
        raise ConfigError([*duplicates, *exc.errors]) from None
    if duplicates:
        raise ConfigError(duplicates)
    return settings


# --------------------------------------------------------------------------- the embedded default


def default_settings() -> Settings:
    """What `serve` runs with no config: pool `demo` of three simulated backends in three
    zones, with SPEC §14 "stragglers" latency (lognormal TTFT, median 150 ms, sigma 0.25, 3 %
    stragglers +1.5 s, 30 tokens at 5 ms), so a newcomer sees hedges win offline with no keys.
    The initial hedge delay is 300 ms, not 500 ms, so hedges show up before the adaptive
    delay has its 20 samples. config/demo.yaml is the same thing as a file (a test checks)."""

    def simulated(name: str, group: str, seed: int) -> BackendSettings:
        profile = SimProfile(ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.03,
                             straggler_extra=1.5, tokens=30, inter_token=0.005, seed=seed)
        return BackendSettings(name=name, provider="sim", model="demo", group=group, sim=profile)

    backends = (simulated("sim-a", "zone-a", 1), simulated("sim-b", "zone-b", 2),
                simulated("sim-c", "zone-c", 3))
    hedging = HedgingSettings(enabled=True, max_attempts=2, delay=DelaySettings(initial=0.3))
    return Settings(pools=(PoolSettings(name="demo", backends=backends, hedging=hedging),))


# --------------------------------------------------------------------------- check-config


def _duration_text(seconds: float) -> str:
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def describe_pools(settings: Settings) -> list[str]:
    """One line per pool for operators (check-config, the serve banner). Names, counts and
    timings only: never a URL or a key."""
    lines = []
    for pool in settings.pools:
        hedging, delay = pool.hedging, pool.hedging.delay
        if not settings.hedging_enabled:
            state = "hedging off (global switch)"
        else:
            state = "hedging on" if hedging.enabled else "hedging off"
        if delay.mode == "fixed":
            timing = f"delay fixed {_duration_text(delay.value)}"
        else:
            q = "auto" if delay.quantile == "auto" else f"p{delay.quantile * 100:g}"
            timing = (f"delay adaptive {q} in "
                      f"[{_duration_text(delay.min)}, {_duration_text(delay.max)}], "
                      f"initial {_duration_text(delay.initial)}")
        count = len(pool.backends)
        lines.append(f"pool {pool.name}: {count} backend{'s' if count != 1 else ''}, {state}, "
                     f"max_attempts {hedging.max_attempts}, {timing}")
    return lines


def check_config(path: str, out: TextIO, err: TextIO) -> int:
    """`hedge-gateway check-config FILE`: 0 and a summary per pool when the file is valid,
    1 and every error (one per line, with key paths) when it is not."""
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        count = len(exc.errors)
        print(f"{path}: invalid configuration ({count} error{'s' if count != 1 else ''})",
              file=err)
        for line in exc.errors:
            print(f"  {line}", file=err)
        return 1
    print(f"{path}: OK", file=out)
    for line in describe_pools(settings):
        print(f"  {line}", file=out)
    return 0
