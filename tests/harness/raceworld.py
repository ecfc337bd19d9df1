"""A scripted world for the race in virtual time (see `virtualtime`).

Each attempt of a race follows one `Step` of its row's script, chosen by the attempt's index:
its upstream answers a token, a complete answer without a token (`empty`: role, finish,
`[DONE]`), a token-less stream cut before `[DONE]` (`cut`), a status, a reset, or nothing, `at`
seconds after the attempt started. The attempts are real `open_until_first_token` calls on
fake providers, so the close paths under test are the gateway's own; the fake streams record
when they were closed.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from starlette.requests import Request
from starlette.types import Message

from gateway.api.proxy import Proxy
from gateway.api.request import LogicalRequest
from gateway.drain import Drain
from gateway.errors import (
    AllAttemptsFailed,
    FirstTokenTimeout,
    UpstreamClientError,
    UpstreamProtocolError,
    UpstreamStatusError,
)
from gateway.hedge.attempt import AttemptRecord, open_until_first_token
from gateway.hedge.budget import HedgeBudget, SuppressReason
from gateway.hedge.deadline import KeyShare
from gateway.hedge.delay import HedgeDelay
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import Race, RaceResult
from gateway.settings import BudgetSettings, DelaySettings, ServerSettings
from gateway.stats import RequestSummary, Stats
from gateway.wire.chat import CHAT
from gateway.wire.sse import SSEBatch, SSEEvent
from providers.base import ENDPOINTS, UpstreamCall
from tests.harness.builders import gateway_settings
from tests.harness.virtualtime import VirtualLoop

ROLE = SSEEvent(b'{"choices":[{"index":0,"delta":{"role":"assistant"}}]}')
TOKEN = SSEEvent(b'{"choices":[{"index":0,"delta":{"content":"x"}}]}')
FINISH = SSEEvent(b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}')
DONE = SSEEvent(b"[DONE]")
#: how long the winner's stream lasts after commit (and an error answer is read), virtually
STREAM_FOR = 5.0

What = Literal["token", "gone+token", "token+done", "empty", "cut", "hang", "reset", "400",
               "503", "cancelled"]


@dataclass(frozen=True, slots=True)
class Step:
    """What attempt i's upstream does, `at` seconds after the attempt started."""

    what: What
    at: float = 0.0


HANG = Step("hang")


class CountingBudget(HedgeBudget):
    """The real budget, counting what the race asked of it."""

    def __init__(self, settings: BudgetSettings, now: float) -> None:
        super().__init__(settings, now)
        self.spent = 0
        self.released = 0
        self.hedge_outcomes: list[bool] = []

    def try_spend(self, now: float, *, inflight_requests: int, hedge: bool,
                  tokens: int = 0) -> SuppressReason | None:
        refused = super().try_spend(now, inflight_requests=inflight_requests, hedge=hedge,
                                    tokens=tokens)
        self.spent += refused is None
        return refused

    def release(self) -> None:
        self.released += 1
        super().release()

    def record_hedge(self, won: bool, now: float) -> None:
        self.hedge_outcomes.append(won)
        super().record_hedge(won, now)


@dataclass
class World:
    loop: VirtualLoop
    #: per attempt index: virtual time its upstream was opened / closed
    opened: dict[int, float] = field(default_factory=dict)
    closed: dict[int, float] = field(default_factory=dict)
    race_task: asyncio.Future[RaceResult] | None = None
    #: how long a stream's close takes (virtual seconds), to catch interrupted closes
    close_takes: float = 0.0
    #: closes that were interrupted before they finished
    interrupted: list[int] = field(default_factory=list)
    #: attempts whose upstream answered with an error status (nothing opened)
    refused: list[int] = field(default_factory=list)


class FakeStream:
    headers: Mapping[str, str] = MappingProxyType({})

    def __init__(self, world: World, index: int, step: Step) -> None:
        self.world, self.index, self.step = world, index, step
        world.opened[index] = world.loop.time()

    async def batches(self) -> AsyncIterator[SSEBatch]:
        step, world = self.step, self.world
        if step.what == "hang":
            await world.loop.create_future()
        await asyncio.sleep(step.at)
        if step.what == "reset":
            raise UpstreamProtocolError("connection reset")
        if step.what == "gone+token":  # the client leaves in the very tick of the token
            assert world.race_task is not None
            world.race_task.cancel()
        if step.what == "empty":
            yield SSEBatch([ROLE, FINISH, DONE])
            return
        if step.what == "cut":  # the stream ends, without a token and without `[DONE]`
            yield SSEBatch([ROLE])
            return
        yield SSEBatch([ROLE, TOKEN])
        if step.what == "token+done":  # and its end a second later, in a read of its own
            await asyncio.sleep(1.0)
            yield SSEBatch([FINISH, DONE])
            return
        await world.loop.create_future()

    async def aclose(self) -> None:
        world = self.world
        try:
            if world.close_takes:
                await asyncio.sleep(world.close_takes)
        except asyncio.CancelledError:
            world.interrupted.append(self.index)
            raise
        world.closed[self.index] = world.loop.time()


class FakeProvider:
    name = "fake"
    serves: frozenset[str] = frozenset(ENDPOINTS)

    def __init__(self, world: World, index: int, step: Step) -> None:
        self.world, self.index, self.step = world, index, step

    async def open(self, call: UpstreamCall) -> FakeStream:
        step = self.step
        if step.what == "cancelled":  # the attempt's task cancelled by something not the race
            await asyncio.sleep(step.at)
            raise asyncio.CancelledError
        if step.what in ("400", "503"):
            await asyncio.sleep(step.at)
            raise UpstreamStatusError.of(int(step.what))
        return FakeStream(self.world, self.index, step)

    async def aclose(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Setup:
    script: Sequence[Step]
    backends: int = 3
    max_attempts: int = 2
    delay: float = 0.25
    #: per backend index, when its delay differs from `delay`
    delays: Mapping[int, float] = field(default_factory=dict)
    deadline: float = 10.0
    hedging: bool = True
    budget: BudgetSettings = field(default_factory=BudgetSettings)
    #: the bucket's tokens at the start, when not full (the settings refuse a burst below 1)
    budget_tokens: float | None = None
    #: client disconnect (the race task cancelled) at this virtual time
    gone_at: float | None = None
    #: backend index -> paused until (virtual time)
    paused: Mapping[int, float] = field(default_factory=dict)
    #: start with the efficacy guard on (a full window of lost hedges)
    guard_on: bool = False
    #: logical requests in flight in the pool (the budget caps extra attempts at 20 % of it)
    inflight_requests: int = 1
    #: backend index -> TTFTs its delay has learnt (repeated to `min_samples`, refreshed at 0)
    learnt: Mapping[int, Sequence[float]] = field(default_factory=dict)
    #: the request's TTFT objective and its key's share of the budget (`gateway.hedge.deadline`)
    objective: float | None = None
    share: KeyShare | None = None


@dataclass
class Seen:
    outcome: str
    decided_at: float
    race: Race
    budget: CountingBudget
    world: World
    result: RaceResult | None
    wakes: list[float]

    @property
    def starts(self) -> list[tuple[str, float]]:
        return [(a.kind, round(a.started, 6)) for a in self.race.attempts]

    @property
    def cancelled(self) -> tuple[int, ...]:
        return tuple(a.index for a in self.race.attempts if a.outcome in ("lost", "cancelled"))

    @property
    def suppressed(self) -> dict[str, int]:
        return dict(Counter(str(r) for r in self.race.suppressed))


def build_pool(setup: Setup) -> tuple[PoolRuntime, CountingBudget]:
    settings = gateway_settings(
        ["http://127.0.0.1:9/v1"] * setup.backends,
        delay=setup.delay,
        max_attempts=setup.max_attempts,
        budget=setup.budget,
    ).pools[0]
    pool = PoolRuntime.build(settings, {}, global_hedging=True, now=0.0, rng=random.Random(1))
    budget = CountingBudget(setup.budget, 0.0)
    pool.budget = budget
    if setup.budget_tokens is not None:
        budget._tokens = setup.budget_tokens
    pool.inflight_requests = setup.inflight_requests
    if setup.guard_on:
        for _ in range(setup.budget.win_window):
            budget.record_hedge(False, 0.0)
        budget.hedge_outcomes.clear()
    for index, until in setup.paused.items():
        pool.balancer.pause(f"b{index}", until, 0.0)  # paused from the virtual start
    return pool, budget


def delays_for(setup: Setup) -> dict[str, HedgeDelay]:
    delays = {
        f"b{i}": HedgeDelay(DelaySettings(mode="fixed", value=setup.delays.get(i, setup.delay)))
        for i in range(setup.backends)
    }
    for index, ttfts in setup.learnt.items():
        delay = delays[f"b{index}"]
        for k in range(max(len(ttfts), delay.settings.min_samples)):
            delay.observe(ttfts[k % len(ttfts)], 0.0)
        delay.refresh(0.0)
    return delays


async def play(setup: Setup, loop: VirtualLoop, world: World | None = None) -> Seen:
    """Run one race to its end, then the winner's stream, then reap: like the proxy does."""
    world = world or World(loop)
    pool, budget = build_pool(setup)

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        step = setup.script[record.index]
        call = UpstreamCall("chat/completions", {}, True, "req", 30.0)
        provider = FakeProvider(world, record.index, step)
        return await open_until_first_token(
            provider, call, lambda: record.outcome is not None, CHAT
        )

    refused = None if setup.hedging else SuppressReason.DISABLED
    options = RaceOptions(setup.deadline, delays_for(setup), setup.hedging, refused,
                          objective=setup.objective, share=setup.share)
    race = Race(pool, runner, options, loop.time)
    task = asyncio.ensure_future(race.run())
    world.race_task = task
    if setup.gone_at is not None:
        loop.call_at(setup.gone_at, task.cancel)
    result: RaceResult | None = None
    try:
        result = await task
        outcome = f"commit {result.winner.index}"
    except asyncio.CancelledError:
        outcome = "gone"
    except UpstreamClientError as exc:
        outcome = str(exc.status)
    except AllAttemptsFailed:
        outcome = "502"
    except FirstTokenTimeout:
        outcome = "504"
    decided_at = loop.time()
    wakes = list(loop.clock.wakes)
    await asyncio.sleep(STREAM_FOR)  # the client reads the stream (or its error answer)
    if result is not None:
        await result.prefix.aclose()
    await race.aclose()
    return Seen(outcome, decided_at, race, budget, world, result, wakes)


# -- the same world behind the proxy -----------------------------------------------------------


class RecordingStats(Stats):
    """The real stats, keeping each summary it was given (and when, virtually)."""

    def __init__(self, pool: PoolRuntime, clock: VirtualLoop) -> None:
        super().__init__({pool.settings.name: [b.name for b in pool.settings.backends]},
                         now=clock.time())
        self._loop = clock
        self.summaries: list[tuple[float, RequestSummary]] = []

    def record(self, summary: RequestSummary) -> None:
        self.summaries.append((self._loop.time(), summary))
        super().record(summary)


class SequencedProvider:
    """A backend's provider for the proxy: the n-th upstream opened follows step n."""

    name = "sequenced"
    serves: frozenset[str] = frozenset(ENDPOINTS)

    def __init__(self, world: World, script: Sequence[Step]) -> None:
        self.world, self.script = world, script

    async def open(self, call: UpstreamCall) -> FakeStream:
        world = self.world
        index = len(world.opened) + len(world.refused)
        step = self.script[index]
        if step.what in ("400", "503"):
            world.refused.append(index)
        return await FakeProvider(world, index, step).open(call)

    async def aclose(self) -> None:
        return None


def proxy_for(setup: Setup, loop: VirtualLoop, world: World) -> tuple[Proxy, PoolRuntime]:
    """A `Proxy` over a pool whose backends follow `setup.script`, on the virtual clock."""
    pool, _ = build_pool(setup)
    pool.inflight_requests = 0  # the proxy counts its own requests
    provider = SequencedProvider(world, setup.script)
    pool.providers = {b.name: provider for b in pool.settings.backends}
    pool.delays = delays_for(setup)
    pool.whole_delays = {endpoint: delays_for(setup) for endpoint in pool.whole_delays}
    stats = RecordingStats(pool, loop)
    return Proxy(ServerSettings(), stats, loop.time, Drain(loop.time)), pool


def http_request() -> Request:
    """A Starlette request whose client never sends another message (nor leaves)."""

    async def receive() -> Message:
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [], "query_string": b""}
    return Request(scope, receive)


def logical_request(stream: bool) -> LogicalRequest:
    body = {"model": "pool", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return LogicalRequest("req", "chat/completions", body, stream, {}, CHAT)
