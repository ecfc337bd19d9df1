"""The attempts a race let go, until they have closed their upstreams.

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
from collections.abc import Callable
from typing import Any

from gateway.clock import Clock
from gateway.hedge.attempt import AttemptRecord, Prefix
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


class Losers:
    """Cancelled attempts and closing prefixes of one race, reaped once by `reap`."""

    __slots__ = ("_clock", "_closing")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._closing: list[asyncio.Future[Any]] = []

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
