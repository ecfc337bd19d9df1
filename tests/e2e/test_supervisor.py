"""The `--workers` supervisor with stand-in workers: real forks, real signals and a
real reserved address, but workers that only record what reaches them, so the supervisor's
own rules are seen directly: the restart bound, SIGHUP forwarding with a reload, SIGTERM.

The supervisor runs in this test's main thread (it installs signal handlers); a helper thread
plays the operator and signals this process once the workers are up.
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.server import supervisor as sup
from gateway.server.workers import MAX_RESTARTS, worker_settings
from gateway.settings import BackendSettings, PoolSettings, ServerSettings, Settings

WAIT = 20.0


def settings(burst: float = 10.0, key: str = "key-old-0001") -> Settings:
    from gateway.settings import BudgetSettings, HedgingSettings

    pool = PoolSettings("p", (BackendSettings("a", provider="sim"),),
                        hedging=HedgingSettings(budget=BudgetSettings(burst=burst)))
    server = ServerSettings(host="127.0.0.1", port=0, shutdown_grace=1.0, api_keys=(key,),
                            ops_keys=(f"ops-{key}",))
    return Settings(pools=(pool,), server=server)


def wait_for(probe: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)  # polling a state change, not a timing assertion


@pytest.mark.timeout(60)
def test_workers_that_keep_dying_stop_the_server_with_status_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[int] = []

    def dies_at_once(plan: sup.WorkerPlan, index: int) -> None:
        os._exit(1)

    monkeypatch.setattr(sup, "_worker_main", dies_at_once)
    original = sup.Supervisor._spawn

    def counting(self: sup.Supervisor, plan: sup.WorkerPlan, index: int) -> object:
        starts.append(index)
        return original(self, plan, index)

    monkeypatch.setattr(sup.Supervisor, "_spawn", counting)
    out = io.StringIO()
    assert sup.Supervisor(settings(), 2, log_config=None, build_app=create_app, out=out).run() == 1
    assert len(starts) == 2 + MAX_RESTARTS  # the first two, then the bounded replacements
    assert "workers keep exiting: stopping the server" in out.getvalue()


@pytest.mark.timeout(60)
def test_sighup_reloads_then_reaches_every_worker_and_sigterm_stops_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def recorder(plan: sup.WorkerPlan, index: int) -> None:
        signal.set_wakeup_fd(-1)
        marks = tmp_path / f"worker-{index}"

        def mark(text: str) -> None:
            with open(marks, "a") as file:
                file.write(text + "\n")

        signal.signal(signal.SIGHUP, lambda s, f: mark("hup"))
        signal.signal(signal.SIGTERM, lambda s, f: os._exit(0))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGHUP, signal.SIGTERM))
        share = worker_settings(plan.settings, plan.workers).pools[0].hedging.budget.burst
        keys = ",".join(plan.settings.server.api_keys + plan.settings.server.ops_keys)
        mark(f"up {os.getpid()} keys={keys} burst={share}")
        while True:
            time.sleep(0.05)

    monkeypatch.setattr(sup, "_worker_main", recorder)
    reloads: list[int] = []

    def reload() -> tuple[None, Settings]:
        reloads.append(1)
        return None, settings(burst=20.0, key="key-new-0002")  # a leaked key rotated

    def read(index: int) -> str:
        path = tmp_path / f"worker-{index}"
        return path.read_text() if path.exists() else ""

    def operator() -> None:
        wait_for(lambda: all("up" in read(i) for i in range(2)), "both workers up")
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: all("hup" in read(i) for i in range(2)), "SIGHUP forwarded")
        os.kill(int(read(0).split()[1]), signal.SIGKILL)  # its replacement: the new settings
        wait_for(lambda: "burst=10.0" in read(0), "worker 0 replaced")
        os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=operator, daemon=True)
    helper.start()
    out = io.StringIO()
    config = sup.ConfigSource("unused.yaml", settings().server, None, reload=reload)
    code = sup.Supervisor(settings(), 2, log_config=None, build_app=create_app, out=out,
                          config=config).run()
    helper.join(WAIT)
    assert code == 0, out.getvalue()
    assert reloads == [1]  # the supervisor re-read the settings before forwarding
    marks = [[" ".join(line.split()[2:]) if line.startswith("up") else line
              for line in read(i).splitlines()] for i in range(2)]
    # burst 10 split over 2 workers; after the reload to 20, a replacement gets 10, and it
    # checks the reloaded keys (which its peers swapped in), never the revoked ones
    old, new = "keys=key-old-0001,ops-key-old-0001", "keys=key-new-0002,ops-key-new-0002"
    assert marks == [[f"{old} burst=5.0", "hup", f"{new} burst=10.0"],
                     [f"{old} burst=5.0", "hup"]]
    assert "worker 0" in out.getvalue() and "exited with status -9" in out.getvalue()


#: a worker's start as `_worker_main` runs it, with a SIGHUP arriving before the server is up
_HANGUP_WHILE_STARTING = """
import os, signal, socket, sys
from gateway.app import create_app
from gateway.server.serve import build_server
from gateway.server.supervisor import worker_signals
from gateway.settings import BackendSettings, PoolSettings, ServerSettings, Settings

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})  # as across the supervisor's fork
worker_signals()
os.kill(os.getpid(), signal.SIGHUP)  # the supervisor forwards a reload: the app is not built
server = ServerSettings(host="127.0.0.1", port=0, shutdown_grace=1.0)
settings = Settings(pools=(PoolSettings("p", (BackendSettings("a", provider="sim"),)),),
                    server=server)
app = create_app(settings)
runner = None

def hangup():
    print("reloaded", "started" if runner.started else "not started", flush=True)
    runner.should_exit = True

runner = build_server(app, server, app.state.drain, log_config=None, on_hangup=hangup)
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
runner.run(sockets=[sock])
sys.exit(0 if runner.started else 3)
"""


@pytest.mark.timeout(60)
def test_a_sighup_while_a_worker_starts_is_acted_on_once_it_has_started() -> None:
    """A SIGHUP forwarded while a worker is still starting waits for the server's reload
    handler instead of being ignored (which left that worker on the old file): the worker
    reloads once, after it has started, and then (here) stops."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _HANGUP_WHILE_STARTING], capture_output=True,
                          text=True, timeout=45)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["reloaded started"]
