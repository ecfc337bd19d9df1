"""A pool's live state: its providers and the pure decision objects the race consults.

One `PoolRuntime` per configured pool, built by the composition root. It holds no logic of
its own beyond small lookups; the decisions live in `balancer`, `budget` and `policy`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.balancer import Balancer
from gateway.budget import HedgeBudget
from gateway.policy import HedgeDelay
from gateway.settings import PoolSettings
from providers.base import ENDPOINTS, Provider


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
    #: logical requests of this pool in flight now (for the budget's in-flight cap)
    inflight_requests: int = 0
    rng: random.Random = field(default_factory=random.Random)

    @classmethod
    def build(
        cls,
        settings: PoolSettings,
        providers: Mapping[str, Provider],
        *,
        global_hedging: bool,
        now: float,
        rng: random.Random,
    ) -> PoolRuntime:
        return cls(
            settings=settings,
            providers=providers,
            balancer=Balancer(settings.backends, settings.health, rng),
            budget=HedgeBudget(settings.hedging.budget, now),
            delays={b.name: HedgeDelay(settings.hedging.delay) for b in settings.backends},
            whole_delays={
                endpoint: {b.name: HedgeDelay(settings.hedging.delay) for b in settings.backends}
                for endpoint in ENDPOINTS
            },
            groups={b.name: b.group for b in settings.backends},
            hedging_enabled=global_hedging and settings.hedging.enabled,
            rng=rng,
        )

    def delays_for(self, endpoint: str, stream: bool) -> Mapping[str, HedgeDelay]:
        return self.delays if stream else self.whole_delays[endpoint]
