"""The bench's cost figures: where each process runs, and what the gateway costs.

- **Pinning.** With two or more usable CPUs the gateway gets the first one to itself and the
  load client and the simulators share the others, so the gateway's figures are not those of
  a process fighting its own load generator for a core. With one CPU nothing is pinned.
- **CPU ms per request**: the gateway process's own CPU time (user + system, from the kernel's
  counters) over the measured pass, divided by its requests. Robust on a shared machine:
  other load slows the run down but does not bill its CPU to the gateway.
- **Added median TTFT at c=1**: a short pass at concurrency 1 per mode, before the main one,
  against the same pass sent direct. At c=50 the median mostly measures queueing on a
  saturated machine, not the gateway; at c=1 there is no queue. During that pass the load
  client asks the kernel for a short scheduler slice (`short_slice`): it shares its CPU with
  the simulators, and with the default slice a simulator writing its whole zero-delay stream
  keeps the CPU for its burst while the client's first event waits (the longer, the less
  often the proxy in front writes to it). The client would then time the kernel's choice,
  not the proxy: a short slice lets it run when its bytes arrive, in every mode.
- **Targets** of the `overhead` and `streams` workloads, each with its value: met, missed,
  or not judged when the run cannot decide it (`gateway.bench.judge`).

Pure functions over the rows the bench collected, plus the affinity and scheduler calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from gateway.bench import judge
from gateway.bench.load import Sample
from gateway.bench.report import ttft_estimate
from gateway.bench.rows import TTFT_QUANTILES, quantile
from gateway.bench.variants import KEYS_MODE, OVER_HEDGING_ON, TRANSLATED_MODE


@dataclass(frozen=True, slots=True)
class Pinning:
    """CPU sets: the gateway's own, and everyone else's (empty: not pinned)."""

    gateway: tuple[int, ...]
    others: tuple[int, ...]

    @classmethod
    def plan(cls, usable: Sequence[int] | None = None) -> Pinning:
        cpus = sorted(usable if usable is not None else os.sched_getaffinity(0))
        if len(cpus) < 2:
            return cls((), ())
        return cls((cpus[0],), tuple(cpus[1:]))

    def as_json(self) -> dict[str, list[int]]:
        return {"gateway": list(self.gateway), "client_and_simulators": list(self.others)}


#: the scheduler slice the load client asks for while it times one request at a time
CLIENT_SLICE_NS = 100_000
#: `sched_setattr`'s and `sched_getattr`'s system call numbers, where the bench knows them
_SCHED_CALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
#: children (threads and processes) started by a thread with this flag get the defaults
_SCHED_FLAG_RESET_ON_FORK = 0x01


class _SchedAttr(ctypes.Structure):
    """`struct sched_attr` as its first version (48 bytes) lays it out."""

    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32),
                ("flags", ctypes.c_uint64), ("nice", ctypes.c_int32),
                ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64)]


def _sched_calls() -> tuple[int, int] | None:
    """The two system calls' numbers here; None where the bench does not know them (another
    system, another architecture, a 32-bit Python, whose numbers differ)."""
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    return _SCHED_CALLS.get(platform.machine())


def _set_slice(calls: tuple[int, int], runtime_ns: int) -> int | None:
    """Set this thread's scheduler slice (0: the kernel's default) and read it back: the
    slice the kernel holds now, None when it refused either call. Linux's EEVDF scheduler
    (6.12 and later) reads `sched_runtime` as the slice of a default-policy task, and a woken
    task whose slice is shorter than the running one's preempts it; an older kernel takes the
    call, ignores the value and reads back 0. A short slice is set with reset-on-fork, so a
    thread or a process started meanwhile gets the default; the default is set without it."""
    set_call, get_call = calls
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _SchedAttr(ctypes.sizeof(_SchedAttr), os.SCHED_OTHER,
                      _SCHED_FLAG_RESET_ON_FORK if runtime_ns else 0,
                      os.getpriority(os.PRIO_PROCESS, 0), 0, runtime_ns, 0, 0)
    if int(libc.syscall(set_call, 0, ctypes.byref(attr), 0)) != 0:
        return None
    held = _SchedAttr()
    if int(libc.syscall(get_call, 0, ctypes.byref(held), ctypes.sizeof(held), 0)) != 0:
        return None
    return int(held.runtime)


@contextlib.contextmanager
def short_slice(runtime_ns: int = CLIENT_SLICE_NS) -> Iterator[int | None]:
    """Run the block with this thread's scheduler slice at `runtime_ns`, the kernel's
    default again after; yields the slice in µs when the kernel holds it (read back), None
    when it does not: another system, an older kernel, a refusal, or a thread that does not
    run under the default policy (left as it is). See the module docstring for why the load
    client asks it while it times one request at a time."""
    calls = _sched_calls()
    if calls is None or os.sched_getscheduler(0) != os.SCHED_OTHER:
        yield None
        return
    try:
        held = _set_slice(calls, runtime_ns)
        yield runtime_ns // 1000 if held == runtime_ns else None
    finally:
        _set_slice(calls, 0)


def ttft_summary(samples: Sequence[Sample]) -> dict[str, Any]:
    """TTFT quantiles (ms) of the successful samples, how many there were, and (private, for
    the targets' intervals) the sorted TTFTs themselves."""
    ttfts = sorted(s.ttft for s in samples if s.ok and s.ttft is not None)
    out: dict[str, Any] = {"requests": len(samples), "ok": len(ttfts), "_ttfts": ttfts}
    for name, q in TTFT_QUANTILES:
        value = quantile(ttfts, q)
        out[f"ttft_{name}_ms"] = None if value is None else round(value * 1000.0, 3)
    return out


def cost_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """The gateway's CPU ms per request and peak RSS of one measured pass (None: no gateway)."""
    proc = row.get("gateway_process")
    n = row.get("requests") or 0
    if not isinstance(proc, Mapping) or not n:
        return {"cpu_ms_per_request": None, "peak_rss_mb": None}
    return {"cpu_ms_per_request": round(1000.0 * float(proc["cpu_s"]) / n, 3),
            "peak_rss_mb": proc.get("peak_rss_mb")}


def per_request_costs(row: Mapping[str, Any]) -> str:
    """Each process's CPU ms and read/write system calls per measured request, on one line
    ('' without process figures). CPU per request stays meaningful on a busy machine, where
    req/s does not; the system calls show how many events each read picked up (a zero-delay
    stream read as it is written costs a read per event; read late, several per read)."""
    procs, n = row.get("processes") or {}, row.get("requests") or 0
    named = {k: v for k, v in procs.items() if k != "machine" and isinstance(v, Mapping)}
    if not n or not named:
        return ""
    cpu = ", ".join(f"{k} {1000.0 * float(v['cpu_s']) / n:.3f}" for k, v in named.items())
    calls = ", ".join(f"{k} {v['reads'] / n:.1f}/{v['writes'] / n:.1f}"
                      for k, v in named.items() if "reads" in v and v["cpu_s"] > 0.05)
    return f"CPU ms {cpu}; system calls read/write {calls}"


def events_delivered(samples: Sequence[Sample]) -> tuple[int, int] | None:
    """(min, max) `data:` events per successful stream, None when none succeeded."""
    counts = [s.events for s in samples if s.ok]
    return (min(counts), max(counts)) if counts else None


def _num(node: Any, *path: str) -> float | None:
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return float(node) if isinstance(node, int | float) and not isinstance(node, bool) else None


def compare_costs(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per gateway mode: added TTFT at c=1 (p50) against direct, CPU ms per request, RSS."""
    out: dict[str, Any] = {}
    direct_c1 = _num(rows.get("direct"), "c1", "ttft_p50_ms")
    for mode, row in rows.items():
        if mode == "direct" or mode == "oracle":
            continue
        c1 = _num(row, "c1", "ttft_p50_ms")
        if c1 is not None and direct_c1 is not None:
            out[f"{mode}_added_ttft_c1_p50_ms"] = round(c1 - direct_c1, 3)
        cost = row.get("cost") or {}
        out[f"{mode}_cpu_ms_per_request"] = cost.get("cpu_ms_per_request")
        out[f"{mode}_peak_rss_mb"] = cost.get("peak_rss_mb")
    return out | over_floor(out, rows) | over_hedging_on(out)


#: what each variant mode of `OVER_HEDGING_ON` (`keys-1000`, `translated`) has its CPU per
#: request divided by: the same gateway and client requests without the variant's change
BESIDE_BASE = "hedging-on"
#: the bound on each such ratio
BESIDE_BOUND = 1.10
#: the least gateway CPU seconds of each of the two passes for a ratio to be judged: the
#: kernel counts CPU time in ticks of 10 ms, so a second of it resolves the ratio to about
#: 1 %, a tenth of the margin judged
BESIDE_MIN_CPU_S = 1.0


def beside_short(rows: Mapping[str, Mapping[str, Any]], mode: str) -> str | None:
    """Why this run cannot judge `mode`'s ratio over `BESIDE_BASE` (None: it can): a pass
    whose gateway used less CPU than `BESIDE_MIN_CPU_S` measures it in too few ticks to tell
    10 % apart."""
    short = []
    for each in (BESIDE_BASE, mode):
        cpu = _num(rows.get(each), "gateway_process", "cpu_s")
        if cpu is None or cpu < BESIDE_MIN_CPU_S:
            short.append(f"{each} {'no' if cpu is None else f'{cpu:.2f}'}")
    if not short:
        return None
    return (f"gateway CPU s too short to resolve 10 %: {', '.join(short)}; needs "
            f">= {BESIDE_MIN_CPU_S:g} s each")


def beside_key(mode: str) -> str:
    """The comparison's key of `mode`'s CPU per request over `BESIDE_BASE`'s."""
    return f"{mode}_cpu_ms_per_request_over_{BESIDE_BASE}"


def beside_target(mode: str) -> str:
    """The target `mode`'s ratio over `BESIDE_BASE` is judged by."""
    return f"{mode} CPU per request <= {BESIDE_BOUND:.2f} x {BESIDE_BASE}'s"


def cpu_read(value: object) -> TypeGuard[float]:
    """Whether a CPU figure was read: a number above zero. Zero is a pass shorter than one
    tick of the process clock (10 ms), not a free one, and divides nothing."""
    return isinstance(value, int | float) and value > 0


def over_hedging_on(costs: Mapping[str, Any]) -> dict[str, Any]:
    """Each variant mode's CPU per request (`OVER_HEDGING_ON`) as a multiple of
    hedging-on's, when the run has both and both were read (`cpu_read`)."""
    base = costs.get(f"{BESIDE_BASE}_cpu_ms_per_request")
    if not cpu_read(base):
        return {}
    out: dict[str, Any] = {}
    for mode in OVER_HEDGING_ON:
        cpu = costs.get(f"{mode}_cpu_ms_per_request")
        if cpu_read(cpu):
            out[beside_key(mode)] = round(cpu / base, 3)
    return out


def beside_check(row: Mapping[str, Any]) -> str | None:
    """The line under a variant mode's ratio that says the row ran with its change: the
    keys its gateway loaded and counted, the requests it translated. None for another."""
    mode = row.get("mode")
    if mode == KEYS_MODE:
        seen = row.get("keys") or {}
        return (f"{KEYS_MODE}: {seen.get('configured')} keys configured, loaded by the "
                f"gateway: {seen.get('gateway_loaded_it')}; its key's requests counted "
                f"{seen.get('requests_counted')} of {seen.get('requests_sent')} sent")
    if mode == TRANSLATED_MODE:
        seen = row.get("translated") or {}
        return (f"{TRANSLATED_MODE}: {seen.get('route')} counted by the gateway "
                f"{seen.get('requests_translated')} of {seen.get('requests_sent')} sent")
    return None


#: the mode every other is divided by when the run has it (`bench --nginx`), and the one the
#: targets are judged against
FLOOR = "nginx"
#: the floor of this stack (`bench --passthrough`): the gateway's modes are divided by it
#: too, which splits their cost into the stack's own and the gateway's on top of it
STACK_FLOOR = "passthrough"


def over_floor(costs: Mapping[str, Any], rows: Mapping[str, Any]) -> dict[str, Any]:
    """Each mode's CPU per request and added TTFT at c=1 as multiples of each floor's the run
    has (nginx's: every other mode's; the pass-through's: each gateway mode's), when the
    floor's figure is positive and, for CPU, the mode's was read (`cpu_read`; an added TTFT
    of zero or less is a measurement, and divides)."""
    out: dict[str, Any] = {}
    for floor_mode, others in ((FLOOR, {FLOOR}), (STACK_FLOOR, {FLOOR, STACK_FLOOR})):
        for figure in ("cpu_ms_per_request", "added_ttft_c1_p50_ms"):
            floor = costs.get(f"{floor_mode}_{figure}")
            if not isinstance(floor, int | float) or floor <= 0:
                continue
            for mode in rows:
                value = costs.get(f"{mode}_{figure}")
                if mode in others or not isinstance(value, int | float):
                    continue
                if figure == "cpu_ms_per_request" and not cpu_read(value):
                    continue
                out[f"{mode}_{figure}_over_{floor_mode}"] = round(value / floor, 2)
    return out


def targets(workload: str, rows: Mapping[str, Mapping[str, Any]],
            comparison: Mapping[str, Any], mode: str = "hedging-on") -> list[dict[str, Any]]:
    """The speed targets of `overhead` and `streams` (and the stragglers' p99), measured on
    `mode`: met, missed, or not judged when this run cannot decide them (`gateway.bench.judge`:
    a p99 needs 1,000 independent requests, 1,000 streams started together are one burst, a
    rate needs a long enough pass and a load side that reaches it)."""
    result: list[dict[str, Any]] = []
    row, direct = rows.get(mode) or {}, rows.get("direct") or {}
    pair = judge.PAIR_CONFIDENCE

    def add(name: str, value: float | None, bound: float) -> None:
        result.append(judge.measured(name, value, None if value is None else value <= bound))

    if workload == "overhead":
        add("gateway CPU <= 1.2 ms per request at c=50",
            comparison.get(f"{mode}_cpu_ms_per_request"), 1.2)
        rate = _num(row, "requests_per_s")
        short = judge.throughput_short(int(row.get("requests") or 0),
                                       int(row.get("concurrency") or 1),
                                       _num(direct, "requests_per_s"), 700.0)
        result.append(judge.measured(">= 700 req/s at c=50", rate,
                                     None if rate is None else rate >= 700.0, short))
        result.append(judge.target(
            "added median TTFT at c=1 <= 1.0 ms",
            judge.difference(ttft_estimate(row.get("c1"), 0.5, pair),
                             ttft_estimate(direct.get("c1"), 0.5, pair)), 1.0, at_most=True))
        add("gateway peak RSS <= 100 MB at c=50", comparison.get(f"{mode}_peak_rss_mb"), 100.0)
        if f"{FLOOR}_cpu_ms_per_request" in comparison:  # a run with the floor beside it
            add(f"gateway CPU per request at c=50 <= 5 x {FLOOR}'s",
                comparison.get(f"{mode}_cpu_ms_per_request_over_{FLOOR}"), 5.0)
            add(f"added median TTFT at c=1 <= 2 x {FLOOR}'s",
                comparison.get(f"{mode}_added_ttft_c1_p50_ms_over_{FLOOR}"), 2.0)
        for beside in (m for m in OVER_HEDGING_ON if m in rows):  # beside hedging-on
            ratio = comparison.get(beside_key(beside))
            result.append(judge.measured(
                beside_target(beside), ratio, None if ratio is None else ratio <= BESIDE_BOUND,
                beside_short(rows, beside)))
    elif workload == "streams":
        delivered = row.get("events_delivered")
        expected = direct.get("events_delivered")
        all_there = (row.get("ok") == row.get("requests") and delivered is not None
                     and expected is not None and delivered[0] == expected[1])
        result.append(judge.measured("every stream complete, every token delivered",
                                     row.get("ok"), all_there))
        result.append(judge.target(
            "TTFT p99 within 250 ms of direct",
            judge.difference(ttft_estimate(row, 0.99, pair), ttft_estimate(direct, 0.99, pair)),
            250.0, at_most=True))
        add("gateway peak RSS <= 300 MB", comparison.get(f"{mode}_peak_rss_mb"), 300.0)
    elif workload == "stragglers":
        result.append(judge.target("TTFT p99 <= 460 ms (hedging on)",
                                   ttft_estimate(row, 0.99), 460.0, at_most=True))
    return result


def format_lines(result: Mapping[str, Any]) -> list[str]:
    """The cost lines under a workload's table."""
    lines: list[str] = []
    for row in result["modes"]:
        c1, cost = row.get("c1"), row.get("cost") or {}
        parts = []
        if c1:
            sliced = c1.get("client_slice_us")
            parts.append(f"c=1 TTFT p50 {c1['ttft_p50_ms']} ms, p99 {c1['ttft_p99_ms']} ms "
                         f"({c1['ok']}/{c1['requests']}"
                         + ("" if sliced is None else f"; client slice {sliced} µs") + ")")
        if cost.get("cpu_ms_per_request") is not None:
            parts.append(f"gateway CPU {cost['cpu_ms_per_request']:.3f} ms/request, "
                         f"peak RSS {cost['peak_rss_mb']} MB")
        if row.get("events_delivered"):
            low, high = row["events_delivered"]
            parts.append(f"events per stream {low}..{high}")
        if parts:
            lines.append(f"   {row['mode']}: " + "; ".join(parts))
        per_request = per_request_costs(row)
        if per_request:
            lines.append(f"   {row['mode']}: per request: {per_request}")
    c = result["comparison"]
    for key, value in c.items():
        if key.endswith("_added_ttft_c1_p50_ms"):
            mode = key.removesuffix("_added_ttft_c1_p50_ms")
            lines.append(f"   gateway ({mode}) vs direct at c=1: median TTFT {value:+.3f} ms")
    for floor in (FLOOR, STACK_FLOOR):
        for row in result["modes"]:
            mode = row["mode"]
            cpu = c.get(f"{mode}_cpu_ms_per_request_over_{floor}")
            ttft = c.get(f"{mode}_added_ttft_c1_p50_ms_over_{floor}")
            if cpu is not None or ttft is not None:
                lines.append(f"   {mode} / {floor}: CPU per request x{_times(cpu)}, added "
                             f"TTFT at c=1 x{_times(ttft)}")
    for row in result["modes"]:
        if row["mode"] in OVER_HEDGING_ON:  # its ratio, then what says it ran its change
            ratio = c.get(beside_key(row["mode"]))
            lines.append(f"   {row['mode']} / {BESIDE_BASE}: CPU per request "
                         f"x{'n/a' if ratio is None else f'{ratio:.3f}'}")
            check = beside_check(row)
            if check is not None:
                lines.append(f"   {check}")
    return lines


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
