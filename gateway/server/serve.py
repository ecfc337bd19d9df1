"""How `hedge-gateway serve` runs the app under uvicorn: shutdown, the client connection,
the open-file limit.

What plain `uvicorn.run` does not do the way a gateway needs:

- Graceful shutdown. uvicorn tells the app only at the *end* of its graceful period, so live
  streams would be cut without a word. `GatewayServer` starts the app's `Drain` the moment
  SIGTERM/SIGINT arrives: new requests get 503, live streams get `shutdown_grace` seconds to
  finish and then a final error event, and uvicorn's own hard timeout is set a little later.
  It also exits with status 0 after a graceful stop instead of re-raising the signal (which
  uvicorn does so that an embedding program sees it; for our CLI it turns a clean stop into
  "killed by SIGTERM").
- The connection: `gateway.server.connection.GatewayHttpProtocol` bounds request heads, aborts stuck
  clients, closes lingering after an early refusal, and enforces `server.body_timeout` and
  `server.max_connections`.
- Descriptors: `raise_open_file_limit` lifts the soft open-file limit to the hard one.
- The cyclic garbage collector: `tune_collector` (see there).

It also installs the SIGHUP handler (reload the configuration) on the running loop
while it serves: the loop runs the reload between requests, so none sees half of it. Without
a handler SIGHUP would kill the process, so one is installed even with nothing to reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import resource
import signal
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn

from gateway.drain import Drain
from gateway.server.connection import ConnectionLimits, GatewayConfig, GatewayHttpProtocol
from gateway.settings import ServerSettings

#: uvicorn's hard graceful-shutdown timeout is `shutdown_grace` plus this: our final error
#: events go out first, and the app's own cleanup (closing upstreams) has time to finish
SHUTDOWN_MARGIN = 3.0


class GatewayServer(uvicorn.Server):
    """uvicorn.Server that drains the app on the first SIGTERM/SIGINT and exits 0, and calls
    `on_hangup` on SIGHUP."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        on_hangup: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.on_hangup = on_hangup
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = loop = asyncio.get_running_loop()
        hangup = threading.current_thread() is threading.main_thread()
        if hangup:
            loop.add_signal_handler(signal.SIGHUP, self._hangup)
        try:
            await super().serve(sockets=sockets)
        finally:
            if hangup:
                loop.remove_signal_handler(signal.SIGHUP)

    async def startup(self, sockets: list[Any] | None = None) -> None:
        """Start, then let a SIGHUP through: a worker keeps SIGHUP blocked while it starts
        (`gateway.server.supervisor.worker_signals`), so one the supervisor forwarded
        meanwhile waits, pending, and is acted on here, with the app up, instead of being
        lost while the worker still ran the old file. A no-op where it was never blocked."""
        await super().startup(sockets=sockets)
        if threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})

    def _hangup(self) -> None:
        """SIGHUP, run by the loop: reload, or say there is nothing to reload."""
        if self.drain.draining:
            return
        if self.on_hangup is None:
            logging.getLogger("hedge_gateway.config").warning(
                "SIGHUP: no configuration file to re-read (serve was started without --config)"
            )
            return
        self.on_hangup()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # from a signal handler: hand the work to the loop instead of touching its state
            loop.call_soon_threadsafe(self.drain.start)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Route SIGINT/SIGTERM to `handle_exit`; unlike uvicorn's, never re-raise them after
        the graceful shutdown (so a clean stop exits with status 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def graceful_timeout(server: ServerSettings) -> int:
    """uvicorn's hard limit for the graceful shutdown, a little after our own grace."""
    return math.ceil(server.shutdown_grace + SHUTDOWN_MARGIN)


def build_server(
    app: Any,
    server: ServerSettings,
    drain: Drain,
    *,
    log_config: dict[str, Any] | None,
    on_hangup: Callable[[], object] | None = None,
) -> GatewayServer:
    config = GatewayConfig(
        app,
        limits=ConnectionLimits.of(server),
        host=server.host,
        port=server.port,
        http=GatewayHttpProtocol,
        log_config=log_config,
        timeout_graceful_shutdown=graceful_timeout(server),
        h11_max_incomplete_event_size=server.max_header_bytes,
        ws="none",
        lifespan="on",
        # The gateway reads no client address, so the X-Forwarded-* rewrite (a middleware
        # call per request) buys nothing; the access log is off (`hedge-gateway serve` logs
        # its own one line per request, `gateway.stats.requestlog`).
        proxy_headers=False,
        access_log=False,
    )
    return GatewayServer(config, drain, on_hangup)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's open-file soft limit to its hard limit; return (before, after).

    Every client stream holds two descriptors (client and upstream sockets), so the common
    soft default of 1024 caps a gateway near 500 streams long before `max_connections`. The
    hard limit is what an unprivileged process may take; where it is unlimited (never on
    Linux), the soft limit stays as it is. A refusal leaves the limit unchanged."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, hard


#: the cyclic collector's thresholds while serving, but the young one: an older collection
#: per 20 young ones, the oldest per 100 of those (and only when CPython's own rule, a
#: quarter more long-lived objects than at the last full collection, also says so)
COLLECTOR_OLDER = (20, 100)
#: a young collection comes after at least this many net allocations of container objects
#: (CPython's default: 700) ...
COLLECTOR_YOUNG_FLOOR = 50_000
#: ... and never within a burst of as many requests as the server admits at once: the
#: container objects a request holds alive from its arrival to its first byte, with room
#: (measured: about 150 to 200 for a streamed chat completion)
OBJECTS_PER_ADMITTED_REQUEST = 200


def collector_thresholds(max_concurrent_requests: int) -> tuple[int, int, int]:
    """The collector's thresholds for a server admitting `max_concurrent_requests` at once."""
    young = max(COLLECTOR_YOUNG_FLOOR, OBJECTS_PER_ADMITTED_REQUEST * max_concurrent_requests)
    return (young, *COLLECTOR_OLDER)


def tune_collector(server: ServerSettings) -> None:
    """Set the cyclic garbage collector up for serving; call once, after the app is built.

    Every live stream holds a few hundred container objects (tasks, futures, the connection
    and parser state, the relay's generator frames), and they survive the young collections
    that CPython runs every 700 allocations, so each older collection walks all of them.
    Measured with 1,000 concurrent streams, the collector took about three quarters of the
    process's CPU under the default thresholds (a full collection walked the whole heap in
    about 0.3 s, nine times in a run) and about a tenth under a young threshold of 50,000; at
    c=50 it went from 10 % to about 1 %. Most of what a request leaves behind is freed by
    reference counting; the cycles it makes (an exception and its traceback, a cancelled
    task) die young and are still collected at the next young collection. `gc.freeze()`
    first moves everything built at start (modules, the app, the configuration) out of the
    collector's sight for good, so no collection walks it again.

    The young threshold also holds a whole burst of `server.max_concurrent_requests` new
    requests (`collector_thresholds`). A burst's objects all live on, so a young collection
    in the middle of it walks every one of them and frees nothing, while every first byte
    still to come waits: with 50,000, 1,000 streams started together met three or four such
    collections, 60 to 130 ms in all on the build machine, added to the burst's TTFT p99.
    Cyclic garbage waits for the same count, so it is bounded by the configuration: about
    200 objects per admitted request (some 20 MB at the default 512).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*collector_thresholds(server.max_concurrent_requests))
