"""One request's plan, decided once before its race: which backends it may use, its deadline,
whether it may be hedged, its conversation key and backend order, its size and the delays
its attempts read.

The API layer hands the request's facts (`RequestFacts`: a structural view of what the route
read, never the route's own type) and the pool; the race is handed the plan as data
(`Plan.options`) and reads no request again. Two steps, because one rule is a refusal before
the request is admitted: `routing` (a route no backend serves is a 404, counted as a
refusal; a request no backend's API can carry is a 400), with the backends it reaches by
translation and what each is sent; the rest is `plan`, read once the request holds its
admission slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import RouteNotServed, Untranslatable
from gateway.hedge.affinity import AffinityRoute, route_for
from gateway.hedge.budget import SuppressReason
from gateway.hedge.deadline import KeyShare
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.sizing import RequestSize
from gateway.wire.base import Translation, translation_for
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
    #: affinity applies to the request but it has no conversation key: its primary is a miss
    affinity_miss: bool


def plan(pool: PoolRuntime, req: RequestFacts, excluded: frozenset[str], start: float,
         admits: Callable[[str], bool] | None = None) -> Plan:
    """The plan of an admitted request started at `start`, over the backends it may use (the
    pool's, less `excluded`: see `excluded_backends`; `admits`: `RaceOptions.admits`)."""
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
    )
    return Plan(options, size, route is None and affinity_applies(pool, req))


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


class Translated(Mapping[str, tuple[Translation, Mapping[str, Any]]]):
    """Per backend a request reaches only by translation: its translation and the body it is
    sent, that body made when an attempt first goes to such a backend (`admits`), once per
    translation and request. A request a native backend answers translates nothing.

    Reading a backend's entry makes its body; one its translation refuses raises the
    refusal (`Untranslatable`)."""

    __slots__ = ("_body", "_made", "_via")

    def __init__(self, via: Mapping[str, Translation], body: Mapping[str, Any]) -> None:
        self._via = via
        self._body = body
        #: translation name -> the body it made, or its refusal
        self._made: dict[str, Mapping[str, Any] | Untranslatable] = {}

    def without(self, backends: Collection[str]) -> Translated:
        """The same request's translations less `backends`, the bodies made kept."""
        kept = Translated({b: t for b, t in self._via.items() if b not in backends}, self._body)
        kept._made = self._made
        return kept

    def made(self, translation: Translation) -> Mapping[str, Any] | Untranslatable:
        """The body `translation` makes of the request's, or its refusal (made once)."""
        made = self._made.get(translation.name)
        if made is None:
            try:
                made = translation.request(self._body)
            except Untranslatable as exc:
                made = exc
            self._made[translation.name] = made
        return made

    def admits(self, backend: str) -> bool:
        """Whether an attempt may go to `backend`: it speaks the request's API, or its
        translation carries the request (translated now, on the first attempt there)."""
        translation = self._via.get(backend)
        return translation is None or not isinstance(self.made(translation), Untranslatable)

    def __getitem__(self, backend: str) -> tuple[Translation, Mapping[str, Any]]:
        translation = self._via[backend]
        made = self.made(translation)
        if isinstance(made, Untranslatable):
            raise made
        return translation, made

    def __contains__(self, backend: object) -> bool:
        """Whether `backend` is reached by translation (nothing is translated to say so)."""
        return backend in self._via

    def __iter__(self) -> Iterator[str]:
        return iter(self._via)

    def __len__(self) -> int:
        return len(self._via)


#: a request that reaches no backend by translation (the usual case)
NOT_TRANSLATED = Translated({}, {})


@dataclass(frozen=True, slots=True)
class Routing:
    """Which of the pool's backends a request may use, and how it reaches each."""

    #: the backends it may not use (see `routing`)
    excluded: frozenset[str]
    #: the backends it reaches only by translation (empty: none, the usual case), each
    #: translation's body made when an attempt needs it
    translated: Translated


def routing(pool: PoolRuntime, req: RequestFacts) -> Routing:
    """The pool's backends this request may not use: those that serve neither its route nor
    (when the pool translates) a route a translation reaches, and all but the pinned one.
    Each backend reached by translation is sent the request translated, once per API.

    RouteNotServed (404) when no backend is left. A request a translation refuses
    (`Untranslatable`: a field that changes the answer has no place in the backend's API)
    goes to the backends that speak its own API; with none, the refusal is the answer (400
    naming the field).

    When some backend speaks the request's API, nothing is translated here: the race asks
    `Translated.admits` of each backend it picks, so a translation is made only for an
    attempt that goes to a backend of another API (and a backend whose translation refuses
    the request is passed over, never attempted). With none, every translation is made here,
    so that a request none can carry is refused before a race."""
    excluded: set[str] = set()
    via: dict[str, Translation] = {}
    translate, table = pool.settings.translate and bool(pool.translations), pool.translations
    for b in pool.settings.backends:
        serves = pool.serves_of(b.name)
        if req.pinned not in (None, b.name):
            excluded.add(b.name)
        elif req.endpoint not in serves:
            found = translation_for(table, req.endpoint, serves) if translate else None
            if found is None:
                excluded.add(b.name)
            else:
                via[b.name] = found
    if len(excluded) == len(pool.settings.backends):
        raise RouteNotServed(
            f"model {pool.settings.name!r} has no backend serving /v1/{req.endpoint}"
        )
    if not via:
        return Routing(frozenset(excluded), NOT_TRANSLATED)
    translated = Translated(via, req.body)
    if len(excluded) + len(via) < len(pool.settings.backends):
        return Routing(frozenset(excluded), translated)  # a native backend: made lazily
    refused: Untranslatable | None = None
    for name, translation in via.items():
        made = translated.made(translation)
        if isinstance(made, Untranslatable):
            refused = made
            excluded.add(name)
    if refused is not None and len(excluded) == len(pool.settings.backends):
        raise refused
    return Routing(frozenset(excluded),
                   translated if refused is None else translated.without(excluded))


def excluded_backends(pool: PoolRuntime, req: RequestFacts) -> frozenset[str]:
    """The backends `req` may not use (`routing`'s)."""
    return routing(pool, req).excluded


def affinity_applies(pool: PoolRuntime, req: RequestFacts) -> bool:
    """Affinity is on for the pool and the request may go to more than one backend."""
    return pool.settings.affinity.enabled and req.pinned is None and not req.single


def affinity_route(pool: PoolRuntime, req: RequestFacts, excluded: frozenset[str]
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
