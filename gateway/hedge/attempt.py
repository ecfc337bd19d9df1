"""What one attempt does before commit: open the upstream and read up to its first token.

The runner hands the race a `Prefix` (`gateway.hedge.prefix`, a value apart from this code):
the events read so far (the role chunk, the first token) and the still-open event iterator, so
the relay can continue exactly where the race stopped, and close it.
A stream that ends normally before any token (its end event, and for chat a finish reason) is
a complete answer without text, not a failure: the runner hands it back as a `Prefix` marked
`empty`, holding every event up to its end, and the race decides whether it is relayed.
Whatever ends the runner other than a token or a complete answer (a failure, a cancellation)
closes the upstream on the way out, shielded from the cancellation that caused it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gateway.errors import (
    UpstreamError,
    UpstreamInBandError,
    UpstreamNoToken,
    UpstreamProtocolError,
)
from gateway.hedge.prefix import Prefix, close_quietly
from gateway.wire.base import Kind, WireProtocol
from gateway.wire.sse import SSEEvent
from providers.base import Provider, UpstreamCall, UpstreamStream

#: `continuation`: only as a trace names a continuation's attempt (`gateway.hedge.continuation`);
#: a continuation's own race records its attempt as its primary, apart from the request's
AttemptKind = Literal["primary", "hedge", "failover", "continuation"]
Outcome = Literal["won", "lost", "failed", "cancelled"]
#: takes the headers of an upstream's answer (a refusal's too) as soon as they are in: the
#: backend's quota headroom reads its rate-limit headers from them
HeadersSeen = Callable[[Mapping[str, str]], None]


@dataclass(slots=True)
class AttemptRecord:
    """What happened to one attempt; the stats and the request log read these."""

    index: int
    backend: str
    kind: AttemptKind
    started: float
    spent_budget: bool
    outcome: Outcome | None = None
    #: seconds from this attempt's start to its first token (or to its cancellation)
    ttft: float | None = None
    reason: str | None = None
    #: seconds it took to close a cancelled attempt's upstream
    close_s: float | None = None
    #: events a cancelled attempt read after the commit (should stay 0)
    late_events: int = 0
    #: a failed attempt's `UpstreamError.code` (bounded; `reason` has the detail)
    failure: str | None = None
    #: when its runner returned or raised (the proxy sets it; the dashboard's timeline)
    ended: float | None = None
    #: the number of its ejected backend's probe when it is that probe, else 0 (what
    #: `Balancer.on_start` said)
    probe: int = 0
    #: its stream ended normally without a token: a complete (perhaps empty) answer
    empty: bool = False
    #: output tokens a loser that held a token had sent when it was closed: its upstream's
    #: count when what it sent reported one, else one per event it sent (an estimate); None
    #: for an attempt closed before its first token (`gateway.hedge.losers`)
    output_sent: int | None = None
    #: a hedge sent early for the request's TTFT objective (`gateway.hedge.deadline`)
    deadline: bool = False
    #: called by its runner as it returns or raises, in the step that ends the attempt: the
    #: race's wake-up (`Race._wait`), an `asyncio.Event.set`
    on_end: Callable[[], object] | None = None

    def lost(self) -> bool:
        """Whether the race has already decided this attempt (another one committed, or the
        request ended): its runner reads it per batch before the first token, and a batch
        read after that is counted (`late_events`, which should stay 0). A method of the
        record rather than a closure of the runner's, so the attempt reads its own state
        without stepping back into the runner per event."""
        if self.outcome is not None:
            self.late_events += 1
            return True
        return False


@dataclass(slots=True)
class ContinuationLeg:
    """One continuation's attempt as its request's spend charges it (`gateway.stats.spend`):
    the upstream was sent the request and the text relayed so far, so it charged both as
    input, and the output it generated until it was closed."""

    #: its attempt (`outcome` and `failure` say whether its upstream took the request)
    record: AttemptRecord
    #: the output tokens relayed to the client before it started: the text it resent
    relayed: int
    #: the relay took it over (a break's continuation, or a stall's that came first): its
    #: output is what the client read from it (the tokens relayed until the next one took
    #: over; the last one's, its upstream's count)
    taken: bool = False
    #: for one that yielded its first token and was not taken (it lost its stall race to the
    #: stalled stream, or the client left): what it had sent when it was closed
    output: int = 0


@dataclass(slots=True)
class ContinuationCounts:
    """What one request's continuations did (the stats add them up per pool and backend)."""

    #: continuations started, per backend they went to
    started: Counter[str] = field(default_factory=Counter)
    #: continuations that gave the client its next token, per backend
    won: Counter[str] = field(default_factory=Counter)
    #: continuations not started, per reason (max_continuations, not_text, no_backend,
    #: budget, disabled, too_long, max_tokens)
    refused: Counter[str] = field(default_factory=Counter)
    #: streams that broke after commit, per backend that broke: continued, or ended with the
    #: in-band error
    breaks_continued: Counter[str] = field(default_factory=Counter)
    breaks_ended: Counter[str] = field(default_factory=Counter)
    #: stalls detected after commit, per backend that stalled
    stalls: Counter[str] = field(default_factory=Counter)
    #: the input tokens the continuations granted were priced at (the request's estimate
    #: plus the tokens relayed, each time): what they resent
    input_tokens: int = 0
    #: each continuation's attempt (kind `continuation`), for the dashboard's timeline: at
    #: most `max_continuations` of them
    records: list[AttemptRecord] = field(default_factory=list)
    #: the same attempts as the request's spend charges them, in the order they started
    legs: list[ContinuationLeg] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.started or self.refused or self.breaks_ended or self.stalls)


#: `AttemptRecord.reason` of an attempt cancelled by the race (lost, or the request ended)
CANCELLED_BEFORE_TOKEN = "cancelled before its first token"
CANCELLED_AFTER_TOKEN = "cancelled after its first token"
#: `AttemptRecord.reason` of a complete answer without a token that another attempt's token beat
EMPTY_ANSWER_LOST = "complete answer without a token; another attempt's token won"


#: events an upstream may send before its first token (role chunks, empty deltas, pings):
#: scaffolding only, since anything that is output (text, a tool item, a partial image) is a
#: token; an attempt whose reads pass this many without a token or an end has failed
MAX_PRE_TOKEN_EVENTS = 1024


async def _open(provider: Provider, call: UpstreamCall, seen: HeadersSeen | None
                ) -> UpstreamStream:
    """`provider.open`, handing `seen` the answer's headers, a refusal's as a success's."""
    try:
        stream = await provider.open(call)
    except UpstreamError as exc:
        if seen is not None and exc.quota:
            seen(exc.quota)
        raise
    if seen is not None:
        seen(stream.headers)
    return stream


async def open_until_first_token(
    provider: Provider,
    call: UpstreamCall,
    is_lost: Callable[[], bool],
    protocol: WireProtocol,
    seen: HeadersSeen | None = None,
) -> Prefix:
    """Open a streaming attempt and read until its first token or its normal end.

    `protocol` is the route's (no default: the race knows no API of its own): its
    `classify` is the per-event predicate; its `answered` says, once, whether a stream
    that reached its end event without a token is a complete answer (chat: it gave a finish
    reason) or a failure. The bound on events before the first token counts every event read,
    checked after each read that brought neither a token nor an end. `seen` gets the
    answer's headers as soon as they are in."""
    classify, answered = protocol.classify, protocol.answered
    stream = await _open(provider, call, seen)
    batches = stream.batches()
    try:
        buffered: list[SSEEvent] = []
        async for batch in batches:
            if is_lost():  # counts a read that arrived after another attempt committed
                raise UpstreamProtocolError("lost the race")
            events = batch.events
            buffered += events
            for event in events:
                kind = classify(event)
                if kind is Kind.TOKEN:
                    return Prefix(stream, batches, buffered)
                if kind is Kind.ERROR:
                    raise UpstreamInBandError("error event before the first token")
                if kind is Kind.DONE:
                    if answered(buffered):
                        return Prefix(stream, batches, buffered, empty=True)
                    raise UpstreamNoToken("stream ended without a token or a finish reason")
            if len(buffered) > MAX_PRE_TOKEN_EVENTS:
                raise UpstreamProtocolError("too many events before the first token")
        raise UpstreamNoToken("stream ended without a token and without its end event")
    except BaseException:
        await close_quietly(stream, batches)
        raise


async def open_whole_response(
    provider: Provider,
    call: UpstreamCall,
    is_lost: Callable[[], bool],
    protocol: WireProtocol,
    seen: HeadersSeen | None = None,
) -> Prefix:
    """Open a non-streaming attempt and read its whole body: its 'first token', as the
    route's `protocol` judges a whole body (`classify_body`). `seen` gets the answer's
    headers as soon as they are in."""
    classify_body = protocol.classify_body
    stream = await _open(provider, call, seen)
    batches = stream.batches()
    try:
        async for batch in batches:
            event = batch.events[0]
            try:
                payload = json.loads(event.data)
            except ValueError:
                raise UpstreamProtocolError("response body is not JSON") from None
            if not isinstance(payload, dict):
                raise UpstreamProtocolError("response body is not a JSON object")
            if classify_body(payload) is Kind.ERROR:
                raise UpstreamInBandError("error in the response body")
            return Prefix(stream, batches, [event], parsed=payload)
        raise UpstreamNoToken("empty response")
    except BaseException:
        await close_quietly(stream, batches)
        raise
