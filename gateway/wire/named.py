"""The relay's per-event rule for protocols with named events (Responses API, Messages).

The relay (`gateway.hedge.relay`) passes chat streams through until `[DONE]`. The Responses API and
Anthropic's
Messages API have no `[DONE]`: each event is named (`event: response.completed`,
`event: message_stop`) and the stream ends at one of a few names. Per event this costs one
frozenset lookup of the name and one concatenation; the payload is never parsed. An upstream
that omits the `event:` line (some compatible servers) is read by a bounded regex on the head
of its payload's `type` instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gateway.wire.base import RelayOutcome, StreamEnd, WireProtocol
from gateway.wire.sse import SSEEvent, encode_event
from gateway.wire.usage import read_usage

EncodeBatch = Callable[[list[SSEEvent], str, RelayOutcome], bytes]

#: `"type":"name"` near the start of a payload (both APIs put `type` first)
_TYPE = re.compile(rb'"type"\s*:\s*"([A-Za-z0-9_.]{1,80})"')
#: how far into a payload the fallback looks for its type
_TYPE_WINDOW = 256
#: event names that report a failure: relayed as they are, and the stream is over
ERROR_NAMES = frozenset({b"error", b"response.failed"})
#: the events that report token usage: read once each, by name, never per delta
USAGE_NAMES = frozenset({b"response.completed", b"message_start", b"message_delta"})


def event_name(event: SSEEvent) -> bytes | None:
    """The SSE event name, else the payload's leading `type`."""
    if event.event is not None:
        return event.event
    match = _TYPE.search(event.data, 0, _TYPE_WINDOW)
    return match.group(1) if match else None


def named_encoder(protocol: WireProtocol) -> EncodeBatch:
    """The relay's batch encoder for `protocol`: pass every event through (with its name),
    stop after an end event (`done`) or an error event (`upstream_error`)."""
    ends = protocol.ends

    def encode(batch: list[SSEEvent], request_id: str, outcome: RelayOutcome) -> bytes:
        parts: list[bytes] = []
        for event in batch:
            data, name = event.data, event.event
            if name is not None and b"\n" not in data:
                parts.append(b"event: " + name + b"\ndata: " + data + b"\n\n")
            else:
                parts.append(encode_event(data, name))
            kind = name if name is not None else event_name(event)
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
