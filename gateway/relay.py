"""After commit: the winner's buffered events, then pass-through until `[DONE]` (SPEC §4).

The hot path of the gateway. Per event it does one bytes comparison, one substring test and one
concatenation: no JSON parsing (except for the rare event that mentions "error"), no logging,
no allocation beyond the output bytes. Upstream `id:`/`retry:` fields and comments were already
dropped by the decoder; keep-alive comments are the response's own.

A stream that ends without `[DONE]` and without an error event is a truncation: the client gets
a final error event in OpenAI shape, never a silent success.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

from gateway.attempt import Prefix
from gateway.errors import UpstreamError
from gateway.sse import SSEEvent, encode_event

StreamEnd = Literal["done", "upstream_error", "truncated", "failed", "too_long", "client_gone"]

DONE = b"data: [DONE]\n\n"
#: after `[DONE]`, how long and how many events the relay reads to let the connection be reused
DRAIN_TIMEOUT = 0.05
DRAIN_READS = 8


def error_event(message: str, code: str, request_id: str) -> bytes:
    """A final in-stream error in OpenAI shape; the SDKs raise it as an APIError."""
    payload = {
        "error": {
            "message": f"{message} (request id {request_id})",
            "type": "upstream_error",
            "param": None,
            "code": code,
        }
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error_kind(event: SSEEvent) -> int:
    """0: not an error; 1: an error event in OpenAI shape; 2: an error in another shape.

    Called only when the cheap byte test in the relay says the event may be an error."""
    try:
        payload = json.loads(event.data)
    except (ValueError, RecursionError):  # not JSON, or hostile nesting: not an error event
        payload = None
    shaped = isinstance(payload, dict) and isinstance(payload.get("error"), dict)
    if shaped:
        return 1
    if event.event == b"error" or (isinstance(payload, dict) and payload.get("error")):
        return 2
    return 0


def _encode(event: SSEEvent) -> bytes:
    data = event.data
    if event.event is None and b"\n" not in data and b"\r" not in data:
        return b"data: " + data + b"\n\n"
    return encode_event(data, event.event)


async def _drain(batches: AsyncIterator[list[SSEEvent]]) -> None:
    """Read the rest of a finished stream (normally just the body's terminator), briefly.

    A response closed before its body ended cannot go back to the connection pool, so without
    this every request would pay for a new upstream connection. Bounded in time and reads:
    an upstream that keeps talking after `[DONE]` is simply dropped."""
    with contextlib.suppress(TimeoutError, UpstreamError):
        async with asyncio.timeout(DRAIN_TIMEOUT):
            left = DRAIN_READS
            async for _ in batches:
                left -= 1
                if not left:
                    return


@dataclass(slots=True)
class RelayOutcome:
    end: StreamEnd = "client_gone"


def _encode_batch(batch: list[SSEEvent], request_id: str, outcome: RelayOutcome) -> bytes:
    """The client's bytes for one upstream read; sets `outcome.end` when the stream is over."""
    parts: list[bytes] = []
    for event in batch:
        data = event.data
        if data == b"[DONE]":
            outcome.end = "done"
            parts.append(DONE)
            break
        if (event.event is not None or b'"error"' in data) and (kind := _error_kind(event)):
            # relayed as is when the SDKs can read it; otherwise our own error event, so
            # the client raises an API error instead of failing to parse the upstream's
            outcome.end = "upstream_error"
            parts.append(
                _encode(event)
                if kind == 1
                else error_event("upstream reported an error", "upstream_error", request_id)
            )
            break
        if b"\n" in data or b"\r" in data:
            parts.append(encode_event(data, None))
        else:
            parts.append(b"data: " + data + b"\n\n")
    return b"".join(parts)


async def relay(
    prefix: Prefix,
    *,
    request_id: str,
    max_stream_deadline: float,
    clock: Callable[[], float],
    outcome: RelayOutcome,
    encode_batch: Callable[[list[SSEEvent], str, RelayOutcome], bytes] | None = None,
    error_event: Callable[[str, str, str], bytes] = error_event,
) -> AsyncIterator[bytes]:
    """Yield the client's SSE bytes, one chunk per upstream read. Always closes the upstream.

    `encode_batch` and `error_event` are the protocol's (SPEC §15: the Responses API and
    Messages end at named events, not `[DONE]`, and shape their errors their own way); the
    defaults are the chat rules."""
    encode = _encode_batch if encode_batch is None else encode_batch
    try:
        yield encode(prefix.buffered, request_id, outcome)
        if outcome.end == "client_gone":
            async for batch in prefix.batches:
                yield encode(batch, request_id, outcome)
                if outcome.end != "client_gone":
                    break
                if clock() > max_stream_deadline:
                    outcome.end = "too_long"
                    yield error_event(
                        "stream exceeded the maximum duration", "stream_timeout", request_id
                    )
                    return
            else:
                outcome.end = "truncated"
                yield error_event(
                    "upstream stream ended before completion", "stream_truncated", request_id
                )
                return
        if outcome.end == "done":
            await _drain(prefix.batches)
    except UpstreamError as exc:
        outcome.end = "failed"
        yield error_event(
            f"upstream failed mid-stream: {exc.reason}", "upstream_failed", request_id
        )
    finally:
        await prefix.aclose()
