"""`hedge-gateway bench --workload soak`: long mixed traffic with faults.

What it answers: after many minutes of ordinary traffic with the failures real upstreams have,
does every request still end in a success or an explicit error, and do the gateway's memory
and open descriptors stay flat? And what share of requests is served when upstreams push back
now and then, with hedging on and off?

Setup, all real processes on loopback: three simulated backends (`hedge-gateway sim`), each
answering `pushback` (3 %) of its requests with `429` and `Retry-After: 1`; `sim-b` also
stalls `stall` (3 %) of its requests (headers and role chunk, then nothing); `sim-a` is killed
(SIGKILL) at a third of the run and restarted on the same port at half of it. Two gateways
run side by side against the same backends, one with hedging on and one with it off, each
with its own load of `concurrency` paced workers (a request every `interval` seconds each,
or as soon as the previous one ended when it took longer), so both see the same faults at
the same moments and, since refusals do not speed a worker up, about the same number of
requests. The mix per request index (seeded): 80 % streaming chat, 10 % non-streaming chat,
10 % embeddings.

Every request ends in one of four ways, and the run is clean only without the last two:
`ok`; `explicit` (an HTTP error status, or an SSE error event); `silent` (a stream that ends
without `[DONE]` and without an error event, a `[DONE]` without content, a malformed body or
a connection cut mid-response); `hung` (no end within `request_timeout`). RSS and open file
descriptors of each gateway are sampled every `sample_every` seconds; after the load, each
gateway idles past the upstream keep-alive expiry and is counted once more (`after_idle`:
descriptors and sockets by TCP state; a socket left in CLOSE_WAIT is one the gateway never
closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TextIO

import httpx
import yaml

from gateway.bench.client import Buffered, LeanClient, TransportError, request_bytes, target
from gateway.bench.load import CHAT_BODY, Sample, stream_one, worker_client
from gateway.bench.procs import Children, free_port, machine, wait_ready

POOL = "soak"
BACKENDS = ("sim-a", "sim-b", "sim-c")
MODES = ("hedging-on", "hedging-off")
#: the "stragglers" profile, as `hedge-gateway sim` options
SIM_ARGS = ("--ttft-median-ms", "150", "--ttft-sigma", "0.25", "--straggler-probability",
            "0.03", "--straggler-extra-ms", "1500", "--tokens", "30", "--inter-token-ms", "5")
EMBED_BODY = {"model": POOL, "input": "Say something."}


@dataclass(frozen=True, slots=True)
class SoakPlan:
    duration: float = 600.0
    #: workers per gateway; each starts a request every `interval` seconds, or when its
    #: previous one ended if that took longer
    concurrency: int = 8
    interval: float = 0.5
    #: share of each backend's requests answered 429 with Retry-After: 1
    pushback: float = 0.03
    #: share of sim-b's requests that stall after the role chunk
    stall: float = 0.03
    #: sim-a is killed at kill_at x duration and restarted at restart_at x duration
    kill_at: float = 1 / 3
    restart_at: float = 1 / 2
    sample_every: float = 10.0
    request_timeout: float = 60.0
    #: after the load, the gateways idle this long (past the upstream keep-alive expiry,
    #: 30 s) and get one request each before the last descriptor count: idle upstream
    #: connections are then closed, so what is left open is what a leak would hold
    settle: float = 31.0
    seed: int = 1
    progress: TextIO | None = None


def gateway_config(port: int, sim_ports: dict[str, int], hedging: bool) -> str:
    backends = [{"name": name, "provider": "openai", "model": "sim",
                 "base_url": f"http://127.0.0.1:{p}/v1", "group": f"zone-{name[-1]}"}
                for name, p in sim_ports.items()]
    config = {"server": {"host": "127.0.0.1", "port": port}, "hedging": {"enabled": hedging},
              "pools": [{"name": POOL, "timeout": "10s", "backends": backends}]}
    return yaml.safe_dump(config, sort_keys=False)


def outcome(sample: Sample) -> tuple[str, str]:
    """(way it ended, error class): `ok`, `explicit`, `silent` or `hung`, as in the module
    docstring; the class is a short label (`status_429`, `error_event`, `truncated`, ...)."""
    error = sample.error
    if sample.ok:
        return "ok", "ok"
    if error is None:
        return "silent", "unknown"
    if error.startswith("status "):
        return "explicit", "status_" + error[7:]
    if error.startswith("error event"):
        return "explicit", "error_event"
    if error == "hung":
        return "hung", "hung"
    if error.startswith("transport: ") and "Timeout" in error:
        return "hung", error[11:]
    labels = {"truncated (no [DONE])": "truncated", "no token": "done_without_content"}
    return "silent", labels.get(error, error.replace("transport: ", "").replace(" ", "_"))


async def whole_one(client: LeanClient, url: str, index: int,
                    body: dict[str, Any], key: str) -> Sample:
    """One non-streaming request; ok when it is a 200 whose JSON has a non-empty `key`."""
    start = time.perf_counter()
    where = target(url)
    headers = {"content-type": "application/json", "x-request-id": f"soak-{index}"}
    answer = Buffered()
    try:
        await client.request(where, request_bytes("POST", where, json.dumps(body).encode(),
                                                  headers), answer)
    except TransportError as exc:
        return Sample(index, False, None, time.perf_counter() - start, f"transport: {exc.kind}")
    total = time.perf_counter() - start
    if answer.status != 200:
        return Sample(index, False, None, total, f"status {answer.status}")
    try:
        ok = not answer.too_large and bool(json.loads(answer.content).get(key))
    except (ValueError, AttributeError):
        ok = False
    return Sample(index, ok, total, total, None if ok else "malformed body")


def _sender(base: str, seed: int) -> Callable[[LeanClient, int], Awaitable[Sample]]:
    chat = f"{base}/v1/chat/completions"
    stream_body = {**CHAT_BODY, "model": POOL}
    whole_body = {**CHAT_BODY, "model": POOL, "stream": False}

    def send(client: LeanClient, index: int) -> Awaitable[Sample]:
        u = random.Random(f"{seed}/{index}").random()
        if u < 0.8:
            return stream_one(client, chat, index, body=stream_body)
        if u < 0.9:
            return whole_one(client, chat, index, whole_body, "choices")
        return whole_one(client, f"{base}/v1/embeddings", index, EMBED_BODY, "data")

    return send


@dataclass(slots=True)
class _Run:
    """One gateway's side of the soak: its load's samples and its resource samples."""

    mode: str
    base: str
    pid: int
    samples: list[Sample]
    series: list[dict[str, float]]


async def _load(run: _Run, plan: SoakPlan, end: float) -> None:
    send = _sender(run.base, plan.seed)
    counter = iter(range(sys.maxsize))

    async def worker(client: LeanClient) -> None:
        due = time.monotonic()
        while due < end:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            # paced: a fast refusal does not make the next request come sooner, so both
            # gateways get about the same requests and their served shares compare
            due = max(due + plan.interval, time.monotonic())
            index = next(counter)
            try:
                async with asyncio.timeout(plan.request_timeout):
                    sample = await send(client, index)
            except TimeoutError:
                sample = Sample(index, False, None, plan.request_timeout, "hung")
            run.samples.append(sample)

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(worker_client(plan.request_timeout))
                   for _ in range(plan.concurrency)]
        await asyncio.gather(*(worker(c) for c in clients))


async def _sample(runs: list[_Run], every: float, start: float, stop: asyncio.Event,
                  progress: TextIO | None) -> None:
    psutil: Any = importlib.import_module("psutil")  # a runtime dependency; no type stubs
    procs = {run.mode: psutil.Process(run.pid) for run in runs}
    while True:
        t = round(time.monotonic() - start, 1)
        notes = []
        for run in runs:
            proc = procs[run.mode]
            rss = round(proc.memory_info().rss / 2**20, 1)
            run.series.append({"t_s": t, "rss_mb": rss, "fds": proc.num_fds(),
                               "requests": len(run.samples)})
            ok = sum(s.ok for s in run.samples)
            notes.append(f"{run.mode} {ok}/{len(run.samples)} ok, {rss} MB, "
                         f"{proc.num_fds()} fds")
        if progress is not None:
            print(f"  soak t={t:>6.1f}s  " + "; ".join(notes), file=progress, flush=True)
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            continue


def _start_sim(children: Children, name: str, port: int, plan: SoakPlan, tag: str) -> Any:
    faults = ["--fail-probability", str(plan.pushback), "--fail-status", "429"]
    if name == "sim-b":
        faults += ["--hang-probability", str(plan.stall)]
    seed = str(plan.seed * 10 + BACKENDS.index(name))
    return children.start(f"{name}{tag}", [
        sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), *SIM_ARGS,
        *faults, "--seed", seed])


async def _faults(children: Children, plan: SoakPlan, start: float, port: int,
                  sims: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Kill sim-a at `kill_at`, restart it on the same port at `restart_at`."""
    await asyncio.sleep(max(0.0, start + plan.kill_at * plan.duration - time.monotonic()))
    victim = sims["sim-a"]
    victim.kill()
    victim.wait()
    children.stop(victim)
    events.append({"t_s": round(time.monotonic() - start, 1), "event": "sim-a killed"})
    await asyncio.sleep(max(0.0, start + plan.restart_at * plan.duration - time.monotonic()))
    sims["sim-a"] = _start_sim(children, "sim-a", port, plan, "-restarted")
    events.append({"t_s": round(time.monotonic() - start, 1), "event": "sim-a restarted"})


async def _soak(plan: SoakPlan, children: Children) -> dict[str, Any]:
    ports = {name: free_port() for name in BACKENDS}
    sims = {name: _start_sim(children, name, ports[name], plan, "") for name in BACKENDS}
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as control:
        await asyncio.gather(*(wait_ready(control, f"http://127.0.0.1:{ports[n]}/v1/models",
                                          sims[n], children) for n in BACKENDS))
        runs = []
        for mode in MODES:
            port = free_port()
            path = f"{children.logdir}/gateway-{mode}.yaml"
            with open(path, "w", encoding="utf-8") as file:
                file.write(gateway_config(port, ports, hedging=mode == "hedging-on"))
            proc = children.start(f"gateway-{mode}", [
                sys.executable, "-m", "gateway.cli", "serve", "--config", path,
                "--log-level", "warning"])
            runs.append(_Run(mode, f"http://127.0.0.1:{port}", proc.pid, [], []))
            await wait_ready(control, f"{runs[-1].base}/healthz", proc, children)
        start = time.monotonic()
        stop = asyncio.Event()
        events: list[dict[str, Any]] = []
        sampler = asyncio.create_task(_sample(runs, plan.sample_every, start, stop,
                                              plan.progress))
        faults = asyncio.create_task(_faults(children, plan, start, ports["sim-a"], sims,
                                             events))
        try:
            await asyncio.gather(*(_load(run, plan, start + plan.duration) for run in runs))
        finally:
            faults.cancel()
            stop.set()
            await asyncio.gather(sampler, faults, return_exceptions=True)
        wall = time.monotonic() - start
        idle = await _after_idle(runs, plan, {p: n for n, p in ports.items()})
        results = []
        for run in runs:
            stats = (await control.get(f"{run.base}/hedge/stats")).json()
            results.append({**summarize(run, stats, wall), "after_idle": idle[run.mode]})
    return {"events": events, "modes": results}


async def _after_idle(runs: list[_Run], plan: SoakPlan, backends: dict[int, str]
                      ) -> dict[str, dict[str, Any]]:
    """Descriptors and sockets by TCP state of each gateway once idle connections expired
    (a few requests first: the upstream pool closes expired connections when next used)."""
    psutil: Any = importlib.import_module("psutil")
    await asyncio.sleep(plan.settle)
    out = {}
    async with worker_client(10.0) as client:
        for run in runs:
            for k in range(10):  # a few that reach an upstream (some may be pushed back)
                sample = await whole_one(client, f"{run.base}/v1/embeddings", -1 - k,
                                         EMBED_BODY, "data")
                if sample.ok and k >= 2:
                    break
            proc = psutil.Process(run.pid)
            conns = proc.net_connections(kind="tcp")
            states = Counter(c.status for c in conns)
            #: whom each half-closed socket was talking to: a backend, or a client
            half = Counter(backends.get(c.raddr.port, "client") for c in conns
                           if c.status == "CLOSE_WAIT" and c.raddr)
            out[run.mode] = {"fds": proc.num_fds(), "sockets": dict(sorted(states.items())),
                             "close_wait_peers": dict(sorted(half.items())),
                             "rss_mb": round(proc.memory_info().rss / 2**20, 1)}
    return out


def summarize(run: _Run, stats: dict[str, Any], wall: float) -> dict[str, Any]:
    ways: Counter[str] = Counter()
    classes: Counter[str] = Counter()
    for sample in run.samples:
        way, cls = outcome(sample)
        ways[way] += 1
        if way != "ok":
            classes[cls] += 1
    n = len(run.samples)
    settled = [s for s in run.series if s["t_s"] >= 0.1 * (run.series[-1]["t_s"] or 1)]
    first, last = (settled or run.series)[0], run.series[-1]
    lifetime = stats["pools"][POOL]["lifetime"]
    return {
        "mode": run.mode, "requests": n, "ok": ways["ok"],
        "served_pct": round(100.0 * ways["ok"] / n, 2) if n else None,
        "explicit": ways["explicit"], "silent": ways["silent"], "hung": ways["hung"],
        "errors_by_class": dict(classes.most_common()),
        "req_per_s": round(n / wall, 1) if wall else None,
        "gateway_errors": lifetime["errors"], "hedges": lifetime["hedges"]["started"],
        "failovers": lifetime["failovers"],
        "rss_mb": {"first": first["rss_mb"], "last": last["rss_mb"],
                   "max": max(s["rss_mb"] for s in run.series)},
        "fds": {"first": first["fds"], "last": last["fds"],
                "max": max(s["fds"] for s in run.series)},
        "series": run.series,
    }


def run_soak(plan: SoakPlan, logdir: str) -> dict[str, Any]:
    started = time.time()
    children = Children(logdir)
    try:
        result = asyncio.run(_soak(plan, children))
    finally:
        children.close()
    return {"workload": "soak", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "duration_s": round(time.time() - started, 1), "machine": machine(),
            "plan": {"duration_s": plan.duration, "concurrency_per_gateway": plan.concurrency,
                     "interval_s": plan.interval,
                     "pushback": plan.pushback, "stall": plan.stall,
                     "kill_at_s": round(plan.kill_at * plan.duration, 1),
                     "restart_at_s": round(plan.restart_at * plan.duration, 1),
                     "seed": plan.seed, "settle_s": plan.settle},
            **result}


def clean(report: dict[str, Any]) -> bool:
    """Every request of every mode ended in a success or an explicit error, and no socket
    was left half-closed."""
    return all(m["silent"] == 0 and m["hung"] == 0
               and not m["after_idle"]["sockets"].get("CLOSE_WAIT") for m in report["modes"])


def format_soak(report: dict[str, Any]) -> str:
    plan = report["plan"]
    lines = [
        f"== soak: {plan['duration_s']:g} s, {plan['concurrency_per_gateway']} workers per "
        f"gateway, one request each per {plan['interval_s']:g} s at most; 80 % streaming chat, "
        "10 % chat, 10 % embeddings",
        f"   faults: every backend answers {plan['pushback'] * 100:g} % with 429 + "
        f"Retry-After: 1; sim-b stalls {plan['stall'] * 100:g} %; sim-a killed at "
        f"{plan['kill_at_s']:g} s, restarted at {plan['restart_at_s']:g} s",
        "mode          requests      ok  served%  explicit  silent  hung  req/s | "
        "gw RSS MB first/last/max | fds first/last/max",
    ]
    for m in report["modes"]:
        rss, fds = m["rss_mb"], m["fds"]
        lines.append(
            f"{m['mode']:<12} {m['requests']:>9} {m['ok']:>7} {m['served_pct']:>8} "
            f"{m['explicit']:>9} {m['silent']:>7} {m['hung']:>5} {m['req_per_s']:>6} | "
            f"{rss['first']:>7}/{rss['last']}/{rss['max']} | "
            f"{fds['first']}/{fds['last']}/{fds['max']}")
    for m in report["modes"]:
        idle = m["after_idle"]
        sockets = ", ".join(f"{k} {v}" for k, v in idle["sockets"].items())
        lines.append(f"   {m['mode']} after {plan['settle_s']:g} s idle: {idle['fds']} fds, "
                     f"{idle['rss_mb']} MB; sockets {sockets}; CLOSE_WAIT peers "
                     f"{json.dumps(idle['close_wait_peers'])}")
    for m in report["modes"]:
        classes = ", ".join(f"{k} {v}" for k, v in m["errors_by_class"].items()) or "none"
        lines.append(f"   {m['mode']} errors by class: {classes}")
        lines.append(f"   {m['mode']} gateway /hedge/stats errors: "
                     f"{json.dumps(m['gateway_errors'])}; hedges {m['hedges']}, "
                     f"failovers {m['failovers']}")
    lines.append("   events: " + ", ".join(f"{e['event']} at {e['t_s']} s"
                                            for e in report["events"]))
    lines.append("   every request ended in success or an explicit error, no socket left "
                 "in CLOSE_WAIT: " + ("yes" if clean(report) else "NO"))
    return "\n".join(lines)
