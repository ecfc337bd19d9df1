"""Our own connection pool being full is our failure, not the backend's.

The gateway's shared upstream client raises `GatewayPoolFull` when every one of its connections
is busy past `timeouts.connect`; the backend was never asked. Counting that as its connect
failure would eject healthy backends one after another exactly when the gateway is busiest."""

from __future__ import annotations

import random
import time

import aiohttp
import pytest

from gateway.errors import AllAttemptsFailed, GatewayPoolFull, UpstreamConnectError, UpstreamError
from gateway.hedge.attempt import AttemptRecord, Prefix
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.race import Race
from providers.http import translate
from tests.harness.builders import gateway_settings


def test_a_pool_timeout_is_ours_and_a_connect_timeout_is_the_backends() -> None:
    ours = GatewayPoolFull("no free upstream connection in the gateway's pool")
    assert not ours.backend_fault and ours.replaceable
    theirs = translate(aiohttp.ConnectionTimeoutError("slow connect"))
    assert isinstance(theirs, UpstreamConnectError) and theirs.backend_fault


def pool_of(backends: int) -> PoolRuntime:
    settings = gateway_settings(["http://127.0.0.1:9/v1"] * backends, delay=5.0)
    pool = settings.pools[0]
    return PoolRuntime.build(
        pool, {}, global_hedging=True, now=time.monotonic(), rng=random.Random(1)
    )


@pytest.mark.parametrize(
    ("error", "penalised"),
    [(GatewayPoolFull("full"), False), (translate(aiohttp.ConnectionTimeoutError("slow")), True)],
    ids=["pool-timeout", "connect-timeout"],
)
async def test_only_the_backends_own_failures_count_against_its_health(
    error: UpstreamError, penalised: bool
) -> None:
    pool = pool_of(2)
    calls: list[str] = []

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        calls.append(backend)
        raise error

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    with pytest.raises(AllAttemptsFailed):
        await race.run()
    await race.aclose()
    assert len(calls) == 2  # still replaceable: another backend was tried
    for name in calls:
        failures = pool.balancer._backends[name].failures
        assert failures == (1 if penalised else 0), name
