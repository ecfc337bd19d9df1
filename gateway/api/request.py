"""One logical request, and the rules read from it before its race.

What a route hands the proxy (`LogicalRequest`: the body, the route's wire rules, the upstream
call details, the commit hook), and the decisions made from it and the pool alone, before any
attempt: may it be hedged, which backends may serve it, its conversation key and backend order,
a header's timeout. The process-wide admission cap is here too: the first thing a request meets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import Overloaded, RouteNotServed
from gateway.hedge.affinity import AffinityRoute, route_for
from gateway.hedge.budget import SuppressReason
from gateway.hedge.pool import PoolRuntime
from gateway.wire.base import WireProtocol
from gateway.wire.chat import CHAT
from gateway.wire.named import Rewrite
from gateway.wire.paths import Endpoint
from gateway.wire.sse import SSEEvent


@dataclass(frozen=True, slots=True)
class LogicalRequest:
    request_id: str
    endpoint: Endpoint
    body: Mapping[str, Any]
    stream: bool
    headers: Mapping[str, str]
    #: the route's wire rules: first token, end of stream, error shapes
    protocol: WireProtocol = CHAT
    #: delay-triggered hedges refused by the route's own rule (the Responses store rules)
    stateful: bool = False
    #: one backend at a time, not hedged and not counted as refused (count_tokens)
    single: bool = False
    #: the only backend this request may use (the one holding its stored response)
    pinned: str | None = None
    #: upstream call details beyond the body (method, path, query, passed-through headers)
    method: str = "POST"
    path: str | None = None
    query: tuple[tuple[str, str], ...] = ()
    forward_headers: Mapping[str, str] = field(default_factory=dict)
    #: called once at commit with the winner's backend and buffered events; what it returns
    #: rewrites the named events it lists and a whole body (the Responses API's response id)
    on_commit: Callable[[str, list[SSEEvent]], Rewrite | None] | None = None
    #: False for a read of stored state (a stored response, its cancel): its body repeats a
    #: past generation's usage and its quick answer is no time to first token, so it counts
    #: no tokens and feeds neither the TTFT quantiles nor the hedge-delay trackers
    metered: bool = True
    #: for the request log: the client's route as the route table writes it, and the model
    #: it sent, already loggable (`gateway.stats.loggable`)
    route: str | None = None
    model: str | None = None
    #: the body's size as received (its input tokens are estimated from it); None: unknown
    body_bytes: int | None = None


class Admission:
    """The process-wide caps on concurrent logical requests and on the request-body bytes
    they hold. A request holds several times its body while it is in flight (the parsed
    body, the serialized copy sent upstream, the copy each attempt sends), so counting
    requests alone let a few hundred large ones take the process's memory; the bytes are
    counted as received, and the first request is always admitted, however large."""

    def __init__(self, limit: int, max_bytes: int | None = None) -> None:
        self.limit = limit
        self.active = 0
        #: None: no bound on bytes
        self.max_bytes = max_bytes
        self.active_bytes = 0

    def enter(self, size: int = 0) -> None:
        # retryable (no `x-should-retry: false`): SDKs come back after the pause
        if self.active >= self.limit:
            raise Overloaded("the gateway is at its concurrency limit", retry_after=1.0)
        if self.max_bytes is not None and self.active and \
                self.active_bytes + size > self.max_bytes:
            raise Overloaded("the gateway holds too many request bytes in flight",
                             retry_after=1.0)
        self.active += 1
        self.active_bytes += size

    def leave(self, size: int = 0) -> None:
        self.active -= 1
        self.active_bytes -= size


def header_seconds(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 and math.isfinite(value) else None


def hedge_refusal(pool: PoolRuntime, req: LogicalRequest) -> SuppressReason | None:
    """Why delay-triggered hedges are off for this request, or None."""
    if not pool.hedging_enabled:
        return SuppressReason.DISABLED
    if req.headers.get("x-hedge", "").lower() == "off":
        return SuppressReason.DISABLED
    if req.body.get("store") is True or "idempotency-key" in req.headers or req.stateful:
        return SuppressReason.DISABLED
    return None


def excluded_backends(pool: PoolRuntime, req: LogicalRequest) -> frozenset[str]:
    """The pool's backends this request may not use: those whose provider does not serve its
    route, and all but the pinned one. RouteNotServed (404) when none is left."""
    excluded = frozenset(
        b.name for b in pool.settings.backends
        if req.endpoint not in pool.providers[b.name].serves
        or (req.pinned not in (None, b.name))
    )
    if len(excluded) == len(pool.settings.backends):
        raise RouteNotServed(
            f"model {pool.settings.name!r} has no backend serving /v1/{req.endpoint}"
        )
    return excluded


def affinity_applies(pool: PoolRuntime, req: LogicalRequest) -> bool:
    """Affinity is on for the pool and the request may go to more than one backend."""
    return pool.settings.affinity.enabled and req.pinned is None and not req.single


def affinity_route(pool: PoolRuntime, req: LogicalRequest, excluded: frozenset[str]
                   ) -> AffinityRoute | None:
    """The request's conversation key and order over the backends it may use (the pool's, less
    `excluded_backends`), or None: affinity does not apply (`affinity_applies`), or the
    request has no key.

    Why not over the whole pool: the first of the order is the conversation's home, which the
    size rules take as the backend holding its history. In a pool that mixes providers the
    first of the pool's order can be one that does not serve the route, so the home would be
    a backend no turn ever reaches, and the real one's delay, warmth and hold-at-home rule
    would be read as a stranger's. Rendezvous hashing keeps the relative order of the rest,
    so the order is the pool's own with the excluded ones left out."""
    settings = pool.settings.affinity
    if not affinity_applies(pool, req):
        return None
    weights = [(b.name, b.weight) for b in pool.settings.backends if b.name not in excluded]
    minimum = settings.min_input_tokens
    assert minimum is not None  # `PoolSettings._complete` fills it in from the backends
    return route_for(req.body, req.headers, weights, min_input_tokens=minimum,
                     load_factor=settings.load_factor, body_bytes=req.body_bytes)
