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
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.errors import UpstreamError
from gateway.hedge.prefix import Prefix
from gateway.wire.base import EncodeEvents, Kind, RelayOutcome, Rewrite, StreamEnd, WireProtocol
from gateway.wire.resume import Splice
from gateway.wire.sse import SSEBatch, SSEEvent
from providers.base import finish_despite_cancel


@dataclass(frozen=True, slots=True)
class Continued:
    """A continuation that yielded its first token: its prefix, the splice its events go
    through, and its backend."""

    prefix: Prefix
    splice: Splice
    backend: str


class Resume(Protocol):
    """What the relay asks when its stream breaks or stalls (`gateway.hedge.continuation`)."""

    async def __call__(self, relayed: list[SSEEvent], backend: str, stall: bool = False
                       ) -> Continued | None:
        """Given the events the client was sent and the backend that broke (or stalled),
        the continuation up to its first token, or None (a break: the client gets the
        route's in-band error; a stall: the stream is waited for)."""

    def stall_delay(self, backend: str) -> float:
        """How long a stream of `backend` may go without an event before a continuation
        starts beside it (inf: none will)."""

    def stall_won(self, backend: str) -> None:
        """The continuation on `backend` gave its token before the stalled stream."""

    def ended(self, backend: str, longest_gap: float) -> None:
        """A stream of `backend` without a stall ended normally: its longest gap."""

    def took(self, continued: Continued) -> None:
        """The relay took `continued` over (its spend counts what the client read from it;
        one it did not take is charged what it had sent when closed)."""

    def refused(self, reason: str, backend: str) -> None:
        """The stream from `backend` broke and the relay could not ask for a continuation
        (`reason`: `too_long`, it relayed more than it keeps)."""


log = logging.getLogger("hedge_gateway.relay")

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
    """`timeouts.idle` and `timeouts.max_stream` as deadlines per event, and the stall delay.

    httpx's read timeout restarts on every byte, so an upstream that sends only comments
    would never trip it; these deadlines move only when an event arrives. Per batch the relay
    stores one clock reading in `last` and tests `expired`: one timer per stream, armed for
    the earliest possible expiry and re-armed when it fires early (events came in meanwhile).
    Only a read that waits on the upstream is interrupted: the timer cancels the relay's task
    and the relay takes the cancellation back (as `asyncio.timeout` does). A deadline that
    passes while the client is being written to is seen in `expired` right after that write.

    The stall delay (`stall`, infinite unless the stream may be continued) is one more
    deadline on the same timer: once per gap it calls `on_stall`, which starts a
    continuation while the stream stays open; `interrupt` then ends the read if the
    continuation yields its first token before the stream its next event."""

    def __init__(
        self, idle: float, max_stream_deadline: float, clock: Callable[[], float]
    ) -> None:
        self.idle = idle
        self.max_at = max_stream_deadline
        self.clock = clock
        self.last = clock()
        #: the relay is awaiting the upstream (only then may the timer cancel it)
        self.reading = False
        #: why the stream must end (None: it need not; `continued`: a continuation won)
        self.expired: Literal["idle", "too_long", "continued"] | None = None
        #: the stall delay, and what to call when a gap reaches it (once per gap: `_stalled`
        #: is the `last` it was called for)
        self.stall = math.inf
        self.on_stall: Callable[[], None] | None = None
        self._stalled: float | None = None
        self._task = asyncio.current_task()
        self._cancelled = False
        self._handle: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        due = min(self.last + self.idle, self.max_at)
        if self._stalled != self.last:
            due = min(due, self.last + self.stall)
        delay = max(0.0, due - self.clock())
        self._handle = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        if self._cancelled:
            # `interrupt` cancelled the read in this turn already: a second cancel would stay
            # pending after `took_back` (the stream would end with no final event), and the
            # winner must not be taken for an idle break; `rearm` arms the timer again
            self._handle = None
            return
        now = self.clock()
        if now >= self.max_at:
            self.expired = "too_long"
        elif now - self.last >= self.idle:
            self.expired = "idle"
        else:
            if self._stalled != self.last and now - self.last >= self.stall \
                    and self.on_stall is not None:
                self._stalled = self.last
                self.on_stall()
            self._arm()
            return
        self._handle = None
        if self.reading and self._task is not None:
            self._cancelled = True
            self._task.cancel()

    def interrupt(self) -> None:
        """A continuation won the stall race: end the read of the stalled stream (only a
        read: when none is pending the relay sees the winner itself)."""
        if self.reading and self._task is not None and not self._cancelled:
            self.expired = "continued"
            self._cancelled = True
            self._task.cancel()

    def took_back(self) -> bool:
        """On a CancelledError from the read: whether it was ours alone (else re-raise)."""
        if not self._cancelled or self._task is None:
            return False
        self._cancelled = False
        return self._task.uncancel() == 0

    def set_stall(self, delay: float) -> None:
        """Watch for stalls of `delay` from now on (inf: no longer): the timer is re-armed
        for the earliest deadline (once per stream and per continuation, never per event)."""
        self.stall = delay
        if self._handle is not None:
            self._handle.cancel()
            self._arm()

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
    protocol: WireProtocol,
    rewrite: Rewrite | None = None,
    resume: Resume | None = None,
    backend: str = "",
) -> AsyncIterator[bytes]:
    """Yield the client's SSE bytes, one chunk per upstream read. Always closes the upstream.

    The encoder (`protocol.encoder_for(rewrite)`, once per request) and the error events
    (`protocol.error_event`) are the route's protocol's: the Responses API and Messages end
    at named events, not `[DONE]`, and shape their errors their own way.

    `resume` (None: a break is the client's in-band error and a stall is waited out, as they
    always were): when the stream from `backend` breaks (it fails, ends without its end
    event, sends an error event, or passes the idle timeout), the relay asks it for a
    continuation, closes the broken upstream and relays the continuation's events through
    its splice; only when none comes does the client get the in-band error. When no event
    comes for the backend's stall delay, a continuation starts beside the open stream: the
    first of the two to yield wins and the other is cancelled and closed. For both the relay
    keeps a reference to each read it relayed (one list append per read, nothing per event),
    up to `MAX_KEPT_BYTES` relayed (past that, the stream is not continued: a break is
    counted as refused, `too_long`), and the stream's longest
    gap (one subtraction per read); the protocol's `classify` finds an error event in the
    rare read that has one."""
    encoder = protocol.encoder_for(rewrite)
    encode, by_batch = encoder.events, encoder.batch
    error_event = protocol.error_event
    deadlines: _Deadlines | None = None
    kept: list[SSEBatch] | None = None if resume is None else [SSEBatch(list(prefix.buffered))]
    #: what `kept` holds, in relayed bytes (and `KEPT_READ_COST` per read); and whether it
    #: passed `MAX_KEPT_BYTES` (then a break is counted as refused: `too_long`)
    kept_bytes, over = 0, False
    splice: Splice | None = None
    #: the continuation started beside a stalled stream, until one of the two yields
    rival: asyncio.Task[Continued | None] | None = None
    longest, stalled = 0.0, False
    #: a break seen in a prefix (an error event read with the first token): the loop
    #: continues it before reading on
    pending: str | None = None
    try:
        outcome.events = len(prefix.buffered)
        out = encode(prefix.buffered, request_id, outcome)
        if kept is not None and outcome.end == StreamEnd.UPSTREAM_ERROR:
            out, before = _cut_at_error(prefix.buffered, encode, request_id, outcome, protocol)
            kept, pending = [SSEBatch(before)], "upstream reported an error"
            outcome.events = len(before)
        if outcome.end is not StreamEnd.CLIENT_GONE:  # the last piece (`_owed`)
            _owed(outcome)
        yield out
        if outcome.end == StreamEnd.CLIENT_GONE:
            deadlines = _Deadlines(idle, max_stream_deadline, clock)
            batches = prefix.batches.__aiter__()
            if resume is not None:
                watch = deadlines

                def on_stall() -> None:
                    nonlocal rival, stalled
                    if rival is not None or kept is None or resume is None:
                        return
                    stalled = True
                    rival = asyncio.ensure_future(
                        resume(_relayed(kept), backend, True))
                    rival.add_done_callback(
                        lambda task: watch.interrupt() if _yielded(task) else None)

                deadlines.on_stall = on_stall
                deadlines.set_stall(resume.stall_delay(backend))
            while True:
                broke, pending = pending, None
                taken: Continued | None = None
                batch: SSEBatch | None = None
                if broke is None and rival is not None and rival.done() and _yielded(rival):
                    # it won while no read was pending (the client was being written to):
                    # its interrupt found no read to end, and the stalled stream may say
                    # nothing more until the idle deadline
                    taken, rival = rival.result(), None
                elif broke is None:
                    deadlines.reading = True
                    try:
                        batch = await batches.__anext__()
                    except StopAsyncIteration:
                        batch = None
                    except asyncio.CancelledError:
                        if not deadlines.took_back():
                            raise
                        if deadlines.expired == "continued" and rival is not None:
                            taken, rival = rival.result(), None
                            batch = None
                        elif kept is None or deadlines.expired != "idle":
                            break
                        else:
                            batch, broke = None, "idle"
                    except UpstreamError as exc:
                        if kept is None:
                            raise
                        batch, broke = None, f"upstream failed mid-stream: {exc.reason}"
                    finally:  # no yield may happen while `reading` is set
                        deadlines.reading = False
                if batch is not None:
                    if rival is not None:  # the stalled stream came back first
                        await _drop(rival)
                        rival = None
                    now = clock()
                    if kept is not None and now - deadlines.last > longest:
                        longest = now - deadlines.last
                    deadlines.last = now
                    read = batch
                    if splice is not None:
                        events = splice.events(batch.events)
                        batch = SSEBatch(events)
                        out = encode(events, request_id, outcome)
                    else:
                        out = (by_batch(batch, request_id, outcome) if by_batch is not None
                               else encode(batch.events, request_id, outcome))
                    # per read, not per event: a raw or named read is counted by one scan in
                    # C, after the encoder, which may write a named read without decoding it
                    outcome.events += read.count()
                    ended: StreamEnd = outcome.end  # (the encoder may have set it)
                    if kept is not None and ended == StreamEnd.UPSTREAM_ERROR:
                        # an error event: what came before it is relayed, the rest continued
                        out, before = _cut_at_error(batch.events, encode, request_id,
                                                    outcome, protocol)
                        batch, broke = SSEBatch(before), "upstream reported an error"
                    if kept is not None:
                        kept_bytes += len(out) + KEPT_READ_COST
                        if kept_bytes <= MAX_KEPT_BYTES:
                            kept.append(batch)
                        else:  # too long to continue: breaks end as they did, counted
                            kept, over = None, True
                            deadlines.stall = math.inf
                    if outcome.end is not StreamEnd.CLIENT_GONE:  # the last piece
                        _owed(outcome)
                    yield out
                    if broke is None:
                        if outcome.end != StreamEnd.CLIENT_GONE or deadlines.expired is not None:
                            break
                        continue
                if taken is None:
                    if kept is None or resume is None:  # ended without its end event
                        outcome.end = StreamEnd.TRUNCATED
                        _owed(outcome)
                        yield error_event(
                            "upstream stream ended before completion", "stream_truncated",
                            request_id,
                        )
                        return
                    if rival is not None:  # a continuation is on its way already
                        taken, rival = await rival, None
                    else:
                        taken = await resume(_relayed(kept), backend)
                    if taken is None:
                        outcome.end = StreamEnd.FAILED if broke else StreamEnd.TRUNCATED
                        _owed(outcome)
                        yield error_event(*_break_error(broke, idle), request_id)
                        return
                elif resume is not None:
                    resume.stall_won(taken.backend)
                assert kept is not None and resume is not None
                resume.took(taken)
                await prefix.aclose()
                prefix, splice, backend = taken.prefix, taken.splice, taken.backend
                batches = prefix.batches.__aiter__()
                events = splice.events(prefix.buffered)
                out = encode(events, request_id, outcome)
                first_end: StreamEnd = outcome.end  # (the encoder may have set it)
                if first_end == StreamEnd.UPSTREAM_ERROR:  # the continuation broke at once
                    out, events = _cut_at_error(events, encode, request_id, outcome, protocol)
                    pending = "upstream reported an error"
                kept.append(SSEBatch(events))
                outcome.events += len(events)
                longest, stalled = 0.0, False
                deadlines.rearm()
                deadlines.set_stall(resume.stall_delay(backend))
                if outcome.end is not StreamEnd.CLIENT_GONE:  # the last piece
                    _owed(outcome)
                yield out
                if outcome.end != StreamEnd.CLIENT_GONE:
                    break
            if outcome.end != StreamEnd.CLIENT_GONE:
                pass
            elif deadlines.expired == "too_long":
                outcome.end = StreamEnd.TOO_LONG
                _owed(outcome)
                yield error_event(
                    "stream exceeded the maximum duration", "stream_timeout", request_id
                )
                return
            elif deadlines.expired == "idle":
                outcome.end = StreamEnd.FAILED
                _owed(outcome)
                yield error_event(
                    f"upstream failed mid-stream: read timeout (no event within {idle:g} s)",
                    "upstream_failed", request_id,
                )
                return
        if outcome.end == StreamEnd.DONE:
            if resume is not None and not stalled:
                resume.ended(backend, longest)
            await _drain(prefix.batches)
    except UpstreamError as exc:
        outcome.end = StreamEnd.FAILED
        _owed(outcome)
        yield error_event(
            f"upstream failed mid-stream: {exc.reason}", "upstream_failed", request_id
        )
    finally:
        if over and resume is not None and outcome.end in _BROKEN:
            resume.refused("too_long", backend)
        if deadlines is not None:
            deadlines.close()
        if rival is not None:  # (rare) the two closes, whatever cancels the relay meanwhile
            await finish_despite_cancel(_drop_then_close(rival, prefix))
        else:
            await prefix.aclose()  # (shielded itself)


def _owed(outcome: RelayOutcome) -> None:
    """The stream's last piece is next (its end event, or our error event that ends it): what
    a complete stream owes its request (`outcome.on_done`: the relay's counts into the
    summary, the winner's slot, a client key's charge) is made first, as the client may send
    its next request as soon as it reads that piece. A call that fails (a bug of ours) is
    logged, and the piece goes out all the same."""
    done = outcome.on_done
    if done is not None:
        try:
            done()
        except Exception:  # the client's answer must not pay for a bug of ours: logged
            log.exception("what a complete stream owes its request failed")


def _yielded(task: asyncio.Task[Continued | None]) -> bool:
    """Whether a continuation's task ended with its first token."""
    return not task.cancelled() and task.exception() is None and task.result() is not None


async def _drop_then_close(rival: asyncio.Task[Continued | None], prefix: Prefix) -> None:
    """The relay's end with a continuation still racing its stalled stream: the continuation
    dropped (and closed, if it had its first token), then the stream the relay was reading
    closed. Run to its end even when the stream is being cancelled (the client left: the
    client stream's scope re-delivers its cancellation at every await), or both upstreams
    would stay open, the one the relay read being no race's to close."""
    await _drop(rival)
    await prefix.aclose()


async def _drop(task: asyncio.Task[Continued | None]) -> None:
    """A continuation that lost to its stalled stream (or the stream's end): cancelled, and
    closed if it had its token already, shielded from a cancellation of our own."""
    task.cancel()
    await asyncio.shield(asyncio.wait({task}))
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:  # a bug of ours: the stream goes on without the continuation
        log.error("a continuation failed inside the gateway", exc_info=exc)
        return
    continued = task.result()
    if continued is not None:
        await continued.prefix.aclose()


#: what the relay keeps of one stream to continue it (`relay`'s `resume`): the bytes the
#: client was sent (1 MiB), each read counted `KEPT_READ_COST` more (the reference kept),
#: so neither big reads nor many empty ones grow it past the bound
MAX_KEPT_BYTES = 1 << 20
KEPT_READ_COST = 64

#: how a stream that broke ends (not a client gone, nor the max_stream deadline)
_BROKEN = frozenset({StreamEnd.FAILED, StreamEnd.TRUNCATED, StreamEnd.UPSTREAM_ERROR})


def _relayed(kept: list[SSEBatch]) -> list[SSEEvent]:
    """The events of the kept reads, decoded into this list alone (a kept plain read stays
    bytes: its events are not cached on it)."""
    return [e for b in kept for e in b.decoded()]


def _cut_at_error(events: list[SSEEvent], encode: EncodeEvents, request_id: str,
                  outcome: RelayOutcome, protocol: WireProtocol
                  ) -> tuple[bytes, list[SSEEvent]]:
    """A read of a stream that will be continued, which held an error event: the client's
    bytes of the events before it (the stream goes on), and those events (rare: a read
    with an error event; encoded again without it)."""
    outcome.end = StreamEnd.CLIENT_GONE
    before = _before_error(events, protocol.classify)
    return encode(before, request_id, outcome), before


def _before_error(events: list[SSEEvent], classify: Callable[[SSEEvent], Kind]
                  ) -> list[SSEEvent]:
    """The events of a read before its first error event."""
    for i, event in enumerate(events):
        if classify(event) is Kind.ERROR:
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
