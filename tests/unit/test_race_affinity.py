"""The race with a conversation key: the primary, hedges and failovers walk the key's order.
In-process runners; what is asserted is which backend each attempt went to, never how fast."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType

from gateway.api.request import LogicalRequest
from gateway.errors import UpstreamConnectError
from gateway.hedge.affinity import AffinityRoute, rendezvous_order
from gateway.hedge.attempt import AttemptRecord
from gateway.hedge.placement import Placement, RaceOptions
from gateway.hedge.plan import affinity_route
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import Race
from gateway.hedge.routing import excluded_backends
from gateway.wire.chat import CHAT
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


class Serving:
    """A provider stub that serves `routes` (all that eligibility reads of one)."""

    def __init__(self, *routes: str) -> None:
        self.serves = frozenset(routes)


def test_in_a_pool_of_mixed_providers_the_home_is_a_backend_that_serves_the_route() -> None:
    """b0 serves chat only, b1 and b2 serve Anthropic's messages. For a messages conversation
    whose key puts b0 first in the pool's order, the home the size rules read (the backend
    taken to hold its history) is the backend its turns go to, not b0, which no turn of it
    can reach. (A pool that translates would reach b0 too: this one keeps each request on
    its own API, `translate: false`.)"""
    settings = dataclasses.replace(gateway_settings(["http://127.0.0.1:9/v1"] * 3).pools[0],
                                   translate=False)
    providers = {"b0": Serving("chat/completions"), "b1": Serving("messages"),
                 "b2": Serving("messages")}
    pool = PoolRuntime.build(settings, providers, global_hedging=True,  # type: ignore[arg-type]
                             now=0.0, rng=random.Random(1))
    names = [("b0", 1.0), ("b1", 1.0), ("b2", 1.0)]
    user = next(f"user-{n}" for n in range(1000)
                if rendezvous_order(f"user:user-{n}", names)[0] == "b0")
    homes = []
    for turn, body_bytes in enumerate((120_000, 124_000)):
        body = {"model": "pool", "max_tokens": 16, "metadata": {"user_id": user},
                "messages": [{"role": "user", "content": f"turn {turn}"}]}
        req = LogicalRequest("r", "messages", body, True, {}, CHAT, body_bytes=body_bytes)
        excluded = excluded_backends(pool, req)
        assert excluded == {"b0"}
        route = affinity_route(pool, req, excluded)
        assert route is not None
        size = pool.size_of(body_bytes, route)
        assert size is not None
        delays, cold = pool.sized(size, "messages", True)
        placement = Placement(pool, RaceOptions(60.0, delays, True, excluded=excluded,
                                                affinity=route, cold=cold))
        primary = placement.primary(0.0)
        assert placement.affinity == "hit"
        homes.append((size.home, primary))
    # the second turn's 1,000 new tokens are read at the backend both turns went to
    assert size is not None and size.new == 1_000
    assert homes[0][0] == homes[0][1] == homes[1][0] == homes[1][1] != "b0"

