"""The bench's load client: a small HTTP/1.1 keep-alive client on `asyncio.Protocol`.

Why not httpx, which the rest of the project uses for its own calls (the stats command, the
bench's control calls): a load generator that saturates before the system it loads measures
only itself. The `overhead` workload runs the load client and both simulated upstreams on one
core while the gateway has the other; with httpx the client cost about 1.5 ms of CPU per
streamed request (its pool, its stream wrappers, one await per chunk), so `direct` (no gateway
at all) stopped near 350 req/s, below the gateway's target. Here a connection is an
`asyncio.Protocol` fed to httptools' response parser (the C parser uvicorn uses), a request is
one prebuilt write, and the body goes chunk by chunk, synchronously, to a `Sink` that scans it
where it lands: one future per request, none per chunk.

What it does not do, since the bench needs none of it: TLS, proxies, redirects, cookies,
compression, request bodies other than bytes, HTTP/2. Bounded: a connect timeout, a read
timeout (no byte for `timeout` seconds), at most `MAX_HEADERS` response headers, at most
`max_idle` idle connections per host; the body is never buffered here (the sink keeps what it
needs). A request whose sink stops early, that fails or whose task is cancelled closes its
connection; only a response read to its end leaves one for reuse.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

#: more response headers than this is a protocol error (the bench's servers send fewer than 10)
MAX_HEADERS = 64


class TransportError(Exception):
    """A request failed below HTTP. `kind` uses httpx's exception names (`ConnectError`,
    `ConnectTimeout`, `ReadTimeout`, `ReadError`, `RemoteProtocolError`), so the bench's error
    labels read as they did when its client was httpx."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Sink(Protocol):
    """Where a response goes: its head once, then its body as it arrives."""

    def head(self, status: int, headers: Mapping[bytes, bytes]) -> None: ...

    def body(self, data: bytes) -> bool:
        """One chunk of the (de-chunked) body; False stops the request here and drops the
        connection (the rest of the body is not read)."""
        ...


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    path: str


def target(url: str) -> Target:
    """`http://host:port/path` split for `request`; only plain http."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"not a plain http URL: {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.hostname, parts.port or 80, path)


def request_bytes(method: str, t: Target, body: bytes, headers: Mapping[str, str]) -> bytes:
    """The whole request, head and body, for one write."""
    lines = [f"{method} {t.path} HTTP/1.1", f"host: {t.host}:{t.port}",
             f"content-length: {len(body)}"]
    lines.extend(f"{name}: {value}" for name, value in headers.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Buffered:
    """A Sink that keeps the whole body (a non-streaming response), at most `limit` bytes:
    a longer body stops the request and sets `too_large`."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self.status = 0
        self.too_large = False
        self._limit = limit
        self._chunks: list[bytes] = []
        self._size = 0

    def head(self, status: int, headers: Mapping[bytes, bytes]) -> None:
        self.status = status

    def body(self, data: bytes) -> bool:
        self._size += len(data)
        if self._size > self._limit:
            self.too_large = True
            return False
        self._chunks.append(data)
        return True

    @property
    def content(self) -> bytes:
        return b"".join(self._chunks)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request on it at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._sink: Sink | None = None
        self._done: asyncio.Future[None] | None = None
        self._headers: dict[bytes, bytes] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        self._last = 0.0
        self.closed = False
        #: the last response was read to its end and the server keeps the connection open
        self.reusable = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but are one
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            self.close()  # bytes nobody asked for: the connection is not reusable
            return
        self._last = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._finish(TransportError("RemoteProtocolError"))

    def eof_received(self) -> bool | None:
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish(TransportError("RemoteProtocolError" if exc is None else "ReadError"))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self._headers) >= MAX_HEADERS:
            raise httptools.HttpParserError("too many headers")
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        if self._sink is not None:
            self._sink.head(self._parser.get_status_code(), self._headers)

    def on_body(self, body: bytes) -> None:
        if self._sink is not None and not self._sink.body(body):
            self._finish(None)  # stopped by the sink: the rest of the body is not wanted

    def on_message_complete(self) -> None:
        if self._done is not None:  # not after a stop: that connection is closing
            self.reusable = self._parser.should_keep_alive()
            self._finish(None)

    # -- the request
    def start(self, payload: bytes, sink: Sink, timeout: float) -> asyncio.Future[None]:
        assert self._transport is not None
        self._sink, self._headers, self.reusable = sink, {}, False
        self._done = self._loop.create_future()
        self._timeout, self._last = timeout, self._loop.time()
        self._timer = self._loop.call_at(self._last + timeout, self._check_timeout)
        self._transport.write(payload)
        return self._done

    def _check_timeout(self) -> None:
        due = self._last + self._timeout
        if self._loop.time() >= due:
            self._timer = None
            self._finish(TransportError("ReadTimeout"))
        else:
            self._timer = self._loop.call_at(due, self._check_timeout)

    def _finish(self, error: TransportError | None) -> None:
        done, self._done, self._sink = self._done, None, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if done is not None and not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
        if error is not None or not self.reusable:
            self.close()

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        if self._transport is not None:
            self._transport.close()


class LeanClient:
    """One load worker's client: keep-alive connections per host, used one request at a time
    each. Use it as an async context manager; closing it closes every idle connection."""

    def __init__(self, timeout: float = 60.0, connect_timeout: float = 5.0,
                 max_idle: int = 4) -> None:
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open = True

    async def __aenter__(self) -> LeanClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._open = False
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(loop)
        try:
            async with asyncio.timeout(self._connect_timeout):
                await loop.create_connection(lambda: conn, host, port)
        except TimeoutError:
            raise TransportError("ConnectTimeout") from None
        except OSError:
            raise TransportError("ConnectError") from None
        return conn

    async def request(self, t: Target, payload: bytes, sink: Sink) -> None:
        """Send `payload` (from `request_bytes`) to `t` and feed the response to `sink` until
        it ends or the sink stops it. Raises TransportError; a cancelled request closes its
        connection."""
        key = (t.host, t.port)
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                break
        else:
            conn = await self._connect(t.host, t.port)
        try:
            await conn.start(payload, sink, self._timeout)
        except BaseException:
            conn.close()
            raise
        if conn.reusable and not conn.closed and self._open:
            pool = self._idle.setdefault(key, [])
            if len(pool) < self._max_idle:
                pool.append(conn)
                return
        conn.close()
