"""Scripts: what a `ScriptedUpstream` does with one request, as plain data.

Why data and not callbacks: a test states the whole hostile behaviour (delays, hangs, resets,
broken framing) up front, where a reader sees it, and the upstream only interprets it. `Gate`
is the one live object, so tests can order steps by causality instead of by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Head:
    """Write the status line and headers here, after `delay` seconds.

    A script without a `Head` step writes its head first. Put steps before an explicit `Head()`
    to act before any byte of the response (`[Hang(), Head()]` never answers at all)."""

    delay: float = 0.0


@dataclass(frozen=True)
class Send:
    """Write `data` as one piece (one chunk when chunked) after `delay` seconds.

    `raw=True` bypasses the body framing: the bytes go to the socket as they are (for broken
    chunk syntax and the like); raw bytes are not counted as SSE events."""

    data: bytes
    delay: float = 0.0
    raw: bool = False


@dataclass(frozen=True)
class Sleep:
    """Wait `seconds` without writing (the wait ends early if the client hangs up)."""

    seconds: float


class Gate:
    """A latch a test opens from any thread; a `Wait(gate)` step blocks until it is open.

    Lets a test order events by causality ("hold the primary until the hedge arrived") instead
    of by sleeping. One gate may hold any number of steps, in any upstream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def open(self) -> None:
        with self._lock:
            self._open = True
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(resolve, fut)

    @property
    def is_open(self) -> bool:
        return self._open

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._open:
                return
            self._waiters.append((loop, fut))
        try:
            await fut
        finally:  # a cancelled wait must not be resolved later, maybe after its loop closed
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove((loop, fut))


def resolve(fut: asyncio.Future[None]) -> None:
    """Wake a waiter unless it is done already (cancelled, or woken by someone else)."""
    if not fut.done():
        fut.set_result(None)


@dataclass(frozen=True)
class Wait:
    """Block until `gate` is opened (or the client hangs up)."""

    gate: Gate


@dataclass(frozen=True)
class Hang:
    """Stop writing; keep the socket open until the client closes it or the server stops."""


@dataclass(frozen=True)
class Reset:
    """Abort the connection with a TCP RST (SO_LINGER 0), mid-response or before any byte."""


@dataclass(frozen=True)
class Close:
    """Close the connection (FIN) right now, without ending the body properly."""


Step = Head | Send | Sleep | Wait | Hang | Reset | Close
#: chunked: Transfer-Encoding chunked; close: no length, the body ends when the socket closes;
#: length: Content-Length = the sum of the non-raw `Send` data.
Framing = Literal["chunked", "close", "length"]


@dataclass(frozen=True, kw_only=True)
class Script:
    """One response. After the last step the body is ended properly (the chunked terminator);
    then the connection is closed if `close` (or framing is "close"), else kept alive for the
    next request. Framing and `connection` headers are added unless `headers` sets them."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    steps: Sequence[Step] = ()
    close: bool = True
    framing: Framing = "chunked"
