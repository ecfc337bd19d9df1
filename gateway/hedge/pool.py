"""A pool's live state: its providers and the pure decision objects the race consults.

One `PoolRuntime` per configured pool, built by the composition root. It holds no logic of
its own beyond small lookups; the decisions live in `balancer`, `budget` and `policy`.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.clock import Clock
from gateway.hedge.affinity import AffinityRoute
from gateway.hedge.balancer import Balancer
from gateway.hedge.budget import HedgeBudget
from gateway.hedge.classes import ClassDelays
from gateway.hedge.delay import HedgeDelay
from gateway.hedge.gaps import GapSketch
from gateway.hedge.prefill import ConversationMemory, estimate_tokens, new_tokens
from gateway.hedge.sizing import ColdRule, DelayReader, RequestSize, SizedDelays
from gateway.settings import PoolSettings
from gateway.settings.model import PriceSettings
from gateway.wire.base import Translations
from gateway.wire.paths import endpoints_of
from providers.base import ENDPOINTS, Endpoint, Provider


@dataclass(slots=True)
class InFlight:
    """Logical requests of a pool in flight now. One object shared by every generation of the
    pool: a request that started before a reload ends on the runtime it started with, and the
    count the new runtime reads (the budget's in-flight cap, the stats) must still hold it."""

    count: int = 0


def _per_endpoint(
    make: Callable[[Endpoint], dict[str, HedgeDelay]],
) -> dict[str, dict[str, HedgeDelay]]:
    """One delay map per route, for every route there is: a route added to `ENDPOINTS` gets
    its trackers at start and after every reload alike."""
    return {endpoint: make(endpoint) for endpoint in ENDPOINTS}


@dataclass(slots=True)
class PoolRuntime:
    settings: PoolSettings
    providers: Mapping[str, Provider]
    balancer: Balancer
    budget: HedgeBudget
    #: per backend: the hedge delay of streaming requests (TTFT of the first token)
    delays: Mapping[str, HedgeDelay]
    #: per endpoint, per backend: the hedge delay of non-streaming requests, learnt from their
    #: full response time, which would distort the streaming TTFT if they shared a sketch
    whole_delays: Mapping[str, Mapping[str, HedgeDelay]]
    #: the backend -> group label map, for "prefer a different group"
    groups: Mapping[str, str]
    #: hedging on for this pool (global switch and pool switch both on)
    hedging_enabled: bool
    #: backend -> its own model name, and the same as a JSON string (built once, used by
    #: every attempt to put the backend's model into the serialized body)
    models: Mapping[str, str] = field(default_factory=dict)
    models_json: Mapping[str, bytes] = field(default_factory=dict)
    #: logical requests of this pool in flight now (for the budget's in-flight cap), shared
    #: with the pool's earlier and later generations
    inflight: InFlight = field(default_factory=InFlight)
    #: requests that started on this runtime and have not given back their upstreams yet:
    #: its own, never shared (a reload's retired providers are closed once it is 0 on every
    #: runtime that holds them, `gateway.hedge.generation.Live.reap`)
    holding: int = 0
    rng: random.Random = field(default_factory=random.Random)
    #: per backend: the streaming delays per size class and the prefill fit, beside `delays`
    classes: Mapping[str, ClassDelays] = field(default_factory=dict)
    #: the last size of each recent conversation key (what its home backend has seen)
    memory: ConversationMemory = field(default_factory=ConversationMemory)
    #: per backend: its streams' longest gaps between tokens (the stall delay); a backend
    #: gets its sketch with its first stream that ends
    gaps: dict[str, GapSketch] = field(default_factory=dict)
    #: backend -> its price, for the backends that have one (built once per configuration;
    #: empty: the pool's requests are not priced)
    prices: Mapping[str, PriceSettings] = field(default_factory=dict)
    #: per backend: the routes it serves, its provider's narrowed by its `apis` (read by
    #: `serves_of`; a backend missing here serves its provider's)
    serves: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: the translations its requests may take to a backend of another API (the composition
    #: root's table, `gateway.wire.translate.routes.TRANSLATIONS`; empty: none), read only
    #: when the pool's `translate` is on
    translations: Translations = field(default_factory=dict)

    def serves_of(self, backend: str) -> frozenset[str]:
        """The routes `backend` serves: its provider's, narrowed by its `apis`."""
        found = self.serves.get(backend)
        return found if found is not None else self.providers[backend].serves

    @property
    def inflight_requests(self) -> int:
        return self.inflight.count

    @inflight_requests.setter
    def inflight_requests(self, value: int) -> None:
        self.inflight.count = value

    @classmethod
    def build(
        cls,
        settings: PoolSettings,
        providers: Mapping[str, Provider],
        *,
        global_hedging: bool,
        now: float,
        rng: random.Random,
        translations: Translations | None = None,
    ) -> PoolRuntime:
        delay, ratio = settings.hedging.delay, settings.hedging.budget.ratio
        delays = {b.name: HedgeDelay(delay, budget_ratio=ratio) for b in settings.backends}
        return cls(
            settings=settings,
            providers=providers,
            balancer=Balancer(settings.backends, settings.health, rng),
            budget=HedgeBudget(settings.hedging.budget, now),
            delays=delays,
            classes={name: ClassDelays(d, budget_ratio=ratio) for name, d in delays.items()},
            whole_delays=_per_endpoint(lambda _: {
                b.name: HedgeDelay(delay, budget_ratio=ratio) for b in settings.backends
            }),
            groups={b.name: b.group for b in settings.backends},
            hedging_enabled=global_hedging and settings.hedging.enabled,
            rng=rng,
            models=_models(settings),
            models_json=_models_json(settings),
            prices=_prices(settings),


            serves=_serves(settings, providers),
            translations=translations or {},
        )

    def carried_over(
        self,
        settings: PoolSettings,
        providers: Mapping[str, Provider],
        *,
        global_hedging: bool,
        now: float,
    ) -> PoolRuntime:
        """The runtime of this pool under a reloaded configuration.

        What was learnt survives for every backend that keeps its name: its health and load
        (the balancer shares the backend's state object, so attempts of requests that started
        before the reload still count against it), its hedge-delay sketches, and the pool's
        budget (the same bucket, re-limited to the new settings). New backends start fresh;
        removed ones are dropped from selection; the in-flight count is shared. This runtime
        is left untouched, so requests that started on it finish under the configuration
        they started with."""
        self.budget.reconfigure(settings.hedging.budget, now)
        delay, ratio = settings.hedging.delay, settings.hedging.budget.ratio

        def carried(old: Mapping[str, HedgeDelay]) -> dict[str, HedgeDelay]:
            return {
                b.name: old[b.name].adopt(delay, budget_ratio=ratio, now=now) if b.name in old
                else HedgeDelay(delay, budget_ratio=ratio)
                for b in settings.backends
            }

        delays = carried(self.delays)
        return PoolRuntime(
            settings=settings,
            providers=providers,
            balancer=self.balancer.adopt(settings.backends, settings.health),
            budget=self.budget,
            delays=delays,
            classes={name: self.classes[name].adopt(d, budget_ratio=ratio, now=now)
                     if name in self.classes else ClassDelays(d, budget_ratio=ratio)
                     for name, d in delays.items()},
            memory=self.memory,
            gaps={b.name: self.gaps[b.name] for b in settings.backends if b.name in self.gaps},
            whole_delays=_per_endpoint(
                lambda endpoint: carried(self.whole_delays.get(endpoint, {}))
            ),
            groups={b.name: b.group for b in settings.backends},
            hedging_enabled=global_hedging and settings.hedging.enabled,
            inflight=self.inflight,
            rng=self.rng,
            models=_models(settings),
            models_json=_models_json(settings),
            prices=_prices(settings),


            serves=_serves(settings, providers),
            translations=self.translations,
        )

    def quota_watch(self, backend: str, clock: Clock) -> Callable[[Mapping[str, str]], None]:
        """What an attempt on `backend` hands its answer's headers to: the balancer's quota
        headroom reads their rate-limit headers at `clock()`, resets given as a time of day
        against the wall clock."""
        balancer = self.balancer

        def seen(headers: Mapping[str, str]) -> None:
            balancer.observe_quota(backend, headers, clock(), time.time())

        return seen

    def delays_for(self, endpoint: str, stream: bool) -> Mapping[str, HedgeDelay]:
        return self.delays if stream else self.whole_delays[endpoint]

    def size_of(self, body_bytes: int | None, route: AffinityRoute | None) -> RequestSize | None:
        """The request's estimated size (None: its body size is unknown), remembering this turn
        of its conversation: the next turn's home will hold what this one sends."""
        if body_bytes is None:
            return None
        tokens = estimate_tokens(body_bytes)
        if route is None:
            return RequestSize(tokens, tokens)
        previous = self.memory.turn(route.key, tokens)
        return RequestSize(tokens, new_tokens(tokens, previous), route.order[0])

    def sized(self, size: RequestSize | None, endpoint: str, stream: bool
              ) -> tuple[Mapping[str, DelayReader], ColdRule | None]:
        """The delays a request's race reads, and its cold rule. Streams with a known size get
        the per-class delays (`hedging.delay.by_size`) and the cold rule (`skip_cold`); the
        rest the one delay per backend (a whole response's time is mostly generation, which
        the prompt's size does not predict) and no cold rule."""
        hedging = self.settings.hedging
        if size is None or not stream or not (hedging.delay.by_size or hedging.skip_cold):
            return self.delays_for(endpoint, stream), None
        delays = SizedDelays(self.classes, size, by_size=hedging.delay.by_size)
        cold = ColdRule(self.classes, size) if hedging.skip_cold else None
        return delays, cold

    def refresh_delays(self, now: float) -> None:
        """Recompute every hedge delay of the pool (off the request path; the
        composition root calls this periodically). `quantile: auto` delays first take in the
        budget's recent hedge win rate (see `HedgeDelay.steer`)."""
        win_rate, recorded = self.budget.win_rate(), self.budget.hedges_recorded
        for delays in (self.delays, *self.whole_delays.values()):
            for delay in delays.values():
                delay.steer(win_rate, recorded)
                delay.refresh(now)
        for classes in self.classes.values():
            classes.refresh(now, win_rate, recorded)


def _prices(settings: PoolSettings) -> dict[str, PriceSettings]:
    """Backend -> its price, for the priced backends, built once per configuration."""
    return {b.name: b.price for b in settings.backends if b.price is not None}


def _serves(settings: PoolSettings, providers: Mapping[str, Provider]
            ) -> dict[str, frozenset[str]]:
    return {b.name: endpoints_of(b.apis, providers[b.name].serves) for b in settings.backends
            if b.name in providers}


def _models(settings: PoolSettings) -> dict[str, str]:
    """Backend -> its own model name, built once per configuration."""
    return {b.name: b.model for b in settings.backends}


def _models_json(settings: PoolSettings) -> dict[str, bytes]:
    """Backend -> its model name as JSON, spliced into each attempt's serialized body."""
    return {b.name: json.dumps(b.model).encode() for b in settings.backends}
