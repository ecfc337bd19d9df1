"""The race with in-process runners (no sockets): bookkeeping that is awkward to observe from
outside. Streaming behaviour over real sockets is in test_hedging.py."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType

import pytest

from gateway.attempt import Prefix
from gateway.errors import (
    AllAttemptsFailed,
    UpstreamClientError,
    UpstreamConnectError,
    UpstreamStatusError,
)
from gateway.pool import PoolRuntime
from gateway.race import AttemptRecord, Race, RaceOptions
from gateway.sse import SSEEvent
from tests.harness.builders import gateway_settings

TOKEN = SSEEvent(b'{"choices":[{"index":0,"delta":{"content":"x"}}]}')


class Done:
    """A stand-in upstream stream that is already complete."""

    headers: Mapping[str, str] = MappingProxyType({})

    async def aclose(self) -> None:
        return None


async def _no_batches() -> AsyncIterator[list[SSEEvent]]:
    if False:
        yield []


def pool_of(backends: int = 2) -> PoolRuntime:
    settings = gateway_settings(["http://127.0.0.1:9/v1"] * backends, delay=5.0)
    pool = settings.pools[0]
    return PoolRuntime.build(
        pool, {}, global_hedging=True, now=time.monotonic(), rng=random.Random(1)
    )


async def test_a_bug_in_a_runner_is_a_502_and_not_the_backends_fault() -> None:
    pool = pool_of()
    calls: list[str] = []

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        calls.append(backend)
        raise RuntimeError("bug")

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    with pytest.raises(AllAttemptsFailed) as info:
        await race.run()
    await race.aclose()
    assert len(calls) == 2  # a replacement was still tried
    assert "internal error (RuntimeError)" in info.value.message
    assert [r.failure for r in race.attempts] == ["internal_error", "internal_error"]
    for name in calls:
        assert pool.balancer.state(name, time.monotonic())[0] == "ok"
        assert pool.balancer._backends[name].failures == 0


async def test_failover_after_a_runner_bug_can_still_win() -> None:
    pool = pool_of()

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        if record.index == 0:
            raise RuntimeError("bug")
        await asyncio.sleep(0)
        return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    result = await race.run()
    await race.aclose()
    assert result.winner.index == 1 and result.winner.kind == "failover"


async def test_each_failed_attempt_records_its_failure_code() -> None:
    pool = pool_of()

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        if record.index == 0:
            raise UpstreamStatusError.of(503)
        raise UpstreamConnectError("connect error")

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    with pytest.raises(AllAttemptsFailed) as info:
        await race.run()
    await race.aclose()
    assert [(r.failure, r.reason) for r in race.attempts] == [
        ("unavailable", "status 503"), ("connect_error", "connect error")]
    assert "status 503" in info.value.message and "connect error" in info.value.message


@pytest.mark.parametrize("status", [400, 413, 422])
async def test_a_status_that_describes_the_request_reaches_the_client_as_is(status: int) -> None:
    pool = pool_of()

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        raise UpstreamStatusError.of(status)

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    with pytest.raises(UpstreamClientError) as info:
        await race.run()
    await race.aclose()
    assert info.value.status == status and info.value.code == "upstream_rejected_request"
    assert [(r.failure, r.outcome) for r in race.attempts] == [("request_rejected", "failed")]
