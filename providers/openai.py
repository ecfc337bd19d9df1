"""Any OpenAI-compatible upstream (vLLM, SGLang, llama.cpp, Ollama, TGI, OpenAI).

One shared `UpstreamClient` (aiohttp underneath, owned by the app; `providers.http`) carries
every attempt, and translates the library's exceptions into our error tree; this adapter only
builds requests and reads answers. It never follows redirects, never forwards the client's
credentials, and keeps only allowlisted response headers. Closing a response that is still
streaming drops its connection (HTTP/1.1 cannot reuse a half-read connection), which is
exactly what a cancelled hedge needs: the upstream sees the disconnect and stops generating.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Collection, Mapping
from urllib.parse import urlsplit

import aiohttp

from gateway.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamRejectedRequest,
    UpstreamStatusError,
)
from gateway.settings import BackendSettings, Timeouts
from gateway.settings.hidden import hidden_values
from gateway.wire.explain import MAX_BODY, explain
from gateway.wire.ratelimit import RATE_LIMIT_HEADERS
from providers.base import UpstreamCall
from providers.http import AiohttpStream, UpstreamClient, UpstreamResponse, allowed_headers
from providers.requestid import upstream_request_headers

#: response headers a client may see from an upstream; everything else stays behind. The
#: rate-limit headers of both families are in every adapter's list: the balancer reads them
#: from every answer, and the client gets the winner's, as it would from the upstream itself
PASS_HEADERS = frozenset({"openai-processing-ms", "openai-version", "x-request-id"}
                         ) | RATE_LIMIT_HEADERS

_MEDIA_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]{1,40}/[A-Za-z0-9!#$&^_.+-]{1,60}")


def media_type(content_type: str) -> str:
    """The bare media type for messages (`text/html`), or `unknown`: the rest of the header
    is the upstream's text, and an upstream's text never reaches a client."""
    bare = content_type.split(";", 1)[0].strip()
    return bare.lower() if _MEDIA_TYPE.fullmatch(bare) else "unknown"


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from `retry-after-ms` or `Retry-After` (delta-seconds form only); None when
    absent or not a finite number. Not capped here: the balancer caps a pause at
    `health.max_pause`, the one place that bounds what one header can do to a backend."""
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
    return max(0.0, seconds)


def refused(response: UpstreamResponse, error: UpstreamError) -> UpstreamError:
    """`error` for a refusal, carrying the response's rate-limit headers (a 429 states the
    quota it ran out of), and the response released."""
    error.quota = allowed_headers(response, RATE_LIMIT_HEADERS)
    response.close()
    return error


#: how long a rejection's body may take to arrive, in seconds: its explanation is worth a
#: moment (the client cannot fix the request without it), not a stalled attempt
EXPLANATION_WAIT = 1.0


async def rejected(response: UpstreamResponse, error: UpstreamError,
                   secrets: Collection[str]) -> UpstreamError:
    """`refused`, and for a rejection (400/413/422) the upstream's explanation read from its
    body first: at most `MAX_BODY` bytes within `EXPLANATION_WAIT`, scrubbed of `secrets`
    and of anything shaped like a credential or an address (`gateway.wire.explain`). A body
    that is too large, too slow or unreadable gives no explanation, never another failure.
    Every other refusal's body stays unread: only a rejection's words reach a client."""
    if isinstance(error, UpstreamRejectedRequest):
        error.explanation = explain(await _error_body(response), secrets)
    return refused(response, error)


async def _error_body(response: UpstreamResponse) -> bytes:
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(EXPLANATION_WAIT):
            while chunk := await response.read_chunk():
                size += len(chunk)
                if size > MAX_BODY:
                    return b""
                parts.append(chunk)
    except (TimeoutError, UpstreamError):
        return b""
    return b"".join(parts)


def secrets_of(settings: BackendSettings) -> frozenset[str]:
    """What of a backend's settings must never reach a client, whatever an upstream echoes:
    every secret field's value (`hidden_values`: its key, static header and query values,
    cloud keys, proxy URL) and the host of its URL."""
    host = urlsplit(settings.base_url).hostname if settings.base_url else None
    return hidden_values(settings) | ({host} if host else set())


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


class OpenAIProvider:
    """A backend that speaks the OpenAI HTTP API.

    `owns_client`: the client is this backend's own (its TLS or proxy settings differ from
    the shared client's) and is closed with the provider."""

    #: the OpenAI API's routes; `/v1/messages` is Anthropic's
    serves: frozenset[str] = frozenset({
        "chat/completions", "completions", "embeddings", "responses", "responses/item"})

    def __init__(
        self,
        settings: BackendSettings,
        client: UpstreamClient,
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
        self._secrets = secrets_of(settings)
        self.pass_headers = PASS_HEADERS
        self._connect = timeouts.connect
        # No read timeout on a stream: before the first token the race's deadline bounds
        # every read, after commit the relay's per-event idle and max_stream deadlines do
        #. A socket read timeout would only re-arm a timer on every chunk.
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect, sock_read=None
        )

    def url(self, call: UpstreamCall) -> str:
        """`{base_url}/{route}`: the OpenAI SDK's base URL includes `/v1`."""
        return f"{self._base_url}/{call.path or call.endpoint}"

    def _whole_body_timeout(self, call: UpstreamCall) -> aiohttp.ClientTimeout:
        """A non-streaming body may take the request's whole remaining deadline (the pool's
        `timeout`) to start: the idle timeout between reads must not cut it off."""
        return aiohttp.ClientTimeout(
            total=None, sock_connect=self._connect,
            sock_read=max(call.first_byte_timeout, 0.001),
        )

    def _params(self, call: UpstreamCall) -> list[tuple[str, str]] | None:
        """The client's query pairs, then the backend's static ones, which win: a client
        cannot send its own `api-version`."""
        pairs = [(k, v) for k, v in call.query if k not in self._query]
        pairs += self._query.items()
        return pairs or None

    async def open(self, call: UpstreamCall) -> AiohttpStream:
        headers = dict(call.extra_headers)
        headers.update(self._headers)  # ours win: a client cannot replace the credential
        headers.update(upstream_request_headers(call.request_id))  # a UUID: see requestid
        has_body = call.method not in ("GET", "DELETE")
        content: bytes | None = None
        if has_body:
            content = call.content or json.dumps(call.body, separators=(",", ":")).encode()
        else:
            del headers["content-type"]
        response = await self._client.request(
            call.method,
            self.url(call),
            params=self._params(call),
            content=content,
            headers=headers,
            timeout=self._timeout if call.stream else self._whole_body_timeout(call),
            pool_timeout=self._connect,
        )
        if response.status != 200:
            retry_after = parse_retry_after(response.headers)
            raise await rejected(response, UpstreamStatusError.of(
                response.status, retry_after=retry_after), self._secrets)
        content_type = media_type(response.headers.get("content-type", ""))
        expected = "text/event-stream" if call.stream else "application/json"
        if content_type != expected:
            response.close()
            raise UpstreamProtocolError(f"unexpected content type {content_type}")
        if (response.headers.get("content-encoding") or "identity").lower() != "identity":
            # we asked for identity and relay raw bytes: compressed bytes would reach the
            # client as garbage
            response.close()
            raise UpstreamProtocolError("unexpected content encoding")
        return AiohttpStream(response, stream=call.stream, allowed=self.pass_headers)

    async def aclose(self) -> None:
        """Close the backend's own client; the shared one belongs to the app."""
        if self._owns_client:
            await self._client.aclose()
