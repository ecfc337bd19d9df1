"""Which of a pool's backends one request may use, and how it reaches each: decided before the
request is admitted, since a route no backend serves is refused without taking a slot (a 404,
counted as a refusal), and a request no backend's API can carry is a 400.

Apart from `gateway.hedge.plan` (taken once the request holds its slot), so that the proxy
enters each of the two once: this file before admission, the plan's after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import RouteNotServed, Untranslatable
from gateway.hedge.plan import RequestFacts
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.translated import NOT_TRANSLATED, Translated
from gateway.wire.base import Translation, translation_for


@dataclass(frozen=True, slots=True)
class Routing:
    """Which of the pool's backends a request may use, and how it reaches each."""

    #: the backends it may not use (see `routing`)
    excluded: frozenset[str]
    #: the backends it reaches only by translation (empty: none, the usual case), each
    #: translation's body made when an attempt needs it
    translated: Translated

    def without_refusals(self) -> Routing:
        """The same routing less the backends whose translation refuses the request (made
        now, once per translation): excluded, as routing does when it translates up front.
        Asked only where a translation left in would change how the request is handled (a
        non-streaming request that could be continued is read whole only when it reaches
        no backend by translation), not on the hot path: a mixed pool's request is
        otherwise translated lazily, for the attempts that go there."""
        translated = self.translated
        refusing = frozenset(b for b in translated if not translated.admits(b))
        if not refusing:
            return self
        kept = translated.without(refusing)
        return Routing(self.excluded | refusing, kept if kept else NOT_TRANSLATED)


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
