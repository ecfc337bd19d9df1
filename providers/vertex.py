"""Claude's Messages API on Google Vertex AI (`provider: vertex`).

What differs from `provider: anthropic`, and why each piece is here:
- **Where.** `POST {base_url}/v1/projects/{project}/locations/{region}/publishers/anthropic/
  models/{model}:streamRawPredict` (streaming) or `:rawPredict`; `base_url` defaults to the
  region's endpoint (`https://{region}-aiplatform.googleapis.com`, or the global one).
- **The body.** The client's Messages body less `model` (the path names it), plus
  `anthropic_version` (the backend's, default `vertex-2023-10-16`); `stream` stays, Vertex
  reads it. The client's `anthropic-beta` header passes as a header, as on Anthropic's API.
- **Auth.** `Authorization: Bearer` with an OAuth access token from google-auth: the
  service-account key file's JWT grant at its `token_uri`, or the metadata server. Fetching
  one is a blocking HTTPS call, so a `Refresher` makes it in a worker thread and again ahead of
  the token's expiry: requests read the cached token and never wait on Google, except the
  very first one (or the first after a long idle). A 401 drops the cached token, so the next
  request fetches a fresh one (a token revoked early).
- **The stream** is Anthropic's own SSE, so the upstream client's decoding
  (`providers.http.AiohttpStream`) and everything after it apply unchanged.
- **Errors.** Vertex sends quota errors as 429 without Retry-After; like Bedrock's throttling
  (and every 429), such a 429 pauses the backend for the pool's `health.default_pause`, so
  that a client whose every attempt was refused gets a 429 with Retry-After instead of a 502.

The token goes upstream only: never into a message, a log line or a stat (google-auth's own
logging hashes it).
"""

from __future__ import annotations

import datetime
import json
from typing import Any
from urllib.parse import quote

import aiohttp
import google.auth.credentials
import urllib3
from google.auth.compute_engine import Credentials as MetadataCredentials
from google.auth.transport.urllib3 import Request as GoogleRequest
from google.oauth2 import service_account

from gateway.errors import UpstreamAuthFailed, UpstreamProtocolError, UpstreamStatusError
from gateway.settings import BackendSettings, Timeouts
from providers.base import Provider, UpstreamCall
from providers.credentials import Fetched, Refresher
from providers.http import AiohttpStream, UpstreamClient
from providers.openai import (
    PASS_HEADERS,
    media_type,
    parse_retry_after,
    rejected,
    secrets_of,
)
from providers.requestid import upstream_request_headers

SCOPE = "https://www.googleapis.com/auth/cloud-platform"
#: the token endpoint's (or metadata server's) answer may take this long, in seconds
TOKEN_READ_TIMEOUT = 10.0
#: Google's own response headers worth passing on (none carries a credential)
VERTEX_PASS_HEADERS = frozenset({"request-id"}) | PASS_HEADERS


def default_base_url(region: str) -> str:
    if region == "global":
        return "https://aiplatform.googleapis.com"
    return f"https://{region}-aiplatform.googleapis.com"


class GoogleTokenSource:
    """Access tokens from a service-account key file (its `token_uri`) or the metadata
    server. `fetch` blocks: the `Refresher` calls it in a worker thread."""

    def __init__(self, settings: BackendSettings, connect_timeout: float) -> None:
        google_settings = settings.google
        self._file = google_settings.credentials_file if google_settings else None
        tls = settings.tls
        pool_options: dict[str, Any] = {
            "timeout": urllib3.Timeout(connect=connect_timeout, read=TOKEN_READ_TIMEOUT),
            "retries": False,
        }
        if not tls.verify:
            pool_options["cert_reqs"] = "CERT_NONE"
        elif tls.ca_file is not None:
            pool_options["ca_certs"] = tls.ca_file
        self._http = urllib3.PoolManager(**pool_options)
        self._credentials: google.auth.credentials.Credentials | None = None

    def _load(self) -> google.auth.credentials.Credentials:
        if self._credentials is None:
            if self._file is not None:
                self._credentials = (
                    service_account.Credentials.from_service_account_file(  # type: ignore[no-untyped-call]
                        self._file, scopes=[SCOPE]))
            else:
                self._credentials = MetadataCredentials(  # type: ignore[no-untyped-call]
                    scopes=[SCOPE])
        return self._credentials

    def fetch(self) -> Fetched[str]:
        credentials = self._load()
        request = GoogleRequest(self._http)  # type: ignore[no-untyped-call]
        credentials.refresh(request)  # type: ignore[no-untyped-call]
        token = credentials.token
        if not isinstance(token, str) or not token:
            raise LookupError("the token endpoint answered without a token")
        lifetime: float | None = None
        expiry = credentials.expiry  # naive UTC, google-auth's convention
        if expiry is not None:
            now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
            lifetime = max(0.0, (expiry - now).total_seconds())
        return Fetched(token, lifetime)

    def close(self) -> None:
        self._http.clear()


class VertexProvider:
    """A backend that serves `/v1/messages` from Claude on Vertex AI."""

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
        if settings.region is None or settings.project is None:  # the loader refuses this
            raise ValueError(f"backend {settings.name}: region and project are required")
        self.name = settings.name
        self._client = client
        self._owns_client = owns_client
        base = (settings.base_url or default_base_url(settings.region)).rstrip("/")
        model = (f"{base}/v1/projects/{quote(settings.project, safe='')}/locations/"
                 f"{quote(settings.region, safe='')}/publishers/anthropic/models/"
                 f"{quote(settings.model, safe='@')}")
        self._stream_url = f"{model}:streamRawPredict"
        self._predict_url = f"{model}:rawPredict"
        self._version = settings.anthropic_version
        self._headers = {name.lower(): value for name, value in settings.headers}
        self._headers["content-type"] = "application/json"
        self._headers["accept-encoding"] = "identity"
        self._secrets = secrets_of(settings)
        self._tokens_source = GoogleTokenSource(settings, timeouts.connect)
        self._tokens = Refresher(self._tokens_source.fetch,
                                 what=f"backend {settings.name}: Google access token")
        #: what the tokens come from: a reload that keeps it keeps them
        self._credential_settings = (settings.google, settings.tls, timeouts.connect)
        #: False once a reloaded provider took the tokens over (it closes them)
        self._owns_credentials = True
        self._connect = timeouts.connect
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect, sock_read=None)

    @property
    def token_fetches(self) -> int:
        """Tokens fetched so far (tests read it: a request must not be the one to fetch)."""
        return self._tokens.fetches

    def body(self, call: UpstreamCall) -> bytes:
        body: dict[str, Any] = {k: v for k, v in call.body.items() if k != "model"}
        body["anthropic_version"] = self._version
        return json.dumps(body, separators=(",", ":")).encode()

    async def open(self, call: UpstreamCall) -> AiohttpStream:
        if call.endpoint != "messages":  # the route table sends nothing else here
            raise UpstreamStatusError.of(404)
        token = await self._tokens.get()
        headers = dict(call.extra_headers)
        headers.update(self._headers)  # ours win: a client cannot replace the credential
        headers["authorization"] = f"Bearer {token}"
        headers.update(upstream_request_headers(call.request_id))  # a UUID: see requestid
        timeout = self._timeout
        if not call.stream:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect,
                                            sock_read=max(call.first_byte_timeout, 0.001))
        response = await self._client.request(
            "POST", self._stream_url if call.stream else self._predict_url,
            content=self.body(call), headers=headers, timeout=timeout,
            pool_timeout=self._connect,
        )
        if response.status != 200:
            # a 429 without Retry-After (a quota error) is a throttle: the race pauses the
            # backend for the pool's default
            error = UpstreamStatusError.of(response.status,
                                           retry_after=parse_retry_after(response.headers))
            if isinstance(error, UpstreamAuthFailed) and response.status == 401:
                self._tokens.invalidate()
            raise await rejected(response, error, self._secrets)
        content_type = media_type(response.headers.get("content-type", ""))
        expected = "text/event-stream" if call.stream else "application/json"
        if content_type != expected or (
                response.headers.get("content-encoding") or "identity").lower() != "identity":
            response.close()
            raise UpstreamProtocolError(f"unexpected content type {content_type}")
        return AiohttpStream(response, stream=call.stream, allowed=VERTEX_PASS_HEADERS)

    def adopt_credentials(self, previous: Provider) -> bool:
        """The previous provider of this backend (a reload rebuilt it): its token, still
        good, when it comes from the same settings."""
        if not isinstance(previous, VertexProvider) or not previous._owns_credentials or (
                previous._credential_settings != self._credential_settings):
            return False
        self._tokens_source.close()  # never used: replaced by the previous one's
        self._tokens_source, self._tokens = previous._tokens_source, previous._tokens
        previous._owns_credentials = False
        return True

    async def aclose(self) -> None:
        if self._owns_credentials:
            await self._tokens.aclose()
            self._tokens_source.close()
        if self._owns_client:
            await self._client.aclose()
