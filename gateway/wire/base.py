"""What every wire protocol shares: the meaning of one event to the race, how a relayed stream
ended, and the `WireProtocol` description a request carries (pure).

The race stays protocol-agnostic ("the runner returned a prefix ending in a token"); what a
token, an end and an error look like on each route is one `WireProtocol`, written in that
API's own module (`gateway.wire.chat`, `gateway.wire.responses`, `gateway.wire.messages`).
The predicates run on every event before commit, so they are plain dict probing, defensive
against any JSON shape, and never raise.

`StreamEnd` is written once here, so a new end cannot be known to the client response and
unknown to the stats (a stream cut by a graceful shutdown was once counted as `other` that way):
the relay sets the ends it sees in the upstream's bytes, the client stream the ones it sees on
the client's side or from the drain, the proxy records whichever came first, and the stats
count every end but `DONE` as an error class `stream_<end>`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from gateway.errors import GatewayError
from gateway.wire.paths import Endpoint, ErrorShape
from gateway.wire.sse import SSEBatch, SSEEvent
from gateway.wire.usage import Usage


class Kind(enum.IntEnum):
    """What one event means to the race."""

    #: anything that is neither output nor a failure (role chunk, usage, finish, malformed)
    OTHER = 0
    #: carries model output: the attempt has produced its first token
    TOKEN = 1
    #: an error reported inside the stream: the attempt has failed
    ERROR = 2
    #: the stream's end event (`[DONE]`, `response.completed`, `message_stop`): it is over
    DONE = 3


class StreamEnd(StrEnum):
    #: `[DONE]` was relayed: the only clean end
    DONE = "done"
    #: the upstream sent an error event (relayed, or replaced by ours)
    UPSTREAM_ERROR = "upstream_error"
    #: the upstream's stream ended without `[DONE]` or an error event
    TRUNCATED = "truncated"
    #: reading the upstream failed mid-stream (reset, idle timeout, bad framing)
    FAILED = "failed"
    #: `timeouts.max_stream` passed
    TOO_LONG = "too_long"
    #: the client went away (also the relay's state until one of the ends above is seen)
    CLIENT_GONE = "client_gone"
    #: the client stopped reading for `timeouts.stuck_client`; its connection was dropped
    STUCK_CLIENT = "stuck_client"
    #: the shutdown grace ended while the stream was live
    SHUTDOWN = "shutdown"
    #: an exception of ours escaped the relay (a bug, logged; never a client that left)
    INTERNAL_ERROR = "internal_error"


#: the ends that are errors, each counted as `stream_<end>`
ERROR_ENDS: tuple[StreamEnd, ...] = tuple(end for end in StreamEnd if end is not StreamEnd.DONE)


class Hooks:
    """What a streamed answer owes its request as soon as it is complete (the relay's counts
    into the summary, the winner's backend slot, a client key's charge): each call added is
    made once, in order, each even if one before it raised (the first error propagates once
    all have run). Called by whichever comes first: the relay, as it has encoded the
    stream's end event and before that piece goes out (a client may send its next request as
    soon as it reads it, and the relay may still read the upstream's last bytes for a while),
    or the client stream, as it is done with the relay's body or ends early."""

    __slots__ = ("called", "calls")

    def __init__(self, *calls: Callable[[], None]) -> None:
        self.calls: tuple[Callable[[], None], ...] = calls
        self.called = False

    def add(self, call: Callable[[], None]) -> None:
        """`call` too, after the others (made at once if the hooks were called already)."""
        if self.called:
            call()
        else:
            self.calls += (call,)

    def __call__(self) -> None:
        if self.called:
            return
        calls, self.calls, self.called = self.calls, (), True
        error: BaseException | None = None
        for call in calls:
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - the rest run; the first propagates
                error = error or exc
        if error is not None:
            raise error


@dataclass(slots=True)
class RelayOutcome:
    """What the relay learnt of a stream after commit: how it ended, the usage it reported."""

    end: StreamEnd = StreamEnd.CLIENT_GONE
    #: the token usage the stream reported, when it did
    usage: Usage | None = None
    #: drop the usage-only chunk: the gateway asked for it, the client did not
    strip_usage: bool = False
    #: the upstream events relayed to the client, the buffered prefix's included: the output
    #: a key is charged, one token per event, when the stream reported no usage (the client
    #: left before it, or the backend never reports one in a stream)
    events: int = 0
    #: called as the stream's end event is encoded, before the piece that carries it goes
    #: out (`Hooks`); None: nothing owed then (a whole answer's relay)
    on_done: Hooks | None = None


#: (events, request id, outcome) -> the client's bytes for them; sets `outcome.end` when the
#: stream is over
EncodeEvents = Callable[[list[SSEEvent], str, RelayOutcome], bytes]
#: the event names a request rewrites, and how it rewrites their payloads
Rewrite = tuple[frozenset[bytes], Callable[[bytes], bytes]]


@dataclass(frozen=True, slots=True)
class Encoder:
    """How a protocol writes the client's stream after commit: `events` for the buffered
    prefix, and for each later upstream read `batch` (which may pass a read's raw bytes as
    they are), or, when it is None, `events` over the read's events."""

    events: EncodeEvents
    batch: Callable[[SSEBatch, str, RelayOutcome], bytes] | None = None


@dataclass(frozen=True, slots=True)
class WireProtocol:
    """How one route's streams and errors look; chosen once per request."""

    name: str
    #: one stream event before commit -> TOKEN / ERROR / DONE / OTHER
    classify: Callable[[SSEEvent], Kind]
    #: a whole non-streaming body (parsed JSON) -> TOKEN / ERROR
    classify_body: Callable[[object], Kind]
    #: event types after which the stream is complete; empty: the chat `[DONE]` rule
    ends: frozenset[bytes]
    #: (message, code, request id) -> the final error event of a cut or failed stream
    error_event: Callable[[str, str, str], bytes]
    #: (error, message) -> the JSON body of an HTTP error on this route
    error_body: Callable[[GatewayError, str], dict[str, object]]
    #: the events of a stream that reached its end event without a token -> whether they are
    #: a complete (empty) answer; called once per such stream, never per event
    answered: Callable[[list[SSEEvent]], bool] = lambda _events: True
    #: (this protocol, the request's rewrite) -> the relay's encoder: the chat rule
    #: (`[DONE]`) or the named-event rule (`gateway.wire.named`); see `encoder_for`
    encoder: Callable[[WireProtocol, Rewrite | None], Encoder] = field(kw_only=True)
    #: the name of the shape `error_body` writes (the route table and the tests read it)
    errors: ErrorShape = field(kw_only=True)

    def encoder_for(self, rewrite: Rewrite | None = None) -> Encoder:
        """The relay's encoder for one request of this protocol (once per request)."""
        return self.encoder(self, rewrite)


class StreamTranslator(Protocol):
    """One translated stream's state machine (`gateway.wire.translate`): the client's bytes
    for each backend event, whether the client's stream is over, the usage read so far."""

    #: the client asked for the usage chunk (a Chat client's `stream_options`); the
    #: machines of other client APIs ignore it
    include_usage: bool

    @property
    def usage(self) -> Usage | None: ...
    @property
    def ended(self) -> bool: ...
    @property
    def failed(self) -> bool: ...

    def feed(self, event: SSEEvent) -> bytes: ...

    def feed_all(self, events: list[SSEEvent]) -> bytes:
        """`feed` over a read's events, joined (a machine may splice its usual event
        without a call per event)."""
        ...

    def feed_named(self, chunk: bytes) -> bytes | None:
        """`feed_all` over the events of a read in the named framing (`SSEBatch.named`),
        written from its bytes; None when the machine does not (the events are then decoded
        and fed)."""
        ...


class AnswerTranslation(Protocol):
    """A whole backend answer written in the client's API (`Translation.answer`)."""

    def __call__(self, data: bytes, created: int, parsed: object = None) -> bytes:
        """`data` in the client's API; `parsed`: `data` parsed already (None: parse it)."""
        ...


@dataclass(frozen=True, slots=True)
class Translation:
    """A client route answered by a backend route of another API; the table of them is
    `gateway.wire.translate.routes.TRANSLATIONS`, handed to each pool."""

    #: `client->backend` by API (`chat->messages`): the label it is counted under
    name: str
    client: Endpoint
    backend: Endpoint
    #: the backend's wire rules: its first token, its end, its errors before commit
    protocol: WireProtocol
    #: the client's request body -> the backend's (Untranslatable: a 400 naming the field)
    request: Callable[[Mapping[str, Any]], dict[str, Any]]
    #: a whole backend answer -> the client's, given `created` (seconds since the epoch)
    #: and, when the race parsed it already, the answer parsed (`Prefix.parsed`)
    answer: AnswerTranslation
    #: a fresh state machine for one stream, given `created`
    machine: Callable[[int], StreamTranslator]
    #: the prefixes of the client's forwarded headers that only its own API reads
    #: (`anthropic-`: a Chat server would refuse or misread `anthropic-beta`)
    client_only_headers: tuple[str, ...] = ()

    def forwarded(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """The client's forwarded headers (lower-case names) the backend's API reads too:
        the deadline's and the trace's go on, as they do to a backend of the client's API."""
        if not headers or not self.client_only_headers:
            return headers
        return {k: v for k, v in headers.items() if not k.startswith(self.client_only_headers)}

    def encoder(self, created: int, include_usage: bool,
                error_event: Callable[[str, str, str], bytes]) -> Encoder:
        """The relay's encoder for one translated stream: the backend's events, each
        translated as it arrives (once per stream). `include_usage`: the client asked for
        the usage chunk (a Chat client's `stream_options`); `error_event`: the client
        protocol's, which ends the stream when the backend sends an event of a shape its API
        never has (the backend's failure, not a bug of ours). A read of plain `data:` events
        (a Chat backend's, `SSEBatch.raw`) is fed without building its events; a read of
        named events (a Messages backend's, `SSEBatch.named`) is offered to the machine's
        `feed_named` first, and decoded only when it declines."""
        machine = self.machine(created)
        machine.include_usage = include_usage
        feed_all, feed_named = machine.feed_all, machine.feed_named

        def events(batch: list[SSEEvent] | SSEBatch, request_id: str,
                   outcome: RelayOutcome) -> bytes:
            try:
                if isinstance(batch, SSEBatch):  # a named read (`by_batch`)
                    named = batch.named
                    written = None if named is None else feed_named(named)
                    out = feed_all(batch.events) if written is None else written
                else:
                    out = feed_all(batch)
            except (TypeError, AttributeError, KeyError, IndexError, ValueError):
                outcome.end = StreamEnd.UPSTREAM_ERROR
                return error_event("upstream sent an event its API never has",
                                   "upstream_error", request_id)
            usage = machine.usage
            if usage is not outcome.usage and usage is not None:
                outcome.usage = usage
            if machine.ended:
                outcome.end = StreamEnd.UPSTREAM_ERROR if machine.failed else StreamEnd.DONE
            return out

        def by_batch(batch: SSEBatch, request_id: str, outcome: RelayOutcome) -> bytes:
            raw = batch.raw
            if raw is None:
                return events(batch if batch.named is not None else batch.events, request_id,
                              outcome)
            if raw.find(b"\n\n") != len(raw) - 2:
                return events(batch.events, request_id, outcome)
            return events([SSEEvent(raw[6:-2])], request_id, outcome)

        return Encoder(events, by_batch)


#: (client route, backend route) -> the translation between them
Translations = Mapping[tuple[Endpoint, Endpoint], Translation]


def translation_for(table: Translations, client: Endpoint, serves: frozenset[str]
                    ) -> Translation | None:
    """The translation of `table` that takes a request on `client` to a backend serving
    `serves` (None: it serves `client` itself, or none reaches it). Once per request and
    backend that does not serve the request's route."""
    if client in serves:
        return None
    for (source, target), translation in table.items():
        if source == client and target in serves:
            return translation
    return None


def json_bytes(obj: object) -> bytes:
    """Compact JSON, as the error events are written (`json.dumps` with separators builds
    an encoder per call; this one is built once and holds no state between calls)."""
    return _compact(obj).encode()


_compact = json.JSONEncoder(separators=(",", ":")).encode


def nonempty(value: object) -> bool:
    return isinstance(value, str) and value != ""


def typed_payload(event: SSEEvent) -> tuple[str, dict[str, object] | None]:
    """The event's type (payload `type`, else its SSE name) and its JSON object, if any."""
    name = event.event.decode("latin-1") if event.event is not None else ""
    try:
        obj = json.loads(event.data)
    except (ValueError, RecursionError):
        return name, None
    if not isinstance(obj, dict):
        return name, None
    kind = obj.get("type")
    return (kind if isinstance(kind, str) and kind else name), obj


def _nonempty(value: object) -> bool:
    return isinstance(value, str) and value != ""


def classify_any_body(obj: object) -> Kind:
    """A body relayed as it is (count_tokens, a stored response): any JSON object answers."""
    return Kind.TOKEN if isinstance(obj, dict) else Kind.OTHER
