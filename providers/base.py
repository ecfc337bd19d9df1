"""The one protocol between the gateway and an upstream API.

A provider opens an attempt and hands back an `UpstreamStream`: an open response whose event
batches are read by the race until the first token and by the relay after commit. Providers know
nothing of hedging. They raise only `gateway.errors.UpstreamError` subclasses: every library
exception (aiohttp's, the simulator's) is translated here, at the boundary.

Closing is the caller's job and must always happen: `aclose()` is idempotent, fast (it drops
the connection rather than draining it) and safe to call from a cancelled task.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gateway.sse import SSEBatch

Endpoint = Literal["chat/completions", "completions", "embeddings"]


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
    #: request, `model` substituted per backend); empty: the provider encodes `body`
    content: bytes = b""


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
        """Release the response and its connection at once. Idempotent."""
        ...


class Provider(Protocol):
    """One configured backend."""

    name: str

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
