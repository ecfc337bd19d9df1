"""`hedge-gateway serve --workers N`: N worker processes serving one address.

The supervisor is a small process with no event loop. It reserves the address, forks N workers,
and then only waits: for a worker to exit (it is replaced, at a bounded rate) or for a signal.

- One address, N accept queues. Each worker binds its own listening socket to the address with
  `SO_REUSEPORT`, so the kernel spreads new connections evenly over the workers by a hash of
  the connection. (One socket shared by every worker would work too, but then all of them wake
  for each connection and whichever loop is idle first takes it, often the same one: load
  piles onto a single worker.) The supervisor holds a bound, never-listening socket of the same
  group, so a port of 0 resolves once and the port stays ours while a worker is replaced.
- A worker is exactly the single-process server: the app and `GatewayServer` with its limits,
  head bound and drain. Its budget bucket holds `burst / N` (`gateway.server.workers`), and its
  stats
  endpoints merge its peers' numbers (`gateway.stats.shared`) through a private directory that
  the supervisor creates and removes at exit.
- A worker that dies (crash, OOM kill, SIGKILL) is replaced in the same slot at once, at most
  `MAX_RESTARTS` times per `RESTART_WINDOW`; past that the supervisor stops the server and
  exits 1 rather than fork in a loop. Its last published lifetime numbers are kept
  (`gateway.stats.shared.retire`), so the server's counters never go down.
- SIGTERM or SIGINT: every worker gets SIGTERM and drains as a single process does (new
  requests refused, live streams get `shutdown_grace`, then a final error event). The
  supervisor closes its own socket, waits for all of them, SIGKILLs any still alive well after
  uvicorn's own hard limit, and exits 0 after a clean drain.
- SIGHUP is forwarded to every worker, and each reloads the configuration file itself as a
  single process does (`gateway.app.Reloader`, with its budgets split again). The supervisor
  re-reads the file first, so a worker started later runs the configuration the others
  reloaded: the `server` section as started, as in every worker, but with the reloaded
  client and ops keys, which every worker swaps in (a replacement must not bring back a
  revoked key).

A worker whose supervisor disappears (SIGKILL) notices within a second and drains as on
SIGTERM, so no worker outlives its supervisor. Signals are blocked around each fork, so a
forwarded signal can never reach a new worker before it has replaced the supervisor's handlers
with its own.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TextIO

from gateway.server.serve import build_server, graceful_timeout, tune_collector
from gateway.server.workers import RestartLimiter, with_response_id_secret
from gateway.settings import RELOADED_SERVER_KEYS, ServerSettings, Settings
from gateway.settings.fields import ConfigError
from gateway.settings.origin import ConfigOrigin
from gateway.stats.shared import Peers, retire

#: how long after uvicorn's own hard shutdown limit the supervisor SIGKILLs a worker
KILL_MARGIN = 5.0
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: exit status of a worker whose server could not start (as the single-process `serve`)
NOT_STARTED = 3
#: how often a worker checks that its supervisor is still there, seconds
ORPHAN_POLL = 1.0


def reuseport_socket(host: str, port: int, *, reuse_port: bool = True) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEADDR (and SO_REUSEPORT unless told
    otherwise), not yet listening."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def claim(host: str, port: int) -> socket.socket:
    """The supervisor's hold on the address: a bound, never-listening SO_REUSEPORT socket.

    SO_REUSEPORT would let a second gateway started on the same port by mistake join the group
    and silently take half the connections. So the address is first bound *without* it, which
    fails as a single-process `serve` would while anything listens there (another gateway and
    its workers included), and resolves a port of 0; the reuse-port socket is bound to that
    port while the first still holds it, so nothing can slip in between."""
    probe = reuseport_socket(host, port, reuse_port=False)
    try:
        return reuseport_socket(host, probe.getsockname()[1])
    finally:
        probe.close()


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """Where the configuration came from, for reloads (SIGHUP)."""

    #: the file (`serve --config`); None for the embedded default, which cannot be re-read
    path: str | None
    #: the file's `server` section before command-line overrides: a reload names what differs
    file_server: ServerSettings
    #: the checksum and load time of the configuration at start
    origin: ConfigOrigin | None
    #: re-reads the file: (its origin, its settings with the command line's overrides)
    reload: Callable[[], tuple[ConfigOrigin | None, Settings]] | None = None


class AppFactory(Protocol):
    """Builds one worker's ASGI app (`gateway.app.create_app`): handed in by the command line,
    so the server sits below the composition root and never imports it."""

    def __call__(self, settings: Settings, *, peers: Peers, origin: ConfigOrigin | None,
                 workers: int) -> Any: ...


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """What a forked worker needs; inherited through fork, never pickled."""

    #: the whole server's settings; the worker's budget share is taken by `create_app`
    settings: Settings
    workers: int
    stats_dir: Path
    log_config: dict[str, Any] | None
    origin: ConfigOrigin | None = None
    path: str | None = None
    file_server: ServerSettings | None = None
    #: when the server started (the supervisor's monotonic clock, which is the workers' too):
    #: the dashboard's series and races of every worker count from it
    started: float = 0.0
    build_app: AppFactory | None = None


def kept_server(running: ServerSettings, reloaded: ServerSettings) -> ServerSettings:
    """The `server` section of a worker started after a reload: the one the server started
    with (its socket and limits are bound at start, and each running worker's reload keeps
    them) but with the reloaded keys, which each running worker swapped in. Keeping the
    started keys let a replacement worker accept a key the reload revoked."""
    return replace(running, **{name: getattr(reloaded, name) for name in RELOADED_SERVER_KEYS})


def worker_signals() -> None:
    """A forked worker's signals, before it builds its app: SIGTERM and SIGINT as usual;
    SIGHUP stays blocked (it was blocked across the fork) until the server has started and
    its reload handler is in place (`GatewayServer.startup` unblocks it). A SIGHUP the
    supervisor forwards while the worker starts is then pending, not ignored: ignoring it
    left a worker that started during a reload on the old file, disagreeing with its
    peers about the pools."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def _worker_main(plan: WorkerPlan, index: int) -> None:
    """The body of one worker process (runs in the forked child)."""
    worker_signals()
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True,
                     name="hedge-gateway-orphan-watch").start()
    server = plan.settings.server
    sock = reuseport_socket(server.host, server.port)
    peers = Peers(plan.stats_dir, index, started=plan.started)
    assert plan.build_app is not None, "the supervisor always sets it"
    app = plan.build_app(plan.settings, peers=peers, origin=plan.origin, workers=plan.workers)
    hangup: Callable[[], object] | None = None
    if plan.path is not None:  # SIGHUP: this worker re-reads the file, as a single process does
        reloader, path, started = app.state.reloader, plan.path, plan.file_server

        def hangup() -> None:
            reloader.hangup(path, started_server=started)

    runner = build_server(app, server, app.state.drain, log_config=plan.log_config,
                          on_hangup=hangup)
    tune_collector(server)
    runner.run(sockets=[sock])
    sys.exit(0 if runner.started else NOT_STARTED)


def _orphan_watch(parent: int) -> None:
    """A worker whose supervisor is gone (SIGKILLed, crashed) drains and exits like on
    SIGTERM instead of serving on unsupervised. Polls, as no portable signal reports it."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL)
    os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Runs N workers on one address until a signal stops them (module docstring)."""

    def __init__(
        self,
        settings: Settings,
        workers: int,
        *,
        log_config: dict[str, Any] | None,
        build_app: AppFactory,
        config: ConfigSource | None = None,
        out: TextIO = sys.stderr,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: the workers inherit it through fork, response id secret included
        self.settings = with_response_id_secret(settings)
        self.count = workers
        self.log_config = log_config
        self._build_app = build_app
        self._config = config
        self._origin = None if config is None else config.origin
        self._out = out
        self._clock = clock
        self._context = multiprocessing.get_context("fork")
        self._pending: list[int] = []
        self._limiter = RestartLimiter()
        #: set when `run` starts: the start every worker's dashboard counts from
        self._started = clock()

    def _say(self, message: str) -> None:
        print(f"hedge-gateway: {message}", file=self._out, flush=True)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._pending.append(sig)  # acted on by the loop, woken through the wakeup fd

    def _spawn(self, plan: WorkerPlan, index: int) -> BaseProcess:
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        try:
            proc = self._context.Process(target=_worker_main, args=(plan, index),
                                         name=f"hedge-gateway-worker-{index}")
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)
        return proc

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 after a clean drain, 1 when workers kept dying or
        had to be killed, 3 when the address cannot be bound."""
        server = self.settings.server
        try:
            reserved = claim(server.host, server.port)
        except OSError as exc:
            self._say(f"cannot listen on {server.host}:{server.port}: {exc.strerror or exc}")
            return NOT_STARTED
        port = reserved.getsockname()[1]
        self.settings = replace(self.settings, server=replace(server, port=port))
        stats_dir = Path(tempfile.mkdtemp(prefix="hedge-gateway-stats-"))
        self._started = self._clock()
        waker, wakeup = socket.socketpair()
        waker.setblocking(False)
        wakeup.setblocking(False)
        previous_fd = signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _HANDLED}
        try:
            self._say(f"{self.count} workers on http://{server.host}:{port}/v1 "
                      f"(supervisor pid {os.getpid()})")
            return self._supervise(stats_dir, waker, reserved)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_fd)
            waker.close()
            wakeup.close()
            reserved.close()
            shutil.rmtree(stats_dir, ignore_errors=True)

    def _plan(self, stats_dir: Path) -> WorkerPlan:
        config = self._config
        return WorkerPlan(self.settings, self.count, stats_dir, self.log_config, self._origin,
                          None if config is None else config.path,
                          None if config is None else config.file_server, self._started,
                          self._build_app)

    def _supervise(self, stats_dir: Path, waker: socket.socket, reserved: socket.socket) -> int:
        plan = self._plan(stats_dir)
        slots = {index: self._spawn(plan, index) for index in range(self.count)}
        stopping = False
        deadline: float | None = None  # when stopping: after it, the rest are killed
        status = 0
        while slots:
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            multiprocessing.connection.wait(
                [waker, *(p.sentinel for p in slots.values())], timeout)
            while True:  # empty the wakeup socket; the signals are in `_pending`
                try:
                    if not waker.recv(512):
                        break
                except BlockingIOError:
                    break
            while self._pending:
                sig = self._pending.pop(0)
                if stopping:
                    continue
                if sig == signal.SIGHUP:
                    plan = self._on_hangup(plan, stats_dir, slots)
                else:
                    stopping, deadline = True, self._stop(slots, reserved)
            for index, proc in list(slots.items()):
                if proc.exitcode is None:
                    continue
                proc.join()
                del slots[index]
                retire(stats_dir, index)  # its lifetime counts stay in the whole server's
                if stopping:
                    continue
                self._say(f"worker {index} (pid {proc.pid}) exited with status "
                          f"{proc.exitcode}")
                if self._limiter.allow(self._clock()):
                    slots[index] = self._spawn(plan, index)
                else:
                    self._say("workers keep exiting: stopping the server")
                    status = 1
                    stopping, deadline = True, self._stop(slots, reserved)
            if deadline is not None and self._clock() >= deadline and slots:
                self._say(f"{len(slots)} workers still running after the grace: killed")
                for proc in slots.values():
                    if proc.pid is not None and proc.exitcode is None:
                        os.kill(proc.pid, signal.SIGKILL)
                status, deadline = 1, None  # killed: only reaping is left
        return status

    def _stop(self, slots: dict[int, BaseProcess], reserved: socket.socket) -> float:
        """SIGTERM every worker; the deadline after which the rest are killed."""
        reserved.close()
        for proc in slots.values():
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGTERM)
        return self._clock() + graceful_timeout(self.settings.server) + KILL_MARGIN

    def _on_hangup(self, plan: WorkerPlan, stats_dir: Path,
                   slots: dict[int, BaseProcess]) -> WorkerPlan:
        config = self._config
        if config is not None and config.path is not None and config.reload is not None:
            try:
                origin, fresh = config.reload()
            except (ConfigError, OSError) as exc:
                self._say(f"SIGHUP: workers started from now on keep the configuration in "
                          f"force ({type(exc).__name__}: {exc})")
            else:
                self.settings = replace(fresh, server=kept_server(self.settings.server,
                                                                  fresh.server))
                self._origin = origin
                plan = self._plan(stats_dir)
        for proc in slots.values():
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGHUP)
        return plan
