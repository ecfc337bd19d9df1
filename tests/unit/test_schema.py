"""`hedge-gateway schema`: the JSON Schema says what the loader says, and the reference file
shows exactly the schema's keys with the model's defaults.

The schema is checked by a small validator below (the keywords the schema uses, nothing more;
an unknown keyword fails loudly), so the test needs no validation library: every shipped config
must pass it, and configs the loader refuses for a reason a schema can express must fail it.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main
from gateway.settings import ConfigError, Settings, parse_settings
from gateway.settings.env import substitute
from gateway.settings.fields import Checked, default_of, specs, yaml_key
from gateway.settings.parse import Parser

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
REFERENCE = CONFIG_DIR / "full-reference.yaml"
EXAMPLE_ENV = {"GATEWAY_KEY": "gw-test-key", "OPENAI_API_KEY": "sk-test-openai"}


def printed_schema() -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["schema"]) == 0
    schema: dict[str, Any] = json.loads(out.getvalue())
    return schema


SCHEMA = printed_schema()


# --------------------------------------------------------------------------- a small validator

#: keywords that say nothing to check, or that `unknown_keys` and `if` handle
_IGNORED = {"description", "default", "title", "$schema", "$defs", "type", "then", "else",
            "additionalProperties"}
_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}


_BOUNDS: dict[str, Any] = {
    "minimum": lambda v, r: v >= r, "exclusiveMinimum": lambda v, r: v > r,
    "maximum": lambda v, r: v <= r, "exclusiveMaximum": lambda v, r: v < r,
    "minItems": lambda v, r: len(v) >= r, "minLength": lambda v, r: len(v) >= r,
    "pattern": lambda v, r: re.search(r, v) is not None,
    "enum": lambda v, r: v in r, "const": lambda v, r: v == r,
    "uniqueItems": lambda v, r: not r or len({json.dumps(x, sort_keys=True) for x in v}) == len(v),
}


def problems(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Where `value` breaks `schema` (draft 2020-12, the keywords our schema uses)."""
    kinds = schema.get("type")
    listed = kinds if isinstance(kinds, list) else [kinds] if kinds else []
    if listed and not any(_TYPES[kind](value) for kind in listed):
        return [f"{path}: not {kinds}"]  # the other keywords assume the type
    found: list[str] = []
    for word, rule in schema.items():
        if word in _BOUNDS:
            if not _BOUNDS[word](value, rule):
                found.append(f"{path}: fails {word} {rule}")
        elif word == "$ref":
            found += problems(value, SCHEMA["$defs"][rule.removeprefix("#/$defs/")], path)
        elif word == "anyOf":
            if all(problems(value, option, path) for option in rule):
                found.append(f"{path}: matches no alternative")
        elif word == "not":
            if not problems(value, rule, path):
                found.append(f"{path}: matches what is forbidden")
        elif word == "if":
            found += problems(value, schema["then" if not problems(value, rule) else "else"], path)
        elif word == "properties":
            for key, sub in rule.items():
                if key in value:
                    found += problems(value[key], sub, f"{path}.{key}".lstrip("."))
        elif word == "required":
            found += [f"{path}.{key}: required" for key in rule if key not in value]
        elif word == "items":
            for index, item in enumerate(value):
                found += problems(item, rule, f"{path}[{index}]")
        elif word not in _IGNORED:
            raise AssertionError(f"the test's validator does not know the keyword {word!r}")
    return found


def unknown_keys(value: Any, schema: dict[str, Any]) -> list[str]:
    """Keys of `value` the schema does not list (what `additionalProperties: false` says).
    A free-form map (`additionalProperties` a schema: backend `headers`, `query`) lists its
    path as `path.*`, which any key below it matches."""
    listed = set(schema_paths(schema))
    return sorted(path for path in set(file_paths(value)) - listed
                  if path.rsplit(".", 1)[0] + ".*" not in listed)


def validate(tree: Any) -> list[str]:
    return problems(tree, SCHEMA) + unknown_keys(tree, SCHEMA)


# --------------------------------------------------------------------------- key paths


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    """The object or array schema behind a `$ref` or an `anyOf [$ref, null]`."""
    for option in schema.get("anyOf", []):
        if "$ref" in option:
            return _resolve(option)
    if "$ref" in schema:
        resolved: dict[str, Any] = SCHEMA["$defs"][schema["$ref"].removeprefix("#/$defs/")]
        return resolved
    return schema


def schema_paths(schema: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key path of the schema, `[]` standing for any list entry."""
    schema = _resolve(schema)
    if schema.get("type") == "array" and "$ref" in schema.get("items", {}):
        yield from schema_paths(schema["items"], prefix + "[]")
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{key}".lstrip(".")
        yield path
        if isinstance(sub.get("additionalProperties"), dict):
            yield f"{path}.*"
        yield from schema_paths(sub, path)


def file_paths(tree: Any, prefix: str = "") -> Iterator[str]:
    """Every key path of a YAML tree, entries of a list merged under `[]`."""
    if isinstance(tree, list):
        for item in tree:
            yield from file_paths(item, prefix + "[]")
    elif isinstance(tree, dict):
        for key, sub in tree.items():
            path = f"{prefix}.{key}".lstrip(".")
            yield path
            yield from file_paths(sub, path)


def described(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property schema of the whole schema, with its key path."""
    for key, sub in schema.get("properties", {}).items():
        yield key, sub
        for inner, deeper in described(sub):
            yield f"{key}.{inner}", deeper
    for name, definition in schema.get("$defs", {}).items():
        for inner, deeper in described(definition):
            yield f"{name}.{inner}", deeper


# --------------------------------------------------------------------------- the schema


def test_schema_command_prints_a_json_schema() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA["type"] == "object" and SCHEMA["required"] == ["pools"]
    assert SCHEMA["additionalProperties"] is False
    assert set(SCHEMA["properties"]) == {"server", "hedging", "affinity", "pools", "keys"}


def test_every_key_has_a_type_and_a_one_line_description() -> None:
    entries = list(described(SCHEMA))
    assert len(entries) > 60
    for path, sub in entries:
        assert sub.get("description"), path
        assert "\n" not in sub["description"], path
        assert {"type", "anyOf", "enum", "$ref"} & set(sub), path


def test_defaults_are_the_model_defaults() -> None:
    delay = SCHEMA["$defs"]["DelaySettings"]["properties"]
    assert delay["quantile"]["default"] == "auto" and delay["min"]["default"] == 0.05
    server = SCHEMA["$defs"]["ServerSettings"]["properties"]
    assert server["max_body"]["default"] == 4 * 1024 * 1024
    assert server["api_keys"]["default"] == []
    assert SCHEMA["properties"]["hedging"]["properties"]["enabled"]["default"] is True
    backend = SCHEMA["$defs"]["BackendSettings"]
    assert "default" not in backend["properties"]["name"]  # required
    assert "default" not in backend["properties"]["model"]  # the pool name: not a constant
    assert backend["required"] == ["name"]
    assert SCHEMA["$defs"]["PoolSettings"]["required"] == ["name", "backends"]


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    assert validate(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize(
    "text",
    [
        "pools: []",
        "server: {port: 70000}\npools: [{name: p, backends: [{name: a, provider: sim}]}]",
        "colour: blue\npools: [{name: p, backends: [{name: a, provider: sim}]}]",
        "pools: [{name: p, backends: [{name: a}]}]",
        "pools: [{name: p, backends: [{name: a, provider: sim, base_url: 'http://h/v1'}]}]",
        "pools: [{name: p, backends: [{name: a, provider: sim, api_key: k}]}]",
        "pools: [{name: p, backends: [{name: a, base_url: 'http://h/v1', sim: {}}]}]",
        "pools: [{name: p, backends: [{name: a, base_url: 'ftp://h/v1'}]}]",
        "pools: [{name: '../p', backends: [{name: a, provider: sim}]}]",
        "pools: [{name: p, hedging: {max_attempts: 6}, backends: [{name: a, provider: sim}]}]",
        "pools: [{name: p, hedging: {dealy: {}}, backends: [{name: a, provider: sim}]}]",
        "pools: [{name: p, timeout: soon, backends: [{name: a, provider: sim}]}]",
        "pools: [{name: p, timeout: 0, backends: [{name: a, provider: sim}]}]",
        "pools: [{name: p, backends: [{name: a, provider: sim, sim: {tokens: 0}}]}]",
        "server: {max_body: 4XB}\npools: [{name: p, backends: [{name: a, provider: sim}]}]",
    ],
)
def test_schema_refuses_what_the_loader_refuses(text: str) -> None:
    tree = yaml.safe_load(text)
    with pytest.raises(ConfigError):
        parse_settings(tree, {})
    assert validate(tree)


def test_schema_accepts_values_from_the_environment() -> None:
    tree = yaml.safe_load(
        "server: {port: '${PORT:-8080}'}\nhedging: {enabled: '${HEDGE:-true}'}\n"
        "pools: [{name: p, timeout: '${T:-60s}', backends: [{name: a, base_url: '${URL}'}]}]"
    )
    assert validate(tree) == []
    assert parse_settings(tree, {"URL": "http://h/v1"}).server.port == 8080


# --------------------------------------------------------------------------- the reference file


def test_reference_file_has_every_schema_key_and_no_other() -> None:
    in_file = set(file_paths(yaml.safe_load(REFERENCE.read_text())))
    in_schema = {path for path in schema_paths(SCHEMA) if not path.endswith(".*")}
    assert in_file - in_schema == set(), "keys the schema does not know"
    assert in_schema - in_file == set(), "keys config/full-reference.yaml does not show"


def model_keys(cls: type[Checked], prefix: str = "") -> Iterator[tuple[str, Parser[Any], Any]]:
    """(key path, parser, default) of every scalar key that has a default, from the model."""
    for f, spec in specs(cls):
        group, key = yaml_key(f, spec)
        path = ".".join(part for part in (prefix, group, key) if part)
        if spec.items is not None:
            yield from model_keys(spec.items, path + "[]")
        elif spec.section is not None:
            yield from model_keys(spec.section, path)
        elif spec.parse is not None and path in DEFAULTS_IN_SCHEMA:
            yield path, spec.parse, default_of(f)


def _schema_defaults(schema: dict[str, Any], prefix: str = "") -> Iterator[str]:
    schema = _resolve(schema)
    if schema.get("type") == "array":
        yield from _schema_defaults(schema["items"], prefix + "[]")
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{key}".lstrip(".")
        if "default" in sub:
            yield path
        yield from _schema_defaults(sub, path)


DEFAULTS_IN_SCHEMA = set(_schema_defaults(SCHEMA))


def first_value(tree: Any, path: str) -> Any:
    """The value at `path` in the first list entry that has it (entries after the first show
    alternatives, such as a sim backend after an openai one)."""
    head, _, rest = path.partition(".")
    if head.endswith("[]"):
        for entry in tree[head[:-2]]:
            found = first_value(entry, rest)
            if found is not _ABSENT:
                return found
        return _ABSENT
    if head not in tree:
        return _ABSENT
    return first_value(tree[head], rest) if rest else tree[head]


_ABSENT = object()


def test_reference_file_shows_the_defaults() -> None:
    tree = yaml.safe_load(REFERENCE.read_text())
    checked = list(model_keys(Settings))
    assert {path for path, _, _ in checked} == DEFAULTS_IN_SCHEMA
    for path, parse, default in checked:
        raw = first_value(tree, path)
        assert raw is not _ABSENT, path
        value = parse(substitute(raw, path, {}, []))
        assert value == default, path
        assert json.loads(json.dumps(value)) == first_value(_schema_default_tree(), path), path


def _schema_default_tree() -> Any:
    """The schema's defaults laid out like a file (one entry per list), for comparison."""
    tree: dict[str, Any] = {}
    for path in DEFAULTS_IN_SCHEMA:
        node, schema = tree, SCHEMA
        parts = path.split(".")
        for part in parts[:-1]:
            schema = _resolve(schema)
            name = part.removesuffix("[]")
            schema = schema["properties"][name]
            if part.endswith("[]"):
                node = node.setdefault(name, [{}])[0]
                schema = schema["items"]
            else:
                node = node.setdefault(name, {})
        node[parts[-1]] = _resolve(schema)["properties"][parts[-1]]["default"]
    return tree
