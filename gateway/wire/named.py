"""The relay's per-event rule for protocols with named events (Responses API, Messages).

The relay (`gateway.hedge.relay`) passes chat streams through until `[DONE]`. The Responses
API and Anthropic's Messages API have no `[DONE]`: each event is named
(`event: response.completed`, `event: message_stop`) and the stream ends at one of a few names.
Per event this costs one frozenset lookup of the name and one concatenation; the payload is
never parsed. An upstream that omits the `event:` line (some compatible servers) is read by its
payload's top-level `type`: first by an anchored match of a payload that starts with it (both
APIs put `type` first), and only when that misses, by a byte search for the few names the relay
acts on (the ends, the errors, the usage events); a payload that mentions one of them is parsed
once to read its real `type`, so key order never hides an end (a missed end read as a cut
stream) and a nested `type` never fakes one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from gateway.wire.base import Encoder, RelayOutcome, Rewrite, StreamEnd, WireProtocol
from gateway.wire.sse import SSEEvent, encode_event
from gateway.wire.usage import read_usage

EncodeBatch = Callable[[list[SSEEvent], str, RelayOutcome], bytes]

#: a payload that opens with its `type` (`{"type":"name"`): the top-level type, certainly
_LEADING_TYPE = re.compile(rb'\s*\{\s*"type"\s*:\s*"([A-Za-z0-9_.]{1,80})"')
#: event names that report a failure: relayed as they are, and the stream is over
ERROR_NAMES = frozenset({b"error", b"response.failed"})
#: the events that report token usage: read once each, by name, never per delta
USAGE_NAMES = frozenset({b"response.completed", b"response.incomplete", b"message_start",
                         b"message_delta"})
#: every name the relay acts on, in both APIs (the fallback's default)
WATCHED = ERROR_NAMES | USAGE_NAMES | frozenset(
    {b"response.completed", b"response.incomplete", b"message_stop"})


def _needles(names: frozenset[bytes]) -> tuple[bytes, ...]:
    """Each name as it appears as a JSON string value: `"name"`."""
    return tuple(b'"' + name + b'"' for name in sorted(names))


_WATCHED_NEEDLES = _needles(WATCHED)


def event_name(event: SSEEvent, needles: tuple[bytes, ...] = _WATCHED_NEEDLES) -> bytes | None:
    """The SSE event name, else the payload's top-level `type` when it leads the payload, else
    (a payload with its keys in another order) its `type` if the payload mentions one of the
    `needles` (quoted names); None when there is none or it matters to no one."""
    if event.event is not None:
        return event.event
    data = event.data
    match = _LEADING_TYPE.match(data)
    if match is not None:
        return match.group(1)
    for needle in needles:
        if data.find(needle) >= 0:  # not `needle in data`: see `gateway.wire.sse.encode_event`
            return _top_level_type(data)
    return None


def _top_level_type(data: bytes) -> bytes | None:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    kind = obj.get("type") if isinstance(obj, dict) else None
    return kind.encode() if isinstance(kind, str) and kind else None


def named_encoder(protocol: WireProtocol, rewrite: Rewrite | None = None) -> EncodeBatch:
    """The relay's batch encoder for `protocol`: pass every event through (with its name),
    stop after an end event (`done`) or an error event (`upstream_error`).

    `rewrite`: (the events it applies to, a payload -> payload function), for the few events
    a request must change (the Responses API's response id in the events that carry the
    response object); every other event costs one set lookup more."""
    ends = protocol.ends
    rewritten, change = rewrite if rewrite is not None else (frozenset(), None)
    needles = _needles(ends | ERROR_NAMES | USAGE_NAMES | rewritten)

    def encode(batch: list[SSEEvent], request_id: str, outcome: RelayOutcome) -> bytes:
        parts: list[bytes] = []
        for event in batch:
            data, name = event.data, event.event
            kind = name if name is not None else event_name(event, needles)
            if change is not None and kind in rewritten:
                data = change(data)
            if name is not None and 10 not in data:
                parts.append(b"event: " + name + b"\ndata: " + data + b"\n\n")
            else:
                parts.append(encode_event(data, name))
            if kind in USAGE_NAMES and (found := read_usage(data)) is not None:
                outcome.usage = found[0].merge(outcome.usage)
            if kind in ERROR_NAMES:
                outcome.end = StreamEnd.UPSTREAM_ERROR
                break
            if kind in ends:
                outcome.end = StreamEnd.DONE
                break
        return b"".join(parts)

    return encode


def named_relay_encoder(protocol: WireProtocol, rewrite: Rewrite | None = None) -> Encoder:
    """The named-event protocols' `WireProtocol.encoder`: every read re-framed by event."""
    return Encoder(named_encoder(protocol, rewrite))
