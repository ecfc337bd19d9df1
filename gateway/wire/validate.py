"""Request body checks before anything is sent upstream (pure).

The gateway forwards bodies as received, so it must refuse what could steer a request to
another destination or credential and what no upstream should be asked to parse.
Message content is data: nothing inside `messages`/`prompt`/`input` is inspected.

Every check is linear in the body's bytes and bounded in memory. Before the JSON is turned
into objects, a pass over the bytes (`count_values`) bounds its number of values, so a
hostile body within the size limit cannot build a hundred megabytes of small objects. Its
nesting is checked on the parsed objects (`_too_deep`, walked only when the body has more
brackets than the depth limit), which that count keeps small, so nothing deeper than the
encoder that forwards it can go is forwarded; nesting deeper than the parser itself goes
is refused the same way. The routing-field scan builds a field's path only when it refuses
it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import ForbiddenField, InvalidJSON, InvalidRequest

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
#: what falls between those words
_NOT_WORD = re.compile(r"[^A-Za-z0-9]+")
_LONGEST_FIELD = max(map(len, METADATA_FIELDS))
_LONGEST_PREFIX = max(map(len, METADATA_PREFIXES))
#: guards the scan of `extra_body` and `metadata` against hostile nesting
MAX_SCAN_DEPTH = 32
#: the deepest nesting of arrays and objects a body may have (the encoder that forwards it
#: recurses once per level, and hundreds of levels are nobody's request)
MAX_BODY_DEPTH = 64
#: the most values (objects, arrays, strings, numbers, literals) a body may hold, counted as
#: separators plus opening brackets (an empty object or array counts twice): each small
#: object costs about 60 bytes of Python per 3 bytes of JSON, so this bounds what a body
#: within the size limit can build
MAX_BODY_VALUES = 100_000
#: a JSON string (possessive: never backtracks), which may hold brackets and commas; one
#: left open runs to the end of the body (a lone backslash included), so a match that starts
#: never fails: a failing one would be tried again from each quote inside it, each time to the
#: end, which is quadratic in a body of escaped quotes (`"\"\"\"...`). Such a body is not
#: JSON, and the parser refuses it where the string opens
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
_MAX_STRINGS = 2 * MAX_BODY_VALUES + 2
_TOO_DEEP = f"request body is nested too deeply (more than {MAX_BODY_DEPTH} levels)"

POSITIVE_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "best_of")
#: fields every API that has them reads as a list, an object or text, and that a translation
#: to another API iterates or looks into: a value of another type (`"messages": 5`) is
#: refused here, naming the field, before the race, rather than left to fail inside a
#: translation made when an attempt goes to a backend of another API. `null` passes (it is
#: the field left out). One `isinstance` per field present; the items of `messages` and
#: `tools` are checked to be objects (one `isinstance` each), nothing deeper.
_LIST, _OBJECT, _TEXT = (list,), (dict,), (str,)
FIELD_SHAPES: Mapping[str, tuple[tuple[type, ...], str]] = {
    "messages": (_LIST, "an array of objects"),
    "tools": (_LIST, "an array of objects"),
    "input": (_TEXT + _LIST, "a string or an array"),
    "prompt": (_TEXT + _LIST, "a string or an array"),
    "system": (_TEXT + _LIST, "a string or an array"),
    "stop": (_TEXT + _LIST, "a string or an array"),
    "stop_sequences": (_LIST, "an array"),
    "instructions": (_TEXT, "a string"),
    "metadata": (_OBJECT, "an object"),
    "reasoning": (_OBJECT, "an object"),
    "text": (_OBJECT, "an object"),
    "response_format": (_OBJECT, "an object"),
}
#: of those, the arrays whose every item must be an object
_OBJECT_ITEMS = ("messages", "tools")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """A number too large for a float (`1e400`) would parse as infinity and be forwarded
    upstream as `Infinity`, which is not JSON: refuse it like the literal."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def count_values(raw: bytes) -> tuple[int, int]:
    """(an upper bound on the values of the JSON text `raw`, the bytes examined), in linear
    time and without building any of it: every value but the first of each array or object
    follows a comma, and every array or object opens a bracket. Counted first over the raw
    bytes, where commas and brackets inside strings (data) make the count too high; only if
    that is past the limit are the strings cut out and the count taken again, exactly for
    valid JSON (for invalid JSON it can be off, but the parser refuses such a body anyway)."""
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
    if values <= MAX_BODY_VALUES:
        return values, len(raw)
    # every string is a value or a key, and an object has no more keys than values: past
    # twice the limit of strings the body has too many values, whatever they are
    structure, strings = _JSON_STRING.subn(b"", raw, count=_MAX_STRINGS)
    work = 2 * len(raw) + len(structure)
    if strings >= _MAX_STRINGS:
        return MAX_BODY_VALUES + 1, work
    return structure.count(b",") + structure.count(b"[") + structure.count(b"{") + 1, work


def _too_deep(body: dict[str, Any], limit: int) -> tuple[bool, int]:
    """(whether arrays and objects nest deeper than `limit` in `body`, containers visited)."""
    work = 0
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(body, 1)]
    while stack:
        item, depth = stack.pop()
        work += 1
        if depth > limit:
            return True, work
        inner: Iterable[object] = item.values() if isinstance(item, dict) else item
        for value in inner:
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1))
    return False, work


def parse_body_counted(raw: bytes) -> tuple[dict[str, Any], int]:
    """`parse_body`, and the work its checks did around the parser (bytes examined plus
    containers visited), which is linear in the body."""
    values, work = count_values(raw)
    if values > MAX_BODY_VALUES:
        raise InvalidRequest(f"request body has too many values (more than {MAX_BODY_VALUES})")
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError:
        raise InvalidJSON("request body is not valid UTF-8") from None
    except RecursionError:  # deeper than the parser goes, yet within the size limit
        raise InvalidRequest(_TOO_DEEP) from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidJSON("request body must be a JSON object")
    # fewer brackets than the limit cannot nest deeper: most bodies skip the walk
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH:
        deep, visited = _too_deep(body, MAX_BODY_DEPTH)
        work += visited
        if deep:
            raise InvalidRequest(_TOO_DEEP)
    return body, work


def parse_body(raw: bytes) -> dict[str, Any]:
    """Strict JSON object: UTF-8, no NaN/Infinity (literal or by overflow), an object at the
    top, at most `MAX_BODY_VALUES` values (counted before parsing, so a hostile body cannot
    build more) and at most `MAX_BODY_DEPTH` levels deep (what the encoder that forwards it
    can take)."""
    return parse_body_counted(raw)[0]


def is_routing_field(key: str) -> bool:
    return key.replace("_", "").replace("-", "").lower() in _ROUTING_NORMALIZED


def is_metadata_routing_field(key: str) -> bool:
    """A destination or credential name inside `metadata`, in any case or separator. The
    check reads the key's first word and the key without its separators (every ASCII letter
    and digit is in some word), never the list of its words: a key of millions of one-letter
    words would hold them all at once."""
    first = _WORDS.search(key)
    if first is None:
        return False
    short = first.end() - first.start() <= _LONGEST_PREFIX
    if short and first.group().lower() in METADATA_PREFIXES:
        return True
    letters = _NOT_WORD.sub("", key)
    return len(letters) <= _LONGEST_FIELD and letters.lower() in METADATA_FIELDS


def is_top_level_routing_field(key: str) -> bool:
    """Refused at the top level and in `extra_body` (whose fields SDKs merge into the top
    level): the strict names, and every name refused inside `metadata` too."""
    return is_routing_field(key) or is_metadata_routing_field(key)


#: the top-level fields of the APIs' own requests, none of which the rule above refuses (the
#: set is that rule's answer for them, taken once at import): a body's usual fields skip the
#: rule's string work, which was a fifth of the checks of a small request. Any other name is
#: judged by the rule as before.
_PLAIN_TOP_LEVEL = frozenset(name for name in (
    *FIELD_SHAPES, *POSITIVE_INT_FIELDS, "model", "stream", "stream_options", "temperature",
    "top_p", "top_k", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "seed", "user", "tool_choice", "parallel_tool_calls", "reasoning_effort",
    "store", "previous_response_id", "thinking", "suffix", "echo", "modalities", "audio",
    "prediction", "service_tier", "include", "truncation", "max_output_tokens",
    "encoding_format", "dimensions",
) if not is_top_level_routing_field(name))


#: a path into the body, built only when a field is refused: (parent, key or index)
_Path = tuple[Any, str | int] | None


def _path_text(path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        parent, part = path
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(part if parent is None else f".{part}")
        path = parent
    return "".join(reversed(parts))


def _scan(value: object, root: str, refused: Callable[[str], bool], tally: list[int]) -> None:
    """Refuse the first key `refused` names at any depth of `value` (at most
    `MAX_SCAN_DEPTH`); add the work done (values visited plus characters of keys examined)
    to `tally[0]`, however the scan ends. It is linear in the body: no path is built unless
    it is answered. Parsed JSON holds only dicts and lists (`isinstance` against them is
    several times cheaper than against `Mapping`)."""
    work = 0
    stack: list[tuple[object, _Path, int]] = [(value, (None, root), 0)]
    try:
        while stack:
            item, path, depth = stack.pop()
            work += 1
            if depth > MAX_SCAN_DEPTH:
                where = _path_text(path)
                raise InvalidRequest(f"{where} is nested too deeply", param=where)
            if isinstance(item, dict):
                for key, inner in item.items():
                    work += len(key)
                    if refused(key):
                        where = _path_text((path, key))
                        raise ForbiddenField(
                            f"field {where!r} may not choose a destination or credential",
                            param=where)
                    if isinstance(inner, (dict, list)):
                        if inner:  # an empty one holds no key
                            stack.append((inner, (path, key), depth + 1))
                    else:
                        work += 1
            elif isinstance(item, list):
                for i, inner in enumerate(item):
                    if isinstance(inner, (dict, list)):
                        if inner:
                            stack.append((inner, (path, i), depth + 1))
                    else:
                        work += 1
    finally:
        tally[0] += work


def _scan_nested(body: Mapping[str, Any], tally: list[int]) -> None:
    for key in NESTED_SCANNED:
        if key in body:
            _scan(body[key], key, is_top_level_routing_field, tally)
    if "metadata" in body:
        _scan(body["metadata"], "metadata", is_metadata_routing_field, tally)


def scan_work(body: Mapping[str, Any]) -> int:
    """The work of the routing-field scan `check_body` runs on `body`, up to its refusal if
    it refuses a field (for tests: it is linear in the body)."""
    tally = [len(body)]
    with contextlib.suppress(InvalidRequest):
        _scan_nested(body, tally)
    return tally[0]


@dataclass(frozen=True, slots=True)
class Validated:
    """A body parsed, and what its shape's checks found (`validated`)."""

    body: dict[str, Any]
    #: the body's model and whether it streams (empty and False when `refused`)
    model: str
    stream: bool
    #: the shape's refusal, handed back rather than raised: the route notes the body's model
    #: for the request's log line first, then raises it (a body that does not parse has no
    #: model to note, and that refusal is raised here)
    refused: InvalidRequest | None


def validated(raw: bytes, *, needs_prompt: str | None) -> Validated:
    """The body's checks in one call: parsed (`parse_body`: raises its refusal), then its
    shape checked (`check_body`: its refusal handed back as `Validated.refused`)."""
    body = parse_body(raw)
    try:
        model, stream = check_body(body, needs_prompt=needs_prompt)
    except InvalidRequest as exc:
        return Validated(body, "", False, exc)
    return Validated(body, model, stream, None)


def check_body(body: Mapping[str, Any], *, needs_prompt: str | None) -> tuple[str, bool]:
    """Validate the fields the gateway relies on; return (model, stream)."""
    for key in body:
        if key not in _PLAIN_TOP_LEVEL and is_top_level_routing_field(key):
            raise ForbiddenField(
                f"field {key!r} may not choose a destination or credential", param=key
            )
    _scan_nested(body, [0])
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
    _check_shapes(body)
    return model, stream


def _check_shapes(body: Mapping[str, Any]) -> None:
    """Refuse a field of `FIELD_SHAPES` of another type, or an item of `messages`/`tools`
    that is not an object, naming it (`messages[2]`)."""
    for key, (types, what) in FIELD_SHAPES.items():
        value = body.get(key)
        if value is not None and not isinstance(value, types):
            raise InvalidRequest(f"'{key}' must be {what}", param=key)
    for key in _OBJECT_ITEMS:
        for i, item in enumerate(body.get(key) or ()):
            if not isinstance(item, dict):
                raise InvalidRequest(f"'{key}[{i}]' must be an object", param=f"{key}[{i}]")
