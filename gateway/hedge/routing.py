"""Which of a pool's backends one request may use, and how it reaches each: decided before the
request is admitted, since a route no backend serves is refused without taking a slot (a 404,
counted as a refusal), and a request no backend's API can carry is a 400.

Apart from `gateway.hedge.plan` (taken once the request holds its slot), so that the proxy
enters each of the two once: this file before admission, the plan's after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import RouteNotServed, Untranslatable
from gateway.hedge.plan import RequestFacts
from gateway.hedge.pool import PoolRuntime
from gateway.wire.base import Translation, translation_for

#: per backend reached by translation: its translation and the body it is sent
Translated = Mapping[str, tuple[Translation, Mapping[str, Any]]]


@dataclass(frozen=True, slots=True)
class Routing:
    """Which of the pool's backends a request may use, and how it reaches each."""

    #: the backends it may not use (see `routing`)
    excluded: frozenset[str]
    #: the backends it reaches only by translation (empty: none, the usual case)
    translated: Translated


def routing(pool: PoolRuntime, req: RequestFacts) -> Routing:
    """The pool's backends this request may not use: those that serve neither its route nor
    (when the pool translates) a route a translation reaches, and all but the pinned one.
    Each backend reached by translation is sent the request translated, once per API.

    RouteNotServed (404) when no backend is left. A request a translation refuses
    (`Untranslatable`: a field that changes the answer has no place in the backend's API)
    goes to the backends that speak its own API; with none, the refusal is the answer (400
    naming the field)."""
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
        return Routing(frozenset(excluded), {})
    bodies: dict[str, Mapping[str, Any]] = {}
    refused: Untranslatable | None = None
    for translation in {t.name: t for t in via.values()}.values():
        try:
            bodies[translation.name] = translation.request(req.body)
        except Untranslatable as exc:
            refused = exc
    translated = {}
    for name, translation in via.items():
        if translation.name in bodies:
            translated[name] = (translation, bodies[translation.name])
        else:
            excluded.add(name)
    if refused is not None and len(excluded) == len(pool.settings.backends):
        raise refused
    return Routing(frozenset(excluded), translated)


def excluded_backends(pool: PoolRuntime, req: RequestFacts) -> frozenset[str]:
    """The backends `req` may not use (`routing`'s)."""
    return routing(pool, req).excluded
