"""An asyncio event loop whose clock only moves when nothing is ready to run.

Why: the race is timers (hedge delay, deadline) and awaits (tokens, failures). Run on this loop
it goes through seconds of its life in microseconds, and deterministically: two events scheduled
for the same virtual instant land in the same loop tick, which real time can only hit by luck.
Everything the race uses (`asyncio.wait(timeout=...)`, `asyncio.sleep`, `asyncio.timeout`,
anyio's cancel scopes) schedules on `loop.time()`, so nothing in the gateway needs to know.

How: the loop's selector is asked to block for `timeout` seconds only when no callback is
ready; instead of blocking, it advances the virtual clock by `timeout`. Real file descriptors
(the loop's own wake-up pipe) are still polled, without waiting.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: a test whose virtual clock passes this has lost its way (a timer re-arming for ever)
VIRTUAL_LIMIT = 24 * 3600.0


class VirtualClock:
    """The loop's notion of now, and each instant the loop slept until (its wake-ups)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.wakes: list[float] = []

    def __call__(self) -> float:
        return self.now


class _AdvancingSelector(selectors.DefaultSelector):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        ready: list[tuple[Any, int]] = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual time: nothing scheduled and nothing ready (a hang)")
        clock = self._clock
        clock.now += timeout
        clock.wakes.append(clock.now)
        if clock.now > VIRTUAL_LIMIT:
            raise RuntimeError("virtual time ran past its limit")
        return ready


class VirtualLoop(asyncio.SelectorEventLoop):
    """A selector event loop on a `VirtualClock` (see the module docstring)."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        super().__init__(selector=_AdvancingSelector(self.clock))

    def time(self) -> float:
        return self.clock.now


def run_virtual(main: Callable[[VirtualLoop], Coroutine[Any, Any, T]]) -> T:
    """Run `main(loop)` to completion on a fresh virtual-time loop; fail if it leaves a task
    behind (the unit tests' leak check)."""
    loop = VirtualLoop()
    try:
        result = loop.run_until_complete(main(loop))
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if left:
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.wait(left))
            raise AssertionError(f"tasks left running: {sorted(t.get_name() for t in left)}")
        return result
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
