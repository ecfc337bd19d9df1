"""Value parsers of a backend's upstream options: static headers and query parameters, an
egress proxy, a dated API version, a cloud region and project.

Like every parser of `gateway.settings.parse`, each pairs the function from a raw YAML value
with the JSON Schema of the values it accepts. Header and query values, and proxy URLs, may be
credentials: no message ever shows them.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from gateway.settings.parse import (
    Invalid,
    Parser,
    Schema,
    nonempty_text,
    or_env,
    show,
    text,
    type_name,
)

# --------------------------------------------------------------------------- upstream options
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}")
#: headers the HTTP client owns: a configured value would break framing or the routing
_RESERVED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection",
                               "content-type", "accept-encoding", "upgrade", "te"})


def _pairs(value: object, what: str, check_name: Callable[[str], None]) -> tuple[
        tuple[str, str], ...]:
    """A mapping of names to string values (numbers allowed: `api-version: 2024-10-21` may
    come out of YAML as a string either way), kept as ordered pairs so settings stay hashable.
    Values are never shown in a message: they may be credentials."""
    if isinstance(value, Mapping):
        items: tuple[object, ...] = tuple(value.items())
    elif isinstance(value, tuple):  # the parsed form, on settings built in code
        items = value
    else:
        raise Invalid(f"must be a mapping of {what} names to values, got {type_name(value)}")
    pairs: list[tuple[str, str]] = []
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise Invalid(f"must be a mapping of {what} names to values")
        key, inner = item
        if not isinstance(key, str):
            raise Invalid(f"{what} names must be strings, got {type_name(key)}")
        check_name(key)
        if isinstance(inner, datetime.date):  # YAML reads `2024-10-21` as a date
            inner = inner.isoformat()
        if isinstance(inner, bool) or not isinstance(inner, str | int | float):
            raise Invalid(f"{what} {key}: must be a string, got {type_name(inner)}")
        text_value = str(inner)
        if any(char in text_value for char in "\r\n\0"):
            raise Invalid(f"{what} {key}: must not contain line breaks")
        pairs.append((key, text_value))
    return tuple(pairs)


def _header_name(name: str) -> None:
    if not _HEADER_NAME.fullmatch(name):
        raise Invalid(f"{show(name)} is not a valid header name")
    if name.lower() in _RESERVED_HEADERS:
        raise Invalid(f"header {name} is set by the gateway and cannot be configured")


def _query_name(name: str) -> None:
    if not name or any(char.isspace() or char in "&=#" for char in name):
        raise Invalid(f"{show(name)} is not a valid query parameter name")


_MAP_SCHEMA: Schema = {"type": "object", "additionalProperties": {"type": ["string", "number"]}}
headers = Parser(lambda value: _pairs(value, "header", _header_name), _MAP_SCHEMA)
query = Parser(lambda value: _pairs(value, "query parameter", _query_name), _MAP_SCHEMA)


def _proxy_url(value: object) -> str:
    """An egress proxy: http(s), credentials allowed (corporate proxies ask for them), so the
    value is never echoed."""
    result = text(value).strip()
    try:
        parts = urlsplit(result)
    except ValueError:  # its message repeats the host
        raise Invalid("is not a valid URL (check the host, and its [brackets] for IPv6)"
                      ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Invalid("must be an http(s) URL such as http://proxy.internal:3128")
    if any(char.isspace() or not char.isprintable() for char in result):
        raise Invalid("must not contain spaces or control characters")
    return result


proxy_url = Parser(_proxy_url, or_env({"type": "string", "pattern": "^https?://"}))


def _version(value: object) -> str:
    """A dated version string (`2023-06-01`), which YAML reads as a date unless quoted."""
    return value.isoformat() if isinstance(value, datetime.date) else nonempty_text(value)


version = Parser(_version, {"type": "string", "minLength": 1})


# --------------------------------------------------------------------------- cloud locations
#: where a region or project lands in a URL (a host name, a path segment), so keep to the
#: characters the clouds use: `us-east-1`, `europe-west1`, `global`; `my-project-123`
_REGION = re.compile(r"[a-z][a-z0-9-]{0,49}")
_PROJECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]{0,99}")


def _located(pattern: re.Pattern[str], what: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        result = text(value).strip()
        if not pattern.fullmatch(result):
            raise Invalid(f"must be {what}, got {show(value)}")
        return result

    return parse


cloud_region = Parser(_located(_REGION, "a region such as us-east-1 or europe-west1"),
                      or_env({"type": "string", "pattern": f"^{_REGION.pattern}$"}))
cloud_project = Parser(_located(_PROJECT, "a project id such as my-project-123"),
                       or_env({"type": "string", "pattern": f"^{_PROJECT.pattern}$"}))
