"""The bench's cost figures: pinning plan, CPU per request, the speed targets."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from gateway.bench import speed
from gateway.bench.load import Sample
from gateway.bench.procs import pin_tree
from gateway.bench.speed import (
    Pinning,
    compare_costs,
    cost_row,
    events_delivered,
    per_request_costs,
    short_slice,
    targets,
    ttft_summary,
)


def test_the_gateway_gets_a_cpu_of_its_own_when_there_are_two_or_more() -> None:
    assert Pinning.plan([3]) == Pinning((), ())  # one CPU: nothing pinned
    assert Pinning.plan([2, 0, 1]) == Pinning((0,), (1, 2))
    assert Pinning.plan([5, 4]).as_json() == {"gateway": [4], "client_and_simulators": [5]}


def _slice_ns() -> int | None:
    """This thread's scheduler slice as the kernel reports it (None: not reported here)."""
    try:
        with open("/proc/thread-self/sched") as stats:
            for line in stats:
                name, _, value = line.partition(":")
                if name.strip() == "se.slice":
                    return int(float(value))
    except OSError:
        return None
    return None


T = TypeVar("T")


def _in_a_thread(work: Callable[[], T]) -> T:
    """`work` run in a thread of its own (so a policy it sets is not the test runner's)."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join()
    return out[0]


def test_the_load_client_asks_a_short_slice_while_it_times_one_request_at_a_time() -> None:
    """The slice the c=1 pass runs with, and the kernel's default again after it; a thread
    started meanwhile gets the default (reset on fork), not the short slice."""

    def work() -> tuple[int | None, int | None, int | None, int | None, int | None]:
        started: list[int | None] = []
        before = _slice_ns()
        with short_slice(100_000) as taken:
            inside = _slice_ns()
            thread = threading.Thread(target=lambda: started.append(_slice_ns()))
            thread.start()
            thread.join()
        return taken, before, inside, started[0], _slice_ns()

    taken, before, inside, in_thread, after = _in_a_thread(work)
    if taken is None or before is None:
        pytest.skip("the kernel took no slice here, or does not report it")
    assert taken == 100
    assert inside == 100_000 != before
    assert in_thread == before
    assert after == before


class _IgnoringKernel:
    """What a kernel before 6.12 does with the calls: takes the slice, holds none."""

    def syscall(self, *_: object) -> int:
        return 0


def test_a_slice_the_kernel_does_not_hold_is_not_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ctypes.CDLL", lambda *_, **__: _IgnoringKernel())
    monkeypatch.setattr(speed, "_sched_calls", lambda: (314, 315))
    monkeypatch.setattr("os.sched_getscheduler", lambda _: os.SCHED_OTHER)
    with short_slice() as taken:
        assert taken is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduler policies: Linux")
def test_a_thread_under_another_policy_is_left_as_it_is() -> None:
    def work() -> tuple[int | None, int]:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        with short_slice() as taken:
            pass
        return taken, os.sched_getscheduler(0)

    assert _in_a_thread(work) == (None, os.SCHED_BATCH)


def test_cpu_per_request_comes_from_the_gateways_own_cpu_time() -> None:
    row = {"requests": 2000, "gateway_process": {"cpu_s": 4.0, "peak_rss_mb": 72.5}}
    assert cost_row(row) == {"cpu_ms_per_request": 2.0, "peak_rss_mb": 72.5}
    assert cost_row({"requests": 10, "gateway_process": None}) == {
        "cpu_ms_per_request": None, "peak_rss_mb": None}


def sample(index: int, ttft: float | None, *, ok: bool = True, events: int = 23) -> Sample:
    return Sample(index, ok, ttft, 1.0, None if ok else "x", events=events)


def test_ttft_summary_and_events_delivered() -> None:
    samples = [sample(i, 0.001 * (i + 1)) for i in range(100)] + [sample(100, None, ok=False)]
    summary = ttft_summary(samples)
    assert summary["requests"] == 101 and summary["ok"] == 100
    assert summary["ttft_p50_ms"] == 50.5
    assert events_delivered([sample(0, 0.1, events=21), sample(1, 0.1, events=23)]) == (21, 23)
    assert events_delivered([sample(0, None, ok=False)]) is None


def _spread(n: int, median_ms: float, width_ms: float = 0.1) -> list[float]:
    """n sorted TTFTs (seconds) evenly spread over `width_ms` around `median_ms`."""
    return [(median_ms + width_ms * (i / (n - 1) - 0.5)) / 1000.0 for i in range(n)]


def rows_for_overhead(direct_rps: float = 1500.0, requests: int = 1000
                      ) -> dict[str, dict[str, Any]]:
    def row(mode: str, c1: float, cpu: float | None, rps: float) -> dict[str, Any]:
        return {"mode": mode, "requests": requests, "concurrency": 50, "requests_per_s": rps,
                "c1": {"requests": 100, "ttft_p50_ms": c1, "_ttfts": _spread(100, c1)},
                "cost": {"cpu_ms_per_request": cpu, "peak_rss_mb": None if cpu is None else 70.0}}

    return {"direct": row("direct", 1.0, None, direct_rps),
            "hedging-on": row("hedging-on", 1.8, 1.1, 750.0)}


def test_overhead_targets_read_the_c1_pass_and_the_cost() -> None:
    rows = rows_for_overhead()
    comparison = compare_costs(rows)
    assert comparison["hedging-on_added_ttft_c1_p50_ms"] == 0.8
    got = {t["target"]: (t["value"], t["met"]) for t in targets("overhead", rows, comparison)}
    assert got == {
        "gateway CPU <= 1.2 ms per request at c=50": (1.1, True),
        ">= 700 req/s at c=50": (750.0, True),
        "added median TTFT at c=1 <= 1.0 ms": (pytest.approx(0.8), True),
        "gateway peak RSS <= 100 MB at c=50": (70.0, True),
    }


def test_a_rate_is_judged_only_on_a_long_pass_that_the_load_side_can_drive() -> None:
    def rate(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
        found = [t for t in targets("overhead", rows, compare_costs(rows))
                 if t["target"] == ">= 700 req/s at c=50"]
        return found[0]

    short = rate(rows_for_overhead(requests=300))  # 6 rounds of 50
    assert short["met"] is None
    assert short["not_judged"] == ("sample too small: n=300 at concurrency 50 is 6 rounds; "
                                   "a rate needs >= 10")
    slow_load = rate(rows_for_overhead(direct_rps=494.0))
    assert slow_load["met"] is None and "only 494 req/s without the gateway" in \
        slow_load["not_judged"]
    assert rate(rows_for_overhead())["met"] is True


def test_streams_need_every_stream_and_every_event() -> None:
    def stream_row(p99: float, events: tuple[int, int], ok: int = 1000,
                   concurrency: int = 1000) -> dict[str, Any]:
        return {"ok": ok, "requests": 1000, "concurrency": concurrency, "ttft_ms": {"p99": p99},
                "_ttfts": _spread(1000, p99, 20.0), "events_delivered": events,
                "cost": {"peak_rss_mb": 120.0}}

    direct = stream_row(300.0, (23, 23))
    rows = {"direct": direct, "hedging-on": stream_row(500.0, (22, 23))}
    got = {t["target"]: t for t in targets("streams", rows, compare_costs(rows))}
    assert {name: t["met"] for name, t in got.items()} == {
        "every stream complete, every token delivered": False,
        "TTFT p99 within 250 ms of direct": None, "gateway peak RSS <= 300 MB": True}
    # 1,000 streams started at once are one burst: one draw, whatever its p99 reads
    assert got["TTFT p99 within 250 ms of direct"]["not_judged"] == (
        "sample too small: n=1; 1000 requests started together are 1 burst")
    rows["hedging-on"] = stream_row(500.0, (23, 23), ok=999)
    met = {t["target"]: t["met"] for t in targets("streams", rows, compare_costs(rows))}
    assert met["every stream complete, every token delivered"] is False
    rows["hedging-on"] = stream_row(500.0, (23, 23))
    met = {t["target"]: t["met"] for t in targets("streams", rows, compare_costs(rows))}
    assert met["every stream complete, every token delivered"] is True
    # streams that did not all start together are independent draws: decided
    rows = {"direct": stream_row(300.0, (23, 23), concurrency=100),
            "hedging-on": stream_row(500.0, (23, 23), concurrency=100)}
    met = {t["target"]: t["met"] for t in targets("streams", rows, compare_costs(rows))}
    assert met["TTFT p99 within 250 ms of direct"] is True


def test_per_request_costs_of_every_process() -> None:
    row: dict[str, Any] = {"requests": 1000, "processes": {
        "client": {"cpu_s": 0.3, "reads": 6100, "writes": 1000},
        "sim-a": {"cpu_s": 0.55, "reads": 1000, "writes": 54000},
        "sim-b": {"cpu_s": 0.01, "reads": 0, "writes": 0},  # idle: no call counts shown
        "machine": {"busy_pct": 90.0, "cpu_s": 3.0}}}
    assert per_request_costs(row) == (
        "CPU ms client 0.300, sim-a 0.550, sim-b 0.010; "
        "system calls read/write client 6.1/1.0, sim-a 1.0/54.0")
    assert per_request_costs({"requests": 0, "processes": row["processes"]}) == ""
    assert per_request_costs({"requests": 5}) == ""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_pinning_a_started_child_pins_every_thread_and_descendant() -> None:
    """A gateway starts on every CPU and is pinned once ready: by then it may run threads
    and worker processes, and each must land on the gateway's CPUs, not just its main thread."""
    code = ("import subprocess, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(30)\n")
    cpus = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild: int | None = None
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        pin_tree(proc.pid, {cpus[0]})
        tasks = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tasks) >= 2  # the main thread and the sleeper
        assert all(os.sched_getaffinity(t) == {cpus[0]} for t in tasks)
        assert os.sched_getaffinity(grandchild) == {cpus[0]}
    finally:
        proc.kill()
        proc.wait()
        if grandchild is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)
