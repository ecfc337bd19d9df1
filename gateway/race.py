"""One logical request's race to the first token (SPEC §5).

The race starts the primary, waits for a first token, a failure, the hedge delay or the
deadline, and starts further attempts under the rules of §5.3 and §5.4. The first attempt
to hand back a `Prefix` (its events up to and including the first token) commits; every other
attempt is cancelled at once. Each attempt task closes its own upstream, shielded from the
cancellation, so a loser's socket is closed within a loop iteration of the commit.

The race knows no HTTP framework and no wire format: what an attempt does is the `AttemptRunner`
it is given, and "token" means "the runner returned".
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.attempt import Prefix
from gateway.budget import SuppressReason
from gateway.clock import Clock
from gateway.errors import (
    AllAttemptsFailed,
    FirstTokenTimeout,
    InternalAttemptError,
    UpstreamClientError,
    UpstreamError,
    UpstreamRejectedRequest,
)
from gateway.policy import HedgeDelay, min_useful
from gateway.pool import PoolRuntime

AttemptKind = Literal["primary", "hedge", "failover"]
Outcome = Literal["won", "lost", "failed", "cancelled"]

log = logging.getLogger("hedge_gateway.race")

#: how long the race waits for cancelled attempts to finish closing before it gives up on them
REAP_TIMEOUT = 5.0


@dataclass(slots=True)
class AttemptRecord:
    """What happened to one attempt; the stats and the request log read these."""

    index: int
    backend: str
    kind: AttemptKind
    started: float
    spent_budget: bool
    outcome: Outcome | None = None
    #: seconds from this attempt's start to its first token (or to its cancellation)
    ttft: float | None = None
    reason: str | None = None
    #: seconds it took to close a cancelled attempt's upstream
    close_s: float | None = None
    #: events a cancelled attempt read after the commit (should stay 0)
    late_events: int = 0
    #: a failed attempt's `UpstreamError.code` (bounded; `reason` has the detail)
    failure: str | None = None
    #: when its runner returned or raised (the proxy sets it; the dashboard's timeline)
    ended: float | None = None


@dataclass(slots=True)
class RaceResult:
    winner: AttemptRecord
    prefix: Prefix
    attempts: list[AttemptRecord]
    suppressed: list[SuppressReason]
    committed_at: float


AttemptRunner = Callable[[str, AttemptRecord], Coroutine[Any, Any, Prefix]]

#: `AttemptRecord.reason` of an attempt cancelled by the race (lost, or the request ended)
CANCELLED_BEFORE_TOKEN = "cancelled before its first token"
CANCELLED_AFTER_TOKEN = "cancelled after its first token"


def _close_timer(
    record: AttemptRecord, clock: Clock, cancelled_at: float
) -> Callable[[asyncio.Task[Prefix]], None]:
    """A done-callback that stores how long a cancelled attempt took to close (stats)."""

    def done(_task: asyncio.Task[Prefix]) -> None:
        record.close_s = max(0.0, clock() - cancelled_at)

    return done


@dataclass(slots=True)
class RaceOptions:
    deadline: float
    #: the latency trackers this request's attempts feed and take their delay from
    delays: Mapping[str, HedgeDelay]
    #: delay-triggered hedges allowed for this request (pool switch, opt-outs, safety rules)
    hedging: bool
    #: when hedging was refused for this request, the reason counted once (`disabled`)
    refused_reason: SuppressReason | None = None


@dataclass(slots=True)
class Race:
    """The state of one race. Use `run()` once, then `aclose()` in a finally."""

    pool: PoolRuntime
    runner: AttemptRunner
    options: RaceOptions
    clock: Clock
    attempts: list[AttemptRecord] = field(default_factory=list)
    suppressed: list[SuppressReason] = field(default_factory=list)
    _tasks: dict[asyncio.Task[Prefix], AttemptRecord] = field(default_factory=dict)
    _losers: list[asyncio.Task[Prefix]] = field(default_factory=list)
    _reasons: list[str] = field(default_factory=list)
    committed: bool = False

    async def run(self) -> RaceResult:
        pool, now = self.pool, self.clock()
        pool.budget.on_request(now)
        if self.options.refused_reason is not None:
            self.suppressed.append(self.options.refused_reason)
        delays = self.options.delays
        primary = pool.balancer.pick(now, ttft=lambda name: delays[name].median(now))
        if primary is None:
            raise AllAttemptsFailed(["no usable backend in the pool"])
        self._start(primary, "primary", spent_budget=False)
        delay = self.options.delays[primary].delay(now)
        next_hedge = now + delay if self.options.hedging else math.inf
        try:
            while True:
                wake = min(next_hedge, self.options.deadline)
                done: set[asyncio.Task[Prefix]] = set()
                if self._tasks:
                    done, _ = await asyncio.wait(
                        self._tasks,
                        timeout=max(0.0, wake - self.clock()),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                result = self._settle(done)
                if result is not None:
                    return result
                now = self.clock()
                if now >= self.options.deadline:
                    raise FirstTokenTimeout(self._reasons)
                if now >= next_hedge:
                    self._try_extra("hedge", now)
                    next_hedge = now + delay
                if not self._tasks:
                    raise AllAttemptsFailed(self._reasons)
        except asyncio.CancelledError:
            self._cancel_all()  # the client left: say nothing of the hedges' efficacy
            raise
        except BaseException:
            self._cancel_all()
            self._record_hedges()
            raise

    def _record_hedges(self) -> None:
        """Feed the efficacy guard: each hedge started won or it did not."""
        now = self.clock()
        for attempt in self.attempts:
            if attempt.kind == "hedge":
                self.pool.budget.record_hedge(attempt.outcome == "won", now)

    def _settle(self, done: set[asyncio.Task[Prefix]]) -> RaceResult | None:
        """Handle finished attempts: a token commits; failures start replacements."""
        winners: list[tuple[asyncio.Task[Prefix], AttemptRecord]] = []
        failures = 0
        for task in done:
            record = self._tasks.pop(task)
            self._finished(record)
            exc = task.exception()
            if exc is None:
                winners.append((task, record))
                continue
            failures += 1
            if not isinstance(exc, UpstreamError):
                # a bug of ours, not the backend's: log it, answer 502 without a trace, and
                # keep it out of the backend's health record
                log.error("attempt %s failed inside the gateway", record.backend, exc_info=exc)
                self._failed(record, InternalAttemptError(f"internal error ({type(exc).__name__})"),
                             backend_fault=False)
                continue
            self._failed(record, exc)
            if isinstance(exc, UpstreamRejectedRequest):
                raise UpstreamClientError.of(exc.status, record.backend)
        if winners:
            winners.sort(key=lambda pair: pair[1].index)
            for task, record in winners[1:]:  # tokens in the same tick: the earlier attempt wins
                record.outcome = "lost"
                self._observe(record, censored=False)
                self._losers.append(task)
            return self._commit(*winners[0])
        now = self.clock()
        for _ in range(failures):
            if now < self.options.deadline:
                self._try_extra("failover", now)
        return None

    def _commit(self, task: asyncio.Task[Prefix], record: AttemptRecord) -> RaceResult:
        now = self.clock()
        self.committed = True
        record.outcome = "won"
        self.pool.balancer.on_success(record.backend, now)
        self._observe(record, censored=False)
        self._cancel_all()
        self._record_hedges()
        return RaceResult(record, task.result(), self.attempts, self.suppressed, now)

    def _try_extra(self, kind: AttemptKind, now: float) -> None:
        """Start a hedge or a failover if §5.3 allows it; else count why not."""
        reason = self._start_extra(kind, now)
        if reason is not None:
            self.suppressed.append(reason)

    def _start_extra(self, kind: AttemptKind, now: float) -> SuppressReason | None:
        pool = self.pool
        hedge = kind == "hedge"
        if len(self.attempts) >= self._max_attempts():
            return SuppressReason.MAX_ATTEMPTS
        in_flight = {r.backend for r in self._tasks.values()}
        tried = {r.backend for r in self.attempts}
        running_groups = {pool.groups[b] for b in in_flight}

        def ttft(name: str) -> float | None:
            return self.options.delays[name].median(now)

        backend = pool.balancer.pick(
            now, exclude=in_flight | tried, avoid_groups=running_groups, ttft=ttft
        )
        if backend is None and not hedge:
            backend = pool.balancer.pick(now, exclude=in_flight, ttft=ttft)
        if backend is None:
            return SuppressReason.NO_BACKEND
        remaining = self.options.deadline - now
        if remaining < min_useful(self.options.delays[backend].median(now)):
            return SuppressReason.DEADLINE
        refused = pool.budget.try_spend(now, inflight_requests=pool.inflight_requests, hedge=hedge)
        if refused is not None:
            return refused
        self._start(backend, kind, spent_budget=True)
        return None

    def _max_attempts(self) -> int:
        configured = min(self.pool.settings.hedging.max_attempts, 5)
        return max(1, min(configured, len(self.pool.settings.backends)))

    def _start(self, backend: str, kind: AttemptKind, *, spent_budget: bool) -> None:
        record = AttemptRecord(len(self.attempts), backend, kind, self.clock(), spent_budget)
        self.attempts.append(record)
        self.pool.balancer.on_start(backend)
        task = asyncio.create_task(
            self.runner(backend, record), name=f"attempt-{record.index}-{backend}"
        )
        self._tasks[task] = record

    def _finished(self, record: AttemptRecord) -> None:
        """Bookkeeping common to every way an attempt ends."""
        self.pool.balancer.on_finish(record.backend)
        if record.spent_budget:
            self.pool.budget.release()

    def _failed(
        self, record: AttemptRecord, exc: UpstreamError, *, backend_fault: bool = True
    ) -> None:
        now = self.clock()
        record.outcome = "failed"
        record.reason = exc.reason
        record.failure = exc.code
        self._reasons.append(f"{record.backend}: {exc.reason}")
        if exc.replaceable and backend_fault:
            self.pool.balancer.on_failure(record.backend, now)
        if exc.retry_after is not None:
            self.pool.balancer.pause(record.backend, now + exc.retry_after)

    def _observe(self, record: AttemptRecord, *, censored: bool) -> None:
        now = self.clock()
        record.ttft = now - record.started
        self.options.delays[record.backend].observe(record.ttft, now, censored=censored)

    def _cancel_all(self) -> None:
        """Cancel every attempt still running, without waiting for it (SPEC §5.5).

        For the stats, each cancelled record gets a `reason` saying whether the attempt had
        already found its token (its task finished in the same tick, not yet picked up), and
        a done-callback sets `close_s`: how long its task took to close the upstream.
        """
        cancelled_at = self.clock()
        for task, record in self._tasks.items():
            had_token = task.done() and not task.cancelled() and task.exception() is None
            task.cancel()
            self._finished(record)
            record.outcome = "lost" if self.committed else "cancelled"
            record.reason = CANCELLED_AFTER_TOKEN if had_token else CANCELLED_BEFORE_TOKEN
            self._observe(record, censored=True)
            if not task.done():
                task.add_done_callback(_close_timer(record, self.clock, cancelled_at))
            self._losers.append(task)
        self._tasks.clear()

    async def aclose(self) -> None:
        """Wait (bounded) for cancelled attempts to finish closing their upstreams."""
        losers, self._losers = self._losers, []
        if losers:
            await asyncio.wait(losers, timeout=REAP_TIMEOUT)
            for task in losers:
                # a loser that found its token in the same tick: close what it opened
                if task.done() and not task.cancelled() and task.exception() is None:
                    await task.result().aclose()
