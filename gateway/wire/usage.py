"""Token usage: read it from the winning stream, ask the upstream for it. Pure.

Chat streams carry usage only when the request says `stream_options.include_usage`; the gateway
asks for it on every streaming chat request, and when the client did not ask itself the relay
drops that final usage-only chunk (`choices: []`) from the client's stream, so the client sees
exactly the stream it asked for.

The relay calls `read_usage` only for an event that passed the byte test `b'"usage"' in data`,
and `read_usage` parses JSON only when `"usage"` is followed by an object: OpenAI sends
`"usage":null` in every chunk once usage is asked for, and those must stay a few byte
comparisons, not a parse per event.

Shapes read (`usage_of`): OpenAI chat and legacy completions (`usage.prompt_tokens`,
`usage.completion_tokens`), the Responses API (`response.usage.input_tokens`/`output_tokens`
in `response.completed` or `response.incomplete`) and Anthropic Messages (`message.usage` in
`message_start`, `usage.output_tokens` in `message_delta`).

Cached input, as each API reports its prompt cache: chat's
`usage.prompt_tokens_details.cached_tokens` and the Responses API's
`usage.input_tokens_details.cached_tokens` (both part of the input count), Anthropic's
`cache_read_input_tokens` and `cache_creation_input_tokens` (both *beside* its
`input_tokens`, which counts only the input after the last cache breakpoint: here they are
added in, so `input` is every input token whatever the API). `cached` is None when the
upstream said nothing about its cache, so that a hit rate is taken only over the requests
whose upstream reports one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_KEY = b'"usage"'
_SPACE = b" \t\r\n"


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens one logical request paid for on its winning attempt."""

    #: every input token, cached or not
    input: int
    output: int
    #: of `input`, read from the upstream's prompt cache (None: the upstream did not say)
    cached: int | None = None
    #: of `input`, written to the prompt cache (Anthropic's cache creation; None: not said)
    cache_write: int | None = None

    def merge(self, later: Usage | None) -> Usage:
        """Combine two reports of one stream: Anthropic sends input tokens in `message_start`
        and output tokens in `message_delta`; counts only grow, so the larger one is right."""
        if later is None:
            return self
        return Usage(max(self.input, later.input), max(self.output, later.output),
                     _larger(self.cached, later.cached),
                     _larger(self.cache_write, later.cache_write))


def _larger(a: int | None, b: int | None) -> int | None:
    if a is None or b is None:
        return b if a is None else a
    return max(a, b)


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


#: Anthropic's cache counts, reported beside (not within) its `input_tokens`
_CACHE_READ, _CACHE_WRITE = "cache_read_input_tokens", "cache_creation_input_tokens"


def _pair(usage: object, names: tuple[str, str]) -> Usage | None:
    if not isinstance(usage, Mapping):
        return None
    counts = [_count(usage.get(name)) for name in names]
    if counts[0] is None and counts[1] is None:
        return None
    read, write = _count(usage.get(_CACHE_READ)), _count(usage.get(_CACHE_WRITE))
    if read is not None or write is not None:  # Anthropic: the cache counts come on top
        return Usage((counts[0] or 0) + (read or 0) + (write or 0), counts[1] or 0, read, write)
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return Usage(counts[0] or 0, counts[1] or 0, cached)


def usage_of(payload: object) -> Usage | None:
    """The usage a response body or event carries, in any of the shapes above, or None."""
    if not isinstance(payload, Mapping):
        return None
    usage = payload.get("usage")
    found = _pair(usage, ("prompt_tokens", "completion_tokens"))
    if found is None:
        found = _pair(usage, ("input_tokens", "output_tokens"))
    if found is None:
        for inner in ("response", "message"):
            nested = payload.get(inner)
            if isinstance(nested, Mapping):
                found = _pair(nested.get("usage"), ("input_tokens", "output_tokens"))
                if found is not None:
                    break
    return found


def _object_follows(data: bytes) -> bool:
    """Whether the first `"usage"` key in `data` has an object value (not `null`)."""
    at = data.find(_KEY)
    if at < 0:
        return False
    rest = data[at + len(_KEY):at + len(_KEY) + 16].lstrip(_SPACE)
    return rest[:1] == b":" and rest[1:].lstrip(_SPACE)[:1] == b"{"


def read_usage(data: bytes) -> tuple[Usage, bool] | None:
    """For an event holding a usage object: its usage, and whether the event is usage only
    (no choice in it: safe to drop when the client did not ask for usage). None otherwise."""
    if not _object_follows(data):
        return None
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return None
    usage = usage_of(payload)
    if usage is None:
        return None
    return usage, not payload.get("choices")


def body_usage(body: bytes) -> Usage | None:
    """The usage of a whole (non-streaming) JSON response body, or None."""
    if _KEY not in body:
        return None
    try:
        return usage_of(json.loads(body))
    except (ValueError, RecursionError):
        return None


def ask_for_usage(
    endpoint: str, stream: bool, body: Mapping[str, Any]
) -> tuple[Mapping[str, Any], bool]:
    """The body to send upstream and whether the relay must drop the usage chunk.

    A streaming chat request that did not ask for usage gets
    `stream_options.include_usage: true` added (its other stream options kept)."""
    if not stream or endpoint != "chat/completions":
        return body, False
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage") is True:
        return body, False
    kept = dict(options) if isinstance(options, Mapping) else {}
    return {**body, "stream_options": {**kept, "include_usage": True}}, True
