"""One logical request's race to the first token.

The race starts the primary, waits for a first token, a failure, the hedge delay or the
deadline, and starts further attempts under the hedge and failover rules (docs/hedging.md). The
first attempt
to hand back a `Prefix` (its events up to and including the first token) commits; every other
attempt is cancelled at once. Each attempt task closes its own upstream, shielded from the
cancellation, so a loser's socket is closed within a loop iteration of the commit. A loser that
already holds a token (it finished in the same tick as the winner, or before the race picked it
up) has nothing left to cancel: the race closes its `Prefix` in a task of its own at commit, so the
client never waits for it and `close_s` counts it.

Rules where several things land in one tick (one wake-up of the race, `Race._wait`):
- every attempt that finished is accounted for before anything is decided, so none is left
  neither committed nor reaped;
- a token beats a 400/413/422 from another attempt: the token proves the request is not one
  that "would fail everywhere", and a fast refusal must not win over a success;
- among several tokens the attempt started first wins.

A complete answer without a token (a runner's `Prefix` marked `empty`: the stream ended
normally, perhaps with nothing in it) is an answer, not a failure: the race keeps the first
one and starts nothing more (no hedge, no failover), waits for the attempts still running to
yield a token (a token beats it: the client gets the text) or to fail, and commits the kept
answer when none is left, or at the deadline. It counts as a success of its backend, never a
failure; like a token, it proves the request is not one that would fail everywhere.

The hedge timer: the next hedge is considered one delay after the last hedge check, and a
failover restarts it with the replacement's delay from the replacement's start. Once
every allowed attempt has started, nothing can start any more: `max_attempts` is counted once
and the timer stops waking the race. A delay shortened to the conversation's home's (an
attempt away from its warm home) is kept only if the hedge would go home when it is due;
else the timer waits for the attempt's own delay (`Placement.early_hedge`). A request with a
TTFT objective whose primary's learnt tail would miss it has its first hedge due earlier, as
late as still meets the objective (`gateway.hedge.deadline`), paid from its key's own share
as well as the pool's budget; one the share cannot pay is counted `key_budget` and the timer
waits for the normal delay. A failover before it puts the replacement's normal delay in force.

The race knows no HTTP framework and no wire format: what an attempt does is the `AttemptRunner`
it is given, and "token" means "the runner returned".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gateway.clock import Clock
from gateway.errors import (
    FirstTokenTimeout,
    InternalAttemptError,
    NoBackendAvailable,
    UpstreamClientError,
    UpstreamError,
    UpstreamRejectedHere,
    UpstreamRejectedRequest,
    all_attempts_failed,
)
from gateway.hedge.attempt import (
    CANCELLED_AFTER_TOKEN,
    CANCELLED_BEFORE_TOKEN,
    EMPTY_ANSWER_LOST,
    AttemptKind,
    AttemptRecord,
)
from gateway.hedge.budget import SuppressReason
from gateway.hedge.deadline import deadline_delay
from gateway.hedge.delay import min_useful
from gateway.hedge.losers import Leftovers
from gateway.hedge.placement import Placement, RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix

log = logging.getLogger("hedge_gateway.race")

@dataclass(slots=True)
class RaceResult:
    winner: AttemptRecord
    prefix: Prefix
    attempts: list[AttemptRecord]
    suppressed: list[SuppressReason]
    committed_at: float


AttemptRunner = Callable[[str, AttemptRecord], Coroutine[Any, Any, Prefix]]

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
    _reasons: list[str] = field(default_factory=list)
    _failures: list[UpstreamError] = field(default_factory=list)
    committed: bool = False
    #: an attempt has ended since the race last looked, or its wait's timer fired (`_wait`)
    _ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: the current wait's timer fired (`_expire`)
    _expired: bool = False
    #: how many times a failover restarted the hedge timer
    timer_restarts: int = 0
    #: the hedge delay in force (the primary's, then the latest replacement's)
    _delay: float = math.inf
    #: the attempt whose delay is in force (the primary, then the latest replacement)
    _timed: AttemptRecord | None = None
    #: when the next hedge is considered (inf: hedging off, or every attempt started)
    _next_hedge: float = math.inf
    #: the next hedge is due early, for the request's TTFT objective (`_plan_deadline`)
    _early: bool = False
    #: the first complete answer without a token, relayed if no running attempt yields one
    _kept: tuple[asyncio.Task[Prefix], AttemptRecord] | None = None
    #: the first rejection (400/413/422), the client's answer once no backend of a kind that
    #: has not rejected the body is running or can start
    _rejection: UpstreamClientError | None = None
    #: what the race leaves for the request's end (the winner's slot and its deferred TTFT,
    #: as the balancer's and the delay reader's calls; the attempts let go): plain data,
    #: handed out, so the end and the stream call what it holds, not us
    leftovers: Leftovers = field(default_factory=Leftovers)
    #: where this request's attempts go, and what the stats count of those choices: made as
    #: the race starts (`run`), so that building a race runs no code of this file (the proxy
    #: builds it as data, then runs it); read only once it has run
    placement: Placement = field(init=False)
    #: the winner's TTFT is learnt through `leftovers.unlearned`, not at the commit: the
    #: stream calls it once the client's first bytes are out, so the delay trackers' inserts
    #: are off that path (`leftovers.learn()` if no stream took it)
    defer_learning: bool = False

    async def run(self) -> RaceResult:
        pool, now = self.pool, self.clock()
        self.placement = Placement(pool, self.options,
                                   affinity="miss" if self.options.affinity_miss else None)
        if self.options.deposit:  # (a continuation's race: its request deposited)
            pool.budget.on_request(now, self.options.input_tokens)
            share = self.options.share
            if share is not None:
                ratio = self.options.share_ratio
                share.deposit(pool.budget.settings.ratio if ratio is None else ratio)
        if self.options.refused_reason is not None:
            self.suppressed.append(self.options.refused_reason)
        primary = self.placement.primary(now)
        if primary is None:
            raise NoBackendAvailable(self._soonest_back(now))
        self._start(primary, "primary", spent_budget=False)
        self._timed = self.attempts[-1]
        self._delay = self.options.delays[primary].delay(now)
        self._next_hedge = now + self._delay if self.options.hedging else math.inf
        if self.options.objective is not None and share is not None and self.options.hedging:
            self._plan_deadline(primary, self.options.objective, now)
        try:
            while True:
                wake = min(self._next_hedge, self.options.deadline)
                done: set[asyncio.Task[Prefix]] = set()
                if self._tasks:
                    done = await self._wait(max(0.0, wake - self.clock()))
                result = self._settle(done)
                if result is not None:
                    return result
                now = self.clock()
                if self._kept is not None and (not self._tasks or now >= self.options.deadline):
                    return self._commit(self._kept, [])
                if now >= self.options.deadline:
                    raise FirstTokenTimeout(self._reasons)
                if now >= self._next_hedge:
                    self._hedge_due(now)
                if not self._tasks:
                    if self._rejection is not None:  # the most the upstreams said of it
                        raise self._rejection
                    raise all_attempts_failed(
                        self._reasons, self._failures, pool.balancer.capped_pause
                    )
        except BaseException:
            # a client that left (CancelledError), a 400, a 502 or a 504: no token decided
            # the race, so it says nothing of the hedges' efficacy (only `_commit` feeds it)
            self._cancel_all()
            self._drop_kept()
            raise

    def _soonest_back(self, now: float) -> float | None:
        """Seconds until the first backend this request may use is past its pause or
        cool-down, when every one is in one; None when one is only at its concurrency limit
        (`NoBackendAvailable`'s advice)."""
        balancer, soonest = self.pool.balancer, math.inf
        for name in balancer.names:
            if name in self.options.excluded:
                continue
            left = balancer.seconds_left(name, now)
            if left is None or left <= 0.0:
                return None
            soonest = min(soonest, left)
        return None if soonest == math.inf else soonest

    async def _wait(self, timeout: float) -> set[asyncio.Task[Prefix]]:
        """The attempts that have finished, once one has or `timeout` seconds have passed.

        What `asyncio.wait(FIRST_COMPLETED)` does, in one turn of the loop instead of two: an
        attempt's runner sets `_ended` itself as it returns (`AttemptRecord.on_end`), in the
        step that finishes its task, where a done callback would take a turn to run and only
        then wake the race. Each task's done callback sets it too (`_attempt_done`), for a
        runner that does not, or a task cancelled before its coroutine ran."""
        ended = self._ended
        self._expired = False
        timer = asyncio.get_running_loop().call_later(timeout, self._expire)
        try:
            while True:
                done = {task for task in self._tasks if task.done()}
                if done or self._expired:
                    return done
                ended.clear()
                await ended.wait()
        finally:
            timer.cancel()

    def _expire(self) -> None:
        """The wait's timer: it says it fired rather than leaving the race to read the clock
        (uvloop rounds a timer to the millisecond and may run it before `loop.time()` has
        reached its due time: read so, the race slept past its hedge delay)."""
        self._expired = True
        self._ended.set()

    def _attempt_done(self, _: asyncio.Task[Prefix]) -> None:
        self._ended.set()

    def _record_hedges(self) -> None:
        """Feed the efficacy guard: each hedge started won or it did not. Only a race decided
        by a token says that; a race that ended in a 400, a 502 or a 504 does not."""
        now = self.clock()
        for attempt in self.attempts:
            if attempt.kind == "hedge":
                self.pool.budget.record_hedge(attempt.outcome == "won", now)

    def _settle(self, done: set[asyncio.Task[Prefix]]) -> RaceResult | None:
        """Handle finished attempts: a token commits; failures start replacements.

        Every task in `done` is accounted for before anything is decided (see the module
        docstring for the same-tick rules)."""
        winners: list[tuple[asyncio.Task[Prefix], AttemptRecord]] = []
        failures = 0
        rejected = 0
        for task in sorted(done, key=lambda t: self._tasks[t].index):
            record = self._tasks.pop(task)
            if not task.cancelled() and task.exception() is None:
                if task.result().empty:
                    self._keep(task, record)
                else:
                    winners.append((task, record))  # accounted for in `_commit`
                continue
            self._finished(record)
            if task.cancelled():  # not by us (we pop before cancelling): count it as failed
                failures += 1
                self._failed(record, UpstreamError("attempt cancelled"), backend_fault=False)
                continue
            exc = task.exception()
            failures += 1
            if not isinstance(exc, UpstreamError):
                # a bug of ours, not the backend's: log it, answer 502 without a trace, and
                # keep it out of the backend's health record
                log.error("attempt %s failed inside the gateway", record.backend, exc_info=exc)
                self._failed(record, InternalAttemptError(f"internal error ({type(exc).__name__})"),
                             backend_fault=False)
                continue
            self._failed(record, exc, backend_fault=exc.backend_fault)
            if isinstance(exc, UpstreamRejectedRequest):
                failures -= 1  # replaced only by another kind of backend (below)
                rejected += 1
                self.placement.rejected_by(record.backend)
                if self._rejection is None:
                    self._rejection = UpstreamClientError.of(exc.status, record.backend,
                                                             exc.explanation)
        if winners:  # a token beats a same-tick 4xx; the attempt started first wins
            try:
                return self._commit(winners[0], winners[1:])
            except BaseException:
                self._drop_uncommitted(winners)
                raise
        if self._kept is not None:  # an answer is in hand: nothing to replace, no 4xx to give
            return None
        now = self.clock()
        if rejected and self.placement.unjudged_left():
            failures += rejected  # another kind of backend may serve what this one refused
        for _ in range(failures):
            if now < self.options.deadline:
                self._try_extra("failover", now)
        rejection = self._rejection
        if rejection is not None and not any(
                self.placement.may_judge(r.backend) for r in self._tasks.values()):
            raise rejection  # no backend that could judge the body otherwise is left
        return None

    def _keep(self, task: asyncio.Task[Prefix], record: AttemptRecord) -> None:
        """A complete answer without a token: a success of its backend, at its own time.

        The first one is kept for relay; any later one is closed at once (the kept answer
        is as good). Once one is kept, no hedge starts any more."""
        now = self.clock()
        record.empty = True
        self.pool.balancer.on_success(record.backend, now)
        self._observe(record, censored=False)
        self._next_hedge = math.inf
        if self._kept is None:
            self._kept = (task, record)
            return
        self._finished(record)
        record.outcome = "lost"
        record.reason = EMPTY_ANSWER_LOST
        self._close_prefix(task, record, now)

    def _commit(
        self,
        winner: tuple[asyncio.Task[Prefix], AttemptRecord],
        same_tick: list[tuple[asyncio.Task[Prefix], AttemptRecord]],
    ) -> RaceResult:
        task, record = winner
        now = self.clock()
        self.committed = True
        record.outcome = "won"
        # the winner keeps its backend slot while it streams (max_concurrency and the
        # balancer's load count whole streams); `aclose` gives it back at the request's end
        if record.spent_budget:
            self.pool.budget.release()
        # (the balancer's own call, left as data: whoever ends the request calls it)
        self.leftovers.release = functools.partial(self.pool.balancer.on_finish,
                                                   record.backend, probe=record.probe)
        kept, self._kept = self._kept, None
        if kept is not None and kept[1] is not record:  # a token beat the kept empty answer
            self._finished(kept[1])
            kept[1].outcome = "lost"
            kept[1].reason = EMPTY_ANSWER_LOST
            self._close_prefix(kept[0], kept[1], now)
        if kept is None or kept[1] is not record:  # a kept answer was observed when kept
            self.pool.balancer.on_success(record.backend, now)
            self._observe(record, censored=False, later=self.defer_learning)
        if self._rejection is not None:
            self._blame_rejections(now)
        for loser, loser_record in same_tick:  # a real TTFT, but it lost: close it now
            self._finished(loser_record)
            loser_record.outcome = "lost"
            loser_record.reason = CANCELLED_AFTER_TOKEN
            self._observe(loser_record, censored=False)
            self._close_prefix(loser, loser_record, now)
        self._cancel_all()
        self._record_hedges()
        return RaceResult(record, task.result(), self.attempts, self.suppressed, now)

    def _blame_rejections(self, now: float) -> None:
        """Another backend served the body some attempts had rejected: each rejection was
        its backend's (a beta flag or a model id it does not take), so it counts as that
        backend's failure, in the stats and towards its ejection."""
        for attempt in self.attempts:
            if attempt.failure == UpstreamRejectedRequest.code:
                attempt.failure = UpstreamRejectedHere.code
                self.pool.balancer.on_failure(attempt.backend, now)

    def _drop_uncommitted(
        self, winners: list[tuple[asyncio.Task[Prefix], AttemptRecord]]
    ) -> None:
        """A commit that raised (a bug of ours) handed no prefix over: every token holder
        it had not closed yet is closed and gives its backend slot back, as a loser does
        (`aclose` reaps them)."""
        now = self.clock()
        for task, record in winners:
            if record.outcome == "lost":  # the commit closed it already
                continue
            if record.outcome == "won" and self.leftovers.release is not None:
                self.leftovers.release_winner()  # its budget was given back by the commit
            else:
                self._finished(record)
            record.outcome = "lost"
            record.reason = CANCELLED_AFTER_TOKEN
            self._close_prefix(task, record, now)

    def _plan_deadline(self, primary: str, objective: float, now: float) -> None:
        """A request with a TTFT objective whose primary's learnt tail would miss it: its
        first hedge is due as late as still meets it (`gateway.hedge.deadline`), predicted
        with the fastest typical TTFT among the other backends it may use."""
        delays, excluded = self.options.delays, self.options.excluded
        seconds = [m for name in delays if name != primary and name not in excluded
                   and (m := delays[name].median(now)) is not None]
        at = deadline_delay(normal=self._delay, objective=objective,
                            primary_tail=delays[primary].tail(now),
                            second_ttft=min(seconds) if seconds else None)
        if at is not None:
            self._early = True
            self._next_hedge = now + at

    def _early_hedge(self, now: float) -> None:
        """The deadline's early hedge is due: paid from the key's own share (refused and
        counted `key_budget` when it cannot pay: the timer then waits for the normal delay,
        as for any request), and from the pool's budget as every hedge is."""
        self._early = False
        share, timed = self.options.share, self._timed
        assert share is not None and timed is not None  # `_plan_deadline` had both
        if not share.can_pay():
            self.suppressed.append(SuppressReason.KEY_BUDGET)
            self._next_hedge = timed.started + self._delay
            return
        started = len(self.attempts)
        self._next_hedge = timed.started + self._delay  # refused: the normal hedge's time
        self._try_extra("hedge", now)
        if len(self.attempts) > started:
            share.spend()
            self.attempts[-1].deadline = True
            self._next_hedge = max(self._next_hedge, now + self._delay)

    def _hedge_due(self, now: float) -> None:
        """The hedge timer is due: try a hedge, unless the delay in force was its home's and
        the hedge would not go home (`Placement.early_hedge`): then the timer waits for the
        timed attempt's own delay, and nothing is counted (no hedge was due by that one)."""
        if self._early:
            self._early_hedge(now)
            return
        timed = self._timed
        wait = None if timed is None else self.placement.early_hedge(
            timed, self._tasks.values(), self.attempts, now)
        if wait is not None:
            self._next_hedge = wait
            return
        self._next_hedge = now + self._delay
        self._try_extra("hedge", now)

    def _try_extra(self, kind: AttemptKind, now: float) -> None:
        """Start a hedge or a failover if the hedge rules allow it; else count why not.

        A failover that starts restarts the hedge timer with the replacement's delay.
        `max_attempts` is final (attempts only ever grow): it is counted once per request and
        the hedge timer stops, so the race no longer wakes up for hedges."""
        reason = self._start_extra(kind, now)
        if reason is None:
            if kind == "failover" and self.options.hedging:
                replacement = self._timed = self.attempts[-1]
                self._early = False  # the replacement's own delay applies
                self._delay = self.options.delays[replacement.backend].delay(now)
                self._next_hedge = replacement.started + self._delay
                self.timer_restarts += 1
            return
        if reason is SuppressReason.MAX_ATTEMPTS:
            self._next_hedge = math.inf
            if reason in self.suppressed:
                return
        self.suppressed.append(reason)

    def _start_extra(self, kind: AttemptKind, now: float) -> SuppressReason | None:
        pool = self.pool
        hedge = kind == "hedge"
        if len(self.attempts) >= self.placement.max_attempts():
            return SuppressReason.MAX_ATTEMPTS
        running = self._tasks.values()
        backend = self.placement.extra(now, running, self.attempts, hedge=hedge)
        if backend is None:
            # the choice may have excluded a backend whose translation refuses the request,
            # lowering the bound: then it is the bound that stops this attempt (counted once)
            if len(self.attempts) >= self.placement.max_attempts():
                return SuppressReason.MAX_ATTEMPTS
            return SuppressReason.NO_BACKEND
        remaining = self.options.deadline - now
        if remaining < min_useful(self.options.delays[backend].median(now)):
            return SuppressReason.DEADLINE
        if hedge and self.placement.cold(backend, running, now):
            return SuppressReason.COLD
        refused = pool.budget.try_spend(now, inflight_requests=pool.inflight_requests,
                                        hedge=hedge, tokens=self.options.input_tokens)
        if refused is not None:
            return refused
        self._start(backend, kind, spent_budget=True)
        return None

    def _start(self, backend: str, kind: AttemptKind, *, spent_budget: bool) -> None:
        record = AttemptRecord(len(self.attempts), backend, kind, self.clock(), spent_budget)
        self.attempts.append(record)
        record.probe = self.pool.balancer.on_start(backend)
        record.on_end = self._ended.set
        task = asyncio.create_task(
            self.runner(backend, record), name=f"attempt-{record.index}-{backend}"
        )
        task.add_done_callback(self._attempt_done)
        self._tasks[task] = record

    def _finished(self, record: AttemptRecord) -> None:
        """Bookkeeping common to every way an attempt ends."""
        self.pool.balancer.on_finish(record.backend, probe=record.probe)
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
        self._failures.append(exc)
        if exc.replaceable and backend_fault:
            self.pool.balancer.on_failure(record.backend, now)
        if exc.retry_after is None and exc.throttle:  # a pushback that named no pause
            exc.retry_after = self.pool.settings.health.default_pause
        if exc.retry_after is not None:
            self.pool.balancer.pause(record.backend, exc.retry_after, now)

    def _observe(self, record: AttemptRecord, *, censored: bool, later: bool = False) -> None:
        """`record`'s TTFT, learnt by its backend's delay now, or (`later`, the winner's
        only) at `learn()`, with the same value and time."""
        now = self.clock()
        record.ttft = now - record.started
        if self.options.learn:
            if later:
                self.leftovers.unlearned = functools.partial(
                    self.options.delays[record.backend].observe, record.ttft, now)
                return
            self.options.delays[record.backend].observe(record.ttft, now, censored=censored)

    def learn(self) -> None:
        """Learn the winner's TTFT deferred at the commit (`Leftovers.learn`)."""
        self.leftovers.learn()

    def _cancel_all(self) -> None:
        """Cancel every attempt still running, without waiting for it.

        For the stats, each cancelled record gets a `reason` saying whether the attempt had
        already found its token (its task finished in the same tick, not yet picked up), and
        `close_s`: how long it took to close the upstream. A task that already holds a token
        cannot be cancelled (`Task.cancel()` does nothing to a finished task): its `Prefix`
        is closed by a task of its own, started here.
        """
        cancelled_at = self.clock()
        tasks, self._tasks = self._tasks, {}  # taken out first: each is ended once
        ending = [(task, record, task.done() and not task.cancelled() and task.exception()
                   is None) for task, record in tasks.items()]
        for task, record, had_token in ending:  # every one stopped before any bookkeeping,
            if had_token:                        # so that a bug in that leaves none running
                self._close_prefix(task, record, cancelled_at)
            else:
                self.leftovers.cancel(task, record, cancelled_at, self.clock)
        for _, record, had_token in ending:
            self._finished(record)
            record.outcome = "lost" if self.committed else "cancelled"
            record.reason = CANCELLED_AFTER_TOKEN if had_token else CANCELLED_BEFORE_TOKEN
            self._observe(record, censored=not had_token)

    def _drop_kept(self) -> None:
        """The race ended without relaying its kept answer (the client left): close it."""
        kept, self._kept = self._kept, None
        if kept is not None:
            task, record = kept
            self._finished(record)
            record.outcome = "cancelled"
            record.reason = CANCELLED_AFTER_TOKEN  # it held its (empty) answer
            self._close_prefix(task, record, self.clock())

    def _close_prefix(
        self, task: asyncio.Task[Prefix], record: AttemptRecord, cancelled_at: float
    ) -> None:
        """Close a loser that holds a token, in a task `aclose` reaps."""
        self.leftovers.close_prefix(task, record, cancelled_at, self.clock)

    def release_winner(self) -> None:
        """Give back the winner's backend slot, once (`Leftovers.release_winner`)."""
        self.leftovers.release_winner()

    async def aclose(self) -> None:
        """At the request's end: give back the winner's backend slot, and wait (bounded) for
        the losers to finish closing their upstreams (`Leftovers.aclose`)."""
        await self.leftovers.aclose()
