"""Claude's Messages API on AWS Bedrock (`provider: bedrock`).

What differs from `provider: anthropic`, and why each piece is here:
- **Where.** `POST {base_url}/model/{model}/invoke-with-response-stream` (streaming) or
  `/invoke`; `base_url` defaults to the region's runtime endpoint. The model id goes into the
  path quoted as the Anthropic SDK's Bedrock client quotes it (`:` kept), which is also what
  the HTTP client sends unchanged: the signature covers the path as sent.
- **The body.** The client's Messages body less `model` and `stream` (the route says both),
  plus `anthropic_version` (the backend's, default `bedrock-2023-05-31`); the client's
  `anthropic-beta` header becomes the body's `anthropic_beta` list, as Bedrock takes it.
- **Signing.** SigV4 (service `bedrock`) with botocore's signer, per request: microseconds of
  hashing, so it runs on the loop. The credentials come from the backend's `aws` keys or
  botocore's standard chain, read in a worker thread by a `Refresher` (the chain may read
  files or call STS): never a blocking call on the event loop. Temporary credentials (web
  identity, container and instance roles, SSO, an assumed role, a `credential_process`) carry
  their expiry, and the refresher is given it, so they are refreshed ahead of it however long
  the backend sat idle; static keys have none and are read once. An answer that says the
  credentials expired or are unknown (`ExpiredTokenException`, `UnrecognizedClientException`)
  drops them and re-reads the chain, and the request is signed again and resent once, when
  that gave other credentials (a token revoked, or the clocks disagreeing on its expiry).
- **The stream.** AWS event-stream frames (binary: prelude, headers, payload, CRCs), parsed by
  botocore's `EventStreamBuffer`. Each `chunk` event's payload is `{"bytes": base64}` holding
  one Messages event as JSON: it is handed on as that SSE event, named by its `type`, so the
  race's first-token rule, the relay and the usage accounting of `/v1/messages` apply as they
  are. An `:exception-type` frame is an upstream error (`bedrock_error`): throttling is a
  pushback, `modelStreamErrorException` an in-band error event (Anthropic's shape), so before
  the first token it fails the attempt and after it reaches the client as an error event.
- **Errors** map to the error tree by Bedrock's error type (`x-amzn-ErrorType`), not only by
  status: `ServiceQuotaExceededException` comes as a 400 but is no fault of the request.
  Throttling carries no Retry-After: it is a `throttle` without a pause of its own, so the
  race pauses the backend for the pool's `health.default_pause`, and a client whose every
  attempt was throttled gets a 429 with that as its Retry-After.

Nothing of a credential leaves this module: the signature headers go upstream only, an
upstream error body is read only for a rejection's explanation, scrubbed of credentials and
addresses (`providers.openai.rejected`), and botocore's signer is kept from logging its
canonical request (which holds the session token) even under a DEBUG root logger.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast
from urllib.parse import quote

import aiohttp
import botocore.session
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials, ReadOnlyCredentials, RefreshableCredentials
from botocore.eventstream import EventStreamBuffer, EventStreamMessage, ParserError

from gateway.errors import (
    UpstreamAuthFailed,
    UpstreamCredentialsUnavailable,
    UpstreamError,
    UpstreamNotFound,
    UpstreamProtocolError,
    UpstreamRateLimited,
    UpstreamRejectedRequest,
    UpstreamServerError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
    upstream_status,
)
from gateway.settings import BackendSettings, Timeouts
from gateway.wire.sse import SSEBatch, SSEEvent
from providers.base import Provider, UpstreamCall
from providers.credentials import Fetched, Refresher
from providers.http import AiohttpStream, UpstreamClient, UpstreamResponse, allowed_headers
from providers.openai import (
    PASS_HEADERS,
    media_type,
    parse_retry_after,
    refused,
    rejected,
    secrets_of,
)
from providers.requestid import upstream_request_headers

#: the signer logs the canonical request at DEBUG, session token included
logging.getLogger("botocore.auth").setLevel(logging.INFO)

SERVICE = "bedrock"
EVENT_STREAM = "application/vnd.amazon.eventstream"
#: Bedrock's own response headers worth passing on
BEDROCK_PASS_HEADERS = frozenset({"x-amzn-requestid"}) | PASS_HEADERS
#: the Messages event's `type` near the start of its JSON (it comes first)
_TYPE = re.compile(rb'"type"\s*:\s*"([A-Za-z0-9_.]{1,80})"')
_TYPE_WINDOW = 256


def default_base_url(region: str) -> str:
    return f"https://bedrock-runtime.{region}.amazonaws.com"


# --- errors -----------------------------------------------------------------------------------


def _error_kind(name: str | None) -> str:
    """`ThrottlingException:http://internal.amazon.com/...`, `throttlingException` ->
    `throttling`: the header's and the frame's spellings of one error type."""
    if not name:
        return ""
    bare = name.split(":", 1)[0].split("#")[-1].strip().lower()
    return bare.removesuffix("exception")


_PUSHBACK = frozenset({"throttling", "servicequotaexceeded", "toomanyrequests"})
_BUSY = frozenset({"serviceunavailable", "modelnotready"})
_AUTH = frozenset({"accessdenied", "unrecognizedclient", "invalidsignature", "expiredtoken",
                   "incompletesignature", "missingauthenticationtoken", "invalidclienttokenid"})
#: the error types that say the credentials themselves are stale: worth one re-read
_STALE_CREDENTIALS = frozenset({"expiredtoken", "unrecognizedclient"})


def bedrock_error(
    error_type: str | None, status: int | None = None, *, retry_after: float | None = None
) -> UpstreamError:
    """The attempt failure for a Bedrock error, from its type (a response's
    `x-amzn-ErrorType` or a frame's `:exception-type`) and, failing that, its status.

    Throttling and quotas are pushbacks (another backend at once, this one paused); access
    and signature errors are this backend's misconfiguration (fail over); a validation error
    is a rejection, judged as every upstream's 400 is (`UpstreamRejectedRequest`: another
    kind of backend in the pool is asked, and one that serves it makes the rejection this
    backend's fault). Throttling and a
    busy model name no pause: each is a `throttle`, paused for the pool's default."""
    kind = _error_kind(error_type)
    if kind in _PUSHBACK:
        return UpstreamRateLimited(429, retry_after=retry_after)
    if kind in _BUSY:
        busy = UpstreamUnavailable(503, retry_after=retry_after)
        busy.throttle = True
        return busy
    if kind == "validation":
        return UpstreamRejectedRequest(400)
    if kind in _AUTH:
        return UpstreamAuthFailed(status if status in (401, 403) else 403)
    if kind == "resourcenotfound":
        return UpstreamNotFound(404)
    if kind == "modeltimeout":
        return UpstreamTimeout("model timeout on Bedrock")
    if kind in ("internalserver", "modelerror", "modelstreamerror"):
        return UpstreamServerError(status if status is not None and status >= 500 else 500)
    if status is not None:  # a 429 without its type is still a throttle (the status table)
        return UpstreamStatusError.of(status, retry_after=retry_after)
    return UpstreamProtocolError("unknown exception in the event stream")


def _refusal(response: UpstreamResponse) -> UpstreamError:
    """The attempt failure for a non-200 answer, from its error type and status."""
    return bedrock_error(response.headers.get("x-amzn-errortype"), response.status,
                         retry_after=parse_retry_after(response.headers))


def stream_error_event(kind: str) -> SSEEvent:
    """An in-band failure as Anthropic's `event: error`, which the race reads as a failed
    attempt before the first token and the relay forwards after it. Its text is ours: an
    upstream's message never reaches a client."""
    payload = {"type": "error", "error": {
        "type": "api_error", "message": f"the model stream failed on Bedrock ({kind})"}}
    return SSEEvent(json.dumps(payload, separators=(",", ":")).encode(), b"error")


# --- frames -----------------------------------------------------------------------------------


def _header(message: EventStreamMessage, name: str) -> str | None:
    # the stubs call the headers an int; botocore's parser makes them a dict
    headers = cast(dict[str, object], message.headers)
    value = headers.get(name)
    return value if isinstance(value, str) else None


def chunk_event(payload: bytes) -> SSEEvent:
    """A `chunk` frame's payload (`{"bytes": base64 JSON}`) as the Messages event it holds."""
    try:
        outer = json.loads(payload)
        inner = base64.b64decode(outer["bytes"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        raise UpstreamProtocolError("malformed event stream: a chunk without its bytes") from None
    if 10 in inner or 13 in inner:  # only JSON whitespace can be a raw line end (ints: a
        # memchr; a bytes needle raises and clears a TypeError inside CPython 3.11's `in`)
        inner = inner.replace(b"\r", b"").replace(b"\n", b"")
    match = _TYPE.search(inner, 0, _TYPE_WINDOW)
    return SSEEvent(inner, match.group(1) if match else None)


def frame_events(message: EventStreamMessage) -> SSEEvent | None:
    """One frame: its Messages event, None for a frame that carries none, or a raised
    `UpstreamError` for an exception or error frame."""
    kind = _header(message, ":message-type")
    if kind == "event":
        if _header(message, ":event-type") == "chunk":
            return chunk_event(message.payload)
        return None  # an event type this adapter does not know carries no Messages event
    if kind == "exception":
        exception = _header(message, ":exception-type")
        if _error_kind(exception) == "modelstreamerror":
            return stream_error_event("modelStreamErrorException")
        raise bedrock_error(exception)
    if kind == "error":
        raise bedrock_error(_header(message, ":error-code"))
    raise UpstreamProtocolError("malformed event stream: a frame of no known message type")


class EventStreamDecoder:
    """Incremental: bytes in as they arrive, the Messages events they completed out."""

    def __init__(self) -> None:
        self._buffer = EventStreamBuffer()
        #: an exception frame read after events of the same read: raised on the next feed
        self._failure: UpstreamError | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events `chunk` completes. An exception frame raises its error, after the events
        before it were returned (so a relayed stream shows them first)."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        self._buffer.add_data(chunk)
        events: list[SSEEvent] = []
        try:
            for message in self._buffer:
                event = frame_events(message)
                if event is not None:
                    events.append(event)
        except UpstreamError as exc:
            if not events:
                raise
            self._failure = exc
        except (ParserError, ValueError, KeyError, IndexError) as exc:
            # botocore's framing checks (a CRC, a length), or a header it cannot decode
            raise UpstreamProtocolError(
                f"malformed event stream ({type(exc).__name__})") from None
        return events

    def pending_failure(self) -> UpstreamError | None:
        failure, self._failure = self._failure, None
        return failure


class EventStream:
    """An open 200 `invoke-with-response-stream` response, decoded frame by frame."""

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response
        self.headers: Mapping[str, str] = allowed_headers(response, BEDROCK_PASS_HEADERS)

    async def batches(self) -> AsyncIterator[SSEBatch]:
        decoder = EventStreamDecoder()
        read = self._response.read_chunk
        while chunk := await read():
            events = decoder.feed(chunk)
            if events:
                yield SSEBatch(events)
            failure = decoder.pending_failure()
            if failure is not None:
                raise failure

    async def aclose(self) -> None:
        self._response.close()


# --- credentials --------------------------------------------------------------------------------


AwsCredentials = Credentials | ReadOnlyCredentials


#: how long refreshable credentials whose expiry cannot be read are used before the chain is
#: read again: under the shortest lifetime temporary AWS credentials are issued with (15 min)
UNKNOWN_EXPIRY_LIFETIME = 60.0


def lifetime_of(credentials: Credentials, now: datetime.datetime | None = None) -> float | None:
    """Seconds until `credentials` expire; None for static keys, which do not.

    botocore's refreshable credentials (every temporary source of the chain) keep their
    expiry in `_expiry_time`, as its own refresh logic reads it; it has no public accessor.
    Should a botocore release drop it, temporary credentials are read again after
    `UNKNOWN_EXPIRY_LIFETIME`, never taken for static ones."""
    if not isinstance(credentials, RefreshableCredentials):
        return None
    expiry = getattr(credentials, "_expiry_time", None)
    if not isinstance(expiry, datetime.datetime):
        return UNKNOWN_EXPIRY_LIFETIME
    if expiry.tzinfo is None:
        expiry = expiry.replace(tzinfo=datetime.UTC)
    moment = now or datetime.datetime.now(datetime.UTC)
    return max(0.0, (expiry - moment).total_seconds())


class AwsCredentialSource:
    """The backend's `aws` keys, else botocore's standard chain (environment, shared files,
    web identity, containers, instance metadata), read in a worker thread.

    The chain's credentials object is kept between reads: a refreshable one refreshes itself
    when read within ten minutes of its expiry (botocore's mandatory window), and the
    refresher reads it again at most five minutes before that expiry, which `fetch` returns
    as the value's lifetime."""

    def __init__(self, settings: BackendSettings) -> None:
        aws = settings.aws
        self._static: Credentials | None = None
        if aws is not None and aws.access_key_id and aws.secret_access_key:
            self._static = Credentials(aws.access_key_id, aws.secret_access_key,
                                       aws.session_token)
        self._region = settings.region
        self._chain: Credentials | None = None

    def fetch(self) -> Fetched[AwsCredentials]:
        if self._static is not None:
            return Fetched(self._static, None)
        chain = self._chain
        if chain is None:
            session = botocore.session.Session()
            if self._region:
                session.set_config_variable("region", self._region)
            chain = session.get_credentials()
            if chain is None:
                raise LookupError("no AWS credentials in the standard chain")
            self._chain = chain
        frozen = chain.get_frozen_credentials()  # refreshes first when close to the expiry
        return Fetched(frozen, lifetime_of(chain))

    def forget(self) -> None:
        """The upstream refused the chain's credentials: resolve the chain anew on the next
        fetch (a refreshable object would hand back the same until the expiry it believes)."""
        self._chain = None


# --- the provider -------------------------------------------------------------------------------


class BedrockProvider:
    """A backend that serves `/v1/messages` from Claude on Bedrock."""

    #: Claude's Messages route only: the cloud's token counting takes another request shape
    #: it builds its own request from `UpstreamCall.body`, never sends `content`: the proxy
    #: then serializes no copy of the body for it (`gateway.api.proxy`)
    sends_content = False
    serves: frozenset[str] = frozenset({"messages"})

    def __init__(
        self,
        settings: BackendSettings,
        client: UpstreamClient,
        timeouts: Timeouts,
        *,
        owns_client: bool = False,
    ) -> None:
        if settings.region is None:  # the config loader already refuses this
            raise ValueError(f"backend {settings.name}: region is required")
        self.name = settings.name
        self._client = client
        self._owns_client = owns_client
        base = (settings.base_url or default_base_url(settings.region)).rstrip("/")
        model = quote(settings.model, safe=":")
        self._stream_url = f"{base}/model/{model}/invoke-with-response-stream"
        self._invoke_url = f"{base}/model/{model}/invoke"
        self._region = settings.region
        self._version = settings.anthropic_version
        self._headers = {name.lower(): value for name, value in settings.headers}
        self._headers["content-type"] = "application/json"
        self._headers["accept-encoding"] = "identity"
        self._secrets = secrets_of(settings)
        self._source = AwsCredentialSource(settings)
        self._credentials = Refresher(self._source.fetch,
                                      what=f"backend {settings.name}: AWS credentials")
        #: what the credentials come from: a reload that keeps it keeps them
        self._credential_settings = (settings.aws, settings.region)
        #: False once a reloaded provider took the credentials over (it closes them)
        self._owns_credentials = True
        self._connect = timeouts.connect
        # as for the OpenAI adapter: no read timeout on a stream (the race's deadline, then
        # the relay's idle and max_stream deadlines bound it)
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect, sock_read=None)

    def body(self, call: UpstreamCall) -> bytes:
        """The client's body for Bedrock: less `model` and `stream`, plus `anthropic_version`
        and the client's betas."""
        body: dict[str, Any] = {k: v for k, v in call.body.items() if k not in ("model", "stream")}
        body["anthropic_version"] = self._version
        beta = call.extra_headers.get("anthropic-beta")
        if beta and "anthropic_beta" not in body:
            body["anthropic_beta"] = [b.strip() for b in beta.split(",") if b.strip()]
        return json.dumps(body, separators=(",", ":")).encode()

    def signed_headers(
        self, url: str, content: bytes, credentials: AwsCredentials, call: UpstreamCall
    ) -> dict[str, str]:
        """Every header the request carries, signed: ours, the trace context, the request id."""
        headers = {k: v for k, v in call.extra_headers.items() if k != "anthropic-beta"}
        headers.update(self._headers)
        headers.update(upstream_request_headers(call.request_id))  # a UUID: see requestid
        if call.stream:
            headers["accept"] = EVENT_STREAM
            headers["x-amzn-bedrock-accept"] = "application/json"
        else:
            headers["accept"] = "application/json"
        request = AWSRequest(method="POST", url=url, data=content, headers=headers)
        SigV4Auth(credentials, SERVICE, self._region).add_auth(request)
        return {name: value for name, value in request.headers.items() if value is not None}

    async def open(self, call: UpstreamCall) -> EventStream | AiohttpStream:
        if call.endpoint != "messages":  # the route table sends nothing else here
            raise UpstreamNotFound(404)
        credentials = await self._credentials.get()
        url = self._stream_url if call.stream else self._invoke_url
        content = self.body(call)
        response = await self._send(url, content, credentials, call)
        if upstream_status(response.status).failure is UpstreamAuthFailed and _error_kind(
                response.headers.get("x-amzn-errortype")) in _STALE_CREDENTIALS:
            refusal = refused(response, _refusal(response))
            fresh = await self._reread(credentials)
            if fresh is None:
                raise refusal
            response = await self._send(url, content, fresh, call)
        if response.status != 200:
            raise await rejected(response, _refusal(response), self._secrets)
        content_type = media_type(response.headers.get("content-type", ""))
        expected = EVENT_STREAM if call.stream else "application/json"
        if content_type != expected or (
                response.headers.get("content-encoding") or "identity").lower() != "identity":
            response.close()
            raise UpstreamProtocolError(f"unexpected content type {content_type}")
        if call.stream:
            return EventStream(response)
        return AiohttpStream(response, stream=False, allowed=BEDROCK_PASS_HEADERS)

    async def _send(self, url: str, content: bytes, credentials: AwsCredentials,
                    call: UpstreamCall) -> UpstreamResponse:
        """The request signed with `credentials`, up to its response head."""
        try:
            headers = self.signed_headers(url, content, credentials, call)
        except (ValueError, TypeError, AttributeError) as exc:
            raise UpstreamCredentialsUnavailable(
                f"could not sign the request ({type(exc).__name__})") from None
        timeout = self._timeout
        if not call.stream:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect,
                                            sock_read=max(call.first_byte_timeout, 0.001))
        return await self._client.request(
            "POST", url, content=content, headers=headers, timeout=timeout,
            pool_timeout=self._connect,
        )

    async def _reread(self, refused_with: AwsCredentials) -> AwsCredentials | None:
        """Bedrock called `refused_with` expired or unknown: drop them (once for every
        request refused with them) and read the chain again. The credentials to resend
        with, or None when the re-read gave the same ones (static keys: resending is
        pointless)."""
        if self._credentials.invalidate(refused_with):
            self._source.forget()
        fresh = await self._credentials.get()
        if (fresh.access_key, fresh.secret_key, fresh.token) == (
                refused_with.access_key, refused_with.secret_key, refused_with.token):
            return None
        return fresh

    def adopt_credentials(self, previous: Provider) -> bool:
        """The previous provider of this backend (a reload rebuilt it: a weight, a pool's
        timeouts): its credentials, still good, when they come from the same settings."""
        if not isinstance(previous, BedrockProvider) or not previous._owns_credentials or (
                previous._credential_settings != self._credential_settings):
            return False
        self._source, self._credentials = previous._source, previous._credentials
        previous._owns_credentials = False
        return True

    async def aclose(self) -> None:
        if self._owns_credentials:
            await self._credentials.aclose()
        if self._owns_client:
            await self._client.aclose()
