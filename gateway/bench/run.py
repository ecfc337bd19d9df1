"""`hedge-gateway bench`: the benchmark of SPEC §14, over real loopback sockets.

Every part runs as a real server in its own process, so that what the bench measures is what
a deployment would see: two simulated backends (`gateway.bench.upstream`, one child process each),
the gateway (`hedge-gateway serve --config <generated yaml>`, one child per gateway mode, its
CPU and RSS sampled with psutil), and the load client in this process
(`gateway.bench.load`). Each workload runs in four modes, one after the other:

- `direct`: every request straight to backend A (the baseline for the gateway's own cost);
- `hedging-off`: through the gateway with `hedging: {enabled: false}`;
- `hedging-on`: through the gateway with the default adaptive hedging;
- `oracle`: best-of-two, each request sent to both backends at once, first token wins.

Seeding: the TTFT of request *i* on backend *b* is a pure function of (seed, b, i) (see
`gateway.bench.upstream`), so every mode and every run with the same seed sees exactly the same
latencies per backend and request, whatever the arrival order under concurrency. What still
differs between modes is routing: the gateway's balancer sends some requests to backend B,
whose draws are independent of A's. The gateway's added latency is therefore given two ways:
the difference of medians against `direct`, and the median of per-request differences over
the requests the gateway served from backend A with one attempt (the same draw on both sides).

Children (`gateway.bench.procs`) are always ended (terminate, then kill) when the bench ends,
fails, or gets Ctrl-C or SIGTERM. The numbers and tables are `gateway.bench.report`'s, the
command line `gateway.cli`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import httpx
import yaml

from gateway.bench import report
from gateway.bench.load import CHAT_BODY, Progress, Send, best_of, run_load, stream_one
from gateway.bench.oracle import best_single_hedge, format_shares, share_targets
from gateway.bench.procs import ChildFailed, Children, ProcessMeter, free_port, machine, wait_ready
from gateway.bench.upstream import profile_to_json, request_ttft
from gateway.settings import BudgetSettings, SimProfile

POOL = "bench"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    profile: SimProfile
    requests: int
    concurrency: int
    #: requests per mode with --quick
    quick_requests: int
    #: seconds added to every backend's TTFT for the middle of the run; 0 means no outage
    outage_extra: float = 0.0
    #: the outage covers these fractions of the request indexes
    outage_span: tuple[float, float] = (1 / 3, 2 / 3)
    #: simulated backends behind the gateway (the oracle races all of them)
    backends: int = 2
    #: the modes this workload runs (None: the plan's)
    modes: tuple[str, ...] | None = None
    #: the gateway's `delay.window` in seconds (None: the default 60 s)
    delay_window: float | None = None
    #: report the best single-hedge policy at the budget, from the seeded draws (SPEC §20)
    single_hedge: bool = False


_STRAGGLERS = SimProfile(ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.03,
                         straggler_extra=1.5, tokens=30, inter_token=0.005)

#: the slow shares of SPEC §20's straggler workloads
SLOW_SHARES = (3, 6, 10)
#: their delay window: 4,000 requests at 30 to 100 a second span 2 to 7 windows of 20 s, so
#: the delay settles and the run measures the settled rule, not the first minute
SHARE_DELAY_WINDOW = 20.0


def _share_workload(percent: int) -> Workload:
    return Workload(
        f"stragglers-{percent}", f"as stragglers, with {percent} % stragglers +1500 ms; "
        f"delay.window {SHARE_DELAY_WINDOW:g} s",
        dataclasses.replace(_STRAGGLERS, straggler_probability=percent / 100),
        requests=4000, concurrency=20, quick_requests=300,
        modes=("hedging-off", "hedging-on"), delay_window=SHARE_DELAY_WINDOW, single_hedge=True)


WORKLOADS: tuple[Workload, ...] = (
    Workload("stragglers", "lognormal TTFT (median 150 ms, sigma 0.25), 3 % stragglers +1500 ms,"
             " 30 tokens at 5 ms", _STRAGGLERS, requests=600, concurrency=20, quick_requests=100),
    Workload("outage", "as stragglers, but both backends +1500 ms for the middle third",
             _STRAGGLERS, requests=600, concurrency=20, quick_requests=60, outage_extra=1.5),
    Workload("overhead", "zero-latency backends (TTFT 0, inter-token 0), 50 tokens",
             SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0,
                        straggler_extra=0.0, tokens=50, inter_token=0.0),
             requests=2000, concurrency=50, quick_requests=150),
    Workload("pushback", "3 backends, TTFT median 150 ms (no stragglers), each answering 3 % "
             "with 503 + Retry-After: 1", SimProfile(
                 ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.0,
                 straggler_extra=0.0, tokens=30, inter_token=0.005, fail_probability=0.03,
                 fail_status=503),
             requests=600, concurrency=16, quick_requests=150, backends=3),
    *(_share_workload(percent) for percent in SLOW_SHARES),
)
#: `--workload` names that stand for several workloads
WORKLOAD_GROUPS = {"slow-shares": tuple(f"stragglers-{p}" for p in SLOW_SHARES)}


@dataclass(frozen=True, slots=True)
class BenchPlan:
    workloads: tuple[Workload, ...]
    seed: int = 1
    modes: tuple[str, ...] = report.MODES
    #: where the progress bar goes (None: nowhere)
    progress: TextIO | None = None
    #: where each workload's table is printed as soon as it is done (None: nowhere)
    tables: TextIO | None = None
    request_timeout: float = 60.0


def gateway_config(port: int, sim_ports: Sequence[int], hedging: bool,
                   delay_window: float | None = None) -> str:
    backends = [
        {"name": f"sim-{chr(97 + k)}", "provider": "openai", "model": "sim",
         "base_url": f"http://127.0.0.1:{p}/v1", "group": f"zone-{chr(97 + k)}"}
        for k, p in enumerate(sim_ports)
    ]
    pool: dict[str, Any] = {"name": POOL, "backends": backends}
    if delay_window is not None:
        pool["hedging"] = {"delay": {"window": delay_window}}
    config = {"server": {"host": "127.0.0.1", "port": port}, "hedging": {"enabled": hedging},
              "pools": [pool]}
    return yaml.safe_dump(config, sort_keys=False)


@dataclass(slots=True)
class _Context:
    plan: BenchPlan
    children: Children
    client: httpx.AsyncClient
    sims: list[str]
    sim_ports: list[int]
    sim_pids: list[int]


async def _start_gateway(ctx: _Context, mode: str, workload: Workload
                         ) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    path = os.path.join(ctx.children.logdir, f"gateway-{mode}.yaml")
    with open(path, "w", encoding="utf-8") as file:
        file.write(gateway_config(port, ctx.sim_ports[:workload.backends],
                                  hedging=mode == "hedging-on",
                                  delay_window=workload.delay_window))
    proc = ctx.children.start(f"gateway-{mode}", [
        sys.executable, "-m", "gateway.cli", "serve", "--config", path, "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "warning"])
    return f"http://127.0.0.1:{port}", proc


async def _hedge_stats(client: httpx.AsyncClient, base: str) -> object:
    """The gateway's `/hedge/stats` document, or None when it has none."""
    try:
        response = await client.get(f"{base}/hedge/stats", timeout=5.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _run_mode(ctx: _Context, workload: Workload, mode: str, requests: int,
                    concurrency: int, gateway: tuple[str, subprocess.Popen[bytes]] | None,
                    ) -> dict[str, Any]:
    client, sims = ctx.client, ctx.sims[:workload.backends]
    outage = {"start": int(requests * workload.outage_span[0]),
              "end": int(requests * workload.outage_span[1]),
              "extra_ms": workload.outage_extra * 1000.0}
    resets = await asyncio.gather(*(
        client.post(f"{s}/bench/reset", json={
            "profile": profile_to_json(workload.profile), "seed": ctx.plan.seed,
            "backend": chr(97 + k), "outage": outage})
        for k, s in enumerate(sims)))
    for response in resets:
        response.raise_for_status()
    direct_body = {**CHAT_BODY, "model": "sim"}
    send: Send
    if mode == "direct":
        url = f"{ctx.sims[0]}/v1/chat/completions"
        send = lambda c, i: stream_one(c, url, i, body=direct_body)  # noqa: E731
    elif mode == "oracle":
        urls = [f"{s}/v1/chat/completions" for s in sims]
        send = lambda c, i: best_of(c, urls, i, body=direct_body)  # noqa: E731
    elif gateway is not None:
        gw_url, gw_body = f"{gateway[0]}/v1/chat/completions", {**CHAT_BODY, "model": POOL}
        send = lambda c, i: stream_one(c, gw_url, i, body=gw_body)  # noqa: E731
    else:
        raise ValueError(f"unknown mode {mode!r}")
    pids = {"client": os.getpid(),
            **{f"sim-{chr(97 + k)}": p for k, p in enumerate(ctx.sim_pids[:len(sims)])}}
    if gateway is not None:
        pids["gateway"] = gateway[1].pid
    done = asyncio.Event()
    meters: list[ProcessMeter] = []
    samplers: list[asyncio.Task[None]] = []
    baseline: list[object] = []

    async def after_warmup() -> None:
        if gateway is not None:
            baseline.append(await _hedge_stats(client, gateway[0]))
        meters.append(ProcessMeter(pids))
        samplers.append(asyncio.create_task(meters[0].sample_until(done)))

    progress = Progress(ctx.plan.progress, f"{workload.name} / {mode}", requests)
    try:
        samples, warmup, wall = await run_load(requests, concurrency, send, progress=progress,
                                               timeout=ctx.plan.request_timeout,
                                               after_warmup=after_warmup)
    finally:
        done.set()
        for task in samplers:
            await task
    processes = meters[0].result()
    await asyncio.sleep(0.3)  # let the losers' closes reach the simulators' logs
    logs = [(await client.get(f"{s}/bench/log")).json() for s in sims]
    hedge_stats = await _hedge_stats(client, gateway[0]) if gateway is not None else None
    row = report.summarize_mode(mode, samples, wall, [entry["log"] for entry in logs],
                                hedge_stats=hedge_stats,
                                hedge_stats_before=baseline[0] if baseline else None,
                                pool=POOL, process=processes.get("gateway"))
    row["processes"] = processes
    row["warmup"] = {"requests": len(warmup), "errors": sum(not s.ok for s in warmup)}
    row["sim_stats"] = [entry["stats"] for entry in logs]
    row["hedge_stats"] = hedge_stats
    progress.finish(f"ok {row['ok']}, errors {row['errors']}, "
                    f"TTFT p50 {row['ttft_ms']['p50']} ms, p99 {row['ttft_ms']['p99']} ms")
    return row


async def _run_workload(ctx: _Context, workload: Workload, requests: int,
                        concurrency: int) -> dict[str, Any]:
    gateways: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    modes = [m for m in ctx.plan.modes if workload.modes is None or m in workload.modes]
    try:
        for mode in modes:
            if mode in report.GATEWAY_MODES:
                gateways[mode] = await _start_gateway(ctx, mode, workload)
        await asyncio.gather(*(wait_ready(ctx.client, f"{url}/healthz", proc, ctx.children)
                               for url, proc in gateways.values()))
        rows = {mode: await _run_mode(ctx, workload, mode, requests, concurrency,
                                      gateways.get(mode))
                for mode in modes}
    finally:
        for _, proc in gateways.values():
            ctx.children.stop(proc)
    comparison = report.compare(rows)
    if workload.single_hedge:
        comparison["single_hedge"] = _single_hedge(workload, requests, ctx.plan.seed)
    result: dict[str, Any] = {
        "name": workload.name, "description": workload.description,
        "requests": requests, "concurrency": concurrency, "seed": ctx.plan.seed,
        "profile": profile_to_json(workload.profile),
        "outage": ({"extra_ms": workload.outage_extra * 1000, "span": workload.outage_span}
                   if workload.outage_extra > 0 else None),
        "modes": list(rows.values()), "comparison": comparison,
        "targets": report.targets(workload.name, rows, comparison, BudgetSettings())
        + (share_targets(workload.name, rows, comparison) if workload.single_hedge else []),
    }
    if workload.outage_extra > 0 and "hedging-on" in rows:
        result["outage_phases"] = report.outage_phases(rows["hedging-on"], requests,
                                                       workload.outage_span)
    if ctx.plan.tables is not None:
        print(report.format_workload(result) + "\n", file=ctx.plan.tables, flush=True)
    return result


def _single_hedge(workload: Workload, requests: int, seed: int) -> dict[str, Any]:
    """The best single-hedge policy at the default budget over this run's seeded draws:
    backend a's TTFT as the primary, backend b's as the hedge (SPEC §20)."""
    pairs = [(request_ttft(workload.profile, seed, "a", i), request_ttft(workload.profile, seed,
                                                                          "b", i))
             for i in range(requests)]
    ratio = BudgetSettings().ratio
    best = best_single_hedge(pairs, ratio, (0.5, 0.99))
    return {"ratio": ratio, "delay_ms": round(best.delay * 1000.0, 3), "hedged": best.hedged,
            "ttft_p50_ms": round(best.ttft[0] * 1000.0, 3),
            "ttft_p99_ms": round(best.ttft[1] * 1000.0, 3)}


async def _run(plan: BenchPlan, children: Children, sizes: Sequence[tuple[int, int]]
               ) -> list[dict[str, Any]]:
    """Start the simulators, then run each workload; the load uses its own clients."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:  # control calls
        ports = [free_port() for _ in range(max(w.backends for w in plan.workloads))]
        procs = [children.start(f"sim-{chr(97 + k)}", [
            sys.executable, "-m", "gateway.bench.upstream", "--port", str(p)])
            for k, p in enumerate(ports)]
        sims = [f"http://127.0.0.1:{p}" for p in ports]
        await asyncio.gather(*(wait_ready(client, f"{s}/v1/models", proc, children)
                               for s, proc in zip(sims, procs, strict=True)))
        ctx = _Context(plan, children, client, sims, ports, [p.pid for p in procs])
        return [await _run_workload(ctx, w, n, c)
                for w, (n, c) in zip(plan.workloads, sizes, strict=True)]


def run_bench(plan: BenchPlan, *, requests: int | None = None, concurrency: int | None = None,
              quick: bool = False) -> dict[str, Any]:
    """Run every workload of `plan` in every mode; the whole report, JSON-ready."""
    sizes = [(requests or (w.quick_requests if quick else w.requests), concurrency or w.concurrency)
             for w in plan.workloads]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hedge-bench-") as logdir:
        children = Children(logdir)
        try:
            workloads = asyncio.run(_run(plan, children, sizes))
        finally:
            children.close()
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": round(time.time() - started, 1), "machine": machine(),
            "seed": plan.seed, "quick": quick, "modes": list(plan.modes),
            "workloads": workloads}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_bench_command(plan: BenchPlan, *, out: str | None, requests: int | None = None,
                      concurrency: int | None = None, quick: bool = False) -> int:
    """`hedge-gateway bench` once its options are parsed: run `plan`, print the tables, write
    the JSON report to `out` (default bench-results/<time>.json); the exit status."""
    out = out or os.path.join("bench-results", time.strftime("%Y%m%d-%H%M%S") + ".json")
    info = machine()
    print(f"hedge-gateway bench: {', '.join(w.name for w in plan.workloads)}; "
          f"{info['nproc']} CPUs ({info['cpu_model']}), Python {info['python']}",
          file=sys.stderr)
    # SIGTERM ends the bench like Ctrl-C does, so that its children are stopped too.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run_bench(plan, requests=requests, concurrency=concurrency, quick=quick)
    except ChildFailed as exc:
        print(f"hedge-gateway bench: a child server failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nhedge-gateway bench: interrupted; every child process was stopped",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    shares = format_shares(result["workloads"])
    if shares:
        print(shares)
    report.write_json(out, result)
    print(f"JSON report: {out}")
    return 0



def run_soak_command(*, duration: float | None, quick: bool, concurrency: int | None, seed: int,
                     out: str | None, progress: bool) -> int:
    """`--workload soak`: both gateways side by side under faults (`gateway.bench.soak`);
    exit 1 when a request hung or ended silently, or a socket was left behind."""
    from gateway.bench import soak

    seconds = duration if duration is not None else (20.0 if quick else 600.0)
    plan = soak.SoakPlan(duration=seconds, concurrency=concurrency or 8, seed=seed,
                         sample_every=max(1.0, min(10.0, seconds / 60)),
                         progress=sys.stderr if progress else None)
    out = out or os.path.join("bench-results", "soak-" + time.strftime("%Y%m%d-%H%M%S")
                              + ".json")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="hedge-soak-") as logdir:
            result = soak.run_soak(plan, logdir)
    except ChildFailed as exc:
        print(f"hedge-gateway bench: a child server failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nhedge-gateway bench: interrupted; every child process was stopped",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(soak.format_soak(result))
    report.write_json(out, result)
    print(f"JSON report: {out}")
    return 0 if soak.clean(result) else 1
