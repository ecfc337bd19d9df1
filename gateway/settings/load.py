"""Load and validate the YAML configuration into frozen `Settings`.

An operator should fix a broken file in one pass, so validation never stops at the first
problem: every error is collected with its key path (`pools[0].backends[1].base_url: ...`) and
all are raised together in one `ConfigError`, one per line. The loader knows no key: it walks
the fields of the model (`gateway.settings.model`), each of which carries its parser.

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
import difflib
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TextIO, TypeVar

import yaml

from gateway.settings import parse as cv
from gateway.settings.env import substitute
from gateway.settings.fields import (
    Checked,
    ConfigError,
    Spec,
    default_of,
    has_default,
    specs,
    unchecked,
    yaml_key,
    yaml_layout,
)
from gateway.settings.model import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
)
from gateway.settings.tenants import TenantKeySettings

__all__ = ["MIN_SECRET_CHARS", "ConfigError", "check_config", "default_settings",
           "describe_pools", "load_settings", "parse_settings", "unenforced_keys",
           "unpriced_budgets", "weak_secrets"]

C = TypeVar("C", bound=Checked)


class Section:
    """One YAML mapping being read: unknown keys reported (with the closest known one), values
    parsed by key, problems recorded with key paths."""

    def __init__(self, node: object, path: str, keys: Sequence[str], errors: list[str]) -> None:
        self.path, self.errors = path, errors
        self._data: dict[object, object] = {}
        if isinstance(node, dict):
            self._data = node
        elif node is not None:
            errors.append(f"{path or '(top level)'}: must be a mapping, got {cv.type_name(node)}")
        for key in self._data:
            if key not in keys:
                close = difflib.get_close_matches(str(key), keys, n=1)
                expected = ", ".join(keys)
                hint = f"did you mean {close[0]!r}?" if close else f"expected one of {expected}"
                errors.append(f"{self.at(key)}: unknown key; {hint}")

    def at(self, key: object) -> str:
        return cv.join(self.path, key)

    def has(self, key: str) -> bool:
        return key in self._data

    def raw(self, key: str) -> object:
        return self._data.get(key)

    def items(self, key: str, what: str, empty_ok: bool = False) -> list[tuple[str, object]]:
        """The entries of a list, each with its key path: required and non-empty unless
        `empty_ok`."""
        value = self.raw(key)
        if empty_ok and (value is None or value == []):
            return []
        if value is None:
            self.errors.append(f"{self.at(key)}: required; list at least one {what}")
        elif not isinstance(value, list):
            self.errors.append(f"{self.at(key)}: must be a list of {what}s, "
                               f"got {cv.type_name(value)}")
        elif not value:
            self.errors.append(f"{self.at(key)}: must list at least one {what}")
        else:
            return [(f"{self.at(key)}[{index}]", item) for index, item in enumerate(value)]
        return []


# --------------------------------------------------------------------------- parsing


def parse_settings(data: object, env: Mapping[str, str]) -> Settings:
    """Validate an already-loaded YAML tree; raise `ConfigError` listing every problem."""
    if data is None:
        raise ConfigError("(top level): the configuration is empty; it needs at least `pools`")
    errors: list[str] = []
    settings = _build(Settings, substitute(data, "", env, errors), "", errors)
    if errors:
        raise ConfigError(errors)
    return settings


def _build(cls: type[C], node: object, path: str, errors: list[str]) -> C:
    """Read one mapping into `cls` by walking its fields' specs (`gateway.settings.fields`).

    A field that fails records its error and takes its default, and reading goes on, so one
    pass finds every problem. The rules that span fields run only when the object's own
    fields parsed (otherwise they would judge stand-in defaults); a failed child does not stop
    its parent's rules. Only a part without any error is constructed for real."""
    errors_before = len(errors)
    layout = yaml_layout(cls)
    top = Section(node, path, layout[None], errors)
    sections = {group: Section(top.raw(group), top.at(group), keys, errors)
                for group, keys in layout.items() if group is not None}
    values: dict[str, Any] = {}
    own_failed = False
    for f, spec in specs(cls):
        group, key = yaml_key(f, spec)
        where = top if group is None else sections[group]
        before = len(errors)
        values[f.name] = _field(where, key, f, spec, errors)
        own_failed = own_failed or (spec.parse is not None and len(errors) > before)
    provisional: C = unchecked(cls, values)
    if not own_failed:
        errors.extend(provisional._rules(top.at))
    return cls(**values) if len(errors) == errors_before else provisional


def _field(where: Section, key: str, f: dataclasses.Field[Any], spec: Spec,
           errors: list[str]) -> Any:
    """The value of one field: parsed, built from its nested mapping(s), or its default."""
    if spec.items is not None:
        item_cls = spec.items
        return tuple(_build(item_cls, node, path, errors)
                     for path, node in where.items(key, spec.item_name, spec.empty_ok))
    if not where.has(key) or (where.raw(key) is None and not has_default(f)):
        if not has_default(f):
            errors.append(f"{where.at(key)}: required")
        return default_of(f)
    if spec.section is not None:
        return _build(spec.section, where.raw(key), where.at(key), errors)
    assert spec.parse is not None  # a spec is one of items, section or a parser
    raw = where.raw(key)
    try:
        return spec.parse(raw)
    except cv.Invalid as problem:
        errors.append(f"{where.at(key)}: {problem}{cv.source_of(raw)}")
        return default_of(f)


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


def load_settings(
    path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    *,
    installed: Callable[[Settings], Sequence[str]] | None = None,
) -> Settings:
    """Read, substitute and validate a YAML file. `env` defaults to `os.environ`.
    `installed`: what a valid configuration needs that is not installed (a provider's extra),
    one error line each; the settings layer knows no provider, so the caller says."""
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
    missing = installed(settings) if installed is not None else ()
    if missing:
        raise ConfigError(missing)
    return settings


# --------------------------------------------------------------------------- the embedded default


def default_settings() -> Settings:
    """What `serve` runs with no config: pool `demo` of three simulated backends in three
    zones, with the bench's "stragglers" latency (lognormal TTFT, median 150 ms, sigma 0.25, 3 %
    stragglers +1.5 s, 30 tokens at 5 ms), so a newcomer sees hedges win offline with no keys;
    60 ms of prefill per 1,000 uncached input tokens and a prefix cache per backend, so a long
    conversation shows affinity at work (its turns stay on the backend that caches it). The
    simulators speak every route as the real APIs do: a request that offers tools gets a call
    to one (with arguments that fit its schema), so an agent can be tried against the demo.
    sim-c has a quota of 600 requests a minute, stated in rate-limit headers, so steady
    traffic shows quota headroom at work (it runs low, the others take its share).
    The initial hedge delay is 300 ms, not 500 ms, so hedges show up before the adaptive
    delay has its 20 samples. config/demo.yaml is the same thing as a file (a test checks)."""

    def simulated(name: str, group: str, seed: int, quota: int = 0) -> BackendSettings:
        profile = SimProfile(ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.03,
                             straggler_extra=1.5, tokens=30, inter_token=0.005, seed=seed,
                             prefill_ms_per_1k=60.0, rate_limit_requests=quota)
        return BackendSettings(name=name, provider="sim", model="demo", group=group, sim=profile)

    backends = (simulated("sim-a", "zone-a", 1), simulated("sim-b", "zone-b", 2),
                simulated("sim-c", "zone-c", 3, quota=600))
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
                     f"max_attempts {hedging.max_attempts}, {timing}, {_continuations(pool)}")
    return lines


def _continuations(pool: PoolSettings) -> str:
    """Whether a stalled or broken stream of `pool` can be continued, and on how many of its
    backends (those whose `continuation` is not `none`)."""
    stall = pool.hedging.stall
    able = sum(b.continuation != "none" for b in pool.backends)
    if not stall.enabled or not stall.max_continuations:
        return "continuations off"
    if not able:
        return "continuations off (no backend continues an answer)"
    return (f"continuations on {able} of {len(pool.backends)} backends, at most "
            f"{stall.max_continuations}, stall delay in [{_duration_text(stall.min)}, "
            f"{_duration_text(stall.max)}]")


#: client keys, ops keys and the response-id secret shorter than this are warned about: a
#: random key of 32 URL-safe characters (`openssl rand -base64 24`) is beyond online guessing
MIN_SECRET_CHARS = 32


def weak_secrets(server: ServerSettings) -> list[str]:
    """A warning per client key, ops key or secret shorter than `MIN_SECRET_CHARS`, naming
    its place (`server.api_keys[1]`) and never its value. Warned, not refused: a short key
    may be all a running deployment has, and refusing it would turn an upgrade into an
    outage (docs/security.md says why)."""
    found = [f"server.{name}[{index}]" for name in ("api_keys", "ops_keys", "admin_keys")
             for index, key in enumerate(getattr(server, name))
             if len(key) < MIN_SECRET_CHARS]
    secret = server.response_id_secret
    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        found.append("server.response_id_secret")
    return [f"{where} is shorter than {MIN_SECRET_CHARS} characters: a short key can be "
            f"guessed; use a random one of {MIN_SECRET_CHARS} or more" for where in found]


def unenforced_keys(keys: Sequence[TenantKeySettings]) -> list[str]:
    """A warning per named key that sets a rule this version does not enforce yet: none
    today (pools, limits, budget, ttft_objective and hedging are all enforced); kept so that a
    rule accepted ahead of its enforcement is never silently taken for in force."""
    return [f"keys[{index}] ({key.name}): {', '.join(found)} not enforced yet by this "
            "version; pools, limits, budget, ttft_objective and hedging are"
            for index, key in enumerate(keys) if (found := key.unenforced())]


def unpriced_budgets(settings: Settings) -> list[str]:
    """A warning per named key with a budget that none of its pools' backends has a price
    for: its requests would cost nothing, so the budget could never be reached."""
    priced = {pool.name for pool in settings.pools
              if any(backend.price is not None for backend in pool.backends)}
    return [f"keys[{index}] ({key.name}): budget set, but no backend of its pools has a "
            "price: its requests cost nothing and the budget is never reached"
            for index, key in enumerate(settings.keys)
            if key.budget.usd is not None
            and not (priced & set(key.pools or (pool.name for pool in settings.pools)))]


def check_config(
    path: str,
    out: TextIO,
    err: TextIO,
    installed: Callable[[Settings], Sequence[str]] | None = None,
) -> int:
    """`hedge-gateway check-config FILE`: 0 and a summary per pool when the file is valid,
    1 and every error (one per line, with key paths) when it is not. `installed`: as for
    `load_settings`."""
    try:
        settings = load_settings(path, installed=installed)
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
    for line in (weak_secrets(settings.server) + unenforced_keys(settings.keys)
                 + unpriced_budgets(settings)):
        print(f"{path}: warning: {line}", file=err)
    return 0
