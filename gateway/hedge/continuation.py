"""A stalled or broken stream continued on another backend: which backend, whether it may,
the race of its attempt, and each backend's stall delay.

After commit the relay (`gateway.hedge.relay`) reads one backend; when its stream breaks (a
reset, a body that ends early, an error event, the idle timeout) it asks `Continuations` for a
continuation before it gives the client an error, and when it stalls for the backend's stall
delay (`stall_delay`: `gateway.hedge.gaps`) it asks for one to race the stalled stream. A
continuation is an attempt like a
failover: the next backend in the request's order (the conversation's, when it has one) that
can continue an answer (its `continuation` is not `none`) and has not failed this request,
granted by the hedge budget (one attempt, and the request's input tokens plus the text relayed
so far), at most `hedging.stall.max_continuations` per request. Its attempt runs in a race of
one backend (`Race`: the backend slot, the first-token deadline, the shielded close), which
deposits nothing in the budget: the request did that once. What the wire makes of the answer
relayed so far, the request it sends and how its events join the ones relayed are
`gateway.wire.resume`'s.

Every refusal and every outcome is counted (`ContinuationCounts`), per request; the request's
summary carries them to the stats and the log line.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from types import MappingProxyType

from gateway.clock import Clock
from gateway.errors import GatewayError
from gateway.hedge.attempt import AttemptRecord, ContinuationCounts, ContinuationLeg
from gateway.hedge.gaps import GapSketch
from gateway.hedge.losers import output_sent
from gateway.hedge.placement import Placement, RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import Race
from gateway.hedge.relay import Continued
from gateway.hedge.runner import AttemptTrace, UpstreamRequest, attempt_runner, race_over
from gateway.wire.resume import (
    Splice,
    continuation_body,
    ended_at_limit,
    limit_reached,
    relayed_answer,
)
from gateway.wire.sse import SSEBatch, SSEEvent

#: the routes whose streams can be continued, by their wire protocol's name
CONTINUED_APIS = frozenset({"chat", "messages", "responses"})


class Continuations:
    """The continuations of one streamed request (`resume` for the relay, `aclose` for the
    request's end). Built only for a request whose pool and route can continue at all."""

    def __init__(self, pool: PoolRuntime, req: UpstreamRequest, options: RaceOptions,
                 clock: Clock, trace: AttemptTrace | None = None) -> None:
        self.pool, self.req, self.options, self.clock, self.trace = (
            pool, req, options, clock, trace)
        self.counts = ContinuationCounts()
        #: backends that failed this request after commit (never asked again)
        self._failed: set[str] = set()
        #: the race of each continuation, closed at the request's end
        self._races: list[Race] = []
        #: the upstream of each continuation that yielded its first token, by its leg: the
        #: output of one not taken is counted from it at the request's end
        self._yielded: list[tuple[ContinuationLeg, Prefix]] = []

    def _refuse(self, reason: str, backend: str, stall: bool) -> None:
        self.counts.refused[reason] += 1
        if not stall:  # a stall that is not continued waits; a break ends the answer
            self.counts.breaks_ended[backend] += 1

    def stall_delay(self, backend: str) -> float:
        """How long a stream of `backend` may go without an event before a continuation
        starts beside it: its streams' usual longest gap times a margin, clamped to
        `hedging.stall.min`..`max` (`gateway.hedge.gaps`); inf once no continuation may
        start any more."""
        stall = self.pool.settings.hedging.stall
        if not stall.enabled or sum(self.counts.started.values()) >= stall.max_continuations:
            return math.inf
        gaps = self.pool.gaps.get(backend)
        return stall.min if gaps is None else gaps.delay(stall.min, stall.max, self.clock())

    def stall_won(self, backend: str) -> None:
        self.counts.won[backend] += 1

    def refused(self, reason: str, backend: str) -> None:
        self._refuse(reason, backend, False)

    def ended(self, backend: str, longest_gap: float) -> None:
        gaps = self.pool.gaps.get(backend)
        if gaps is None and backend in self.pool.providers:
            gaps = self.pool.gaps[backend] = GapSketch()
        if gaps is not None:
            gaps.observe(longest_gap, self.clock())

    async def __call__(self, relayed: list[SSEEvent], backend: str, stall: bool = False
                       ) -> Continued | None:
        """A continuation of the answer `relayed` (the events the client was sent), whose
        stream on `backend` broke (or stalled); None when none may start or every one
        failed."""
        pool = self.pool
        settings = pool.settings.hedging.stall
        if stall:
            self.counts.stalls[backend] += 1
        else:
            self._failed.add(backend)
        if not settings.enabled:
            self._refuse("disabled", backend, stall)
            return None
        answer = relayed_answer(self.req.protocol.name, relayed)
        if answer is None:
            self._refuse("not_text", backend, stall)
            return None
        if limit_reached(self.req.body, answer):  # nothing to continue
            ending = None if stall else ended_at_limit(answer)
            if ending is None:  # a stall is waited out; a Responses break is the error
                self._refuse("max_tokens", backend, stall)
                return None
            self.counts.refused["max_tokens"] += 1  # the answer ends, at its limit
            return Continued(Prefix(_Ended(), _no_batches(), ending), Splice(answer), "")
        while True:
            if sum(self.counts.started.values()) >= settings.max_continuations:
                self._refuse("max_continuations", backend, stall)
                return None
            now = self.clock()
            styles = {b.name: b.continuation for b in pool.settings.backends}
            excluded = self.options.excluded | self._failed | {backend} | frozenset(
                name for name, style in styles.items() if style in (None, "none"))
            options = replace(self.options, excluded=excluded)
            chosen = Placement(pool, options).primary(now)
            if chosen is None:
                self._refuse("no_backend", backend, stall)
                return None
            tokens = self.options.input_tokens + answer.tokens
            refused = pool.budget.try_spend(now, inflight_requests=pool.inflight_requests,
                                            hedge=False, tokens=tokens)
            if refused is not None:
                self._refuse(str(refused), backend, stall)
                return None
            self.counts.input_tokens += tokens
            style = styles[chosen]
            assert style in ("prefill", "continue_final_message")
            body, dropped = continuation_body(self.req.body, answer, style)
            deadline = now + pool.settings.timeouts.first_token
            traced = None if self.trace is None else _ContinuationTrace(
                self.trace, TRACE_INDEX * len(self._races) + TRACE_INDEX)
            runner = attempt_runner(pool, replace(self.req, body=body), deadline, self.clock,
                                    traced)
            race = Race(pool, runner, replace(
                options, deadline=deadline, hedging=False, refused_reason=None,
                excluded=frozenset(b.name for b in pool.settings.backends
                                   if b.name != chosen),
                learn=False, deposit=False, input_tokens=tokens, objective=None,
                share=None), self.clock)
            self._races.append(race)
            self.counts.started[chosen] += 1
            legs: list[ContinuationLeg] = []
            try:
                result = await race.run()
            except GatewayError:
                self._failed.add(chosen)
                continue  # the next backend, while the bound allows
            finally:
                race.runner = race_over
                pool.budget.release()
                records = [replace(r, kind="continuation") for r in race.attempts]
                self.counts.records.extend(records)
                legs = [ContinuationLeg(r, answer.tokens) for r in records]
                self.counts.legs.extend(legs)
            self._yielded.extend((leg, result.prefix) for leg in legs
                                 if leg.record.index == result.winner.index)
            if not stall:  # a stall's continuation wins only if it beats the stream
                self.counts.won[chosen] += 1
                self.counts.breaks_continued[backend] += 1
            return Continued(result.prefix, Splice(answer, dropped), chosen)

    def took(self, continued: Continued) -> None:
        """The relay took `continued` over: its output is what the client reads from it."""
        for leg, prefix in self._yielded:
            if prefix is continued.prefix:
                leg.taken = True

    async def aclose(self) -> None:
        """At the request's end: each continuation's race gives back its backend slot and
        reaps its losers; one that yielded and was not taken over is charged what it had
        sent when it was closed (at most `max_continuations` of them, once per request)."""
        for race in self._races:
            await race.aclose()
        for leg, prefix in self._yielded:
            if not leg.taken:
                leg.output = output_sent(prefix.buffered)


class _Ended:
    """The upstream of an answer that ended at its output limit: no backend, nothing to
    close (its `Continued` has the backend name "", which no stall delay or gap knows)."""

    headers: Mapping[str, str] = MappingProxyType({})

    def batches(self) -> AsyncIterator[SSEBatch]:
        return _no_batches()

    async def aclose(self) -> None:
        """Nothing was opened."""


async def _no_batches() -> AsyncIterator[SSEBatch]:
    """No read after the end events."""
    return
    yield


#: where a continuation's attempts are numbered in the request's trace: past every attempt
#: of the request's own race (at most `MAX_ATTEMPTS_CAP`), apart from each other
TRACE_INDEX = 1000


class _ContinuationTrace:
    """The request's trace as a continuation's attempt sees it: its span says
    `continuation`, under a number of its own (its race numbers its attempts from 0, as the
    request's race does)."""

    def __init__(self, trace: AttemptTrace, base: int) -> None:
        self._trace, self._base = trace, base

    def _as_traced(self, record: AttemptRecord) -> AttemptRecord:
        return replace(record, index=self._base + record.index, kind="continuation")

    def attempt_started(self, record: AttemptRecord) -> Mapping[str, str]:
        return self._trace.attempt_started(self._as_traced(record))

    def attempt_ended(self, record: AttemptRecord) -> None:
        self._trace.attempt_ended(self._as_traced(record))


def may_continue(pool: PoolRuntime, protocol: str, stream: bool, stateful: bool,
                 pinned: str | None, excluded: frozenset[str] = frozenset()) -> bool:
    """Whether a request can be continued at all (checked once per request, before the
    race): a stream of a continued route, not bound to stored state, in a pool whose stall
    rules are on, with two backends or more it may use and one of them that continues
    answers (a request that can never be continued keeps nothing and arms nothing)."""
    stall = pool.settings.hedging.stall
    if not (stream and protocol in CONTINUED_APIS and not stateful and pinned is None
            and stall.enabled and stall.max_continuations > 0):
        return False
    usable = [b for b in pool.settings.backends if b.name not in excluded]
    return len(usable) > 1 and any(b.continuation not in (None, "none") for b in usable)
