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
- No redirects, no environment proxies, TLS verified (the default context), keep-alive expiry,
  no transparent decompression (bytes are relayed as they are).
- **A kept-alive connection the upstream closed as we reused it is no backend failure.**
  Inference servers close idle connections sooner than we drop them (uvicorn, under vLLM,
  SGLang and llama-cpp-python, after 5 s); when our loop is busy at that moment, its close is
  still unread as we pick the connection, and the request meets a closed socket. A POST that
  fails so on a reused connection, before any byte of an answer, is sent again
  (`_closed_idle`), up to `RESENDS` times, since the next idle connection may be as stale
  (aiohttp hands out the oldest first); each try drops the dead one, so the last goes out on
  a fresh connection at worst. Without that it would fail over to another backend, cold for
  the conversation, and count against a healthy one. If the server did read it (it crashed
  right then), the copy is what a failover would have sent anyway, only to the same backend.
  A fresh connection closed unanswered is the server's doing and fails as before; other
  methods are left to aiohttp, which resends idempotent ones once by itself. Knowing that a
  connection was reused costs aiohttp's request tracing: about 16-20 us of CPU per upstream
  request (measured on loopback, 164 -> 180 us a request in the client's thread), some 2 % of
  the gateway's CPU per request, the price of not failing over from a healthy backend.

The session is created on first use, inside the running loop (aiohttp binds it to one).
"""

from __future__ import annotations

import asyncio
import errno
import re
import ssl as ssl_module
from collections.abc import AsyncIterator, Mapping, Sequence

import aiohttp

from gateway.errors import (
    GatewayPoolFull,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

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


#: the errors of a request sent on a connection the upstream had closed: its close read as we
#: sent (EOF: `ServerDisconnectedError`), the reset its kernel answered our request with, or a
#: write refused by the closing transport (aiohttp's "Can not write request body": no errno)
_CLOSED_UNDER_US = frozenset({errno.ECONNRESET, errno.EPIPE, None})


class _Reuse:
    """One request's record of whether aiohttp gave it a kept-alive connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _on_reuse(session: aiohttp.ClientSession, context: object,
                    params: aiohttp.TraceConnectionReuseconnParams) -> None:
    holder = getattr(context, "trace_request_ctx", None)
    if isinstance(holder, _Reuse):
        holder.reused = True


#: the times a POST that met a closed kept-alive connection is sent again (module docstring)
RESENDS = 3


def _closed_idle(exc: BaseException, reuse: _Reuse) -> bool:
    """The request met a kept-alive connection its upstream had closed (see the module
    docstring): most likely unread by the upstream, so worth sending again."""
    if not reuse.reused or isinstance(exc, aiohttp.ClientConnectorError):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in _CLOSED_UNDER_US


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
            connector = aiohttp.TCPConnector(
                # our semaphore is the bound that answers "pool full"; this one is a backstop
                limit=self.max_connections,
                limit_per_host=0,
                keepalive_timeout=self.keepalive_expiry,
                ssl=self.ssl,
            )
            reuse = aiohttp.TraceConfig()
            reuse.on_connection_reuseconn.append(_on_reuse)
            session = self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=self.trust_env,
                timeout=aiohttp.ClientTimeout(total=None), trace_configs=[reuse],
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
        """The request up to its response head; a POST that met a kept-alive connection its
        upstream had closed is sent again, up to `RESENDS` times (`_closed_idle`)."""
        session = self._get_session()
        resends = RESENDS if method == "POST" else 0
        while True:
            reuse = _Reuse()
            try:
                return await session.request(
                    method, url, data=content, headers=headers, params=params,
                    timeout=timeout, allow_redirects=False, proxy=self.proxy,
                    trace_request_ctx=reuse)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if resends <= 0 or not _closed_idle(exc, reuse):
                    raise
                resends -= 1

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
