"""The configuration's JSON Schema (draft 2020-12), generated from the model for `hedge-gateway
schema`, so editors and CI can check a YAML file before the gateway loads it.

Nothing here is written by hand per key: the walk reads each field's spec (its parser's schema,
its description, its YAML key) and its default, as the loader does. The schema describes the
file before `${VAR}` substitution, so numbers and booleans also admit a `${...}` string. Rules it
cannot say (delay.min <= delay.max, unique names) are still checked by the loader and the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gateway.settings.fields import Checked, Spec, default_of, specs, yaml_key, yaml_layout
from gateway.settings.model import Settings

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def json_schema() -> dict[str, Any]:
    """The schema of a configuration file: the top-level object inline, the others in `$defs`."""
    defs: dict[str, Any] = {}
    root = _object(Settings, defs)
    return {"$schema": DRAFT, "title": "hedge-gateway configuration", **root,
            "$defs": dict(sorted(defs.items()))}


def _object(cls: type[Checked], defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of one settings class, with groups of dotted keys as nested objects."""
    found: dict[str | None, dict[str, Any]] = {group: {} for group in yaml_layout(cls)}
    required: list[str] = []
    for f, spec in specs(cls):
        group, key = yaml_key(f, spec)
        found[group][key] = _property(f, spec, defs)
        if group is None and f.default is dataclasses.MISSING and (
                f.default_factory is dataclasses.MISSING):
            required.append(key)
    properties: dict[str, Any] = {}
    for key in yaml_layout(cls)[None]:  # the file's order, groups where they first appear
        properties[key] = found[None].get(key) or {
            "description": cls.groups.get(key, ""), "type": "object",
            "properties": found[key], "additionalProperties": False,
        }
    result: dict[str, Any] = {"description": _first_line(cls.__doc__), "type": "object",
                              "properties": properties, "additionalProperties": False}
    if required:
        result["required"] = required
    result.update(getattr(cls, "json_rules", {}))
    return result


def _property(f: dataclasses.Field[Any], spec: Spec, defs: dict[str, Any]) -> dict[str, Any]:
    if spec.items is not None:
        return {"description": spec.doc, "type": "array", "minItems": 0 if spec.empty_ok else 1,
                "items": _ref(spec.items, defs)}
    if spec.section is not None:
        # `sim:` with every key commented out is YAML null, and loads as the defaults
        return {"description": spec.doc, "anyOf": [_ref(spec.section, defs), {"type": "null"}]}
    assert spec.parse is not None  # a spec is one of items, section or a parser
    result = {"description": spec.doc, **spec.parse.schema}
    if f.default is not dataclasses.MISSING and spec.default_shown:
        default = default_of(f)
        result["default"] = list(default) if isinstance(default, tuple) else default
    return result


def _ref(cls: type[Checked], defs: dict[str, Any]) -> dict[str, Any]:
    if cls.__name__ not in defs:
        defs[cls.__name__] = {}  # placed first: a class may be reached again while built
        defs[cls.__name__] = _object(cls, defs)
    return {"$ref": f"#/$defs/{cls.__name__}"}


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc else ""
