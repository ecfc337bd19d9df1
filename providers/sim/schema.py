"""A value that fits a JSON schema, drawn from a seeded generator: a simulated tool call's
arguments. Pure.

A client that offers tools parses the arguments it is called with, often strictly (the
OpenAI SDK validates them into the pydantic model the tool was made from), so the simulator's
calls must fit the schema a client sent: `type` (one or a list), `enum` and `const`,
`properties` with `required` (a required property is always there, another one half the time;
`additionalProperties: false` is then kept by adding nothing else), `items`, the bounds
(`minimum`/`maximum` and their exclusive forms, `multipleOf`, `minLength`/`maxLength`,
`minItems`/`maxItems`), common string `format`s, `anyOf`/`oneOf` (one branch), `allOf`
(merged) and local `$ref`s (`#/$defs/...`, as pydantic writes nested models).

Bounded whatever the schema: arrays hold at most `MAX_ITEMS` items and strings at most
`MAX_STRING` characters unless the schema's minimum asks for more (capped too), optional
properties stop past `MAX_DEPTH` levels, and a schema that recurses through required fields
gets an empty object at `HARD_DEPTH` (the only place a value may not fit). A `pattern` is not
followed: no generator can satisfy every regular expression, and few tool schemas use one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

MAX_ITEMS = 3
MAX_STRING = 24
#: levels of nesting below which optional properties and array items are still generated
MAX_DEPTH = 4
#: where a schema that recurses through required fields is cut
HARD_DEPTH = 12
#: the most characters or items a schema's minimum can ask for here
MAX_MINIMUM = 256
WORDS = ("alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "sierra", "tango",
         "zulu", "paris", "tokyo", "oslo", "blue", "green", "small", "large")
_FORMATS = {
    "date": "2024-05-17",
    "date-time": "2024-05-17T09:30:00Z",
    "time": "09:30:00",
    "email": "someone@example.com",
    "uri": "https://example.com/item",
    "url": "https://example.com/item",
    "uuid": "0b9ef6f4-3c1e-4b8a-9d2f-6a1c7e5b2d40",
    "hostname": "example.com",
    "ipv4": "192.0.2.7",
    "ipv6": "2001:db8::7",
}


def arguments_for(schema: Mapping[str, Any], rng: random.Random) -> Any:
    """A value of `schema` (the tool's whole parameters schema, which its `$ref`s point into)."""
    return _Draw(schema, rng).value(schema, 0)


class _Draw:
    __slots__ = ("_rng", "_root")

    def __init__(self, root: Mapping[str, Any], rng: random.Random) -> None:
        self._root, self._rng = root, rng

    def value(self, schema: object, depth: int) -> Any:
        if schema is True or not isinstance(schema, Mapping):
            return self._string({}) if schema is not False else None
        schema = self._resolved(schema)
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return self._rng.choice(enum)
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                # prefer a branch that is not null: an argument is more useful than nothing
                useful = [b for b in branches
                          if not (isinstance(b, Mapping) and b.get("type") == "null")]
                return self.value(self._merged(schema, key, self._rng.choice(useful or
                                                                              branches)), depth)
        if isinstance(schema.get("allOf"), list):
            return self.value(self._all_of(schema), depth)
        kind = self._kind(schema)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        if kind == "boolean":
            return self._rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema)

    # --- structure ------------------------------------------------------------------------

    def _resolved(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        """Follow local `$ref`s (their siblings win over the target, as in 2020-12)."""
        hops = 0
        while isinstance(schema.get("$ref"), str) and hops < HARD_DEPTH:
            target = self._pointer(schema["$ref"])
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **rest} if target is not None else rest
            hops += 1
        return schema

    def _pointer(self, ref: str) -> Mapping[str, Any] | None:
        if not ref.startswith("#"):
            return None  # a remote schema: nothing to fetch here
        node: object = self._root
        for raw in ref[1:].split("/")[1:]:
            key = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return node if isinstance(node, Mapping) else None

    @staticmethod
    def _merged(schema: Mapping[str, Any], key: str, branch: object) -> Mapping[str, Any]:
        rest = {k: v for k, v in schema.items() if k != key}
        return {**rest, **branch} if isinstance(branch, Mapping) else rest

    def _all_of(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        properties: dict[str, Any] = dict(merged.get("properties") or {})
        required: list[str] = list(merged.get("required") or [])
        for part in schema["allOf"]:
            if not isinstance(part, Mapping):
                continue
            part = self._resolved(part)
            properties.update(part.get("properties") or {})
            required += [r for r in part.get("required") or [] if r not in required]
            merged.update({k: v for k, v in part.items()
                           if k not in ("properties", "required") and k not in merged})
        if properties:
            merged["properties"] = properties
        if required:
            merged["required"] = required
        return merged

    def _kind(self, schema: Mapping[str, Any]) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if isinstance(k, str)]
            useful = [k for k in kinds if k != "null"]
            return self._rng.choice(useful or kinds or ["string"])
        if isinstance(kind, str):
            return kind
        if "properties" in schema or "required" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        return "string"

    def _object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = schema.get("required")
        required = {r for r in required if isinstance(r, str)} \
            if isinstance(required, list) else set()
        if depth >= HARD_DEPTH:
            return {}
        out: dict[str, Any] = {}
        for name, sub in properties.items():
            must = name in required
            if must or (depth < MAX_DEPTH and self._rng.random() < 0.5):
                out[name] = self.value(sub, depth + 1)
        for name in sorted(required - set(out)):  # required but not described: anything
            out[name] = self._string({})
        return out

    def _array(self, schema: Mapping[str, Any], depth: int) -> list[Any]:
        low, high = _bounds(schema, "minItems", "maxItems", default_high=MAX_ITEMS)
        count = low if depth >= MAX_DEPTH else self._rng.randint(low, max(low, high))
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = schema.get("items", {})
        out = [self.value(prefix[i] if i < len(prefix) else items, depth + 1)
               for i in range(count)]
        if schema.get("uniqueItems") is True:
            out = _unique(out)
        return out

    # --- scalars ----------------------------------------------------------------------------

    def _string(self, schema: Mapping[str, Any]) -> str:
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in _FORMATS:
            return _FORMATS[fmt]
        low, high = _bounds(schema, "minLength", "maxLength", default_high=MAX_STRING)
        text = self._rng.choice(WORDS)
        while len(text) < low:
            text += " " + self._rng.choice(WORDS)
        return text[:high] if len(text) > high else text

    def _integer(self, schema: Mapping[str, Any]) -> int:
        low, high = _number_bounds(schema, integer=True)
        step = schema.get("multipleOf")
        if isinstance(step, int) and not isinstance(step, bool) and step > 0:
            first, last = math.ceil(low / step), math.floor(high / step)
            return self._rng.randint(first, max(first, last)) * step
        return self._rng.randint(math.ceil(low), max(math.ceil(low), math.floor(high)))

    def _number(self, schema: Mapping[str, Any]) -> float | int:
        low, high = _number_bounds(schema, integer=False)
        step = schema.get("multipleOf")
        if isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0:
            first, last = math.ceil(low / step), math.floor(high / step)
            multiple = self._rng.randint(first, max(first, last)) * step
            return multiple if isinstance(multiple, int) else round(multiple, 10)
        if high <= low:
            return low
        return max(low, min(high, round(self._rng.uniform(low, high), 2)))


def _bounds(schema: Mapping[str, Any], low_key: str, high_key: str, *,
            default_high: int) -> tuple[int, int]:
    low = _whole(schema.get(low_key), 0)
    low = min(low, MAX_MINIMUM)
    high = _whole(schema.get(high_key), max(default_high, low))
    return low, max(low, min(high, max(default_high, low)))


def _whole(value: object, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return default
    return int(value)


def _number_bounds(schema: Mapping[str, Any], *, integer: bool) -> tuple[float, float]:
    """The closed range a number may take; exclusive bounds move in by one for integers and
    by a hundredth (the rounding `_number` uses) otherwise. Unbounded: 0 to 100 around
    whichever bound is given."""
    nudge = 1.0 if integer else 0.01
    low: float | None = _finite(schema.get("minimum"))
    high: float | None = _finite(schema.get("maximum"))
    exclusive_low, exclusive_high = (_finite(schema.get("exclusiveMinimum")),
                                     _finite(schema.get("exclusiveMaximum")))
    if exclusive_low is not None:
        low = max(low, exclusive_low + nudge) if low is not None else exclusive_low + nudge
    if exclusive_high is not None:
        high = min(high, exclusive_high - nudge) if high is not None else exclusive_high - nudge
    if low is None and high is None:
        low, high = 0.0, 100.0
    elif low is None:
        assert high is not None
        low = high - 100.0
    elif high is None:
        high = low + 100.0
    return low, max(low, high)


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _unique(values: Sequence[Any]) -> list[Any]:
    seen: list[Any] = []
    for value in values:
        if value not in seen:
            seen.append(value)
    return seen
