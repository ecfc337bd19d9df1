"""Leak checks: after a test, no asyncio task, file descriptor or TCP socket may remain.

Why: hedging cancels losing attempts; a loser that is never closed shows up here as a task or
a socket left over, which no assertion on responses would catch.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import time
from typing import Any

from tests.harness.loop import LoopThread

# psutil ships no type information; importing it as a plain module object keeps mypy --strict
# quiet without an ignore comment that would turn into an error once stubs are installed.
_psutil: Any = importlib.import_module("psutil")


def _open_fds() -> dict[int, str]:
    fds: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


def _addr(addr: Any) -> str:
    return f"{addr.ip}:{addr.port}" if addr else "-"


def _tcp_sockets() -> dict[tuple[str, str], str]:
    """This process's TCP sockets: (local, remote) -> status."""
    conns = _psutil.Process().net_connections(kind="tcp")
    return {(_addr(c.laddr), _addr(c.raddr)): str(c.status) for c in conns}


def _describe_task(task: asyncio.Task[Any]) -> str:
    where = ""
    stack = task.get_stack(limit=1)
    if stack:
        code = stack[-1].f_code
        where = f" at {code.co_filename}:{stack[-1].f_lineno} in {code.co_name}"
    return f"task {task.get_name()!r}: {task.get_coro()!r}{where}"


def gateway_in_use(app: Any) -> list[str]:
    """What a gateway app still holds (empty for any other app): admitted requests, in-flight
    counts, and upstream connections of its shared httpx client that are not idle.

    Checked while the servers still run: stopping the gateway closes its client, and with it
    any upstream response it leaked, so a check after the cleanups would see nothing."""
    state = getattr(app, "state", None)
    proxy = getattr(state, "proxy", None)
    if proxy is None:
        return []
    problems: list[str] = []
    if proxy.admission.active:
        problems.append(f"gateway: {proxy.admission.active} admitted requests still active")
    live = getattr(state, "live", None)
    # the pools in force (after a reload, the current generation's; they share the in-flight
    # count and the backends' slots with the generations before)
    pools = live.current.pools if live is not None else getattr(state, "pools", {})
    for name, pool in pools.items():
        if pool.inflight_requests:
            problems.append(f"gateway: pool {name} has {pool.inflight_requests} requests in flight")
        for backend in pool.balancer.names:
            if pool.balancer.inflight(backend):
                problems.append(f"gateway: backend {name}/{backend} has "
                                f"{pool.balancer.inflight(backend)} attempts running")
    client = getattr(state, "http_client", None)
    # a response that was never closed holds one of the client's slots
    in_use = getattr(client, "in_use", 0)
    if in_use:
        problems.append(f"gateway: {in_use} upstream responses still open")
    return problems


class LeakBaseline:
    """What was open when a test started: tasks of the loop thread's loop, file descriptors,
    TCP sockets of this process. `check()` fails if anything beyond that is still open.

    Capture it before the test opens anything, and call `check` from the test thread after
    every server, client and response of the test is closed."""

    def __init__(self, loop_thread: LoopThread | None = None) -> None:
        self._loop_thread = loop_thread
        self.tasks = self._tasks()
        self.fds = _open_fds()
        self.tcp = _tcp_sockets()

    def _tasks(self) -> set[asyncio.Task[Any]]:
        return self._loop_thread.tasks() if self._loop_thread is not None else set()

    def leaks(self) -> list[str]:
        """What is open now and was not at the baseline, one line each."""
        problems: list[str] = []
        if self._loop_thread is not None:
            new = self._tasks() - self.tasks
            if new:
                problems += self._loop_thread.call(lambda: [_describe_task(t) for t in new])
        fds = _open_fds()
        problems += [
            f"fd {fd} -> {target}" for fd, target in fds.items() if self.fds.get(fd) != target
        ]
        tcp = _tcp_sockets()
        problems += [
            f"tcp {local} -> {remote} ({status})"
            for (local, remote), status in tcp.items()
            if (local, remote) not in self.tcp
        ]
        return sorted(problems)

    def check_live(self, settle_timeout: float = 2.0) -> None:
        """Before the servers stop: poll until every live check of the loop thread passes
        (no gateway request, upstream response or upstream connection still in use), or
        raise AssertionError listing what is still held. Run it before the cleanups, which
        close clients and upstreams and would hide what the gateway leaked."""
        if self._loop_thread is None:
            return
        deadline = time.monotonic() + settle_timeout
        while problems := self._loop_thread.live_problems():
            if time.monotonic() >= deadline:
                listing = "\n  ".join(problems)
                raise AssertionError(f"still in use after the test:\n  {listing}")
            time.sleep(0.02)

    def check(self, settle_timeout: float = 2.0) -> None:
        """Poll until nothing is left over (closing is asynchronous), or raise AssertionError
        listing what leaked. The short sleeps here are polling, not a timing assertion."""
        deadline = time.monotonic() + settle_timeout
        while problems := self.leaks():
            if time.monotonic() >= deadline:
                listing = "\n  ".join(problems)
                raise AssertionError(f"resources leaked by the test:\n  {listing}")
            time.sleep(0.02)
