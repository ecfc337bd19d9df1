"""What a race leaves for its request's end: the winner's backend slot, its TTFT not learnt
yet, and the attempts it let go, until they have closed their upstreams.

The race builds one `Leftovers` and hands it out as data (`Race.leftovers`): the stream
learns the winner's TTFT through it once the client's first bytes are out and gives the
winner's slot back at its last byte, and the request's end reaps through it, without stepping
back into the race's file. The race only writes its fields (`winner` at the commit,
`unlearned` for a deferred TTFT) and hands it its losers.

A loser is closed without the race waiting for it: a running attempt is cancelled (its runner
closes its upstream, shielded from the cancellation: `gateway.hedge.attempt.close_quietly`), and
one that already holds a token, which `Task.cancel()` cannot reach, has its `Prefix` closed in
a task of its own. Either way the loser is kept here, so the request's end can wait for every
upstream to be closed (bounded by `REAP_TIMEOUT`) and nothing is left running after it. Each
loser's record gets `close_s`, how long its close took, for the stats, and a loser that held a
token its `output_sent`, what it had sent (its spend counts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from gateway.clock import Clock
from gateway.hedge.attempt import AttemptRecord, Prefix
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.sizing import DelayReader
from gateway.wire.sse import SSEEvent
from gateway.wire.usage import read_usage

#: how long the race waits for cancelled attempts to finish closing before it gives up on them
REAP_TIMEOUT = 5.0


def _close_timer(
    record: AttemptRecord, clock: Clock, cancelled_at: float
) -> Callable[[asyncio.Future[Any]], None]:
    """A done-callback that stores how long a cancelled attempt took to close (stats)."""

    def done(_task: asyncio.Future[Any]) -> None:
        record.close_s = max(0.0, clock() - cancelled_at)

    return done


def output_sent(buffered: list[SSEEvent]) -> int:
    """The output tokens of what a loser had read when it was closed: the largest count a
    usage object among its events reported (a whole non-streamed answer, Anthropic's
    `message_start`), else one per event. Runs once per loser that held a token, never on
    the winner's path."""
    reported = 0
    for event in buffered:
        if event.data.find(b'"usage"') >= 0:
            found = read_usage(event.data)
            if found is not None:
                reported = max(reported, found[0].output)
    return reported or len(buffered)


class Leftovers:
    """What one race holds past its commit: the winner's backend slot, its deferred TTFT,
    and its cancelled attempts and closing prefixes, reaped once by `reap`."""

    __slots__ = ("_clock", "_closing", "_delays", "_pool", "unlearned", "winner")

    def __init__(self, clock: Clock, pool: PoolRuntime, delays: Mapping[str, DelayReader]
                 ) -> None:
        self._clock = clock
        self._pool = pool
        #: the race's delay readers, which learn the winner's deferred TTFT
        self._delays = delays
        self._closing: list[asyncio.Future[Any]] = []
        #: the committed attempt, holding its backend slot until `release_winner`
        self.winner: AttemptRecord | None = None
        #: the winner's observation not learnt yet (the race's `defer_learning`): backend,
        #: TTFT, when
        self.unlearned: tuple[str, float, float] | None = None

    def cancel(self, task: asyncio.Task[Prefix], record: AttemptRecord, at: float) -> None:
        """Cancel a running attempt; its runner closes its upstream."""
        task.cancel()
        if not task.done():
            task.add_done_callback(_close_timer(record, self._clock, at))
        self._closing.append(task)

    def close_prefix(self, task: asyncio.Task[Prefix], record: AttemptRecord, at: float) -> None:
        """Close an attempt that holds a token (or an empty answer), in a task of its own."""
        record.output_sent = output_sent(task.result().buffered)
        closer = asyncio.ensure_future(task.result().aclose())
        closer.add_done_callback(_close_timer(record, self._clock, at))
        self._closing.append(closer)

    async def reap(self, timeout: float = REAP_TIMEOUT) -> None:
        """Wait (bounded) for every loser to finish closing its upstream."""
        losers, self._closing = self._closing, []
        if losers:
            await asyncio.wait(losers, timeout=timeout)
            for task in losers:  # a loser's own failure while closing is no news: retrieve it
                if task.done() and not task.cancelled():
                    task.exception()

    def learn(self) -> None:
        """Learn the winner's TTFT deferred at the commit (`Race.defer_learning`); once, and
        a no-op when there is none. The stream calls it once its first bytes are out (so
        the delay trackers' inserts are off that path); `aclose` calls it too, for a request
        whose first bytes never went out."""
        unlearned, self.unlearned = self.unlearned, None
        if unlearned is not None:
            backend, ttft, at = unlearned
            self._delays[backend].observe(ttft, at)

    def release_winner(self) -> None:
        """Give back the winner's backend slot (once; `aclose` does it if nobody did). The
        stream calls it as its answer is out, before the request's end awaits the winner's
        upstream close: the client's next request (a conversation's next turn) can arrive
        in that await, and must not find its home still counting this one, or with two
        conversations there the turn meets the home's bound and spills to a backend that
        must prefill its whole history."""
        winner = self.winner
        if winner is not None:
            self._pool.balancer.on_finish(winner.backend, probe=winner.probe)
            self.winner = None

    async def aclose(self) -> None:
        """At the request's end: learn what is still unlearnt, give back the winner's backend
        slot, and wait (bounded) for the losers to finish closing their upstreams."""
        self.learn()
        self.release_winner()
        await self.reap()
