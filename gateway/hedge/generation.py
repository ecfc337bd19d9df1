"""The configuration in force: an immutable generation (settings + pool runtimes) and the one
reference a reload swaps (reload without a restart).

Why a swapped snapshot rather than settings mutated in place: a request reads `Live.current`
once, at its start, and keeps that `Generation` (its pool runtime, its timeouts, its hedging
switch) to the end, so a reload never changes the rules under a request that is already
running. A new generation shares the learnt state of the pools and backends that keep their
name (balancer health, budget, hedge-delay sketches: see `PoolRuntime.carried_over`), so what
changes is the configuration, not what the gateway has learnt.

No I/O here: building a generation is the composition root's job (`gateway.app`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from gateway.hedge.pool import PoolRuntime
from gateway.settings import Settings
from gateway.settings.hidden import hidden_values
from gateway.settings.origin import ConfigOrigin
from providers.base import Provider


@dataclass(frozen=True, slots=True)
class Generation:
    """One loaded configuration and the runtimes built for it. Never changed once built."""

    settings: Settings
    pools: Mapping[str, PoolRuntime]
    origin: ConfigOrigin
    #: 1 for the configuration loaded at start, +1 per successful reload
    number: int = 1
    #: the configuration's secrets, which the request log never repeats
    #: (`gateway.settings.hidden`): computed once per generation, not per request
    hidden: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", hidden_values(self.settings))


@dataclass(slots=True)
class Live:
    """The current generation, swapped whole by a reload (one attribute assignment on the
    event loop, so a reader sees the old or the new generation, never a mix)."""

    current: Generation
    #: reloads refused because the file was invalid (the generation in force stayed)
    failed_reloads: int = 0
    #: providers of earlier generations that no generation uses any more; requests that
    #: started before the reload may still hold them: `reap` hands each out to be closed
    #: once none does (and shutdown closes what is left)
    retired: list[Provider] = field(default_factory=list)
    #: runtimes replaced by a reload, kept while requests that started on them still run
    #: (`PoolRuntime.holding`); dropped by `reap` once they are done
    draining: list[PoolRuntime] = field(default_factory=list)

    def swap(self, generation: Generation) -> None:
        in_use = {id(p) for pool in generation.pools.values() for p in pool.providers.values()}
        for pool in self.current.pools.values():
            self.retired.extend(p for p in pool.providers.values() if id(p) not in in_use)
        self.draining.extend(self.current.pools.values())
        self.current = generation

    def reap(self) -> list[Provider]:
        """The retired providers no running request holds any more, taken out of `retired`:
        the caller closes them. Why not at the swap: a request keeps the runtime it started
        on to its end, and its upstreams are its provider's; why not never: each reload that
        rebuilds a backend retires a provider (a client of its own with a CA bundle, a
        credential refresher), and a gateway reloaded hourly would keep them all."""
        self.draining = [runtime for runtime in self.draining if runtime.holding > 0]
        held = {id(p) for runtime in self.draining for p in runtime.providers.values()}
        done = [p for p in self.retired if id(p) not in held]
        self.retired = [p for p in self.retired if id(p) in held]
        return done

    def providers(self) -> list[Provider]:
        """Every provider to close at shutdown: the current ones and the retired ones."""
        current = [p for pool in self.current.pools.values() for p in pool.providers.values()]
        return [*current, *self.retired]


class LivePools(Mapping[str, PoolRuntime]):
    """A read-only view of the current generation's pools, for readers that look once per
    scrape (`/metrics`), not once per request."""

    __slots__ = ("_live",)

    def __init__(self, live: Live) -> None:
        self._live = live

    def __getitem__(self, name: str) -> PoolRuntime:
        return self._live.current.pools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._live.current.pools)

    def __len__(self) -> int:
        return len(self._live.current.pools)
