"""The race with a conversation key: the primary, hedges and failovers walk the key's order.
In-process runners; what is asserted is which backend each attempt went to, never how fast."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType

from gateway.errors import UpstreamConnectError
from gateway.hedge.affinity import AffinityRoute
from gateway.hedge.attempt import AttemptRecord, Prefix
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.race import Race
from gateway.wire.sse import SSEBatch, SSEEvent
from tests.harness.builders import gateway_settings

TOKEN = SSEEvent(b'{"choices":[{"index":0,"delta":{"content":"x"}}]}')


class Done:
    headers: Mapping[str, str] = MappingProxyType({})

    async def aclose(self) -> None:
        return None


async def _no_batches() -> AsyncIterator[SSEBatch]:
    if False:
        yield SSEBatch([])


def token() -> Prefix:
    return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]


def pool_of(backends: int, *, max_attempts: int = 2, delay: float = 5.0) -> PoolRuntime:
    settings = gateway_settings(["http://127.0.0.1:9/v1"] * backends, delay=delay,
                                max_attempts=max_attempts)
    return PoolRuntime.build(settings.pools[0], {}, global_hedging=True,
                             now=time.monotonic(), rng=random.Random(1))


def route_of(pool: PoolRuntime, key: str) -> AffinityRoute:
    return AffinityRoute.of(key, {b.name: b.weight for b in pool.settings.backends}, 1.25)


def options(pool: PoolRuntime, r: AffinityRoute | None) -> RaceOptions:
    return RaceOptions(time.monotonic() + 5, pool.delays, True, affinity=r)


async def test_every_turn_of_a_key_starts_on_its_first_backend() -> None:
    pool = pool_of(3)
    seen: list[str] = []

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        seen.append(backend)
        return token()

    for key in ("k1", "k2", "k3", "k4"):
        r = route_of(pool, key)
        seen.clear()
        for _ in range(5):
            race = Race(pool, runner, options(pool, r), time.monotonic)
            await race.run()
            await race.aclose()
            assert race.placement.affinity == "hit"
        assert seen == [r.order[0]] * 5


async def test_a_hedge_goes_to_the_second_backend_of_the_order() -> None:
    pool = pool_of(3, delay=0.0)
    r = route_of(pool, "conversation")
    release = asyncio.Event()

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        if record.index == 0:
            await release.wait()  # the primary is slow: the hedge starts and wins
        return token()

    race = Race(pool, runner, options(pool, r), time.monotonic)
    result = await race.run()
    release.set()
    await race.aclose()
    assert [(a.kind, a.backend) for a in race.attempts] == [
        ("primary", r.order[0]), ("hedge", r.order[1])]
    assert result.winner.backend == r.order[1]


async def test_failovers_walk_the_order() -> None:
    pool = pool_of(3, max_attempts=3)
    r = route_of(pool, "another conversation")

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        if record.index < 2:
            raise UpstreamConnectError("connect error")
        return token()

    race = Race(pool, runner, options(pool, r), time.monotonic)
    result = await race.run()
    await race.aclose()
    assert [a.backend for a in race.attempts] == list(r.order)
    assert result.winner.backend == r.order[2]


async def test_a_loaded_first_backend_spills_and_is_counted() -> None:
    pool = pool_of(3)
    r = route_of(pool, "busy")
    for _ in range(3):  # three streams of other requests already on the key's first backend
        pool.balancer.on_start(r.order[0])

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        return token()

    race = Race(pool, runner, options(pool, r), time.monotonic)
    await race.run()
    await race.aclose()
    assert race.attempts[0].backend == r.order[1]
    assert race.placement.affinity == "spill"


async def test_the_winner_re_pins_nothing() -> None:
    """A hedge that wins on the second backend leaves the next turn on the first."""
    pool = pool_of(2, delay=0.0)
    r = route_of(pool, "conversation")
    release = asyncio.Event()

    async def slow_primary(backend: str, record: AttemptRecord) -> Prefix:
        if record.index == 0:
            await release.wait()
        return token()

    race = Race(pool, slow_primary, options(pool, r), time.monotonic)
    assert (await race.run()).winner.backend == r.order[1]
    release.set()
    await race.aclose()

    async def fast(backend: str, record: AttemptRecord) -> Prefix:
        return token()

    race = Race(pool, fast, options(pool, r), time.monotonic)
    assert (await race.run()).winner.backend == r.order[0]
    await race.aclose()
