"""The shared upstream HTTP client: aiohttp's connection pool and C parser, our own bounds.

Why aiohttp and not httpx here: measured at c=50 (README, "Performance"), about half of the
gateway's CPU went to httpcore, most of it in its pool scanning every connection on each
request. aiohttp's connector keeps idle connections per host in a dict of lists and parses
responses in C. httpx stays where it serves (the stats command, the bench's load client).

What this module adds around aiohttp, because the gateway needs it:
- **Our pool bound, our error.** At most `max_connections` responses are open at once; a
  request that finds none free within `timeouts.connect` fails with `GatewayPoolFull`, which
  is our failure, never held against the backend. aiohttp's own connector wait would surface
  as a connect timeout, indistinguishable from a slow backend, so the bound is a semaphore
  here and the connector never has to wait.
- **Exact error classes** (`translate`): refused, connect timeout, read timeout, reset and a
  close mid-body stay distinct.
- **Dropping a half-read response.** `UpstreamResponse.close()` closes the connection of a
  response whose body did not end (the upstream sees the disconnect: a cancelled hedge stops
  generating), and returns a fully read one to the pool.
- **A response read as events** (`AiohttpStream`): the stream every HTTP adapter hands the
  race, SSE decoded per read (an event that never completes bounded by `MAX_EVENT_BYTES`) or
  a whole body (bounded by `MAX_BODY_BYTES`), with only the headers the adapter allows.
- No redirects, no environment proxies, TLS verified (the default context), keep-alive expiry,
  no transparent decompression (bytes are relayed as they are).
- **No cookies.** The client carries every client's and every key's requests: a cookie jar
  would store what a backend (or the load balancer in front of it) sets on one tenant's
  answer, a session or a stickiness cookie, and send it with every later request to that
  host, whoever made it. The session's jar is aiohttp's `DummyCookieJar`, which keeps nothing
  (and spares each request the jar's filtering).
- **A kept-alive connection the upstream closed while it sat idle is no backend failure.**
  Inference servers close idle connections sooner than we drop them (uvicorn, under vLLM,
  SGLang and llama-cpp-python, after 5 s); when our loop is busy at that moment, its close is
  still unread as we pick the connection. Written on such a connection, the request would
  fail over to another backend, cold for the conversation, and count against a healthy one.
  So a pooled connection is looked at as it is handed out (`_CheckedConnector`): if its socket
  is readable, the server spoke while nobody asked (its FIN, a reset, a TLS close_notify, a
  stray 408), it cannot carry a request, and it is closed before anything is written on it;
  the next pooled or a new connection is taken. One `poll` of one descriptor, reused
  connections only (about a microsecond).
- **A POST is sent again only when the server provably did not start on it, and at most
  once** (`_closed_idle`): on a reused connection, when writing the request failed (`EPIPE`,
  `ECONNRESET`, or a transport already closing: aiohttp's "Can not write request body"). The
  server then never had the whole request, and an HTTP server cannot act on a body it did not
  receive. A close or a reset *after* the request was written is never resent, however soon it
  came: the server may have read the request and worked on it (a proxy's timeout, a worker
  that dies on this prompt), and a copy would repeat that work on the same server and delay
  the failover; it fails over like any other failure. What that leaves out is a close that
  reaches us between the look at hand-out and the write (one pass of the loop), rare and
  answered by a failover. A fresh connection closed unanswered is the server's doing and is
  never resent; other methods are left to aiohttp, which resends idempotent ones once by
  itself. Whether a connection was reused is known without aiohttp's request tracing, which
  cost about 16-20 us of CPU per upstream request on the first byte's path (164 -> 180 us a
  request in the client's thread, some 2 % of the gateway's CPU per request): the connector
  remembers, weakly, every connection it has handed out, and one handed out again came from
  the pool (`_CheckedConnector`). It tells the request being sent through a context
  variable, which each attempt's task has its own copy of.

The session is created on first use, inside the running loop (aiohttp binds it to one).
"""

from __future__ import annotations

import asyncio
import errno
import re
import select
import ssl as ssl_module
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import aiohttp
import aiohttp.connector
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.tracing import Trace

from gateway.errors import (
    GatewayPoolFull,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.wire.sse import SSEBatch, SSEDecoder, SSEEvent, SSEProtocolError

#: aiohttp appends `. <OSError>(...)` to a payload error when the connection was lost with an
#: error (a reset) rather than closed cleanly; the exception carries no other trace of it
_LOST_WITH_ERROR = re.compile(r"\. [A-Za-z]*Error\(")


def translate(exc: aiohttp.ClientError | asyncio.TimeoutError) -> UpstreamError:
    """Map an aiohttp exception to our error tree, keeping no URL or body in the reason."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectTimeout("connect timeout")
    if isinstance(exc, aiohttp.ServerTimeoutError | asyncio.TimeoutError):
        return UpstreamTimeout("read timeout")
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, DNS, TLS handshake
        return UpstreamConnectError("connect error")
    if isinstance(exc, aiohttp.ClientPayloadError):
        if _LOST_WITH_ERROR.search(str(exc)):
            return UpstreamDisconnected("connection reset by upstream")
        return UpstreamDisconnected("connection closed by upstream before the response ended")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return UpstreamDisconnected("connection closed by upstream before the response")
    if isinstance(exc, aiohttp.ClientOSError):
        return UpstreamDisconnected("connection reset by upstream")
    if isinstance(exc, aiohttp.ClientResponseError):  # a head the parser refused
        return UpstreamProtocolError("malformed response head")
    return UpstreamProtocolError(f"transport error ({type(exc).__name__})")


#: the errno of a failed write of the request: the peer reset the connection (EPIPE,
#: ECONNRESET), or the transport was already closing (aiohttp's refusal carries no errno)
_WRITE_FAILED = frozenset({errno.ECONNRESET, errno.EPIPE, None})
#: how aiohttp words a failure to write the request (the write's, not the response's, error)
_WRITE_FAILURE_TEXT = "Can not write request body"


class _Reuse:
    """One request's record of whether aiohttp gave it a kept-alive connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


#: the record of the request this task is sending (`UpstreamClient._send` sets it around the
#: call into aiohttp, `_CheckedConnector.connect` fills it in, in the same task). A context
#: variable, not shared state: each attempt runs in a task of its own, with its own value.
_SENDING: ContextVar[_Reuse | None] = ContextVar("hedge_gateway_sending", default=None)


#: the times a POST whose request could not be written is sent again (module docstring)
RESENDS = 1


def _closed_idle(exc: BaseException, reuse: _Reuse) -> bool:
    """The request failed on a kept-alive connection while it was being written, so the
    server never had all of it (module docstring): worth sending again. A failure after the
    write, a clean close included, is not: the server may have started on it."""
    if not reuse.reused or not isinstance(exc, aiohttp.ClientOSError):
        return False
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return exc.errno in _WRITE_FAILED and _WRITE_FAILURE_TEXT in str(exc.strerror)


def _peer_spoke(connection: aiohttp.connector.Connection) -> bool:
    """An idle kept-alive connection whose socket is readable: the server closed or reset it,
    or sent bytes nobody asked for. Either way it cannot carry a request."""
    transport = connection.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


class _CheckedConnector(aiohttp.TCPConnector):
    """aiohttp's connector, which also drops a pooled connection whose server has closed it
    while it sat idle (module docstring), before the request is written on it, and tells the
    request being sent (`_SENDING`) whether its connection came from the pool."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        #: every connection handed out so far, weakly (an entry goes with its connection):
        #: one handed out again was kept alive in the pool
        self._handed: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()

    def _hand_out(self, connection: aiohttp.connector.Connection) -> bool:
        """Whether this connection was handed out before (a pooled one); remembers it."""
        protocol = connection.protocol
        if protocol is None:
            return False
        if protocol in self._handed:
            return True
        self._handed.add(protocol)
        return False

    async def connect(self, req: ClientRequest, traces: list[Trace],
                      timeout: aiohttp.ClientTimeout) -> aiohttp.connector.Connection:
        holder = _SENDING.get()
        # each pass takes one pooled connection out of the pool, so this ends; bounded
        # anyway, in case others keep putting closed ones back
        for _ in range(max(self.limit, 1)):
            connection = await super().connect(req, traces, timeout)
            reused = self._hand_out(connection)
            if holder is not None:
                holder.reused = reused
            if not reused or not _peer_spoke(connection):
                return connection
            connection.close()  # the next one may be a new connection
        connection = await super().connect(req, traces, timeout)
        reused = self._hand_out(connection)
        if holder is not None:
            holder.reused = reused
        return connection


class UpstreamResponse:
    """One open upstream response holding one of the client's slots until `close()`."""

    __slots__ = ("_client", "_response", "status")

    def __init__(self, client: UpstreamClient, response: aiohttp.ClientResponse) -> None:
        self._client: UpstreamClient | None = client
        self._response = response
        self.status = response.status

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive header lookup (values decoded by aiohttp)."""
        return self._response.headers

    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """The header lines as received, undecoded."""
        return self._response.raw_headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; aiohttp exceptions are translated."""
        read = self.read_chunk
        while chunk := await read():
            yield chunk

    async def read_chunk(self) -> bytes:
        """The next bytes of the body as they arrive (b"" at its end), translated errors.

        A plain coroutine rather than only the generator above, so the stream decoder reads
        with one await per chunk and no extra generator in between (the hot path)."""
        try:
            return await self._response.content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise translate(exc) from None

    def close(self) -> None:
        """Release the response: a fully read one's connection goes back to the pool, a
        half-read one's is closed (HTTP/1.1 cannot reuse it). Idempotent, never awaits."""
        self._response.close()
        client, self._client = self._client, None
        if client is not None:
            client.release()


class UpstreamClient:
    """The upstream client: bounded, no redirects, no env proxies unless `trust_env`.

    The app's one shared client carries every backend with default TLS and proxy settings; a
    backend with its own (`providers.registry.own_client`) gets a client of its own."""

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry: float = 30.0,
        ssl: ssl_module.SSLContext | bool = True,
        proxy: str | None = None,
        trust_env: bool = False,
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        #: TLS verification: True (system CAs), False (off) or a context (a backend's CA file)
        self.ssl = ssl
        #: every request goes through this proxy (aiohttp takes it per request)
        self.proxy = proxy
        #: honour HTTP(S)_PROXY / NO_PROXY and netrc from the environment
        self.trust_env = trust_env
        #: responses open now (the leak check reads it; 0 when nothing is in flight)
        self.in_use = 0
        self._slots = asyncio.Semaphore(max_connections)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None:
            connector = _CheckedConnector(
                # our semaphore is the bound that answers "pool full"; this one is a backstop
                limit=self.max_connections,
                limit_per_host=0,
                keepalive_timeout=self.keepalive_expiry,
                ssl=self.ssl,
            )
            session = self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=self.trust_env,
                timeout=aiohttp.ClientTimeout(total=None),
                cookie_jar=aiohttp.DummyCookieJar(),  # no tenant's cookie on another's request
            )
        return session

    def release(self) -> None:
        self.in_use -= 1
        self._slots.release()

    async def request(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None,
        headers: Mapping[str, str],
        timeout: aiohttp.ClientTimeout,
        pool_timeout: float,
        params: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    ) -> UpstreamResponse:
        """Send a request and return once its status and headers are in.

        `timeout.sock_connect` bounds the connect, `timeout.sock_read` every read (the head
        included); `pool_timeout` bounds the wait for a free slot (then `GatewayPoolFull`)."""
        if self._slots.locked():
            try:
                async with asyncio.timeout(pool_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise GatewayPoolFull(
                    "no free upstream connection in the gateway's pool"
                ) from None
        else:
            await self._slots.acquire()
        self.in_use += 1
        try:
            response = await self._send(method, url, content, headers, timeout, params)
        except BaseException as exc:
            self.release()
            if isinstance(exc, aiohttp.ClientError | asyncio.TimeoutError):
                raise translate(exc) from None
            raise
        return UpstreamResponse(self, response)

    async def _send(self, method: str, url: str, content: bytes | None,
                    headers: Mapping[str, str], timeout: aiohttp.ClientTimeout,
                    params: Mapping[str, str] | Sequence[tuple[str, str]] | None
                    ) -> aiohttp.ClientResponse:
        """The request up to its response head; a POST that could not be written on a
        kept-alive connection is sent again, `RESENDS` times at most (`_closed_idle`)."""
        session = self._get_session()
        resends = RESENDS if method == "POST" else 0
        while True:
            reuse = _Reuse()
            sending = _SENDING.set(reuse)
            try:
                return await session.request(
                    method, url, data=content, headers=headers, params=params,
                    timeout=timeout, allow_redirects=False, proxy=self.proxy)
            except aiohttp.ClientOSError as exc:
                if resends <= 0 or not _closed_idle(exc, reuse):
                    raise
                resends -= 1
            finally:
                _SENDING.reset(sending)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


#: a non-streaming body larger than this is refused (a broken upstream must not fill memory)
MAX_BODY_BYTES = 64 * 1024 * 1024

#: stream bytes that may arrive without completing an event (many `data:` lines and no blank
#: line, or endless comments): the SSE decoder bounds one line, this bounds one event
MAX_EVENT_BYTES = 16 * 1024 * 1024


def allowed_headers(response: UpstreamResponse, allowed: frozenset[str]) -> dict[str, str]:
    """The response's headers named in `allowed`, names lower-cased.

    From the raw bytes, decoded as Latin-1 (lossless, and what the server re-encodes with): a
    str decoded as UTF-8 may hold characters that cannot be written back into a header, which
    made a hostile upstream's header a 500."""
    return {
        name.decode("latin-1").lower(): value.decode("latin-1")
        for name, value in response.raw_headers
        if name.decode("latin-1").lower() in allowed
    }


class AiohttpStream:
    """An open 200 response as the `UpstreamStream` the race and the relay read; `batches()`
    decodes it incrementally (SSE, or a whole body as one event), bounded.

    Every HTTP adapter's stream (OpenAI's, Anthropic's, Vertex's; Bedrock's whole bodies):
    nothing in it is one API's, so it lives with the client whose response it reads. An
    adapter builds and opens the request and judges the answer's status; what it hands back
    is read here, per read, by whoever holds it (the attempt to its first token, the relay
    after), and closed here. `allowed`: the adapter's allowlist of headers a client may see."""

    def __init__(
        self, response: UpstreamResponse, *, stream: bool, allowed: frozenset[str]
    ) -> None:
        self._response = response
        self._stream = stream
        self.headers: Mapping[str, str] = allowed_headers(response, allowed)

    def batches(self) -> AsyncIterator[SSEBatch]:
        return self._sse() if self._stream else self._whole_body()

    async def _sse(self) -> AsyncIterator[SSEBatch]:
        decoder = SSEDecoder()
        feed, read = decoder.feed_batch, self._response.read_chunk
        pending = 0  # bytes since the last completed event
        try:
            while chunk := await read():
                batch = feed(chunk)
                if batch is None:
                    pending += len(chunk)
                    if pending > MAX_EVENT_BYTES:
                        raise UpstreamProtocolError(
                            f"malformed stream: no event in {MAX_EVENT_BYTES} bytes"
                        )
                    continue
                pending = 0
                yield batch
        except SSEProtocolError as exc:
            raise UpstreamProtocolError(f"malformed stream: {exc}") from None

    async def _whole_body(self) -> AsyncIterator[SSEBatch]:
        parts: list[bytes] = []
        size = 0
        async for chunk in self._response.chunks():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise UpstreamProtocolError("response body too large")
            parts.append(chunk)
        yield SSEBatch([SSEEvent(b"".join(parts))])

    async def aclose(self) -> None:
        """Release the response (`UpstreamResponse.close`): at once, idempotent."""
        self._response.close()
