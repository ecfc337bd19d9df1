"""What a race leaves for its request's end: the winner's backend slot, its TTFT not learnt
yet, and the attempts it let go, until they have closed their upstreams.

The race builds one `Leftovers`, plain data, and hands it out (`Race.leftovers`). It writes
its fields (at the commit `release`, the balancer's call that gives the winner's slot back,
and `unlearned`, the delay reader's call that learns a deferred TTFT) and hands it its
losers. A stream takes the two calls over (the proxy moves them into its response, which
learns the TTFT once the client's first bytes are out and gives the slot back at its last
byte); the request's end gives back what is left and reaps the losers (`aclose`), its one
step into this file; nothing steps back into the race's.

A loser is closed without the race waiting for it: a running attempt is cancelled (its runner
closes its upstream, shielded from the cancellation: `gateway.hedge.prefix.close_quietly`), and
one that already holds a token, which `Task.cancel()` cannot reach, has its `Prefix` closed in
a task of its own. Either way the loser is kept here, so the request's end can wait for every
upstream to be closed (bounded by `REAP_TIMEOUT`) and nothing is left running after it. Each
loser's record gets `close_s`, how long its close took, for the stats, and a loser that held a
token its `output_sent`, what it had sent (its spend counts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.clock import Clock
from gateway.hedge.attempt import AttemptRecord
from gateway.hedge.prefix import Prefix
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


@dataclass(slots=True, eq=False)
class Leftovers:
    """What one race holds past its commit: the winner's backend slot, its deferred TTFT,
    and its cancelled attempts and closing prefixes, reaped once by `reap`.

    Plain data: built with the race, filled in by it, read by whoever ends the request. The
    winner's slot and its TTFT are held as the calls that give them back and learn it (the
    balancer's and the delay reader's own, made by the race at its commit), so the stream
    that takes them over runs them where they live, without a step into this file."""

    #: the cancelled attempts and the closing prefixes, until reaped
    closing: list[asyncio.Future[Any]] = field(default_factory=list)
    #: gives the committed attempt's backend slot back (the balancer's `on_finish` for it):
    #: None until the commit, and once given back or handed on (the stream takes it over)
    release: Callable[[], None] | None = None
    #: learns the winner's TTFT deferred at the commit (the race's `defer_learning`: its
    #: backend's delay reader's `observe`, with the TTFT and when): None once learnt or
    #: handed on
    unlearned: Callable[[], None] | None = None

    def cancel(self, task: asyncio.Task[Prefix], record: AttemptRecord, at: float,
               clock: Clock) -> None:
        """Cancel a running attempt; its runner closes its upstream (timed on `clock`)."""
        task.cancel()
        if not task.done():
            task.add_done_callback(_close_timer(record, clock, at))
        self.closing.append(task)

    def close_prefix(self, task: asyncio.Task[Prefix], record: AttemptRecord, at: float,
                     clock: Clock) -> None:
        """Close an attempt that holds a token (or an empty answer), in a task of its own."""
        record.output_sent = output_sent(task.result().buffered)
        closer = asyncio.ensure_future(task.result().aclose())
        closer.add_done_callback(_close_timer(record, clock, at))
        self.closing.append(closer)

    async def reap(self, timeout: float = REAP_TIMEOUT) -> None:
        """Wait (bounded) for every loser to finish closing its upstream."""
        losers, self.closing = self.closing, []
        if losers:
            await asyncio.wait(losers, timeout=timeout)
            for task in losers:  # a loser's own failure while closing is no news: retrieve it
                if task.done() and not task.cancelled():
                    task.exception()

    def learn(self) -> None:
        """Learn the winner's TTFT deferred at the commit (`Race.defer_learning`); once, and
        a no-op when there is none (or the stream took it over: it learns it once its first
        bytes are out, so the delay trackers' inserts are off that path). `aclose` calls it
        too, for a request whose stream never took it."""
        learn, self.unlearned = self.unlearned, None
        if learn is not None:
            learn()

    def release_winner(self) -> None:
        """Give back the winner's backend slot (once; `aclose` does it if nobody did). A
        stream gives it back as its answer is out (it takes `release` over), before the
        request's end awaits the winner's upstream close: the client's next request (a
        conversation's next turn) can arrive in that await, and must not find its home
        still counting this one, or with two conversations there the turn meets the home's
        bound and spills to a backend that must prefill its whole history."""
        release, self.release = self.release, None
        if release is not None:
            release()

    async def aclose(self) -> None:
        """At the request's end: learn what is still unlearnt, give back the winner's backend
        slot, and wait (bounded) for the losers to finish closing their upstreams."""
        self.learn()
        self.release_winner()
        await self.reap()
