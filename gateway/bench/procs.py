"""The bench's child processes: start, wait until ready, measure, stop.

Kept apart from the orchestration (`gateway.bench`) because it is the part that touches the
operating system: every child is a real server process whose log goes to a file (shown when
it fails to start), whose CPU time and RSS are sampled with psutil, and which is always ended
(terminate, then kill) by `Children.close()`, also after an error or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import platform
import socket
import subprocess
from collections.abc import Collection, Mapping, Sequence
from typing import IO, Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

READY_TIMEOUT = 30.0


class ChildFailed(RuntimeError):
    """A child server exited or never became ready; the message ends with its log's tail."""


class _NotReady(Exception):
    pass


class Children:
    """Every child process the bench started. `close()` ends them all and is idempotent."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self._procs: dict[int, tuple[str, subprocess.Popen[bytes], IO[bytes]]] = {}

    def start(self, name: str, argv: Sequence[str], *, cpus: Collection[int] = (),
              env: Mapping[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Start a child (in `cwd` when given); pinned to `cpus` when given (before it starts
        any thread)."""
        log = open(os.path.join(self.logdir, f"{name}.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, cwd=cwd,
                                env=None if env is None else {**os.environ, **env})
        self._procs[proc.pid] = (name, proc, log)
        if cpus:
            with contextlib.suppress(OSError):  # it may have exited already: seen later
                os.sched_setaffinity(proc.pid, cpus)
        return proc

    def tail(self, proc: subprocess.Popen[bytes], size: int = 2000) -> str:
        name, _, log = self._procs[proc.pid]
        log.flush()
        with open(os.path.join(self.logdir, f"{name}.log"), "rb") as file:
            return file.read()[-size:].decode(errors="replace")

    def stop(self, proc: subprocess.Popen[bytes], *, signalled: bool = False) -> None:
        """Terminate `proc` (unless `signalled`: its SIGTERM was sent already, and a second
        one would cut its graceful stop short), wait up to 5 s, then kill it."""
        entry = self._procs.pop(proc.pid, None)
        if proc.poll() is None:
            if not signalled:
                proc.terminate()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
        if entry is not None:
            entry[2].close()

    def stop_all(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        """Stop several children at once: each gets its SIGTERM before any is waited for, so
        their shutdowns overlap instead of queueing."""
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            self.stop(proc, signalled=True)

    def close(self) -> None:
        self.stop_all([proc for _, proc, _ in list(self._procs.values())])


def pin_tree(pid: int, cpus: Collection[int]) -> None:
    """Pin process `pid`, each of its threads and each of its descendants (a supervisor's
    workers, a front server's worker process) to `cpus`. For a child that was started on
    every CPU so its start-up, which is never measured, does not queue on one core: a
    process pinned after it started threads keeps them where they were unless each thread
    is pinned too. Threads and processes started later inherit the pinning."""
    pids = [pid]
    psutil: Any = None
    with contextlib.suppress(ImportError):  # without psutil: the process and its threads
        psutil = importlib.import_module("psutil")
    if psutil is not None:
        with contextlib.suppress(psutil.Error):  # it ended meanwhile: the run will say so
            pids += [child.pid for child in psutil.Process(pid).children(recursive=True)]
    for each in pids:
        try:
            threads = [int(tid) for tid in os.listdir(f"/proc/{each}/task")]
        except OSError:
            threads = [each]  # ended meanwhile, or no /proc: the process itself
        for tid in threads:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cpus)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_ready(client: httpx.AsyncClient, url: str, proc: subprocess.Popen[bytes],
                     children: Children) -> None:
    """Poll `url` until it answers 200; fail at once if the child exited."""
    retrying = AsyncRetrying(stop=stop_after_delay(READY_TIMEOUT), wait=wait_fixed(0.1),
                             retry=retry_if_exception_type((httpx.HTTPError, _NotReady)),
                             reraise=True)
    try:
        async for attempt in retrying:
            with attempt:
                if proc.poll() is not None:
                    raise ChildFailed(f"child exited with {proc.returncode}:\n"
                                      f"{children.tail(proc)}")
                response = await client.get(url, timeout=1.0)
                if response.status_code != 200:
                    raise _NotReady(url)
    except (httpx.HTTPError, _NotReady):
        raise ChildFailed(f"not ready after {READY_TIMEOUT:.0f}s: {url}\n"
                          f"{children.tail(proc)}") from None


class ProcessMeter:
    """CPU seconds and peak RSS of some processes over one run, sampled with psutil (peak RSS
    every 100 ms; CPU as the difference of the counters at the ends), and how busy the whole
    machine was meanwhile: on a shared machine, other work competes with the benchmark, and
    the numbers only mean something next to that. Without psutil the results are empty."""

    def __init__(self, pids: dict[str, int], trees: tuple[str, ...] = ()) -> None:
        """`trees`: names whose child processes count as theirs (a gateway's workers)."""
        self._trees = trees
        self._procs: dict[str, Any] = {}
        self._psutil: Any = None
        try:
            self._psutil = importlib.import_module("psutil")
        except ImportError:
            return
        self._procs = {name: self._psutil.Process(pid) for name, pid in pids.items()}
        self._cpu0 = {name: self._cpu_of(name) for name in self._procs}
        self._io0 = {name: self._io_of(name) for name in self._procs}
        self._machine0 = self._psutil.cpu_times()
        self._peak = dict.fromkeys(self._procs, 0)
        self._samples = 0

    @staticmethod
    def _cpu(proc: Any) -> float:
        times = proc.cpu_times()
        return float(times.user + times.system)

    def _members(self, name: str) -> list[Any]:
        proc = self._procs[name]
        if name not in self._trees:
            return [proc]
        try:
            return [proc, *proc.children(recursive=True)]
        except self._psutil.Error:
            return [proc]

    def _cpu_of(self, name: str) -> float:
        total = 0.0
        for proc in self._members(name):
            try:
                total += self._cpu(proc)
            except self._psutil.Error:
                continue  # ended meanwhile
        return total

    def _io_of(self, name: str) -> tuple[int, int]:
        """Read and write system calls so far (Linux's syscr and syscw): on loopback, one
        `read` takes whatever the peer's writes put in the socket meanwhile, so reads per
        request tell how many events a process got per wake-up, writes how many it sent."""
        reads = writes = 0
        for proc in self._members(name):
            try:
                io = proc.io_counters()
            except (self._psutil.Error, AttributeError):
                continue  # ended meanwhile, or a platform without the counters
            reads, writes = reads + int(io.read_count), writes + int(io.write_count)
        return reads, writes

    def _rss_of(self, name: str) -> int:
        total = 0
        for proc in self._members(name):
            try:
                total += int(proc.memory_info().rss)
            except self._psutil.Error:
                continue
        return total

    async def sample_until(self, done: asyncio.Event) -> None:
        while self._procs:
            for name in self._procs:
                self._peak[name] = max(self._peak[name], self._rss_of(name))
            self._samples += 1
            try:
                await asyncio.wait_for(done.wait(), 0.1)
            except TimeoutError:
                continue
            return

    def result(self) -> dict[str, dict[str, float]]:
        """Per process `cpu_s`, `peak_rss_mb`, `reads` and `writes` (system calls); under
        "machine", `busy_pct` of all CPUs and `cpu_s` of every process on the machine, ours
        included."""
        if self._psutil is None:
            return {}
        out: dict[str, dict[str, float]] = {}
        for name in self._procs:
            reads, writes = self._io_of(name)
            out[name] = {"cpu_s": round(self._cpu_of(name) - self._cpu0[name], 3),
                         "peak_rss_mb": round(self._peak[name] / 2**20, 1),
                         "rss_samples": self._samples,
                         "reads": reads - self._io0[name][0],
                         "writes": writes - self._io0[name][1]}
        end = self._psutil.cpu_times()
        total = sum(end) - sum(self._machine0)
        idle = (end.idle + getattr(end, "iowait", 0.0)) - (
            self._machine0.idle + getattr(self._machine0, "iowait", 0.0))
        out["machine"] = {"busy_pct": round(100.0 * (total - idle) / total, 1) if total else 0.0,
                          "cpu_s": round(total - idle, 3)}
        return out


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "cpu_model": model, "python": platform.python_version(),
            "platform": platform.platform()}
