"""The race with in-process runners (no sockets): bookkeeping that is awkward to observe from
outside. Streaming behaviour over real sockets is in test_hedging.py."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from types import MappingProxyType
from typing import Any

import pytest
import uvloop

from gateway.errors import (
    AllAttemptsFailed,
    NoBackendAvailable,
    UpstreamClientError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPushback,
    UpstreamRejectedRequest,
    UpstreamStatusError,
    all_attempts_failed,
)
from gateway.hedge.attempt import AttemptRecord
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import AttemptRunner, Race
from gateway.hedge.runner import UpstreamRequest, attempt_runner
from gateway.settings import HealthSettings
from gateway.wire.chat import CHAT
from gateway.wire.explain import Explanation
from gateway.wire.sse import SSEBatch, SSEEvent
from providers.base import UpstreamCall
from tests.harness.builders import gateway_settings

TOKEN = SSEEvent(b'{"choices":[{"index":0,"delta":{"content":"x"}}]}')


class Done:
    """A stand-in upstream stream that is already complete."""

    headers: Mapping[str, str] = MappingProxyType({})

    async def aclose(self) -> None:
        return None


async def _no_batches() -> AsyncIterator[SSEBatch]:
    if False:
        yield SSEBatch([])


def pool_of(backends: int = 2, health: HealthSettings | None = None) -> PoolRuntime:
    settings = gateway_settings(["http://127.0.0.1:9/v1"] * backends, delay=5.0)
    pool = settings.pools[0]
    if health is not None:
        pool = dataclasses.replace(pool, health=health)
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


# -- honest refusals, panic -----------------------------------------------------------


def failing(*errors: UpstreamError) -> AttemptRunner:
    """A runner whose n-th attempt raises errors[n]."""

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        await asyncio.sleep(0)
        raise errors[record.index]

    return runner


async def race_error(pool: PoolRuntime, *errors: UpstreamError) -> Exception:
    race = Race(pool, failing(*errors), RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    with pytest.raises(Exception) as info:
        await race.run()
    await race.aclose()
    assert len(race.attempts) == len(errors)
    return info.value


def test_pushback_everywhere_is_a_pushback_with_the_smallest_pause_capped() -> None:
    def cap(seconds: float) -> float:
        return min(seconds, 30.0)

    def pushback(status: int, seconds: float | None) -> UpstreamStatusError:
        return UpstreamStatusError.of(status, retry_after=seconds)

    both_429 = all_attempts_failed(["x", "y"], [pushback(429, 40.0), pushback(429, 35.0)], cap)
    assert isinstance(both_429, UpstreamPushback)
    assert (both_429.status, both_429.retry_after, both_429.should_retry) == (429, 30.0, None)
    assert both_429.type == "rate_limit_error"
    mixed = all_attempts_failed(["x", "y"], [pushback(429, 4.0), pushback(503, 2.0)], cap)
    assert (mixed.status, mixed.retry_after) == (503, 2.0)
    for others in (
        [pushback(429, 4.0), pushback(500, 2.0)],  # a 500 among them
        [pushback(503, None)],  # a 503 without Retry-After
        [pushback(429, 1.0), UpstreamConnectError("connect error")],
        [],
    ):
        error = all_attempts_failed(["x"], others, cap)
        assert isinstance(error, AllAttemptsFailed), others
        assert (error.status, error.should_retry, error.retry_after) == (502, False, None)


async def test_the_race_answers_a_pushback_when_every_attempt_pushed_back() -> None:
    pool = pool_of()
    error = await race_error(pool, UpstreamStatusError.of(503, retry_after=300.0),
                             UpstreamStatusError.of(429, retry_after=120.0))
    assert isinstance(error, UpstreamPushback)
    assert (error.status, error.retry_after) == (503, 30.0)  # health.max_pause
    now = time.monotonic()
    for name in pool.balancer.names:
        left = pool.balancer.seconds_left(name, now)
        assert left is not None and 29.0 < left <= 30.0  # each pause capped too


async def test_a_request_no_backend_can_take_is_refused_untried() -> None:
    pool = pool_of()
    for name in pool.balancer.names:  # max_concurrency 1 each, and both busy
        pool.balancer._backends[name].max_concurrency = 1
        pool.balancer.on_start(name)
    calls: list[str] = []

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        calls.append(backend)
        raise AssertionError("no attempt may start")

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    with pytest.raises(NoBackendAvailable) as info:
        await race.run()
    await race.aclose()
    assert (info.value.status, info.value.retry_after, info.value.should_retry) == (503, 1.0, None)
    assert calls == [] and not race.placement.panic


async def test_a_paused_one_backend_pool_is_tried_in_panic() -> None:
    pool = pool_of(backends=1)
    pool.balancer.pause("b0", 30.0, time.monotonic())

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        await asyncio.sleep(0)
        return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    result = await race.run()
    await race.aclose()
    assert result.winner.backend == "b0" and race.placement.panic


async def test_the_winner_holds_its_backend_slot_until_the_request_ends() -> None:
    """`max_concurrency` and the balancer's load count whole streams, not only the wait for
    the first token: the winner's slot is given back when the request ends (`aclose`)."""
    pool = pool_of(backends=1)
    pool.balancer._backends["b0"].max_concurrency = 1

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        await asyncio.sleep(0)
        return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    result = await race.run()
    now = time.monotonic()
    assert result.winner.backend == "b0"
    assert pool.balancer.inflight("b0") == 1  # still streaming
    assert pool.balancer.usable(now) == []  # at its cap: a second request is not sent there
    await race.aclose()
    assert pool.balancer.inflight("b0") == 0
    assert pool.balancer.usable(now) == ["b0"]


# -- a rejection only one provider makes ----------------------------------------------------


def mixed_pool() -> PoolRuntime:
    """b0 an `anthropic` backend, b1 a `bedrock` one (the settings only: nothing is sent)."""
    pool = pool_of()
    settings = pool.settings
    b0, b1 = settings.backends
    backends = (dataclasses.replace(b0, provider="anthropic"),
                dataclasses.replace(b1, provider="bedrock", region="us-east-1"))
    return dataclasses.replace(pool, settings=dataclasses.replace(settings, backends=backends))


async def test_a_rejection_fails_over_to_another_provider_which_serves_it() -> None:
    """The rejecting backend's rejection becomes its failure once the other provider served
    the same body: counted (`rejected_served`) and towards its ejection."""
    pool = mixed_pool()
    explanation = Explanation("invalid beta flag")

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        if record.index == 0:
            raise UpstreamRejectedRequest(400, explanation=explanation)
        await asyncio.sleep(0)
        return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, False),
                time.monotonic)
    result = await race.run()
    await race.aclose()
    first, second = race.attempts
    assert (result.winner is second, second.kind) == (True, "failover")
    assert first.backend != second.backend
    assert (first.outcome, first.failure) == ("failed", "rejected_served")
    assert pool.balancer._backends[first.backend].failures == 1
    assert pool.balancer._backends[second.backend].failures == 0


async def test_a_rejection_by_every_provider_is_the_clients_with_the_first_explanation() -> None:
    pool = mixed_pool()

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        raise UpstreamRejectedRequest(422, explanation=Explanation(f"no, says {backend}"))

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, False),
                time.monotonic)
    with pytest.raises(UpstreamClientError) as info:
        await race.run()
    await race.aclose()
    first = race.attempts[0].backend
    assert info.value.status == 422
    assert info.value.message == f"no, says {first} (backend {first})"
    assert [r.failure for r in race.attempts] == ["request_rejected", "request_rejected"]
    for name in ("b0", "b1"):
        assert pool.balancer._backends[name].failures == 0


async def test_a_race_that_defers_learning_learns_its_winners_ttft_once_when_told() -> None:
    """A stream's race learns its winner's TTFT once the client's first bytes are out
    (`learn`, which the proxy hands the response), not at the commit: the same value, once;
    a request whose first bytes never went out learns it at `aclose`."""

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        await asyncio.sleep(0)
        return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]

    for told in (True, False):
        pool = pool_of(backends=1)
        delay = pool.delays["b0"]
        race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                    time.monotonic, defer_learning=True)
        result = await race.run()
        assert result.winner.ttft is not None  # measured at the commit ...
        assert delay.observations == 0  # ... and not learnt yet
        if told:
            race.learn()
            assert delay.observations == 1
            race.learn()
        await race.aclose()
        assert delay.observations == 1


# -- how an attempt's end reaches the race ---------------------------------------------------


async def test_an_attempt_that_ends_wakes_the_race_in_the_next_turn_of_the_loop() -> None:
    """The race takes an attempt's result up in the turn after the attempt's last step: its
    runner sets the race's wake-up as it returns (`AttemptRecord.on_end`), where a done
    callback (as `asyncio.wait` has) takes a turn to run and only then wakes the race."""
    pool = pool_of()
    loop = asyncio.get_running_loop()
    order: list[str] = []

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        await asyncio.sleep(0)
        loop.call_soon(order.append, "one turn later")
        loop.call_soon(loop.call_soon, order.append, "two turns later")
        try:
            return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]
        finally:
            assert record.on_end is not None
            record.on_end()

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    await race.run()
    order.append("race returned")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert order == ["one turn later", "race returned", "two turns later"]
    await race.aclose()


async def test_an_attempt_cancelled_before_it_ran_is_taken_up_and_replaced() -> None:
    """A task cancelled before its first step runs none of its runner (no `on_end`): its
    done callback still wakes the race, which counts it failed and fails over at once rather
    than at the hedge delay."""
    pool = pool_of()
    loop = asyncio.get_running_loop()

    def cancel(name: str) -> None:
        (task,) = [t for t in asyncio.all_tasks() if t.get_name() == name]
        task.cancel()

    async def answer() -> Prefix:
        return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]

    def runner(backend: str, record: AttemptRecord) -> Coroutine[Any, Any, Prefix]:
        if record.index == 0:  # before the task's first step, which is scheduled after this
            loop.call_soon(cancel, f"attempt-0-{backend}")
        return answer()

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    async with asyncio.timeout(2.0):  # the hedge delay is 5 s: only the wake-up is sooner
        result = await race.run()
    assert [a.outcome for a in race.attempts] == ["failed", "won"]
    assert result.winner.kind == "failover"
    await race.aclose()


def test_the_runner_calls_on_end_once_however_its_attempt_ends() -> None:
    """The runner (`gateway.hedge.runner`) sets the race's wake-up as its attempt ends,
    a failure as a token: the race's one-turn take-up rests on it."""

    class Failing:
        serves = frozenset({"chat/completions"})

        async def open(self, call: UpstreamCall) -> Any:
            raise UpstreamConnectError("refused")

    settings = gateway_settings(["http://127.0.0.1:9/v1"], delay=5.0)
    providers: dict[str, Any] = {"b0": Failing()}
    pool = PoolRuntime.build(settings.pools[0], providers, global_hedging=True,
                             now=0.0, rng=random.Random(1))
    run = attempt_runner(pool, UpstreamRequest(
        endpoint="chat/completions", body={"model": "m", "messages": []}, stream=True,
        request_id="r", protocol=CHAT), 1e9, lambda: 0.0)
    ends: list[int] = []
    record = AttemptRecord(index=0, backend="b0", kind="primary", started=0.0,
                           spent_budget=False, on_end=lambda: ends.append(1))
    with pytest.raises(UpstreamConnectError):
        asyncio.run(run("b0", record))
    assert ends == [1] and record.ended == 0.0


async def _hedged_race(delay: float) -> str:
    """A race whose primary never answers: only the hedge, sent at `delay`, can."""
    settings = gateway_settings(["http://127.0.0.1:9/v1"] * 2, delay=delay)
    pool = PoolRuntime.build(settings.pools[0], {}, global_hedging=True,
                             now=time.monotonic(), rng=random.Random(1))

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        if record.index == 0:
            await asyncio.Event().wait()
        return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    try:
        async with asyncio.timeout(0.5):  # 25 times the hedge delay and more
            return (await race.run()).winner.kind
    finally:
        await race.aclose()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop],
                         ids=["asyncio", "uvloop"])
def test_the_hedge_starts_at_its_delay_on_either_loop(
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """The race's wait ends when its timer fires, on uvloop too (`hedge-gateway serve`'s
    loop), which rounds a timer to the millisecond and may run it before its own clock reads
    the due time: a race that read the clock to tell slept on past its hedge delay."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        for i in range(10):  # delays off the millisecond grid, as learnt delays are
            assert runner.run(_hedged_race(0.0103 + i * 0.0011)) == "hedge", i


async def test_a_bug_while_the_losers_are_cancelled_leaves_none_running_and_frees_each_once(
) -> None:
    """A bug of ours at the commit, as the losers are ended (here the delay reader raises as
    it learns a loser's censored TTFT): the bug surfaces (the request is answered 500), but
    every loser is cancelled all the same and each backend slot goes back once: another
    request's slot on the loser's backend is still counted after it."""
    pool = pool_of(backends=2)
    hold = asyncio.Event()

    class Buggy:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def delay(self, now: float) -> float:
            return 0.05

        def median(self, now: float) -> None:
            return None

        def tail(self, now: float) -> None:
            return None

        def observe(self, ttft: float, now: float, *, censored: bool = False) -> None:
            if censored:
                raise ValueError("a bug in the delay reader")
            self.inner.observe(ttft, now, censored=censored)

    delays = {name: Buggy(reader) for name, reader in pool.delays.items()}

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        if record.index == 0:
            await hold.wait()  # the primary hangs: the hedge wins
        return Prefix(Done(), _no_batches(), [TOKEN])  # type: ignore[arg-type]

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, delays, True), time.monotonic)
    run = asyncio.ensure_future(race.run())
    await asyncio.sleep(0.01)
    primary = race.attempts[0].backend
    pool.balancer.on_start(primary)  # another request's attempt there, still running
    with pytest.raises(ValueError):
        await run
    await race.aclose()
    running = [t for t in asyncio.all_tasks() if t.get_name().startswith("attempt-0")
               and not t.done()]
    for task in running:
        task.cancel()
    assert not running, "the primary was left running"
    assert pool.balancer.inflight(primary) == 1  # the other request's, not given back twice


async def test_every_backend_paused_is_answered_with_the_soonest_end_of_the_pauses() -> None:
    """Panic routing off (`panic_below: 0`): every backend told the gateway to come back in
    30 s, one of them in 20. The next request is refused untried; its advice is the soonest
    end (20 s), not the 1 s of a pool merely at its concurrency limit (the client would come
    back nineteen times for nothing), and it does not say the backends are at their limit."""
    from gateway.errors import NoBackendAvailable

    pool = pool_of(health=HealthSettings(panic_below=0.0))
    first, second = pool.balancer.names
    pool.balancer.pause(first, 30.0, time.monotonic())
    pool.balancer.pause(second, 20.0, time.monotonic())

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        raise AssertionError("nothing is tried")

    race = Race(pool, runner, RaceOptions(time.monotonic() + 5, pool.delays, True),
                time.monotonic)
    with pytest.raises(NoBackendAvailable) as refused:
        await race.run()
    await race.aclose()
    assert refused.value.retry_after is not None and 19.0 < refused.value.retry_after <= 20.0
    assert "paused" in refused.value.message
    assert NoBackendAvailable().retry_after == 1.0  # at the concurrency limit: a slot frees
