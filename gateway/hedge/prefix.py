"""An attempt that reached its first token, handed on: its events so far, its open upstream,
and the close every holder of an open upstream uses.

The attempt (`gateway.hedge.attempt`) builds a `Prefix` as it finds its first token (or its
answer's normal end) and hands it on as a value: to the race, which commits it or closes it as
a loser (`gateway.hedge.losers`), then to the relay, which reads on from where the attempt
stopped and closes it as the stream ends; the request's end reads its `closed` flag and closes
it only when nothing did. So the value lives apart from the code that reads to the first token:
building it is plain data (no step into this file), and closing it is the one step here, made by
whoever holds it last (on a streamed answer, the relay).

`close_quietly` is the close itself, also the attempt's own when it fails or is cancelled
before its first token: the batch iterator, then the upstream, shielded from a cancellation
(`providers.base.finish_despite_cancel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.errors import UpstreamProtocolError
from gateway.wire.base import Translation
from gateway.wire.sse import SSEBatch, SSEEvent
from providers.base import UpstreamStream, finish_despite_cancel


@dataclass(slots=True)
class Prefix:
    """An attempt that produced its first token, with everything needed to relay it."""

    stream: UpstreamStream
    batches: AsyncIterator[SSEBatch]
    #: every event read so far, in order: up to the first token and the rest of its batch
    buffered: list[SSEEvent]
    #: the stream ended normally without a token: `buffered` holds the whole answer
    empty: bool = False
    #: the attempt's backend speaks another API than the client: how its answer is written
    #: in the client's (None: it is relayed as it is)
    translation: Translation | None = None
    #: a whole answer as the runner parsed it to judge it (None: a stream), so that its
    #: translation does not parse it again
    parsed: object = None
    #: a close has run to its end: closing again does nothing
    closed: bool = False

    async def aclose(self) -> None:
        """Close the upstream; once it is closed, at once, without a task or a loop turn.

        A streamed answer is closed by the relay as it ends, and the request's end (which
        must be sure of it on every path) closes it again unless `closed` says it is done
        (it reads the flag, so a stream's end does not step into this file a second time). A close
        runs in a task of its own (`close_quietly`), and the second one cost a task, a shield
        and two turns of the loop, which the client's next request on the connection waited
        behind. The flag is set only once a close has finished, so a second close while the
        first is still under way still waits for a complete one."""
        if self.closed:
            return
        await close_quietly(self.stream, self.batches)
        self.closed = True


async def close_quietly(
    stream: UpstreamStream, batches: AsyncIterator[SSEBatch] | None
) -> None:
    """Close the batch iterator and the upstream, even from a cancelled task: a native
    `Task.cancel()` of the caller (the race cancelling a loser that is already closing after a
    failure) is held back until both are closed, then re-raised (an interrupted close leaks
    the HTTP client's connection)."""
    await finish_despite_cancel(_close(stream, batches))


async def _close(stream: UpstreamStream, batches: AsyncIterator[SSEBatch] | None) -> None:
    aclose = getattr(batches, "aclose", None)
    if aclose is not None:
        # "already running" or a broken stream: the response close below suffices
        with contextlib.suppress(RuntimeError, UpstreamProtocolError):
            await aclose()
    await stream.aclose()
