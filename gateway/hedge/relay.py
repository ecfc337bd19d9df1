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
a final error event in OpenAI shape, never a silent success. Those are the chat rules; the
Responses API and Messages end at named events and shape their errors their own way, so the
proxy passes their per-batch encoder (`gateway.wire.named`) and error builder
(`gateway.wire.responses`, `gateway.wire.messages`) in; the deadlines, the drain and the closing
stay the same.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Literal, Protocol

from gateway.errors import UpstreamError
from gateway.hedge.attempt import Prefix
from gateway.wire.base import Encoder, Kind, RelayOutcome, StreamEnd
from gateway.wire.chat import CHAT_ENCODER, openai_error_event
from gateway.wire.resume import Splice
from gateway.wire.sse import SSEBatch, SSEEvent


class Resume(Protocol):
    """What the relay calls when its stream breaks (`gateway.hedge.continuation`): given
    the events the client was sent and the backend that broke, the continuation's prefix
    (up to its first token) and the splice its events go through, or None (the client gets
    the route's in-band error)."""

    async def __call__(self, relayed: list[SSEEvent], backend: str
                       ) -> tuple[Prefix, Splice] | None: ...

#: after `[DONE]`, how long and how many events the relay reads to let the connection be reused
DRAIN_TIMEOUT = 0.05
DRAIN_READS = 8


#: a final in-stream error in OpenAI shape (the default for callers that name no protocol;
#: the proxy passes each protocol's own)
error_event = openai_error_event


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

    def rearm(self) -> None:
        """A continuation took over: the idle deadline runs from now (the max_stream one
        stays the request's)."""
        self.expired = None
        self.last = self.clock()
        if self._handle is None:
            self._arm()

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
    encoder: Encoder = CHAT_ENCODER,
    error_event: Callable[[str, str, str], bytes] = error_event,
    resume: Resume | None = None,
    backend: str = "",
    classify: Callable[[SSEEvent], Kind] | None = None,
) -> AsyncIterator[bytes]:
    """Yield the client's SSE bytes, one chunk per upstream read. Always closes the upstream.

    `encoder` and `error_event` are the protocol's (`WireProtocol.encoder_for`,
    `.error_event`: the Responses API and Messages end at named events, not `[DONE]`, and
    shape their errors their own way); the defaults, for callers that name no protocol, are
    chat's.

    `resume` (None: a break is the client's in-band error, as it always was): when the
    stream from `backend` breaks (it fails, ends without its end event, sends an error
    event, or passes the idle timeout), the relay asks it for a continuation, closes the
    broken upstream and relays the continuation's events through its splice; only when
    none comes does the client get the in-band error. For that the relay keeps a reference
    to each read it relayed (one list append per read, nothing per event), up to
    `MAX_KEPT_READS` (past that, the stream is not continued), and `classify` (the
    protocol's) finds an error event in the rare read that has one."""
    encode, by_batch = encoder.events, encoder.batch
    deadlines: _Deadlines | None = None
    kept: list[SSEBatch] | None = None if resume is None else [SSEBatch(list(prefix.buffered))]
    splice: Splice | None = None
    try:
        yield encode(prefix.buffered, request_id, outcome)
        if outcome.end == StreamEnd.CLIENT_GONE:
            deadlines = _Deadlines(idle, max_stream_deadline, clock)
            batches = prefix.batches.__aiter__()
            while True:
                broke: str | None = None
                deadlines.reading = True
                try:
                    batch: SSEBatch | None = await batches.__anext__()
                except StopAsyncIteration:
                    batch = None
                except asyncio.CancelledError:
                    if not deadlines.took_back():
                        raise
                    if kept is None or deadlines.expired != "idle":
                        break
                    batch, broke = None, "idle"
                except UpstreamError as exc:
                    if kept is None:
                        raise
                    batch, broke = None, f"upstream failed mid-stream: {exc.reason}"
                finally:  # no yield may happen while `reading` is set
                    deadlines.reading = False
                if batch is not None:
                    deadlines.last = clock()
                    if splice is not None:
                        events = splice.events(batch.events)
                        batch = SSEBatch(events)
                        out = encode(events, request_id, outcome)
                    else:
                        out = (by_batch(batch, request_id, outcome) if by_batch is not None
                               else encode(batch.events, request_id, outcome))
                    ended: StreamEnd = outcome.end  # (the encoder may have set it)
                    if kept is not None and ended == StreamEnd.UPSTREAM_ERROR:
                        # an error event: what came before it is relayed, the rest continued
                        outcome.end = StreamEnd.CLIENT_GONE
                        before = _before_error(batch.events, classify)
                        out = encode(before, request_id, outcome)
                        batch, broke = SSEBatch(before), "upstream reported an error"
                    if kept is not None:
                        if len(kept) < MAX_KEPT_READS:
                            kept.append(batch)
                        else:
                            kept = None  # too long to continue: breaks end as they did
                    yield out
                    if broke is None:
                        if outcome.end != StreamEnd.CLIENT_GONE or deadlines.expired is not None:
                            break
                        continue
                if kept is None or resume is None:  # ended without its end event
                    outcome.end = StreamEnd.TRUNCATED
                    yield error_event(
                        "upstream stream ended before completion", "stream_truncated",
                        request_id,
                    )
                    return
                resumed = await resume([e for b in kept for e in b.events], backend)
                if resumed is None:
                    outcome.end = StreamEnd.FAILED if broke else StreamEnd.TRUNCATED
                    yield error_event(*_break_error(broke, idle), request_id)
                    return
                await prefix.aclose()
                prefix, splice = resumed
                batches = prefix.batches.__aiter__()
                events = splice.events(prefix.buffered)
                kept.append(SSEBatch(events))
                deadlines.rearm()
                yield encode(events, request_id, outcome)
                if outcome.end != StreamEnd.CLIENT_GONE:
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


#: reads of one stream the relay keeps to continue it (`relay`'s `resume`)
MAX_KEPT_READS = 1 << 16


def _before_error(events: list[SSEEvent], classify: Callable[[SSEEvent], Kind] | None
                  ) -> list[SSEEvent]:
    """The events of a read before its first error event."""
    for i, event in enumerate(events):
        if classify is not None and classify(event) is Kind.ERROR:
            return events[:i]
    return []


def _break_error(broke: str | None, idle: float) -> tuple[str, str]:
    """The message and code of the in-band error of a break that was not continued."""
    if broke is None:
        return "upstream stream ended before completion", "stream_truncated"
    if broke == "idle":
        return (f"upstream failed mid-stream: read timeout (no event within {idle:g} s)",
                "upstream_failed")
    return broke, "upstream_failed"
