"""The HTTP/1.1 connection under `hedge-gateway serve`: what uvicorn's httptools protocol
leaves to a proxy in front, done here.

- A bound on the request head. uvicorn applies `h11_max_incomplete_event_size` only to its
  h11 parser; with httptools (the fast parser `uvicorn[standard]` installs and prefers) a
  client can send an endless header line or URL and the server buffers all of it.
  `GatewayHttpProtocol` counts head bytes as they arrive and answers 431 past the limit.
- Key guessing. Every request of a connection carries that connection's count of wrong
  keys (extension `FAILED_KEYS_EXTENSION`), so the app answers a guesser more slowly and
  closes its connection after a few (`gateway.api.keys.backoff`).
- One send for a stream's head and first event. A response that asks for it (extension
  `HOLD_HEAD_EXTENSION`) has its head held back until its next write, which carries both:
  written apart, the head cost a system call (on loopback, the peer's receive path too) and
  a packet on the way to the client's first token.
- Watching the client without a task. A request that asks (extension `GONE_EXTENSION`) gets
  a future resolved when its connection is lost; the proxy watches the client through it for
  the whole request instead of a task reading `receive` until `http.disconnect`.
- Aborting a stuck client. A response that stops because its client stopped reading cannot
  complete, and uvicorn then only `close()`s the transport, which waits for the unsent
  buffer to drain: forever, for a client that never reads. The protocol puts an `abort`
  callable into the ASGI scope (extension `ABORT_EXTENSION`) that drops the connection at
  once; `SSEResponse` uses it when present.
- A lingering close. A response that closes the connection before the request body has fully
  arrived (a 413) must not simply close: a close with unread bytes makes the kernel send a
  reset, which destroys the response before a client that is still uploading (`AsyncOpenAI`,
  `httpx.AsyncClient`) reads it. The protocol sends its FIN, keeps reading and discarding the
  rest of the body for a bounded while (nginx's "lingering close"), then closes.
- Slow and numerous clients. A request whose head and body have not arrived within
  `server.body_timeout` gets 408; a new connection past `server.max_connections` gets 503
  (once its request line is in, or after a short wait for it).
- Trailers. uvicorn appends the trailer fields of a chunked body to the request's header
  list, which is the ASGI scope's, after every check of the head, and without any bound: a
  client could grow the server's memory without end (no key needed: `/healthz` answers
  before the body ends, and parsing goes on) and add headers the app never checked. The app
  reads no trailer, so they are dropped; and the bytes of a body that are not body (its
  trailers, its chunk framing) may not run past the head limit between two pieces of body:
  431 while the app is still waiting for the body, else the connection ends.
- A body no framing delimits. A `Transfer-Encoding` whose last coding is not `chunked` gets
  uvicorn's 400 before the app is handed the request: httptools refuses it only once the head
  is complete, after the app had started waiting for a body that never comes.
- The answers given here, below the app (431, 408, 503), are in the error shape of the route
  the request line names (Anthropic's under /v1/messages, `gateway.api.inference`), and each
  ends with a lingering close, so a client still sending its head or body reads the answer
  instead of a reset.
"""

from __future__ import annotations

import asyncio
import functools
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.errors import GatewayError, HeadersTooLarge, RequestTimeout, TooManyConnections
from gateway.server.extensions import (
    ABORT_EXTENSION,
    FAILED_KEYS_EXTENSION,
    GONE_EXTENSION,
    HOLD_HEAD_EXTENSION,
    FailedKeys,
)
from gateway.settings import ServerSettings
from gateway.wire.messages import MESSAGES
from gateway.wire.paths import errors_of

DEFAULT_HEAD_LIMIT = 16 * 1024
#: a connection past the cap waits this long (at most) for its request line, whose path says
#: which error shape the 503 takes; the bytes it may send meanwhile are bounded too
CAP_LINE_WAIT = 1.0
CAP_LINE_BYTES = 8 * 1024
#: after a 431, at most this much more of the head is read and dropped: enough for the rest
#: of a client's oversized header, not for an endless one
HEAD_LINGER_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one client connection may cost; the lingering bounds are nginx's."""

    #: the head and body of a request must have arrived this many seconds after its first byte
    body_timeout: float = 30.0
    #: open client connections (those being refused count too); past it: 503
    max_connections: int = 4096
    #: after a response that ends the connection early, at most this much more is read ...
    linger_bytes: int = 64 * 1024 * 1024
    #: ... for at most this long, before the connection is closed regardless
    linger_seconds: float = 5.0

    @classmethod
    def of(cls, server: ServerSettings) -> ConnectionLimits:
        return cls(body_timeout=server.body_timeout, max_connections=server.max_connections)


class GatewayConfig(uvicorn.Config):
    """uvicorn's config plus the connection limits `GatewayHttpProtocol` enforces."""

    def __init__(self, app: Any, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits


class HeadTooLarge(Exception):
    """Raised inside the parser callback to stop parsing a head that is over the limit."""


class UnframedBody(Exception):
    """Raised inside the parser callback for a `Transfer-Encoding` whose last coding is not
    `chunked`: the parser refuses such a body, but only once the head is complete, after the
    app was already handed the request (it then waited for a body that never came)."""


def chunked_last(values: list[bytes]) -> bool:
    """Whether the codings of these `Transfer-Encoding` values, in order, end in `chunked`
    (the only framing of a request body by transfer coding)."""
    return b",".join(values).rsplit(b",", 1)[-1].strip().lower() == b"chunked"


def raw_error_response(error: GatewayError, path: bytes = b"") -> bytes:
    """A complete `connection: close` response in the error shape of `path` (the OpenAI shape
    when it is unknown), for answers given below the app (no request id: the request never
    reached it)."""
    route = path.split(b"?", 1)[0].decode("latin-1")
    shape = MESSAGES.error_body(error, error.message) if errors_of(route) == "anthropic" \
        else error.body()
    body = json.dumps(shape).encode()
    lines = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if error.retry_after is not None:
        lines += [f"retry-after: {max(1, round(error.retry_after))}",
                  f"retry-after-ms: {int(error.retry_after * 1000)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


class _CloseHook(asyncio.Transport):
    """The transport as one request/response cycle sees it: its `close()` (uvicorn calls it
    after a `connection: close` response) goes to the protocol, which may linger first; and a
    response head the app asked to hold (`hold`) waits for the write after it."""

    def __init__(self, transport: asyncio.Transport, on_close: Callable[[], None]) -> None:
        super().__init__()
        self._transport = transport
        self._on_close = on_close
        #: the response head held for the write after it (`hold`)
        self._held: bytes | None = None

    def hold(self) -> None:
        """Hold the next write (the response head) until the one after it (its first body
        piece): both leave in one send. Only a response that has that piece in hand asks,
        so nothing waits behind the head; a close still sends what is held first. The two
        writes go through writers set on the instance for them alone, so every other write
        of the response pays nothing for the hold."""
        self.write = self._write_held  # type: ignore[method-assign]

    def _write_held(self, data: bytes | bytearray | memoryview) -> None:
        self._held = bytes(data)
        self.write = self._write_with_held  # type: ignore[method-assign]

    def _write_with_held(self, data: bytes | bytearray | memoryview) -> None:
        del self.write  # the plain `write` again
        held, self._held = self._held, None
        self._transport.write(data if held is None else held + data)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        held = self._held
        if held is not None:  # a head whose body never came: it goes out, as it would have
            self._held = None
            self._transport.write(held)
        self.__dict__.pop("write", None)  # a hold never completed: the plain `write` again
        self._on_close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head, an abort extension, a
    lingering close, a deadline for each request's head and body, and a connection cap.

    The head limit is the config's `h11_max_incomplete_event_size` (the same setting h11 uses).
    While a head is being read, every received chunk counts against the limit (an upper
    bound: a chunk may also hold body bytes), so memory stays bounded by the limit plus one
    read; when the head completes, its exact size is checked too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_limit = self.config.h11_max_incomplete_event_size or DEFAULT_HEAD_LIMIT
        config = self.config
        self._limits = config.limits if isinstance(config, GatewayConfig) else ConnectionLimits()
        self._reading_head = True
        self._head_bytes = 0
        self._refused = False
        # past the connection cap: the bytes of the request line so far, and its bound
        self._cap_line: bytearray | None = None
        self._cap_timer: asyncio.TimerHandle | None = None
        # the request being received: its declared length, body bytes seen, whether complete
        self._declared: int | None = None
        self._body_seen = 0
        self._body_done = True
        self._body_timer: asyncio.TimerHandle | None = None
        # while a body is read, bounded by the head limit: the bytes received since its last
        # piece (its framing, and a trailer field, which the parser buffers whole: an upper
        # bound, off by at most one read), and the size of its trailer fields (exact)
        self._framing_bytes = 0
        self._trailer_bytes = 0
        # the lingering close: at most this many more bytes are read, until its deadline
        self._lingering = False
        self._linger_left = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        #: wrong keys this connection sent (its answers slow down: `gateway.api.keys.backoff`)
        self._failed_keys = FailedKeys()
        #: the running request's watcher of its client, if it asked for one (`_gone`)
        self._gone_future: asyncio.Future[None] | None = None

    # ---- connection life -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            self._refused = True
            self._cap_line = bytearray()
            self._cap_timer = self.loop.call_later(
                min(CAP_LINE_WAIT, self._limits.body_timeout), self._refuse_connection)
            return
        self._start_body_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_body_timer()
        gone, self._gone_future = self._gone_future, None
        if gone is not None and not gone.done():  # (a request done with it cancelled it)
            gone.set_result(None)
        if self._cap_timer is not None:
            self._cap_timer.cancel()
            self._cap_timer = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)
        # its last request's cycle holds the protocol through its scope's hooks (abort, hold):
        # let it go, as uvicorn lets go of its parser, so that both are freed now and not by the
        # cyclic collector, which reaches a long-lived connection's objects late
        self.cycle = None  # type: ignore[assignment]
        self.pipeline.clear()

    def eof_received(self) -> None:
        if self._cap_line is not None:  # no request line will come: answer without it
            self._refuse_connection()
        if self._lingering:  # the client is done sending: nothing more to wait for
            self._end_linger()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._discard(len(data))
            return
        if self._cap_line is not None:
            self._cap_line += data
            if b"\n" in self._cap_line or len(self._cap_line) > CAP_LINE_BYTES:
                self._refuse_connection()
            return
        if self._refused:
            return
        if self._reading_head:
            self._head_bytes += len(data)
        elif not self._body_done:
            self._framing_bytes += len(data)
        super().data_received(data)
        if self._refused:
            return
        if self._reading_head:
            if self._head_bytes > self._head_limit:
                self._refuse()
        elif not self._body_done and max(self._framing_bytes,
                                         self._trailer_bytes) > self._head_limit:
            self._refuse_trailers()

    # ---- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._body_done = False
        self._body_seen = 0
        self._declared = None
        self._start_body_timer()
        extensions = self.scope.get("extensions") or {}
        extensions[ABORT_EXTENSION] = {"abort": self._abort}
        extensions[FAILED_KEYS_EXTENSION] = {"failed": self._failed_keys}
        self.scope["extensions"] = extensions

    def on_header(self, name: bytes, value: bytes) -> None:
        """A field of the head; past the head, a trailer field: dropped (the app reads none,
        and the header list it would join is the scope's, checked already)."""
        if self._reading_head:
            super().on_header(name, value)
        else:
            self._trailer_bytes += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self._head_limit:
            self._refused = True
            raise HeadTooLarge  # httptools wraps it; uvicorn calls send_400_response
        self._reading_head = False
        self._head_bytes = 0
        self._framing_bytes = self._trailer_bytes = 0
        codings: list[bytes] = []
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit():
                self._declared = int(value)
            elif name == b"transfer-encoding":
                codings.append(value)
        if codings and not chunked_last(codings):
            raise UnframedBody  # uvicorn answers 400 and closes; the app never sees it
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None:
            hook = cycle.transport = _CloseHook(self.transport, self._close_after_response)
            # this request's own hook (a pipelined request's cycle has its own)
            cycle.scope["extensions"][HOLD_HEAD_EXTENSION] = {"hold": hook.hold}
            # this request's own cycle, weakly: held strongly from its scope, the cycle and
            # its scope would be a reference cycle, freed only by the collector
            cycle.scope["extensions"][GONE_EXTENSION] = {
                "gone": functools.partial(self._gone, weakref.ref(cycle))}

    def on_body(self, body: bytes) -> None:
        self._body_seen += len(body)
        self._framing_bytes = 0
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_done = True
        self._cancel_body_timer()
        super().on_message_complete()
        self._reading_head = True
        self._head_bytes = 0

    def on_response_complete(self) -> None:
        if self._lingering:  # no keep-alive timer, no pipelined request: the linger decides
            self.server_state.total_requests += 1
            return
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        if self._refused:
            self._refuse()
            return
        super().send_400_response(msg)

    # ---- refusing, timing out, lingering ---------------------------------------------------

    def _refuse(self) -> None:
        """431. The client may still be sending its head: linger, so it reads the answer."""
        self._refused = True
        if not self.transport.is_closing() and not self._lingering:
            self.transport.write(raw_error_response(HeadersTooLarge(
                f"request line and headers exceed {self._head_limit} bytes"
            ), getattr(self, "url", b"")))
            self._linger(HEAD_LINGER_BYTES)

    def _refuse_trailers(self) -> None:
        """A body's trailers (or framing) ran past the head limit: 431 when no answer has
        begun (the app, still waiting for the body, sees a disconnect), else the connection
        ends once its answer is out; either way nothing more of it is parsed."""
        self._refused = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = not cycle.response_started  # the app gives up on the body
            cycle.message_event.set()
            if cycle.response_started:  # an answer under way: it finishes, then the close
                cycle.keep_alive = False
                return
        if self.transport.is_closing() or self._lingering:
            return
        if cycle is None or not cycle.response_started:
            self.transport.write(raw_error_response(HeadersTooLarge(
                f"request trailers exceed {self._head_limit} bytes"
            ), getattr(self, "url", b"")))
        self._linger(HEAD_LINGER_BYTES)

    def _refuse_connection(self) -> None:
        """503 to a connection past the cap, in the shape its request line's path asks for
        (the OpenAI shape when none came); then the lingering close."""
        line, self._cap_line = bytes(self._cap_line or b""), None
        if self._cap_timer is not None:
            self._cap_timer.cancel()
            self._cap_timer = None
        if self.transport.is_closing():
            return
        parts = line.split(b"\n", 1)[0].split(b" ")
        path = parts[1] if len(parts) > 1 else b""
        self.transport.write(raw_error_response(TooManyConnections(
            "the gateway has too many open connections", retry_after=1.0
        ), path))
        self._linger()

    def _gone(self, request: weakref.ref[RequestResponseCycle]) -> asyncio.Future[None]:
        """`GONE_EXTENSION`: a future resolved when this connection is lost, for the request
        of the cycle `request` refers to (resolved at once if it already is). One request's
        app runs at a time on a connection, so the latest one asked for is the one
        `connection_lost` resolves.

        Reading is resumed, as uvicorn's `receive()` does (and the watcher task reading it
        did): a body larger than uvicorn's high-water mark that arrived in one read leaves
        the connection's reading paused after the app took it, and a paused connection never
        sees its client's close."""
        future: asyncio.Future[None] = self.loop.create_future()
        cycle = request()
        if self.transport.is_closing() or cycle is None or cycle.disconnected:
            future.set_result(None)
            return future
        self._gone_future = future
        if not self._lingering and not cycle.response_complete:
            self.flow.resume_reading()
        return future

    def _abort(self) -> None:
        """Drop the connection now, unsent bytes and all (a client that stopped reading)."""
        self.transport.abort()

    def _start_body_timer(self) -> None:
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(
                self._limits.body_timeout, self._body_timed_out
            )

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        """The request's head or body is late: 408 unless a response is already under way
        (the app answered before reading the body); either way the connection ends."""
        self._body_timer = None
        if self.transport.is_closing() or self._lingering:
            return
        cycle = self.cycle
        if self.pipeline or (self._reading_head and cycle and not cycle.response_complete):
            # an earlier response is still being sent: the delay is ours, not the client's
            self._start_body_timer()
            return
        if self._reading_head or cycle is None or not cycle.response_started:
            if cycle is not None and not self._reading_head:  # the app waits for the body:
                cycle.disconnected = True  # it sees a disconnect, and answers nothing
                cycle.message_event.set()
            self.transport.write(raw_error_response(RequestTimeout(
                f"the request did not arrive within {self._limits.body_timeout:g} s"
            ), getattr(self, "url", b"")))
        self._linger()

    def _close_after_response(self) -> None:
        """A response asked to close the connection: at once if the request has been read
        to its end, else only after lingering."""
        if self._body_done or self.transport.is_closing():
            self.transport.close()
        else:
            self._linger()

    def _linger(self, limit: int | None = None) -> None:
        """Send our FIN, then read and drop what the client still sends (the rest of the
        declared body, or until its EOF), bounded in bytes (`limit`, else the configured
        bound) and time, then close. A close with unread bytes would reset the connection
        and destroy the response unread."""
        if self._lingering or self.transport.is_closing():
            return
        self._lingering = True
        self._cancel_body_timer()
        left = min(self._limits.linger_bytes, limit or self._limits.linger_bytes)
        if self._declared is not None and not self._body_done and not self._reading_head:
            left = min(left, max(0, self._declared - self._body_seen))
            if left == 0:
                self.transport.close()
                return
        self._linger_left = left
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(self._limits.linger_seconds, self._end_linger)

    def _discard(self, size: int) -> None:
        self._linger_left -= size
        if self._linger_left <= 0:
            self._end_linger()

    def _end_linger(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if not self.transport.is_closing():
            self.transport.close()
