"""`hedge-gateway bench`: the benchmark, over real loopback sockets.

Every part runs as a real server in its own process, so that what the bench measures is what
a deployment would see: two simulated backends (`gateway.bench.upstream`, one child process each),
the gateway (`hedge-gateway serve --config <generated yaml>`, one child per gateway mode, its
CPU and RSS sampled with psutil), and the load client in this process
(`gateway.bench.load` over `gateway.bench.client`, on uvloop: the client shares a core with the
simulators, so its own CPU must stay small next to theirs). Each workload runs in four
modes, one after the other:

- `direct`: every request straight to backend A (the baseline for the gateway's own cost);
- `hedging-off`: through the gateway with `hedging: {enabled: false}`;
- `hedging-on`: through the gateway with the default adaptive hedging;
- `oracle`: best-of-two, each request sent to both backends at once, first token wins;
- with `--servers`, one more per other front server (`granian`, ...): `hedging-on` under it;
- with `--features`, one more per feature of the request path switched off (`no-affinity`,
  ..., then `all-off`: `gateway.bench.variants`), hedging on otherwise: each feature's cost
  is its row's difference from `hedging-on`;
- with `--keys` (on by default for `--workload overhead`), `keys-1000` right after
  `hedging-on`: hedging on with 1,000 named keys, each with all four limits, the client
  sending one of them (`gateway.bench.variants`); its CPU per request prints over
  hedging-on's (no keys), and the gateway's usage count of the key is read from its store;
- with `--translated` (on by default for `--workload overhead`), `translated` after those:
  hedging on with the same simulators spoken to in Messages (`anthropic`), the same chat
  requests, so every one is translated both ways; its CPU per request prints over
  hedging-on's, and the gateway's `/hedge/stats` count of `chat->messages` beside the
  requests sent;
- with `--nginx`, one more right after `direct`: Debian's nginx as a plain reverse proxy to
  the same simulators (`gateway.bench.servers.nginx_config`), the floor; each gateway mode's
  CPU per request and added TTFT at c=1 are then printed as multiples of nginx's;
- with `--passthrough` (on by default for `--workload overhead`), one more after those:
  uvicorn and aiohttp with nothing of the gateway between them
  (`gateway.bench.passthrough`), the floor of this stack; each gateway mode's CPU and
  added TTFT print over its too, and its own over nginx's.

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
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import httpx
import uvloop
import yaml

from gateway.bench import report, rows, servers, speed, variants
from gateway.bench.load import CHAT_BODY, Progress, Send, best_of, run_load, stream_one
from gateway.bench.oracle import best_single_hedge, share_targets
from gateway.bench.procs import (
    Children,
    ProcessMeter,
    free_port,
    machine,
    pin_tree,
    wait_ready,
)
from gateway.bench.rows import CONTINUATION_MODES
from gateway.bench.subject import (
    POOL,
    baseline_env,
    counted_requests,
    counted_stats,
    gateway_config,
    sim_logs,
)
from gateway.bench.upstream import profile_to_json, request_ttft
from gateway.bench.workloads import Workload
from gateway.settings import BudgetSettings, StallSettings
from gateway.tenants.store import SqliteStore, default_path


@dataclass(frozen=True, slots=True)
class BenchPlan:
    workloads: tuple[Workload, ...]
    seed: int = 1
    modes: tuple[str, ...] = rows.MODES
    #: where the progress bar goes (None: nowhere)
    progress: TextIO | None = None
    #: where each workload's table is printed as soon as it is done (None: nowhere)
    tables: TextIO | None = None
    request_timeout: float = 60.0
    #: another checkout of hedge-gateway whose gateway runs as an extra mode, `baseline`
    baseline_src: str | None = None
    #: `serve --workers` of the gateway under test: >1 checks that its workers
    #: serve and report as one server, and sums their CPU and RSS
    workers: int = 1
    #: the front servers compared: uvicorn serves the standard modes, each other one adds a
    #: mode of its name (`gateway.bench.servers`)
    servers: tuple[str, ...] = ("uvicorn",)
    #: how many times each workload runs, seed after seed: one run's p99 is one draw, and
    #: the spread over several says whether a cut holds every time or only on a good seed
    repeat: int = 1
    #: a mode per feature of the request path switched off (`variants.feature_modes`)
    features: bool = False
    #: the nginx executable: a mode `nginx` after `direct` (None: none)
    nginx: str | None = None
    #: a mode `passthrough` after `direct` (and `nginx`): this stack's floor
    #: (`gateway.bench.passthrough`)
    passthrough: bool = False
    #: a mode `keys-1000` right after `hedging-on` (`variants.KEYS_MODE`)
    keys: bool = False
    #: a mode `translated` right after `hedging-on` and `keys-1000`
    #: (`variants.TRANSLATED_MODE`)
    translated: bool = False

    def over_hedging_on(self) -> tuple[str, ...]:
        """The variant modes this plan runs beside `hedging-on`, divided by it, in the order
        of `variants.OVER_HEDGING_ON`."""
        wanted = {variants.KEYS_MODE: self.keys, variants.TRANSLATED_MODE: self.translated}
        return tuple(mode for mode in variants.OVER_HEDGING_ON if wanted[mode])


def plan_modes(plan: BenchPlan, workload: Workload, quick: bool = False) -> list[str]:
    """The modes of `workload` in the order they run: the plan's that the workload has (with
    `quick`, its `quick_modes` when it names them; then its own continuation modes;
    `nginx` right after `direct`, with `plan.nginx`, then `passthrough` with
    `plan.passthrough`; `keys-1000` then `translated` right
    after `hedging-on`, or last without it, with `plan.keys` and `plan.translated`), then
    one per feature switched off (`features`),
    then `baseline` (with `baseline_src`), then one per other front server (`servers`)."""
    own = workload.quick_modes if quick and workload.quick_modes is not None else workload.modes
    modes = [m for m in plan.modes if own is None or m in own]
    # a workload's own modes beyond the plan's (the `stalls` workload's continuation modes)
    modes += [m for m in own or () if m in rows.CONTINUATION_MODES]
    beside = plan.over_hedging_on()  # next to the mode they are divided by
    at = modes.index("hedging-on") + 1 if "hedging-on" in modes else len(modes)
    modes[at:at] = beside
    floors = [name for name, wanted in ((servers.NGINX, plan.nginx),
                                        (servers.PASSTHROUGH, plan.passthrough)) if wanted]
    at = modes.index("direct") + 1 if "direct" in modes else 0
    modes[at:at] = floors  # next to the other mode without a gateway
    return [*modes, *(variants.feature_modes() if plan.features else ()),
            *(["baseline"] if plan.baseline_src else []),
            *servers.extra_modes(plan.servers)]


@dataclass(slots=True)
class _Context:
    plan: BenchPlan
    children: Children
    client: httpx.AsyncClient
    sims: list[str]
    sim_ports: list[int]
    sim_pids: list[int]
    pinning: speed.Pinning
    quick: bool = False


async def _start_gateway(ctx: _Context, mode: str, workload: Workload
                         ) -> tuple[str, subprocess.Popen[bytes]]:
    """A gateway child for `mode`, with hedging on for every mode but `hedging-off`:
    `baseline` runs the code of `plan.baseline_src` (another checkout), a mode named after a
    front server (`plan.servers`) runs under that server; both side by side in the same run.
    It starts on every CPU (`_run_workload` pins it to the gateway's once it is ready): a
    workload's gateways start together, and on one core their imports queued for a second
    more per workload."""
    port = free_port()
    if mode == servers.NGINX and ctx.plan.nginx:
        prefix = os.path.join(ctx.children.logdir, "nginx")
        os.makedirs(prefix, exist_ok=True)
        conf = os.path.join(prefix, "nginx.conf")
        with open(conf, "w", encoding="utf-8") as file:
            file.write(servers.nginx_config(port, ctx.sim_ports[:workload.backends], prefix))
        proc = ctx.children.start("nginx", servers.nginx_command(ctx.plan.nginx, conf, prefix),
                                  cpus=(*ctx.pinning.gateway, *ctx.pinning.others))
        return f"http://127.0.0.1:{port}", proc
    if mode == servers.PASSTHROUGH:
        proc = ctx.children.start("passthrough", servers.passthrough_command(
            port, ctx.sims[:workload.backends]),
                                  cpus=(*ctx.pinning.gateway, *ctx.pinning.others))
        return f"http://127.0.0.1:{port}", proc
    path = config_path(ctx, mode)
    with open(path, "w", encoding="utf-8") as file:
        file.write(gateway_config(port, ctx.sim_ports[:workload.backends],
                                  hedging=mode != "hedging-off",
                                  delay_window=workload.delay_window,
                                  max_concurrent_requests=workload.max_concurrent_requests,
                                  variant=variants.VARIANTS.get(mode),
                                  continuation=rows.CONTINUATION_MODES.get(mode),
                                  stall_min=workload.stall_min))
    server = mode if mode in ctx.plan.servers else servers.OWN
    argv, env = servers.server_command(server, path, port, workers=ctx.plan.workers)
    cwd = None
    if mode == "baseline" and ctx.plan.baseline_src:
        env, cwd = baseline_env(ctx.plan.baseline_src)
    if _keyed(mode):  # the store its keys open is the run's own, gone with it
        env = {**(env or {}), "XDG_STATE_HOME": state_home(ctx, mode)}
    # every CPU, explicitly: a child inherits this process's pinning to the load side's CPUs
    proc = ctx.children.start(f"gateway-{mode}", argv, env=env, cwd=cwd,
                              cpus=(*ctx.pinning.gateway, *ctx.pinning.others))
    return f"http://127.0.0.1:{port}", proc


def config_path(ctx: _Context, mode: str) -> str:
    """The generated configuration file of gateway mode `mode`."""
    return os.path.join(ctx.children.logdir, f"gateway-{mode}.yaml")


def state_home(ctx: _Context, mode: str) -> str:
    """`XDG_STATE_HOME` of a mode with named keys: where its key store's file is."""
    return os.path.join(ctx.children.logdir, f"state-{mode}")


def _keyed(mode: str) -> bool:
    """Whether `mode`'s configuration names client keys (`keys-1000`)."""
    variant = variants.VARIANTS.get(mode)
    return variant is not None and "keys" in variant.top


def keys_seen(ctx: _Context, mode: str, stats: object) -> dict[str, Any]:
    """What says a keyed mode's gateway ran with its keys: how many its configuration file
    names, whether the configuration the gateway reports (`/hedge/stats` `config.sha256`) is
    that file, and the key the client sends."""
    with open(config_path(ctx, mode), "rb") as file:
        data = file.read()
    configured = yaml.safe_load(data).get("keys") or []
    reported = stats.get("config") if isinstance(stats, dict) else None
    loaded = reported.get("sha256") if isinstance(reported, dict) else None
    return {"configured": len(configured),
            "gateway_loaded_it": loaded == hashlib.sha256(data).hexdigest(),
            "client_key": variants.key_name(variants.BENCH_CLIENT_KEY)}


def key_usage(ctx: _Context, mode: str, name: str) -> int | None:
    """The requests the (stopped) gateway of `mode` counted for key `name` in its store: the
    last batch is written at shutdown. None when there is no store file. Blocking."""
    path = default_path({"XDG_STATE_HOME": state_home(ctx, mode)})
    if not os.path.exists(path):
        return None
    store = SqliteStore(path)
    try:
        return sum(row.requests for row in store.usage(name))
    finally:
        store.close()


def translated_count(stats: object) -> int | None:
    """The requests the bench pool's backends answered through `variants.TRANSLATED_ROUTE`
    over the gateway's lifetime, from its `/hedge/stats` (None without one)."""
    try:
        count = stats["pools"][POOL]["lifetime"]["translated"][  # type: ignore[index]
            variants.TRANSLATED_ROUTE]
    except (TypeError, KeyError):
        return None
    return count if isinstance(count, int) else None


def warm_or(body: dict[str, Any], index: int) -> dict[str, Any]:
    """The body of request `index`: `body` itself for a measured request; for a warm-up
    (index < 0) the same with `max_tokens: 1`. A warm-up only has to open the connections and
    run every code path once (role chunk, a token, finish, `[DONE]`), and a one-token stream
    does; the workload's whole stream made the 1,000-stream warm-up last 4 s per mode."""
    return {**body, "max_tokens": 1} if index < 0 else body


async def _run_mode(ctx: _Context, workload: Workload, mode: str, requests: int,
                    concurrency: int, gateway: tuple[str, subprocess.Popen[bytes]] | None,
                    ) -> dict[str, Any]:
    client, sims = ctx.client, ctx.sims[:workload.backends]
    outage = {"start": int(requests * workload.outage_span[0]),
              "end": int(requests * workload.outage_span[1]),
              "extra_ms": workload.outage_extra * 1000.0}

    profile = workload.profile
    if mode in rows.FAULTLESS_MODES:  # the same streams without a stall or a break
        profile = dataclasses.replace(profile, stall_probability=0.0, break_probability=0.0)

    async def reset() -> None:
        resets = await asyncio.gather(*(
            client.post(f"{s}/bench/reset", json={
                "profile": profile_to_json(profile), "seed": ctx.plan.seed,
                "backend": chr(97 + k), "outage": outage})
            for k, s in enumerate(sims)))
        for response in resets:
            response.raise_for_status()

    direct_body = {**CHAT_BODY, "model": "sim"}
    send: Send
    if mode == "direct":
        url = f"{ctx.sims[0]}/v1/chat/completions"
        send = lambda c, i: stream_one(c, url, i, body=warm_or(direct_body, i))  # noqa: E731
    elif mode == "oracle":
        urls = [f"{s}/v1/chat/completions" for s in sims]
        send = lambda c, i: best_of(c, urls, i, body=warm_or(direct_body, i))  # noqa: E731
    elif mode in servers.FLOORS and gateway is not None:  # a proxy: the body as sent direct
        floor_url = f"{gateway[0]}/v1/chat/completions"
        send = lambda c, i: stream_one(c, floor_url, i,  # noqa: E731
                                       body=warm_or(direct_body, i))
    elif gateway is not None:
        gw_url, gw_body = f"{gateway[0]}/v1/chat/completions", {**CHAT_BODY, "model": POOL}
        variant = variants.VARIANTS.get(mode)
        gw_headers = dict(variant.headers) if variant is not None else {}
        send = lambda c, i: stream_one(c, gw_url, i, body=warm_or(gw_body, i),  # noqa: E731
                                       headers=gw_headers)
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

    c1: dict[str, Any] | None = None
    c1_requests = workload.quick_c1_requests if ctx.quick else workload.c1_requests
    c1_sent = 0  # the c=1 pass's requests, its warm-up's too
    # what the gateway has counted once the warm-up ended: the c=1 pass (its own warm-up
    # request and its requests), then one warm-up request per worker of the main pass
    warmed = (1 + c1_requests if c1_requests else 0) + max(1, min(concurrency, requests))

    # nginx and the pass-through have a process to meter but no /hedge/stats to read
    stats_of = gateway[0] if gateway is not None and mode not in servers.FLOORS else None

    async def after_warmup() -> None:
        if stats_of is not None:  # the warm-up's last requests counted (workers: published)
            baseline.append(await counted_stats(client, stats_of, warmed, ctx.plan.workers,
                                                 wait=2.0))
        meters.append(ProcessMeter(pids, trees=("gateway",)))
        samplers.append(asyncio.create_task(meters[0].sample_until(done)))

    if c1_requests:
        await reset()
        c1_progress = Progress(ctx.plan.progress, f"{workload.name} / {mode} c=1", c1_requests)
        # the client runs when its bytes arrive, not after a simulator's burst (`speed`)
        with speed.short_slice() as client_slice_us:
            c1_samples, c1_warm, _ = await run_load(c1_requests, 1, send, progress=c1_progress,
                                                    timeout=ctx.plan.request_timeout)
        c1_sent = len(c1_warm) + len(c1_samples)
        c1 = speed.ttft_summary(c1_samples) | {"client_slice_us": client_slice_us}
        c1_progress.finish(f"TTFT p50 {c1['ttft_p50_ms']} ms")
    await reset()
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
    hedge_stats = None
    if stats_of is not None:  # counted: answered, and the losers closed
        hedge_stats = await counted_stats(client, stats_of,
                                           counted_requests(baseline[0]) + len(samples),
                                           ctx.plan.workers)
    logs = await sim_logs(client, sims, mode, len(samples))
    row = rows.summarize_mode(mode, samples, wall, [entry["log"] for entry in logs],
                                hedge_stats=hedge_stats,
                                hedge_stats_before=baseline[0] if baseline else None,
                                pool=POOL, process=processes.get("gateway"),
                                concurrency=concurrency)
    row["processes"] = processes
    row["c1"] = c1
    row["cost"] = speed.cost_row(row)
    row["events_delivered"] = speed.events_delivered(samples)
    row["warmup"] = {"requests": len(warmup), "errors": sum(not s.ok for s in warmup)}
    row["sim_stats"] = [entry["stats"] for entry in logs]
    row["hedge_stats"] = hedge_stats
    if stats_of is not None:  # the gateway's own count of the measured requests, all workers
        row["gateway_counted"] = {
            "requests": counted_requests(hedge_stats) - counted_requests(baseline[0]),
            "workers": len(hedge_stats.get("workers", [])) if isinstance(hedge_stats, dict)
            else None}
    sent = c1_sent + len(warmup) + len(samples)  # every pass's, the gateway's lifetime
    if _keyed(mode):  # every request of every pass sent the key: the store's count to match
        row["keys"] = keys_seen(ctx, mode, hedge_stats) | {"requests_sent": sent}
    variant = variants.VARIANTS.get(mode)
    if variant is not None and variant.translated:  # every request of every pass translated
        row["translated"] = {"route": variants.TRANSLATED_ROUTE, "requests_sent": sent,
                             "requests_translated": translated_count(hedge_stats)}
    progress.finish(f"ok {row['ok']}, errors {row['errors']}, "
                    f"TTFT p50 {row['ttft_ms']['p50']} ms, p99 {row['ttft_ms']['p99']} ms")
    return row


async def _run_workload(ctx: _Context, workload: Workload, requests: int,
                        concurrency: int) -> dict[str, Any]:
    gateways: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    modes = plan_modes(ctx.plan, workload, ctx.quick)
    try:
        for mode in modes:
            if mode not in ("direct", "oracle"):
                gateways[mode] = await _start_gateway(ctx, mode, workload)
        await asyncio.gather(*(wait_ready(
            ctx.client, f"{url}/v1/models" if mode in servers.FLOORS else f"{url}/healthz",
            proc, ctx.children) for mode, (url, proc) in gateways.items()))
        if ctx.pinning.gateway:  # before anything is measured
            for _, proc in gateways.values():
                pin_tree(proc.pid, ctx.pinning.gateway)
        rows = {mode: await _run_mode(ctx, workload, mode, requests, concurrency,
                                      gateways.get(mode))
                for mode in modes}
    finally:
        ctx.children.stop_all([proc for _, proc in gateways.values()])
    for mode, row in rows.items():
        if "keys" in row:  # written by the gateway as it stopped (exit 0: on its own terms)
            row["keys"]["gateway_exit"] = gateways[mode][1].returncode
            row["keys"]["requests_counted"] = await asyncio.to_thread(
                key_usage, ctx, mode, row["keys"]["client_key"])
    comparison = report.compare(rows) | speed.compare_costs(rows)
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
        + speed.targets(workload.name, rows, comparison)
        + (share_targets(workload.name, rows, comparison) if workload.single_hedge else []),
    }
    if any(mode in CONTINUATION_MODES for mode in modes):  # the stall delay's floor
        result["stall_min_s"] = StallSettings().min if workload.stall_min is None \
            else workload.stall_min
    if workload.outage_extra > 0 and "hedging-on" in rows:
        result["outage_phases"] = report.outage_phases(rows["hedging-on"], requests,
                                                       workload.outage_span)
    if ctx.plan.workers > 1:
        result["gateway_workers"] = ctx.plan.workers
    if ctx.plan.tables is not None:
        table = "\n".join([report.format_workload(result), *speed.format_lines(result)])
        print(table, file=ctx.plan.tables, flush=True)
        for row in rows.values():
            counted = row.get("gateway_counted")
            if counted is not None and ctx.plan.workers > 1:
                print(f"   {row['mode']}: gateway with {ctx.plan.workers} workers; its "
                      f"/hedge/stats lists {counted['workers']} and counts "
                      f"{counted['requests']} of {row['requests']} requests",
                      file=ctx.plan.tables, flush=True)
        print(file=ctx.plan.tables, flush=True)
    return result


def _single_hedge(workload: Workload, requests: int, seed: int) -> dict[str, Any]:
    """The best single-hedge policy at the default budget over this run's seeded draws:
    backend a's TTFT as the primary, backend b's as the hedge."""
    pairs = [(request_ttft(workload.profile, seed, "a", i), request_ttft(workload.profile, seed,
                                                                          "b", i))
             for i in range(requests)]
    ratio = BudgetSettings().ratio
    best = best_single_hedge(pairs, ratio, (0.5, 0.99))
    return {"ratio": ratio, "delay_ms": round(best.delay * 1000.0, 3), "hedged": best.hedged,
            "ttft_p50_ms": round(best.ttft[0] * 1000.0, 3),
            "ttft_p99_ms": round(best.ttft[1] * 1000.0, 3)}


async def _run(plan: BenchPlan, children: Children, sizes: Sequence[tuple[int, int]],
               pinning: speed.Pinning, quick: bool) -> list[dict[str, Any]]:
    """Start the simulators, then run each workload; the load uses its own clients."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:  # control calls
        ports = [free_port() for _ in range(max(w.backends for w in plan.workloads))]
        procs = [children.start(f"sim-{chr(97 + k)}", [
            sys.executable, "-m", "gateway.bench.upstream", "--port", str(p)],
            cpus=pinning.others)
            for k, p in enumerate(ports)]
        sims = [f"http://127.0.0.1:{p}" for p in ports]
        await asyncio.gather(*(wait_ready(client, f"{s}/v1/models", proc, children)
                               for s, proc in zip(sims, procs, strict=True)))
        results: list[dict[str, Any]] = []
        for w, (n, c) in zip(plan.workloads, sizes, strict=True):
            runs = []
            for k in range(plan.repeat):
                seeded = dataclasses.replace(plan, seed=plan.seed + k)
                ctx = _Context(seeded, children, client, sims, ports, [p.pid for p in procs],
                               pinning, quick)
                runs.append(await _run_workload(ctx, w, n, c))
            if plan.repeat > 1:
                runs[-1]["spread"] = report.spread(runs)
                if plan.tables is not None:
                    print(report.format_spread(w.name, runs[-1]["spread"]), file=plan.tables,
                          flush=True)
            results += runs
        return results


def run_bench(plan: BenchPlan, *, requests: int | None = None, concurrency: int | None = None,
              quick: bool = False) -> dict[str, Any]:
    """Run every workload of `plan` in every mode; the whole report, JSON-ready."""
    sizes = [(requests or (w.quick_requests if quick else w.requests), concurrency or w.concurrency)
             for w in plan.workloads]
    from gateway.server.serve import raise_open_file_limit  # not at import: FastAPI and the app

    started = time.time()
    # 1,000 streams need ~1,000 descriptors in the load client and ~2,000 in the gateway:
    # the children inherit the raised limit (the gateway also raises its own)
    files = raise_open_file_limit()
    pinning = speed.Pinning.plan()
    before = os.sched_getaffinity(0)
    if pinning.others:  # the load client runs here: off the gateway's core
        os.sched_setaffinity(0, pinning.others)
    with tempfile.TemporaryDirectory(prefix="hedge-bench-") as logdir:
        children = Children(logdir)
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                workloads = runner.run(_run(plan, children, sizes, pinning, quick))
        finally:
            children.close()
            os.sched_setaffinity(0, before)
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": round(time.time() - started, 1), "machine": machine(),
            "pinning": pinning.as_json(), "open_files": {"before": files[0], "after": files[1]},
            "seed": plan.seed, "quick": quick, "modes": list(plan.modes),
            "baseline_src": plan.baseline_src, "servers": list(plan.servers),
            "features": plan.features, "nginx": plan.nginx, "passthrough": plan.passthrough,
            "workloads": workloads}
