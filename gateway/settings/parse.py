"""The machinery of the configuration loader: a mapping reader that records errors with key
paths, `${VAR}` substitution, and parsers for durations, sizes, bounded numbers, names and
upstream URLs.

Internal to `gateway.settings.load`, which holds the schema. Each parser takes one raw YAML value
and returns the typed value or raises `Invalid` with a message that says what is wrong;
`Section` adds the key path and collects the message, so that every problem of a file is
reported in one pass.

Messages never show a string that came from the environment (`Substituted`), and type errors
name the type only, so a misplaced key cannot leak through an error message.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    D = TypeVar("D", bound=DataclassInstance)

T = TypeVar("T")
Parser = Callable[[object], object]


class Invalid(Exception):
    """One value is wrong; the message says how, the caller prefixes the key path."""


class Substituted(str):
    """A string produced by `${VAR}` substitution: numeric fields may parse it, and error
    messages never show it (it may be a secret)."""


def join(path: str, key: object) -> str:
    """The key path of `key` inside the mapping at `path` ("" is the top level)."""
    return f"{path}.{key}" if path else str(key)


class Section:
    """One YAML mapping being read: typed values by key, problems recorded with key paths."""

    def __init__(self, node: object, path: str, keys: Sequence[str], errors: list[str]) -> None:
        self.path, self.errors = path, errors
        self._data: dict[object, object] = {}
        if isinstance(node, dict):
            self._data = node
        elif node is not None:
            errors.append(f"{path or '(top level)'}: must be a mapping, got {type_name(node)}")
        for key in self._data:
            if key not in keys:
                close = difflib.get_close_matches(str(key), keys, n=1)
                expected = ", ".join(keys)
                hint = f"did you mean {close[0]!r}?" if close else f"expected one of {expected}"
                errors.append(f"{self.at(key)}: unknown key; {hint}")

    def at(self, key: object) -> str:
        return join(self.path, key)

    def has(self, key: str) -> bool:
        return key in self._data

    def raw(self, key: str) -> object:
        return self._data.get(key)

    def error(self, key: str, message: str) -> None:
        self.errors.append(f"{self.at(key)}: {message}")

    def get(self, key: str, parse: Callable[[object], T], default: T) -> T:
        """The parsed value, or `default` when the key is absent or (after an error) invalid."""
        if key not in self._data:
            return default
        try:
            return parse(self._data[key])
        except Invalid as problem:
            self.error(key, str(problem))
            return default

    def require(self, key: str, parse: Callable[[object], T], fallback: T) -> T:
        if self.raw(key) is None:
            self.error(key, "required")
            return fallback
        return self.get(key, parse, fallback)

    def section(self, key: str, keys: Sequence[str]) -> Section:
        return Section(self.raw(key), self.at(key), keys, self.errors)

    def fill(self, defaults: D, parsers: Mapping[str, Parser],
             renames: Mapping[str, str] | None = None) -> D:
        """`defaults` with every key of `parsers` that is present replaced by its parsed
        value; `renames` maps YAML keys to dataclass fields where they differ."""
        renames = renames or {}
        values: dict[str, Any] = {}
        for key, parse in parsers.items():
            field = renames.get(key, key)
            values[field] = self.get(key, parse, getattr(defaults, field))
        return dataclasses.replace(defaults, **values)

    def sub(self, key: str, defaults: D, parsers: Mapping[str, Parser],
            renames: Mapping[str, str] | None = None) -> D:
        return self.section(key, tuple(parsers)).fill(defaults, parsers, renames)

    def items(self, key: str, what: str) -> list[tuple[str, object]]:
        """The entries of a required, non-empty list, each with its key path."""
        value = self.raw(key)
        if value is None:
            self.error(key, f"required; list at least one {what}")
        elif not isinstance(value, list):
            self.error(key, f"must be a list of {what}s, got {type_name(value)}")
        elif not value:
            self.error(key, f"must list at least one {what}")
        else:
            return [(f"{self.at(key)}[{index}]", item) for index, item in enumerate(value)]
        return []


# --------------------------------------------------------------------------- ${VAR}

_REFERENCE = re.compile(r"\$\$\{|\$\{([^{}]*)\}|\$\{")
_REFERENCE_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def substitute(node: object, path: str, env: Mapping[str, str], errors: list[str]) -> object:
    """Return a copy of the YAML tree with `${...}` replaced in every string value."""
    if isinstance(node, dict):
        return {k: substitute(v, join(path, k), env, errors) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute(v, f"{path}[{i}]", env, errors) for i, v in enumerate(node)]
    if not isinstance(node, str) or "${" not in node:
        return node
    replaced = False

    def replace(match: re.Match[str]) -> str:
        nonlocal replaced
        if match.group(0) == "$${":
            return "${"
        body = match.group(1)
        parsed = _REFERENCE_BODY.fullmatch(body) if body is not None else None
        if parsed is None:
            errors.append(f"{path}: malformed reference {match.group(0)!r}; use ${{NAME}}")
            return ""
        replaced = True
        variable, default = parsed.group(1), parsed.group(2)
        value = env.get(variable)
        if default is not None:
            return value if value else default
        if value is None:
            errors.append(f"{path}: environment variable {variable} is not set")
            return ""
        return value

    result = _REFERENCE.sub(replace, node)
    return Substituted(result) if replaced else result


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


def duration(*, zero: bool = False) -> Callable[[object], float]:
    what = "a duration like 50ms, 2s, 1.5s or 10m"

    def parse(value: object) -> float:
        amount, unit = _decimal(value, _DURATION, what)
        seconds = float(amount * _DURATION_SCALE[unit or "s"])
        if seconds < 0 or (seconds == 0 and not zero):
            raise Invalid(f"must be {'>= 0' if zero else '> 0'}, got {show(value)}")
        return seconds

    return parse


def size(value: object) -> int:
    amount, unit = _decimal(value, _SIZE, "a size like 4MiB, 512KiB or 4194304")
    scaled = amount * _SIZE_SCALE[unit or "b"]
    if scaled != scaled.to_integral_value() or scaled < 1:
        raise Invalid(f"must be a whole number of bytes >= 1, got {show(value)}")
    return int(scaled)


def integer(low: int, high: int | None = None) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, Substituted) and re.fullmatch(r"\s*-?\d+\s*", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid(f"must be an integer, got {type_name(value)}")
        if value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f">= {low}"
            raise Invalid(f"must be {bounds}, got {show(value)}")
        return value

    return parse


def number(low: float, high: float | None = None, *, open_low: bool = False,
            open_high: bool = False) -> Callable[[object], float]:
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

    return parse


def boolean(value: object) -> bool:
    if isinstance(value, Substituted) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false, got {type_name(value)}")
    return value


def text(value: object) -> str:
    if not isinstance(value, str):
        raise Invalid(f"must be a string, got {type_name(value)}")
    return str(value)


def nonempty_text(value: object) -> str:
    result = text(value)
    if not result.strip():
        raise Invalid("must not be empty")
    return result


def optional(parse: Callable[[object], T]) -> Callable[[object], T | None]:
    return lambda value: None if value is None else parse(value)


def choice(options: tuple[T, ...]) -> Callable[[object], T]:
    def parse(value: object) -> T:
        if value not in options:
            listed = ", ".join(str(option) for option in options)
            raise Invalid(f"must be one of {listed}, got {show(value)}")
        return value  # mypy narrows `object` to T through the membership test

    return parse


_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,200}")


def name(value: object) -> str:
    """Pool and backend names: pool names are what clients send as `model` and appear in
    URLs, logs and metric labels, so keep them to a charset that is safe everywhere."""
    result = text(value)
    if not _NAME.fullmatch(result):
        raise Invalid(f"must be 1-200 characters of A-Z a-z 0-9 . _ : / -, got {show(value)}")
    if ".." in result or result.startswith("/"):
        raise Invalid(f"must not contain '..' or start with '/', got {show(value)}")
    return result


def http_url(value: object) -> str:
    """An upstream base URL. The value is never echoed: it may carry a password."""
    result = text(value).strip()
    if any(char.isspace() or not char.isprintable() for char in result):
        raise Invalid("must not contain spaces or control characters")
    parts = urlsplit(result)
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
