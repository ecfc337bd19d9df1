"""After commit: the winner's buffered events, then pass-through until `[DONE]`.

The hot path of the gateway. An upstream read made only of whole plain `data:` events
(`SSEBatch.raw`, the usual case) goes out as the bytes that arrived: a few substring scans of
the read for `[DONE]`, error markers and a usage object, nothing per event, no allocation. Any
other read (and every read of a named-event protocol, whose reads carry `event:` lines) is
re-framed from the decoder's events: per event one bytes comparison, two substring tests and one
concatenation, with JSON parsed only for the rare event that mentions "error" and the one holding
a usage object (see `gateway.wire.usage`). No logging, no lock. Per upstream read it stores one
clock
reading: the idle and max_stream deadlines are one timer per stream (`_Deadlines`), never a
timer per event.
Upstream `id:`/`retry:` fields and comments were already dropped by the decoder; keep-alive
comments are the response's own.

A stream that ends without `[DONE]` and without an error event is a truncation: the client gets
a final error event in the route's shape, never a silent success. What ends a stream and how
its errors look are the route's `WireProtocol`, a required argument (this module holds no
default of one API): chat ends at `[DONE]` with OpenAI's error events, the Responses API and
Messages at named events (`gateway.wire.named`) with their own error builders
(`gateway.wire.responses`, `gateway.wire.messages`); the deadlines, the drain and the closing
are the same for all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Literal

from gateway.errors import UpstreamError
from gateway.hedge.attempt import Prefix
from gateway.wire.base import RelayOutcome, Rewrite, StreamEnd, WireProtocol
from gateway.wire.sse import SSEBatch

#: after `[DONE]`, how long and how many events the relay reads to let the connection be reused
DRAIN_TIMEOUT = 0.05
DRAIN_READS = 8


async def _drain(batches: AsyncIterator[SSEBatch]) -> None:
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


class _Deadlines:
    """`timeouts.idle` and `timeouts.max_stream` as deadlines per event.

    httpx's read timeout restarts on every byte, so an upstream that sends only comments
    would never trip it; these deadlines move only when an event arrives. Per batch the relay
    stores one clock reading in `last` and tests `expired`: one timer per stream, armed for
    the earliest possible expiry and re-armed when it fires early (events came in meanwhile).
    Only a read that waits on the upstream is interrupted: the timer cancels the relay's task
    and the relay takes the cancellation back (as `asyncio.timeout` does). A deadline that
    passes while the client is being written to is seen in `expired` right after that write."""

    def __init__(
        self, idle: float, max_stream_deadline: float, clock: Callable[[], float]
    ) -> None:
        self.idle = idle
        self.max_at = max_stream_deadline
        self.clock = clock
        self.last = clock()
        #: the relay is awaiting the upstream (only then may the timer cancel it)
        self.reading = False
        #: why the stream must end (None: it need not)
        self.expired: Literal["idle", "too_long"] | None = None
        self._task = asyncio.current_task()
        self._cancelled = False
        self._handle: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        delay = max(0.0, min(self.last + self.idle, self.max_at) - self.clock())
        self._handle = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        now = self.clock()
        if now >= self.max_at:
            self.expired = "too_long"
        elif now - self.last >= self.idle:
            self.expired = "idle"
        else:
            self._arm()
            return
        self._handle = None
        if self.reading and self._task is not None:
            self._cancelled = True
            self._task.cancel()

    def took_back(self) -> bool:
        """On a CancelledError from the read: whether it was ours alone (else re-raise)."""
        if not self._cancelled or self._task is None:
            return False
        self._cancelled = False
        return self._task.uncancel() == 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def relay(
    prefix: Prefix,
    *,
    request_id: str,
    idle: float,
    max_stream_deadline: float,
    clock: Callable[[], float],
    outcome: RelayOutcome,
    protocol: WireProtocol,
    rewrite: Rewrite | None = None,
) -> AsyncIterator[bytes]:
    """Yield the client's SSE bytes, one chunk per upstream read. Always closes the upstream.

    The encoder (`protocol.encoder_for(rewrite)`, once per request) and the error events
    (`protocol.error_event`) are the route's protocol's: the Responses API and Messages end
    at named events, not `[DONE]`, and shape their errors their own way."""
    encoder = protocol.encoder_for(rewrite)
    encode, by_batch = encoder.events, encoder.batch
    error_event = protocol.error_event
    deadlines: _Deadlines | None = None
    try:
        outcome.events = len(prefix.buffered)
        yield encode(prefix.buffered, request_id, outcome)
        if outcome.end == StreamEnd.CLIENT_GONE:
            deadlines = _Deadlines(idle, max_stream_deadline, clock)
            batches = prefix.batches.__aiter__()
            while True:
                deadlines.reading = True
                try:
                    batch: SSEBatch | None = await batches.__anext__()
                except StopAsyncIteration:
                    batch = None
                except asyncio.CancelledError:
                    if not deadlines.took_back():
                        raise
                    break
                finally:  # no yield may happen while `reading` is set
                    deadlines.reading = False
                if batch is None:
                    outcome.end = StreamEnd.TRUNCATED
                    yield error_event(
                        "upstream stream ended before completion", "stream_truncated",
                        request_id,
                    )
                    return
                deadlines.last = clock()
                # per read, not per event: a raw read is counted by one scan in C
                raw = batch.raw
                outcome.events += len(batch.events) if raw is None else raw.count(b"\n\n")
                yield (by_batch(batch, request_id, outcome) if by_batch is not None
                       else encode(batch.events, request_id, outcome))
                if outcome.end != StreamEnd.CLIENT_GONE or deadlines.expired is not None:
                    break
            if outcome.end != StreamEnd.CLIENT_GONE:
                pass
            elif deadlines.expired == "too_long":
                outcome.end = StreamEnd.TOO_LONG
                yield error_event(
                    "stream exceeded the maximum duration", "stream_timeout", request_id
                )
                return
            elif deadlines.expired == "idle":
                outcome.end = StreamEnd.FAILED
                yield error_event(
                    f"upstream failed mid-stream: read timeout (no event within {idle:g} s)",
                    "upstream_failed", request_id,
                )
                return
        if outcome.end == StreamEnd.DONE:
            await _drain(prefix.batches)
    except UpstreamError as exc:
        outcome.end = StreamEnd.FAILED
        yield error_event(
            f"upstream failed mid-stream: {exc.reason}", "upstream_failed", request_id
        )
    finally:
        if deadlines is not None:
            deadlines.close()
        await prefix.aclose()
