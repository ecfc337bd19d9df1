"""The shutdown drain: one flag and one event that live streams and races watch.

Set once when the server starts shutting down (SIGTERM). Races in progress and streams that
are relaying read it to decide when their grace period ends; new requests are refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import anyio


class Drain:
    """Set once when the server starts shutting down; live streams and races watch it.

    The grace period counts from the moment the drain started, for every request alike, so
    a stream that commits during the drain does not get a fresh `grace` of its own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._event: asyncio.Event | None = None
        self._clock = clock
        self.draining = False
        self.started_at: float | None = None
        #: callbacks for the end of the grace period: id -> (grace, callback, timer if armed)
        self._at_grace_end: dict[int, tuple[float, Callable[[], None],
                                            asyncio.TimerHandle | None]] = {}
        self._next_id = 0

    def _get(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def start(self) -> None:
        if not self.draining:
            self.draining = True
            self.started_at = self._clock()
            for key, (grace, callback, _) in list(self._at_grace_end.items()):
                self._at_grace_end[key] = (grace, callback, self._arm(grace, callback))
        self._get().set()

    def _arm(self, grace: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        started = self.started_at if self.started_at is not None else self._clock()
        delay = max(0.0, started + grace - self._clock())
        return asyncio.get_running_loop().call_later(delay, callback)

    def call_at_grace_end(self, grace: float, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` `grace` seconds after the drain starts (never, if it does not);
        returns the function that takes the request back. A dict entry per request instead
        of a task per request: the race registers here for its whole run."""
        key = self._next_id
        self._next_id += 1
        handle = self._arm(grace, callback) if self.draining else None
        self._at_grace_end[key] = (grace, callback, handle)

        def forget() -> None:
            entry = self._at_grace_end.pop(key, None)
            if entry is not None and entry[2] is not None:
                entry[2].cancel()

        return forget

    async def wait(self) -> None:
        await self._get().wait()

    async def wait_grace(self, grace: float) -> None:
        """Return `grace` seconds after the drain started (never, if it does not start)."""
        await self.wait()
        started = self.started_at if self.started_at is not None else self._clock()
        await anyio.sleep(max(0.0, started + grace - self._clock()))
