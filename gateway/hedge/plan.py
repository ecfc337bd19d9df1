"""One request's plan, decided once before its race: which backends it may use, its deadline,
whether it may be hedged, its conversation key and backend order, its size and the delays
its attempts read.

The API layer hands the request's facts (`RequestFacts`: a structural view of what the route
read, never the route's own type) and the pool; the race is handed the plan as data
(`Plan.options`) and reads no request again. The plan is taken once the request holds its
admission slot (it notes the turn of the request's conversation, which a refused request must
not); which backends it may use is decided before that, by `gateway.hedge.routing`, since a
route no backend serves is refused without a slot. Two files for the two steps, so that the
proxy enters each once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.hedge.affinity import AffinityRoute, route_for
from gateway.hedge.budget import SuppressReason
from gateway.hedge.deadline import KeyShare
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.sizing import RequestSize
from gateway.wire.paths import Endpoint


class RequestFacts(Protocol):
    """What the plan reads of one logical request (`gateway.api.request.LogicalRequest`)."""

    @property
    def endpoint(self) -> Endpoint: ...
    @property
    def body(self) -> Mapping[str, Any]: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def stream(self) -> bool: ...
    #: delay-triggered hedges refused by the route's own rule (the Responses store rules)
    @property
    def stateful(self) -> bool: ...
    #: one backend at a time, not hedged and not counted as refused (count_tokens)
    @property
    def single(self) -> bool: ...
    #: the only backend this request may use (the one holding its stored response)
    @property
    def pinned(self) -> str | None: ...
    #: False: its attempt times are not latency samples (a read of stored state)
    @property
    def metered(self) -> bool: ...
    #: the body's size as received; None: unknown
    @property
    def body_bytes(self) -> int | None: ...
    #: False: the client's key turned delay-triggered hedges off
    @property
    def hedging(self) -> bool: ...
    #: the request's TTFT objective in seconds (None: none; `gateway.hedge.deadline`)
    @property
    def objective(self) -> float | None: ...
    #: its named key's share of the hedge budget (None: no named key)
    @property
    def share(self) -> KeyShare | None: ...
    #: its named key's own budget ratio (None: the pool's)
    @property
    def share_ratio(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Plan:
    """What the race of one request is handed, and what the request's summary notes of it."""

    options: RaceOptions
    #: the request's estimated size (None: unknown, or a read of stored state)
    size: RequestSize | None


def plan(pool: PoolRuntime, req: RequestFacts, excluded: frozenset[str], start: float,
         admits: Callable[[str], bool] | None = None) -> Plan:
    """The plan of an admitted request started at `start`, over the backends it may use (the
    pool's, less `excluded`: see `gateway.hedge.routing`; `admits`: `RaceOptions.admits`)."""
    refusal = None if req.single else hedge_refusal(pool, req)
    at = deadline(pool, req, start)
    route = affinity_route(pool, req, excluded)
    size = pool.size_of(req.body_bytes if req.metered else None, route)
    delays, cold = pool.sized(size, req.endpoint, req.stream)
    options = RaceOptions(
        at,
        delays,
        refusal is None and not req.single,
        refusal,
        excluded,
        learn=req.metered,
        affinity=route,
        cold=cold,
        input_tokens=0 if size is None else size.tokens,
        objective=req.objective,
        share=req.share,
        share_ratio=req.share_ratio,
        admits=admits,
        affinity_miss=route is None and affinity_applies(pool, req),
    )
    return Plan(options, size)


def deadline(pool: PoolRuntime, req: RequestFacts, start: float) -> float:
    """One absolute first-token deadline shared by every attempt.

    A non-streaming response (and an embedding) has no token before its whole body, so
    `timeouts.first_token` would cut off every answer that takes longer to generate: those
    are bounded by the pool's `timeout`, for the whole response."""
    limits = [pool.settings.timeout]
    if req.stream:
        limits.append(pool.settings.timeouts.first_token)
    for name in ("x-request-timeout", "x-stainless-read-timeout"):
        seconds = header_seconds(req.headers, name)
        if seconds is not None:
            limits.append(seconds)
    return start + min(limits)


def header_seconds(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 and math.isfinite(value) else None


def hedge_refusal(pool: PoolRuntime, req: RequestFacts) -> SuppressReason | None:
    """Why delay-triggered hedges are off for this request, or None."""
    if not pool.hedging_enabled:
        return SuppressReason.DISABLED
    if req.headers.get("x-hedge", "").lower() == "off":
        return SuppressReason.DISABLED
    if req.body.get("store") is True or "idempotency-key" in req.headers or req.stateful \
            or not req.hedging:
        return SuppressReason.DISABLED
    return None


def affinity_applies(pool: PoolRuntime, req: RequestFacts) -> bool:
    """Affinity is on for the pool and the request may go to more than one backend."""
    return pool.settings.affinity.enabled and req.pinned is None and not req.single


def affinity_route(pool: PoolRuntime, req: RequestFacts, excluded: frozenset[str]
                   ) -> AffinityRoute | None:
    """The request's conversation key and order over the backends it may use (the pool's, less
    `gateway.hedge.routing`), or None: affinity does not apply (`affinity_applies`), or the
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
