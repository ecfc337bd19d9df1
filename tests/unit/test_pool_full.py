"""Our own connection pool being full is our failure, not the backend's (issue 10, risk 12).

httpx raises `PoolTimeout` when every connection of the gateway's shared client is busy; the
backend was never asked. Counting that as its connect failure would eject healthy backends
one after another exactly when the gateway is busiest."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from gateway.attempt import Prefix
from gateway.errors import AllAttemptsFailed, GatewayPoolFull, UpstreamConnectError
from gateway.pool import PoolRuntime
from gateway.race import AttemptRecord, Race, RaceOptions
from providers.openai import translate
from tests.harness.builders import gateway_settings


def test_a_pool_timeout_is_ours_and_a_connect_timeout_is_the_backends() -> None:
    ours = translate(httpx.PoolTimeout("pool full"))
    assert isinstance(ours, GatewayPoolFull)
    assert not ours.backend_fault and ours.replaceable
    theirs = translate(httpx.ConnectTimeout("slow connect"))
    assert isinstance(theirs, UpstreamConnectError) and theirs.backend_fault


def pool_of(backends: int) -> PoolRuntime:
    settings = gateway_settings(["http://127.0.0.1:9/v1"] * backends, delay=5.0)
    pool = settings.pools[0]
    return PoolRuntime.build(
        pool, {}, global_hedging=True, now=time.monotonic(), rng=random.Random(1)
    )


@pytest.mark.parametrize(
    ("error", "penalised"),
    [(httpx.PoolTimeout("full"), False), (httpx.ConnectTimeout("slow"), True)],
    ids=["pool-timeout", "connect-timeout"],
)
async def test_only_the_backends_own_failures_count_against_its_health(
    error: httpx.HTTPError, penalised: bool
) -> None:
    pool = pool_of(2)
    calls: list[str] = []

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        calls.append(backend)
        raise translate(error)

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    with pytest.raises(AllAttemptsFailed):
        await race.run()
    await race.aclose()
    assert len(calls) == 2  # still replaceable: another backend was tried
    for name in calls:
        failures = pool.balancer._backends[name].failures
        assert failures == (1 if penalised else 0), name
