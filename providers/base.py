"""The one protocol between the gateway and an upstream API.

A provider opens an attempt and hands back an `UpstreamStream`: an open response whose event
batches are read by the race until the first token and by the relay after commit. Providers know
nothing of hedging. They raise only `gateway.errors.UpstreamError` subclasses: every library
exception (aiohttp's, the simulator's) is translated here, at the boundary.

Closing is the caller's job and must always happen: `aclose()` is idempotent, fast (it drops
the connection rather than draining it) and safe to call from a cancelled task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import anyio

from gateway.wire.paths import ENDPOINTS as ENDPOINTS
from gateway.wire.paths import Endpoint as Endpoint
from gateway.wire.sse import SSEBatch


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    """What one attempt sends. `body` already carries the backend's own model name."""

    endpoint: Endpoint
    body: Mapping[str, Any]
    stream: bool
    request_id: str
    #: seconds the upstream may take before its first byte (the remaining deadline)
    first_byte_timeout: float
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    #: `body` as JSON bytes when the caller already has them (serialized once per logical
    #: request, `model` substituted per backend); empty: the provider encodes `body`. A
    #: provider class with `sends_content = False` never reads it, and is given none
    content: bytes = b""
    #: the HTTP method; GET and DELETE send no body
    method: str = "POST"
    #: the path below the API root when it is not `endpoint` (`responses/resp_1/cancel`)
    path: str | None = None
    #: query parameters the client sent that the upstream should see (`limit`, `after`), as
    #: (name, value) pairs: a repeated parameter keeps every value, in order
    query: tuple[tuple[str, str], ...] = ()


class UpstreamStream(Protocol):
    """An open upstream response with status 200 (anything else was raised by `open`)."""

    #: response headers worth passing to the client (already filtered by an allowlist)
    headers: Mapping[str, str]

    def batches(self) -> AsyncIterator[SSEBatch]:
        """The stream's events in order, as the batches that arrived together (never empty).

        Batches, not single events, because one upstream read often carries several events
        and the relay then forwards them in one write; a batch also carries the read's bytes
        when they can be forwarded as they are (`SSEBatch.raw`). For a non-streaming call:
        one batch of one event, the whole body."""
        ...

    async def aclose(self) -> None:
        """Release the response and its connection at once. Idempotent; it completes even
        when the caller is cancelled meanwhile (see `finish_despite_cancel`)."""
        ...


class Provider(Protocol):
    """One configured backend."""

    name: str
    #: the routes (`ENDPOINTS`) this provider serves: a request races only among the pool's
    #: backends whose provider serves its route
    serves: frozenset[str]

    async def open(self, call: UpstreamCall) -> UpstreamStream:
        """Send the request and return once the status and headers are in.

        Raises `GatewayPoolFull` when the gateway's own connection pool stays full.

        Raises `UpstreamStatusError` for a status other than 200, `UpstreamConnectError`,
        `UpstreamTimeout` or `UpstreamProtocolError`.
        """
        ...

    async def aclose(self) -> None:
        """Release what the provider holds (not the shared HTTP client)."""
        ...


@runtime_checkable
class CarriesCredentials(Protocol):
    """A provider holding cloud credentials it refreshes (`providers.credentials`): a reload
    that rebuilds its backend hands the new provider the old one's, when the settings they
    come from are the same, so the first request after it does not wait for a fetch."""

    def adopt_credentials(self, previous: Provider) -> bool:
        """Take over `previous`'s credentials (its refresher and what it reads) when they come
        from the same settings; `previous` then no longer closes them. True when taken."""
        ...


async def finish_despite_cancel(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` (a close) to its end even if the caller is cancelled meanwhile, then re-raise
    that cancellation.

    Why: the race cancels a losing attempt with a native `Task.cancel()`, which an anyio (or
    httpcore) shield does not hold back. A close interrupted at its first await leaves the
    HTTP client's connection marked in use for ever: the upstream later closes its side and
    the gateway's socket stays in CLOSE_WAIT (the soak found one per ~1,000 hedged requests,
    a loser cancelled while it was closing a 429). So the close runs in a task of its own,
    awaited under `asyncio.shield` until it is over. The anyio shield stays so that a
    cancelled anyio scope does not keep re-delivering its cancellation meanwhile.
    """
    with anyio.CancelScope(shield=True):
        closing = asyncio.ensure_future(work)
        interrupted: asyncio.CancelledError | None = None
        while not closing.done():
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError as exc:
                interrupted = exc
        closing.result()
    if interrupted is not None:
        raise interrupted
