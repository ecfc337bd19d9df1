"""The background event loop every integration test's servers live in.

Why a thread: streaming can only be tested over real sockets, so servers run in one asyncio
loop in a daemon thread while the test thread drives them with sync clients, exactly as a
production client would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


#: `HEDGE_TEST_LOOP=uvloop` runs the servers on uvloop, the loop `hedge-gateway serve` runs on
LOOP_ENV = "HEDGE_TEST_LOOP"


def new_loop() -> asyncio.AbstractEventLoop:
    """The loop the servers run on: asyncio's, or with `HEDGE_TEST_LOOP=uvloop` the loop
    `hedge-gateway serve` runs on (uvicorn picks uvloop where it is installed)."""
    if os.environ.get(LOOP_ENV) == "uvloop":
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


async def _open_once() -> None:
    """Listen once and stop: uvloop opens what it keeps for the loop's life (a reserve
    descriptor on /dev/null, its wake-up sockets) on its first listen, which the leak check's
    baseline must already hold (on asyncio's loop it opens nothing that stays)."""
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    server.close()
    await server.wait_closed()


class LoopThread:
    """An asyncio event loop in a daemon thread, driven from the test thread.

    Servers (gateway, upstreams) live in this loop; the test thread talks to them over sockets
    with sync clients, so streaming is exercised exactly as in production. `add_cleanup`
    registers async teardown steps (server stops) that `run_cleanups`/`stop` run LIFO."""

    def __init__(self, name: str = "harness-loop") -> None:
        self.name = name
        self.loop = new_loop()
        #: contexts the loop's exception handler saw ("Task exception was never retrieved"...)
        self.errors: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._cleanups: list[Callable[[], Awaitable[object]]] = []
        #: what must hold while the servers still run (see `live_problems`)
        self._live_checks: list[Callable[[], list[str]]] = []
        self._lock = threading.Lock()

    def start(self) -> LoopThread:
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.loop.set_exception_handler(self._on_loop_error)
        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(5.0):
            raise RuntimeError("event loop thread did not start")
        self.run(_open_once(), 5.0)
        return self

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.errors.append(context)
        loop.default_exception_handler(context)

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident if self._thread is not None else None

    def submit(self, aw: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Schedule `aw` (a coroutine or any awaitable) in the loop; return a future the test
        thread can wait on."""
        coro = aw if asyncio.iscoroutine(aw) else _await(aw)
        if threading.get_ident() == self.thread_id:
            coro.close()
            raise RuntimeError("LoopThread.run/submit called from inside its own loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, aw: Awaitable[T], timeout: float = 10.0) -> T:
        """Run `aw` in the loop and return its result; on timeout cancel it and raise
        TimeoutError."""
        fut = self.submit(aw)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout}s") from None

    def call(self, fn: Callable[[], T], timeout: float = 5.0) -> T:
        """Run a plain function in the loop thread (to read loop-owned state safely)."""

        async def invoke() -> T:
            return fn()

        return self.run(invoke(), timeout)

    def tasks(self) -> set[asyncio.Task[Any]]:
        """Every unfinished task of the loop (except the one that asks)."""

        async def collect() -> set[asyncio.Task[Any]]:
            return asyncio.all_tasks() - {asyncio.current_task()}

        return self.run(collect(), 5.0)

    def add_cleanup(self, fn: Callable[[], Awaitable[object]]) -> None:
        with self._lock:
            self._cleanups.append(fn)

    def add_live_check(self, fn: Callable[[], list[str]]) -> None:
        """Register a check that runs in the loop before the cleanups: it returns what is
        still in use (one line each) that should not be once the test is over."""
        with self._lock:
            self._live_checks.append(fn)

    def live_problems(self) -> list[str]:
        """Every registered live check's findings, run in the loop (a consistent view)."""
        with self._lock:
            checks = list(self._live_checks)
        return self.call(lambda: [line for check in checks for line in check()])

    def run_cleanups(self, timeout: float = 15.0) -> None:
        """Run registered cleanups LIFO; each runs even if an earlier one raised (the first
        error propagates, later ones are chained to it)."""
        with self._lock:
            if not self._cleanups:
                return
            fn = self._cleanups.pop()
        try:
            self.run(fn(), timeout)
        finally:
            self.run_cleanups(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Run cleanups, cancel what is left, shut the loop down and join the thread."""
        if self._thread is None:
            return
        try:
            self.run_cleanups()
        finally:
            try:
                self.run(self._cancel_everything(timeout), timeout + 5.0)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout)
                if not self._thread.is_alive():
                    self.loop.close()
                self._thread = None

    async def _cancel_everything(self, timeout: float) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        await self.loop.shutdown_asyncgens()
        await asyncio.wait_for(self.loop.shutdown_default_executor(), timeout)

    def __enter__(self) -> LoopThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _await(aw: Awaitable[T]) -> T:
    return await aw
