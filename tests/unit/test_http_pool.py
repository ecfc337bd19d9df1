"""Our own connection pool being full is our failure, not the backend's.

The gateway's shared upstream client raises `GatewayPoolFull` when every one of its connections
is busy past `timeouts.connect`; the backend was never asked. Counting that as its connect
failure would eject healthy backends one after another exactly when the gateway is busiest."""

from __future__ import annotations

import errno
import random
import time

import aiohttp
import pytest

from gateway.errors import AllAttemptsFailed, GatewayPoolFull, UpstreamConnectError, UpstreamError
from gateway.hedge.attempt import AttemptRecord
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import Race
from providers.http import _closed_idle, _Reuse, translate
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


@pytest.mark.parametrize(
    ("error", "reused", "resent"),
    [
        # the request could not be written: the server never had all of it
        (aiohttp.ClientOSError(errno.EPIPE, "Can not write request body for http://u/v1"),
         True, True),
        (aiohttp.ClientOSError(errno.ECONNRESET, "Can not write request body for http://u"),
         True, True),
        (aiohttp.ClientOSError(None, "Can not write request body for http://u/v1"), True, True),
        # ... but on a new connection that is the server's doing
        (aiohttp.ClientOSError(errno.EPIPE, "Can not write request body for http://u/v1"),
         False, False),
        # written, then closed or reset: the server may have started on it
        (aiohttp.ServerDisconnectedError(), True, False),
        (aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"), True, False),
        (aiohttp.ClientOSError(errno.ETIMEDOUT, "Can not write request body for http://u"),
         True, False),
    ],
)
def test_a_post_is_sent_again_only_when_it_could_not_be_written(
    error: BaseException, reused: bool, resent: bool
) -> None:
    reuse = _Reuse()
    reuse.reused = reused
    assert _closed_idle(error, reuse) is resent
