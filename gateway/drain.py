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

    def _get(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def start(self) -> None:
        if not self.draining:
            self.draining = True
            self.started_at = self._clock()
        self._get().set()

    async def wait(self) -> None:
        await self._get().wait()

    async def wait_grace(self, grace: float) -> None:
        """Return `grace` seconds after the drain started (never, if it does not start)."""
        await self.wait()
        started = self.started_at if self.started_at is not None else self._clock()
        await anyio.sleep(max(0.0, started + grace - self._clock()))
