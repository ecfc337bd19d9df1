"""Any OpenAI-compatible upstream (vLLM, SGLang, llama.cpp, Ollama, TGI, OpenAI) over httpx.

One shared `httpx.AsyncClient` (owned by the app) carries every attempt; this adapter only
builds requests and translates httpx's exceptions into our error tree. It never follows
redirects, never forwards the client's credentials, and keeps only allowlisted response
headers. Closing a response that is still streaming drops its connection (HTTP/1.1 cannot
reuse a half-read connection), which is exactly what a cancelled hedge needs: the upstream
sees the disconnect and stops generating.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import anyio
import httpx

from gateway.errors import (
    GatewayPoolFull,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from gateway.settings import BackendSettings, Timeouts
from gateway.sse import SSEDecoder, SSEEvent, SSEProtocolError
from providers.base import UpstreamCall, finish_despite_cancel

#: response headers a client may see from an upstream; everything else stays behind
PASS_HEADERS = frozenset(
    {
        "openai-processing-ms",
        "openai-version",
        "x-request-id",
        "x-ratelimit-limit-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-requests",
        "x-ratelimit-reset-tokens",
    }
)

#: a non-streaming body larger than this is refused (a broken upstream must not fill memory)
MAX_BODY_BYTES = 64 * 1024 * 1024

#: stream bytes that may arrive without completing an event (many `data:` lines and no blank
#: line, or endless comments): the SSE decoder bounds one line, this bounds one event
MAX_EVENT_BYTES = 16 * 1024 * 1024

#: a backend's `Retry-After` pauses it at most this long: a broken or hostile upstream must
#: not take itself out of the pool for hours with one header
MAX_RETRY_AFTER = 300.0

#: closing must finish quickly even when cancelled; past this the socket is abandoned to GC
CLOSE_TIMEOUT = 2.0

_MEDIA_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]{1,40}/[A-Za-z0-9!#$&^_.+-]{1,60}")


def media_type(content_type: str) -> str:
    """The bare media type for messages (`text/html`), or `unknown`: the rest of the header
    is the upstream's text, and an upstream's text never reaches a client."""
    bare = content_type.split(";", 1)[0].strip()
    return bare.lower() if _MEDIA_TYPE.fullmatch(bare) else "unknown"


def parse_retry_after(headers: httpx.Headers) -> float | None:
    """Seconds from `retry-after-ms` or `Retry-After` (delta-seconds form only), at most
    `MAX_RETRY_AFTER`; None when absent or not a finite number."""
    raw_ms = headers.get("retry-after-ms")
    raw = headers.get("retry-after")
    try:
        if raw_ms is not None:
            seconds = float(raw_ms) / 1000.0
        elif raw is not None:
            seconds = float(raw)
        else:
            return None
    except ValueError:
        return None
    if not math.isfinite(seconds):  # `inf` would pause the backend for ever, `nan` confuse it
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER)


def translate(exc: httpx.HTTPError) -> UpstreamError:
    """Map an httpx exception to our error tree, keeping no URL or body in the reason."""
    if isinstance(exc, httpx.PoolTimeout):  # our own pool is full: not the backend's fault
        return GatewayPoolFull("no free upstream connection in the gateway's pool")
    if isinstance(exc, httpx.ConnectTimeout):
        return UpstreamConnectTimeout("connect timeout")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamConnectError("connect error")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout("read timeout")
    if isinstance(exc, httpx.RemoteProtocolError):
        return UpstreamDisconnected("connection closed or reset by upstream")
    if isinstance(exc, httpx.ReadError):
        return UpstreamDisconnected("connection reset by upstream")
    return UpstreamProtocolError(f"transport error ({type(exc).__name__})")


class HttpxStream:
    """An open 200 response; `batches()` decodes it incrementally."""

    def __init__(
        self, response: httpx.Response, *, stream: bool, allowed: frozenset[str] = PASS_HEADERS
    ) -> None:
        self._response = response
        self._stream = stream
        # From the raw bytes, decoded as Latin-1 (lossless, and what the server re-encodes
        # with): httpx's own str values may hold UTF-8-decoded characters that cannot be
        # written back into a header, which made a hostile upstream's header a 500.
        self.headers: Mapping[str, str] = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in response.headers.raw
            if name.decode("latin-1").lower() in allowed
        }

    def batches(self) -> AsyncIterator[list[SSEEvent]]:
        return self._sse() if self._stream else self._whole_body()

    def _body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive. Not httpx's `aiter_raw`: that one closes the
        response itself at the body's end, unshielded, and a cancel landing in that close (a
        non-streaming loser whose body just ended) left the connection in use for ever;
        `aclose` closes it instead, whatever cancel comes."""
        return cast(httpx.AsyncByteStream, self._response.stream).__aiter__()

    async def _sse(self) -> AsyncIterator[list[SSEEvent]]:
        decoder = SSEDecoder()
        pending = 0  # bytes since the last completed event
        try:
            async for chunk in self._body():
                events = decoder.feed(chunk)
                if not events:
                    pending += len(chunk)
                    if pending > MAX_EVENT_BYTES:
                        raise UpstreamProtocolError(
                            f"malformed stream: no event in {MAX_EVENT_BYTES} bytes"
                        )
                    continue
                pending = 0
                yield events
        except httpx.HTTPError as exc:
            raise translate(exc) from None
        except SSEProtocolError as exc:
            raise UpstreamProtocolError(f"malformed stream: {exc}") from None

    async def _whole_body(self) -> AsyncIterator[list[SSEEvent]]:
        parts: list[bytes] = []
        size = 0
        try:
            async for chunk in self._body():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise UpstreamProtocolError("response body too large")
                parts.append(chunk)
        except httpx.HTTPError as exc:
            raise translate(exc) from None
        yield [SSEEvent(b"".join(parts))]

    async def aclose(self) -> None:
        # `open` closes a non-200 response itself, outside `attempt.close_quietly`: this close
        # must survive the race's cancel on its own
        await finish_despite_cancel(self._close())

    async def _close(self) -> None:
        with anyio.move_on_after(CLOSE_TIMEOUT):
            await self._response.aclose()


#: where each `auth` mode puts the key
AUTH_HEADERS = {"bearer": "authorization", "api-key": "api-key", "x-api-key": "x-api-key"}


def upstream_headers(settings: BackendSettings) -> dict[str, str]:
    """The headers every request to this backend carries: the configured static ones, then
    the key as `auth` says (so a static header cannot be mistaken for the credential)."""
    headers = {name.lower(): value for name, value in settings.headers}
    headers["accept-encoding"] = "identity"
    headers["content-type"] = "application/json"
    target = AUTH_HEADERS.get(settings.auth or "none")
    if settings.api_key and target is not None:
        value = settings.api_key
        headers[target] = f"Bearer {value}" if target == "authorization" else value
    return headers


async def close_orphaned_connections(client: httpx.AsyncClient) -> None:
    """Close the client's connections that are connected but carry no request (httpcore's
    state `NEW`).

    Why: httpcore 1.0.x has a one-iteration window between a new connection's TCP connect and
    the start of its first request (the connection's state lock) where a cancellation leaves
    the connection in state `NEW` for ever: never used, never expired, its socket open until
    the upstream closes it, and then in CLOSE_WAIT (the soak's leak, with hedge losers and
    504s cancelled while they connect). Called after a cancelled `send`. A `NEW` connection
    that another request is about to use is safe to close too: that request gets httpcore's
    `ConnectionNotAvailable` and its pool opens another connection.
    """
    # httpx keeps its transport's pool private; httpcore's `connections` and `info()` are public
    pool: Any = getattr(getattr(client, "_transport", None), "_pool", None)
    for connection in list(getattr(pool, "connections", ())):
        if ", NEW," in connection.info():
            await connection.aclose()


def guard_pool_closes(client: httpx.AsyncClient) -> None:
    """Make the client's pool finish closing the connections it drops, despite a cancel.

    Why: before each request httpcore's pool closes, one after the other, the connections it
    finds dead (the upstream closed them while idle) or expired. The first close awaits once;
    a cancel landing there (a hedge cancelled as it starts) skips the rest, which have left
    the pool already: nothing closes their sockets any more (CLOSE_WAIT for ever). httpcore
    shields that loop with an anyio shield, which a native `Task.cancel()` goes through.
    """
    # httpx keeps its transport's pool private; this wraps one method of httpcore's pool
    pool: Any = getattr(getattr(client, "_transport", None), "_pool", None)
    close_connections = getattr(pool, "_close_connections", None)
    if close_connections is None:
        return

    async def close_all(closing: list[Any]) -> None:
        if closing:
            await finish_despite_cancel(close_connections(closing))

    pool._close_connections = close_all


class OpenAIProvider:
    """A backend that speaks the OpenAI HTTP API.

    `owns_client`: the client is this backend's own (its TLS or proxy settings differ from
    the shared client's) and is closed with the provider."""

    def __init__(
        self,
        settings: BackendSettings,
        client: httpx.AsyncClient,
        timeouts: Timeouts,
        *,
        owns_client: bool = False,
    ) -> None:
        if settings.base_url is None:  # the config loader already refuses this
            raise ValueError(f"backend {settings.name}: base_url is required")
        self.name = settings.name
        self._client = client
        self._owns_client = owns_client
        self._base_url = settings.base_url.rstrip("/")
        self._headers = upstream_headers(settings)
        self._query = dict(settings.query)
        self.pass_headers = PASS_HEADERS
        # The read timeout bounds the gap between two reads: before the first token the
        # race's deadline is tighter; after commit it is the idle timeout (SPEC §8).
        self._timeout = httpx.Timeout(
            connect=timeouts.connect,
            read=timeouts.idle,
            write=timeouts.connect,
            pool=timeouts.connect,
        )

    def url(self, call: UpstreamCall) -> str:
        """`{base_url}/{route}`: the OpenAI SDK's base URL includes `/v1`."""
        return f"{self._base_url}/{call.path or call.endpoint}"

    def _whole_body_timeout(self, call: UpstreamCall) -> httpx.Timeout:
        """A non-streaming body may take the request's whole deadline (the pool's `timeout`,
        SPEC §18) to start: the idle timeout between reads must not cut it off first."""
        read = self._timeout.read or 0.0
        if call.first_byte_timeout <= read:
            return self._timeout
        return httpx.Timeout(
            connect=self._timeout.connect,
            read=call.first_byte_timeout,
            write=self._timeout.write,
            pool=self._timeout.pool,
        )

    async def open(self, call: UpstreamCall) -> HttpxStream:
        headers = dict(call.extra_headers)
        headers.update(self._headers)  # ours win: a client cannot replace the credential
        headers["x-request-id"] = call.request_id
        has_body = call.method not in ("GET", "DELETE")
        request = self._client.build_request(
            call.method,
            self.url(call),
            params={**call.query, **self._query} or None,
            content=json.dumps(call.body, separators=(",", ":")).encode() if has_body else None,
            headers=headers if has_body else {k: v for k, v in headers.items()
                                              if k != "content-type"},
            timeout=self._timeout if call.stream else self._whole_body_timeout(call),
        )
        try:
            response = await self._client.send(request, stream=True, follow_redirects=False)
        except httpx.HTTPError as exc:
            raise translate(exc) from None
        except asyncio.CancelledError:
            await finish_despite_cancel(close_orphaned_connections(self._client))
            raise
        if response.status_code != 200:
            retry_after = parse_retry_after(response.headers)
            await HttpxStream(response, stream=False).aclose()
            raise UpstreamStatusError.of(response.status_code, retry_after=retry_after)
        content_type = media_type(response.headers.get("content-type", ""))
        expected = "text/event-stream" if call.stream else "application/json"
        if content_type != expected:
            await HttpxStream(response, stream=False).aclose()
            raise UpstreamProtocolError(f"unexpected content type {content_type}")
        if (response.headers.get("content-encoding") or "identity").lower() != "identity":
            # we asked for identity and relay raw bytes: compressed bytes would reach the
            # client as garbage
            await HttpxStream(response, stream=False).aclose()
            raise UpstreamProtocolError("unexpected content encoding")
        return HttpxStream(response, stream=call.stream, allowed=self.pass_headers)

    async def aclose(self) -> None:
        """Close the backend's own client; the shared one belongs to the app."""
        if self._owns_client:
            await self._client.aclose()
