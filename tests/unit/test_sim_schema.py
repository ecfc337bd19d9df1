"""The simulator's tool-call arguments: a value fitting the tool's JSON schema, checked by an
independent validator (jsonschema) and by pydantic on the models schemas are made from, for
every construct the generator claims, over many seeds; reproducible from a seed; bounded."""

from __future__ import annotations

import enum
import json
import random
from typing import Any, Literal

import jsonschema
import pydantic
import pytest

from providers.sim.schema import MAX_ITEMS, MAX_STRING, arguments_for

SEEDS = range(60)

SCHEMAS: dict[str, dict[str, Any]] = {
    "empty object": {"type": "object", "properties": {}},
    "scalars": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "temperature": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 40},
            "metric": {"type": "boolean"},
            "nothing": {"type": "null"},
        },
        "required": ["city", "days", "temperature", "metric", "nothing"],
        "additionalProperties": False,
    },
    "enum and const": {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["c", "f"]},
                       "level": {"enum": [1, 2, 3]}, "kind": {"const": "weather"}},
        "required": ["unit", "level", "kind"],
    },
    "strings with bounds and formats": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 3, "maxLength": 3},
            "long": {"type": "string", "minLength": 40},
            "short": {"type": "string", "maxLength": 2},
            "when": {"type": "string", "format": "date-time"},
            "day": {"type": "string", "format": "date"},
            "mail": {"type": "string", "format": "email"},
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["code", "long", "short", "when", "day", "mail", "id"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "minItems": 2, "maxItems": 2},
            "few": {"type": "array", "items": {"type": "integer", "multipleOf": 5},
                    "maxItems": 2, "uniqueItems": True},
        },
        "required": ["tags", "pair", "few"],
    },
    "nested and optional": {
        "type": "object",
        "properties": {
            "trip": {
                "type": "object",
                "properties": {
                    "legs": {"type": "array", "items": {
                        "type": "object",
                        "properties": {"from": {"type": "string"}, "to": {"type": "string"},
                                       "stops": {"type": "integer", "minimum": 0}},
                        "required": ["from", "to"], "additionalProperties": False}},
                    "note": {"type": "string"},
                },
                "required": ["legs"],
            },
        },
        "required": ["trip"],
    },
    "unions and types lists": {
        "type": "object",
        "properties": {
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "one": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
            "maybe": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "both": {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}},
                                "required": ["a"]},
                               {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
        },
        "required": ["either", "one", "maybe", "both"],
    },
    "untyped and required without a description": {
        "properties": {"x": {"items": {"type": "integer"}}}, "required": ["x", "y"]},
    "local references": {
        "type": "object",
        "$defs": {"place": {"type": "object", "properties": {"name": {"type": "string"}},
                            "required": ["name"]}},
        "properties": {"home": {"$ref": "#/$defs/place"},
                       "visits": {"type": "array", "items": {"$ref": "#/$defs/place"}}},
        "required": ["home", "visits"],
    },
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_arguments_fit_their_schema(name: str) -> None:
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for seed in SEEDS:
        value = arguments_for(schema, random.Random(seed))
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, (seed, value, errors)
        json.dumps(value, allow_nan=False)  # JSON all the way down


def test_the_draws_vary_and_are_reproducible() -> None:
    schema = SCHEMAS["scalars"]
    draws = [arguments_for(schema, random.Random(seed)) for seed in SEEDS]
    assert draws == [arguments_for(schema, random.Random(seed)) for seed in SEEDS]
    assert len({json.dumps(d, sort_keys=True) for d in draws}) > len(draws) // 2
    optional = SCHEMAS["nested and optional"]
    notes = [("note" in arguments_for(optional, random.Random(s))["trip"]) for s in SEEDS]
    assert any(notes) and not all(notes)  # an optional property sometimes, not always


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Place(pydantic.BaseModel):
    name: str
    country: str | None = None


class Forecast(pydantic.BaseModel):
    """The schemas SDKs send: pydantic's, with `$defs`, enums by reference, optionals as
    `anyOf` with null, literals, lists of models."""

    place: Place
    days: int = pydantic.Field(ge=1, le=10)
    unit: Unit
    mode: Literal["daily", "hourly"]
    alternatives: list[Place]
    precision: float | None = None


def test_pydantic_models_accept_the_arguments_for_their_own_schema() -> None:
    schema = Forecast.model_json_schema()
    assert "$defs" in schema  # the references are the point
    for seed in SEEDS:
        value = arguments_for(schema, random.Random(seed))
        Forecast.model_validate(value)


def test_sizes_are_bounded_whatever_the_schema() -> None:
    """Arrays and strings stay small, and a schema that recurses through a required field
    ends (in an empty object at the depth limit) instead of growing without end."""
    recursive = {"$defs": {"node": {"type": "object", "properties": {
        "child": {"$ref": "#/$defs/node"}, "name": {"type": "string"}},
        "required": ["child"]}}, "$ref": "#/$defs/node"}
    huge = {"type": "object", "properties": {
        "many": {"type": "array", "items": {"type": "string", "maxLength": 10_000},
                 "maxItems": 10_000}}, "required": ["many"]}
    for seed in SEEDS:
        assert len(json.dumps(arguments_for(recursive, random.Random(seed)))) < 2_000
        many = arguments_for(huge, random.Random(seed))["many"]
        assert len(many) <= MAX_ITEMS and all(len(s) <= MAX_STRING for s in many)


def test_schemas_that_say_little_still_give_json() -> None:
    odd: list[dict[str, Any]] = [{}, {"type": "object"}, {"$ref": "https://elsewhere/schema"},
                                 {"type": []}, {"anyOf": []}, {"properties": "not a mapping"}]
    for schema in odd:
        json.dumps(arguments_for(schema, random.Random(1)))
