"""Value parsers for the configuration: durations, sizes, bounded numbers, names, URLs (a
backend's upstream options are `gateway.settings.upstream`'s; `${VAR}` substitution, which
runs before them, is `gateway.settings.env`).

Each parser is a `Parser`: a function from one raw YAML value to the typed value (raising
`Invalid` with a message that says what is wrong), paired with the JSON Schema of the YAML values
it accepts. The settings model names a parser for every field (`gateway.settings.model`); the
loader runs it on the file's value and adds the key path; the model runs it again on values
built in code; `hedge-gateway schema` prints its schema. One object, so the three cannot drift.

Messages never show a string that came from the environment (`Substituted`), and type errors
name the type only, so a misplaced key cannot leak through an error message.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")
Schema = Mapping[str, Any]


class Invalid(Exception):
    """One value is wrong; the message says how, the caller prefixes the key path."""


class Substituted(str):
    """A string produced by `${VAR}` substitution: numeric fields may parse it, and error
    messages never show it (it may be a secret); they name its `variables` instead."""

    variables: tuple[str, ...] = ()

    @classmethod
    def of(cls, text: str, variables: tuple[str, ...]) -> Substituted:
        result = cls(text)
        result.variables = variables
        return result


def source_of(value: object) -> str:
    """What to add to a message about `value`: the variables it came from, if any."""
    if isinstance(value, Substituted) and value.variables:
        names = ", ".join(f"${{{name}}}" for name in value.variables)
        return f" (the value comes from {names})"
    return ""


class Parser(Generic[T]):
    """A value parser and the JSON Schema of the raw values it accepts, written side by side."""

    __slots__ = ("_parse", "schema", "what")

    def __init__(self, parse: Callable[[object], T], schema: Schema, what: str = "value"
                 ) -> None:
        self._parse = parse
        self.schema = schema
        self.what = what

    def __call__(self, value: object) -> T:
        """The parsed value, or `Invalid`. A parser's own failure (a library that raises on a
        value, as `urlsplit` does on `http://[x]/`) is `Invalid` too, with no message of its
        own and no chained traceback: those messages repeat the value."""
        try:
            return self._parse(value)
        except Invalid:
            raise
        except Exception:  # noqa: BLE001 - a value the parser's library cannot take
            raise Invalid(f"is not a valid {self.what}") from None


#: what a `${VAR}` reference looks like to a schema validator, which sees the file before
#: substitution: numbers and booleans may be written as one (`port: ${PORT:-8080}`)
FROM_ENV: Schema = {"type": "string", "pattern": r"\$\{"}


def or_env(schema: Schema) -> Schema:
    """`schema`, or a `${VAR}` reference that will become such a value."""
    return {"anyOf": [schema, FROM_ENV]}


def join(path: str, key: object) -> str:
    """The key path of `key` inside the mapping at `path` ("" is the top level)."""
    return f"{path}.{key}" if path else str(key)


# --------------------------------------------------------------------------- value parsers


def show(value: object) -> str:
    """How a bad value appears in a message: literal YAML values only, never substitutions."""
    if isinstance(value, Substituted):
        return "the value from the environment"
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def type_name(value: object) -> str:
    """The YAML-ish name of a value's type, for messages that must not show the value."""
    kinds: tuple[tuple[type, str], ...] = (
        (bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
        (list, "a list"), (dict, "a mapping"), (type(None), "null"),
    )
    for kind, label in kinds:
        if isinstance(value, kind):
            return label
    return "a " + type(value).__name__


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?")
_DURATION_SCALE = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?", re.IGNORECASE)
_SIZE_SCALE = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20,
               "gb": 10**9, "gib": 2**30}


def _decimal(value: object, pattern: re.Pattern[str], what: str) -> tuple[Decimal, str]:
    """A number and its unit (lower-cased, "" when none) from a YAML number or string."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise Invalid(f"must be {what}, got {type_name(value)}")
    if not isinstance(value, str):
        if value != value or value in (float("inf"), float("-inf")):
            raise Invalid(f"must be {what}, got {show(value)}")
        if value < 0:
            raise Invalid(f"must not be negative, got {show(value)}")
        return Decimal(repr(value)) if isinstance(value, float) else Decimal(value), ""
    match = pattern.fullmatch(value.strip())
    if match is None:
        raise Invalid(f"must be {what}, got {show(value)}")
    try:
        return Decimal(match.group(1)), (match.group(2) or "").lower()
    except InvalidOperation:  # pragma: no cover - the pattern admits only valid decimals
        raise Invalid(f"must be {what}, got {show(value)}") from None


def duration(*, zero: bool = False) -> Parser[float]:
    what = "a duration like 50ms, 2s, 1.5s or 10m"

    def parse(value: object) -> float:
        amount, unit = _decimal(value, _DURATION, what)
        seconds = float(amount * _DURATION_SCALE[unit or "s"])
        if seconds < 0 or (seconds == 0 and not zero):
            raise Invalid(f"must be {'>= 0' if zero else '> 0'}, got {show(value)}")
        return seconds

    seconds = {"type": "number", ("minimum" if zero else "exclusiveMinimum"): 0}
    text = {"type": "string", "pattern": r"^\s*(\d+(\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$"}
    return Parser(parse, {"anyOf": [seconds, text, FROM_ENV]})


def _size(value: object) -> int:
    amount, unit = _decimal(value, _SIZE, "a size like 4MiB, 512KiB or 4194304")
    scaled = amount * _SIZE_SCALE[unit or "b"]
    if scaled != scaled.to_integral_value() or scaled < 1:
        raise Invalid(f"must be a whole number of bytes >= 1, got {show(value)}")
    return int(scaled)


size = Parser(_size, {"anyOf": [
    {"type": "integer", "minimum": 1},
    {"type": "string", "pattern": r"^\s*(\d+(\.\d*)?|\.\d+)\s*([Bb]|[KkMmGg][Ii]?[Bb])?\s*$"},
    FROM_ENV,
]})


def integer(low: int, high: int | None = None) -> Parser[int]:
    def parse(value: object) -> int:
        if isinstance(value, Substituted) and re.fullmatch(r"\s*-?\d+\s*", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid(f"must be an integer, got {type_name(value)}")
        if value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f">= {low}"
            raise Invalid(f"must be {bounds}, got {show(value)}")
        return value

    schema: dict[str, Any] = {"type": "integer", "minimum": low}
    if high is not None:
        schema["maximum"] = high
    return Parser(parse, or_env(schema))


def number(low: float, high: float | None = None, *, open_low: bool = False,
           open_high: bool = False) -> Parser[float]:
    def parse(value: object) -> float:
        if isinstance(value, Substituted):
            try:
                value = float(value)
            except ValueError:
                raise Invalid("must be a number, got the value from the environment") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Invalid(f"must be a number, got {type_name(value)}")
        result = float(value)
        too_low = result <= low if open_low else result < low
        too_high = high is not None and (result >= high if open_high else result > high)
        if too_low or too_high or not math.isfinite(result):
            left = ("(" if open_low else "[") + f"{low:g}"
            right = f"{high:g}" + (")" if open_high else "]") if high is not None else "inf)"
            raise Invalid(f"must be in {left}, {right}, got {show(value)}")
        return result

    schema: dict[str, Any] = {"type": "number"}
    schema["exclusiveMinimum" if open_low else "minimum"] = low
    if high is not None:
        schema["exclusiveMaximum" if open_high else "maximum"] = high
    return Parser(parse, or_env(schema))


def _boolean(value: object) -> bool:
    if isinstance(value, Substituted) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false, got {type_name(value)}")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise Invalid(f"must be a string, got {type_name(value)}")
    return str(value)


def _nonempty_text(value: object) -> str:
    result = _text(value)
    if not result.strip():
        raise Invalid("must not be empty")
    return result


def _secret(value: object) -> str | None:
    """A provider key: a string, where empty (e.g. `${KEY:-}` unset) means "send no key"."""
    return None if value is None else _text(value) or None


boolean = Parser(_boolean, or_env({"type": "boolean"}))
text = Parser(_text, {"type": "string"})
nonempty_text = Parser(_nonempty_text, {"type": "string", "minLength": 1})
secret = Parser(_secret, {"type": ["string", "null"]})


def optional(parse: Parser[T]) -> Parser[T | None]:
    return Parser(lambda value: None if value is None else parse(value),
                  {"anyOf": [parse.schema, {"type": "null"}]})


def choice(options: tuple[T, ...]) -> Parser[T]:
    def parse(value: object) -> T:
        if value not in options:
            listed = ", ".join(str(option) for option in options)
            raise Invalid(f"must be one of {listed}, got {show(value)}")
        return options[options.index(value)]  # the option itself, never a `Substituted`

    return Parser(parse, or_env({"enum": list(options)}))


def auto_or_fraction() -> Parser[float | Literal["auto"]]:
    """`auto`, or a number strictly between 0 and 1 (`delay.quantile`). A word other
    than `auto` is told both forms; a number out of range only the range."""
    fraction = number(0, 1, open_low=True, open_high=True)

    def parse(value: object) -> float | Literal["auto"]:
        if value == "auto":
            return "auto"
        if isinstance(value, str) and not value.strip()[:1].isdigit():
            raise Invalid(f"must be auto or a number in (0, 1), got {show(value)}")
        return fraction(value)

    return Parser(parse, {"anyOf": [{"const": "auto"}, fraction.schema]})


def either(first: Parser[A], second: Parser[B]) -> Parser[A | B]:
    """A key that takes one of two forms, such as a word or a number (`auto` or `0.95`):
    the first parser that accepts the value wins; when neither does, both messages are shown."""

    def parse(value: object) -> A | B:
        try:
            return first(value)
        except Invalid as problem:
            try:
                return second(value)
            except Invalid as other:
                raise Invalid(f"{problem}; or {other}") from None

    return Parser(parse, {"anyOf": [first.schema, second.schema]})


def _list_of_keys(value: object) -> tuple[str, ...]:
    """Client keys. An empty entry is refused rather than dropped: an unset variable must not
    quietly turn authentication off."""
    if not isinstance(value, list | tuple):
        raise Invalid(f"must be a list of keys, got {type_name(value)}")
    for index, key in enumerate(value):
        if not isinstance(key, str) or not key.strip():
            raise Invalid(f"entry [{index}] must be a non-empty string "
                          "(remove api_keys to serve without authentication)")
    return tuple(str(key) for key in value)


keys = Parser(_list_of_keys, {"type": "array", "items": {"type": "string", "minLength": 1}})
_ORIGIN = re.compile(r"https?://[a-z0-9.-]+(:[0-9]{1,5})?|https?://\[[0-9a-f:.]+\](:[0-9]{1,5})?")
_HOST_NAME = re.compile(r"[a-z0-9.-]{1,253}|\[[0-9a-f:.]+\]")


def _strings(value: object, what: str, pattern: re.Pattern[str], example: str) -> tuple[
    str, ...
]:
    if not isinstance(value, list | tuple):
        raise Invalid(f"must be a list of {what}s, got {type_name(value)}")
    result = []
    for index, entry in enumerate(value):
        text = entry.strip().lower().rstrip("/") if isinstance(entry, str) else None
        if text is None or not pattern.fullmatch(text):
            raise Invalid(f"entry [{index}] must be a {what} like {example}, got {show(entry)}")
        result.append(text)
    return tuple(result)


#: the APIs a backend may be narrowed to (`apis`), by the name of their routes' family
API_NAMES = ("chat", "responses", "messages", "completions", "embeddings")


def _api_list(value: object) -> tuple[str, ...]:
    """A backend's `apis`: a non-empty list of distinct API names."""
    if not isinstance(value, list | tuple) or not value:
        raise Invalid(f"must be a non-empty list of {', '.join(API_NAMES)}, "
                      f"got {type_name(value)}")
    for index, entry in enumerate(value):
        if entry not in API_NAMES:
            raise Invalid(f"entry [{index}] must be one of {', '.join(API_NAMES)}, "
                          f"got {show(entry)}")
    if len(set(value)) != len(value):
        raise Invalid("names an API twice")
    return tuple(str(entry) for entry in value)


apis = Parser(_api_list, {"type": "array", "minItems": 1, "uniqueItems": True,
                          "items": {"enum": list(API_NAMES)}})
#: browser origins (`scheme://host[:port]`), compared lowercase as browsers send them
origins = Parser(lambda value: _strings(value, "origin", _ORIGIN, "https://app.example.com"),
                 {"type": "array", "items": {"type": "string", "pattern": "^https?://"}})
#: host names (without a port) a `Host` header may name
host_names = Parser(lambda value: _strings(value, "host name", _HOST_NAME, "gateway.internal"),
                    {"type": "array", "items": {"type": "string", "minLength": 1}})
_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,200}")


def _name(value: object) -> str:
    """Pool and backend names: pool names are what clients send as `model` and appear in
    URLs, logs and metric labels, so keep them to a charset that is safe everywhere."""
    result = _text(value)
    if not _NAME.fullmatch(result):
        raise Invalid(f"must be 1-200 characters of A-Z a-z 0-9 . _ : / -, got {show(value)}")
    if ".." in result or result.startswith("/"):
        raise Invalid(f"must not contain '..' or start with '/', got {show(value)}")
    return result


name = Parser(_name, or_env({"type": "string",
                              "pattern": r"^(?!/)(?!.*\.\.)[A-Za-z0-9._:/-]{1,200}$"}))


def _http_url(value: object) -> str:
    """An upstream base URL. The value is never echoed: it may carry a password."""
    result = _text(value).strip()
    if any(char.isspace() or not char.isprintable() for char in result):
        raise Invalid("must not contain spaces or control characters")
    try:
        parts = urlsplit(result)
    except ValueError:  # its message repeats the host
        raise Invalid("is not a valid URL (check the host, and its [brackets] for IPv6)"
                      ) from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise Invalid("must be an http(s) URL such as http://10.0.0.5:8000/v1")
    if "@" in parts.netloc:
        raise Invalid("must not contain credentials (user:pass@); put the key in api_key")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when asked
    except ValueError:
        raise Invalid("has an invalid port") from None
    if not parts.hostname:
        raise Invalid("must name a host")
    if parts.query or parts.fragment:
        raise Invalid("must not have a query or fragment; paths are appended to it")
    return result.rstrip("/")


http_url = Parser(_http_url, or_env({"type": "string", "pattern": "^https?://[^@?#]+$"}),
                  "URL")
