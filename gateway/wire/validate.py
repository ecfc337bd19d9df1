"""Request body checks before anything is sent upstream (pure).

The gateway forwards bodies as received, so it must refuse what could steer a request to
another destination or credential and what no upstream should be asked to parse.
Message content is data: nothing inside `messages`/`prompt`/`input` is inspected.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from gateway.errors import ForbiddenField, InvalidRequest

#: keys that choose a destination or a credential, refused at the top level and at any depth
#: inside `extra_body`
ROUTING_FIELDS = frozenset(
    {"api_base", "base_url", "api_key", "api_version", "extra_headers", "headers", "url"}
)
#: the same names as compared: case, `_` and `-` ignored, so `baseURL`, `API-KEY` and
#: `extraHeaders` (spellings other SDKs and proxies accept) are refused too
_ROUTING_NORMALIZED = frozenset(name.replace("_", "") for name in ROUTING_FIELDS)
NESTED_SCANNED = ("extra_body",)
#: OpenAI's `metadata` is free-form (tags a client attaches, `url` and `headers` included): in
#: it only the names proxies use to pick a destination or credential are refused
METADATA_FIELDS = frozenset({"apibase", "baseurl", "apikey", "apiversion", "azureendpoint"})
#: ... and every name that starts with one of these words (`aws_region`, `vertexProject`)
METADATA_PREFIXES = ("aws", "vertex")
#: a key split into words at separators and camelCase humps: `AWSRegion` -> AWS, Region
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
#: guards the recursive scan against hostile nesting
MAX_SCAN_DEPTH = 32

POSITIVE_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "best_of")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """A number too large for a float (`1e400`) would parse as infinity and be forwarded
    upstream as `Infinity`, which is not JSON: refuse it like the literal."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_body(raw: bytes) -> dict[str, Any]:
    """Strict JSON object: UTF-8, no NaN/Infinity (literal or by overflow), an object at the
    top, nesting the parser can handle."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8") from None
    except RecursionError:  # hostile nesting (`[[[[...`) well within the size limit
        raise InvalidRequest("request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def is_routing_field(key: str) -> bool:
    return key.replace("_", "").replace("-", "").lower() in _ROUTING_NORMALIZED


def is_metadata_routing_field(key: str) -> bool:
    """A destination or credential name inside `metadata`, in any case or separator."""
    words = [word.lower() for word in _WORDS.findall(key)]
    return bool(words) and ("".join(words) in METADATA_FIELDS or words[0] in METADATA_PREFIXES)


def _scan(value: object, path: str, depth: int, refused: Callable[[str], bool]) -> None:
    if depth > MAX_SCAN_DEPTH:
        raise InvalidRequest(f"{path} is nested too deeply", param=path)
    if isinstance(value, Mapping):
        for key, inner in value.items():
            where = f"{path}.{key}"
            if refused(key):
                raise ForbiddenField(
                    f"field {where!r} may not choose a destination or credential", param=where
                )
            _scan(inner, where, depth + 1, refused)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            _scan(inner, f"{path}[{i}]", depth + 1, refused)


def check_body(body: Mapping[str, Any], *, needs_prompt: str | None) -> tuple[str, bool]:
    """Validate the fields the gateway relies on; return (model, stream)."""
    for key in body:
        if is_routing_field(key):
            raise ForbiddenField(
                f"field {key!r} may not choose a destination or credential", param=key
            )
    for key in NESTED_SCANNED:
        if key in body:
            _scan(body[key], key, 0, is_routing_field)
    if "metadata" in body:
        _scan(body["metadata"], "metadata", 0, is_metadata_routing_field)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    for key in POSITIVE_INT_FIELDS:
        value = body.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise InvalidRequest(f"'{key}' must be a positive integer", param=key)
    if needs_prompt is not None and needs_prompt not in body:
        raise InvalidRequest(f"'{needs_prompt}' is required", param=needs_prompt)
    return model, stream
