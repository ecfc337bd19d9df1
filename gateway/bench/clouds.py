"""`hedge-gateway bench --workload claude-everywhere`: the stragglers race over three clouds.

What it shows: `config/claude-everywhere.yaml` is one Claude pool over Anthropic's API, AWS
Bedrock and Google Vertex AI, three wire formats the race has to treat alike (SSE with an API
key, SigV4-signed event-stream frames, SSE behind OAuth). Here that file's pool runs against
three simulators of those wires (`gateway.bench.cloudsims`, one child process each), with the
stragglers workload's latency: TTFT lognormal around 150 ms, 3 % of requests 1.5 s later,
drawn per (seed, cloud, request), so both modes see the same draws. Only the backends'
addresses and credentials change (the simulators', a bench key pair, a generated service
account); the pool's hedging settings are the file's.

Two modes, each through its own gateway child (`hedge-gateway serve`): `hedging-off`
(`hedging.enabled: false`) and `hedging-on` (the file's settings). Each first sends
`warmup` requests that are not measured (they open connections, fetch Vertex's token and let
the adaptive delay learn every backend's TTFT), then the measured ones, streamed as the
Anthropic SDK streams them (`/v1/messages`), `concurrency` at a time. Reported per mode: TTFT
p50/p99 to the first text delta, as the client sees it, which cloud answered each request
(`x-hedge-backend`) and the hedges started and won per cloud (from `/hedge/stats`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.bench import cloudsims, servers
from gateway.bench.load import Sample, request_id
from gateway.bench.procs import Children, free_port, wait_ready
from gateway.bench.speed import ttft_summary

#: the pool this workload runs: the one of the example configuration, as it is
CONFIG = Path(__file__).resolve().parents[2] / "config" / "claude-everywhere.yaml"
MODES = ("hedging-off", "hedging-on")
#: the simulator each provider's backend is pointed at, and the latency draws it uses
CLOUDS = (("anthropic", "a"), ("bedrock", "b"), ("vertex", "c"))


@dataclass(frozen=True, slots=True)
class CloudsPlan:
    requests: int = 300
    concurrency: int = 8
    #: unmeasured requests first, per mode (about 30 per backend: the adaptive delay's 20)
    warmup: int = 90
    seed: int = 1
    modes: tuple[str, ...] = MODES


def _no_variables(value: Any, where: str = "") -> None:
    """Every `${VAR}` of the example was replaced (a left one would need the environment)."""
    if isinstance(value, str) and "${" in value:
        raise ValueError(f"{CONFIG.name}: {where} still reads the environment")
    if isinstance(value, Mapping):
        for key, item in value.items():
            _no_variables(item, f"{where}.{key}")
    elif isinstance(value, list):
        for k, item in enumerate(value):
            _no_variables(item, f"{where}[{k}]")


def gateway_config(example: Mapping[str, Any], port: int, sims: Mapping[str, str],
                   key_file: str, *, hedging: bool) -> dict[str, Any]:
    """The example configuration with its backends pointed at the simulators: base URLs, a
    key for Anthropic, the bench key pair for Bedrock, the generated service account for
    Vertex; no client keys (the bench's own gateway), hedging on or off globally."""
    config: dict[str, Any] = json.loads(json.dumps(example))  # a deep copy of plain data
    config["server"] = {"host": "127.0.0.1", "port": port}
    config["hedging"] = {"enabled": hedging}
    (pool,) = config["pools"]
    for backend in pool["backends"]:
        provider = backend["provider"]
        backend["base_url"] = sims[provider]
        if provider == "anthropic":
            backend["api_key"] = "sk-bench"
        elif provider == "bedrock":
            backend["region"] = cloudsims.REGION
            backend["aws"] = {"access_key_id": cloudsims.AWS_KEY.access_key_id,
                              "secret_access_key": cloudsims.AWS_KEY.secret_access_key,
                              "session_token": ""}
        elif provider == "vertex":
            backend["project"], backend["region"] = cloudsims.PROJECT, cloudsims.VERTEX_REGION
            backend["google"] = {"credentials_file": key_file}
    _no_variables(config)
    return config


async def stream_message(client: httpx.AsyncClient, url: str, model: str,
                         index: int) -> Sample:
    """One streamed Messages request: TTFT to the first non-empty text delta, ended at
    `message_stop`; every failure is a failed Sample."""
    body = {"model": model, "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "Say something."}]}
    headers = {"x-request-id": request_id(index), "anthropic-version": "2023-06-01"}
    start = time.perf_counter()
    ttft: float | None = None
    events = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            backend = response.headers.get("x-hedge-backend")
            attempts = response.headers.get("x-hedge-attempts")
            if response.status_code != 200:
                await response.aread()
                return Sample(index, False, None, time.perf_counter() - start,
                              f"status {response.status_code}", backend=backend)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                events += 1
                kind = event.get("type")
                if kind == "error":
                    return Sample(index, False, ttft, time.perf_counter() - start,
                                  "error event", backend=backend)
                text = (event.get("delta") or {}).get("text") if kind == \
                    "content_block_delta" else None
                if ttft is None and text:
                    ttft = time.perf_counter() - start
                if kind == "message_stop":
                    return Sample(index, ttft is not None, ttft, time.perf_counter() - start,
                                  None if ttft is not None else "no token",
                                  int(attempts) if attempts and attempts.isdigit() else None,
                                  backend, events)
    except (httpx.HTTPError, ValueError) as exc:
        return Sample(index, False, ttft, time.perf_counter() - start, type(exc).__name__)
    return Sample(index, False, ttft, time.perf_counter() - start, "truncated")


async def _load(client: httpx.AsyncClient, url: str, model: str, indexes: Sequence[int],
                concurrency: int) -> list[Sample]:
    """`indexes` in order, `concurrency` in flight (a closed loop)."""
    queue = list(reversed(indexes))
    samples: list[Sample] = []

    async def worker() -> None:
        while queue:
            samples.append(await stream_message(client, url, model, queue.pop()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(samples, key=lambda s: s.index)


async def _pool_stats(client: httpx.AsyncClient, base: str, pool: str,
                      requests: int) -> dict[str, Any]:
    """The pool's `/hedge/stats` once it counts `requests` (each is counted once it ended and
    its losers were closed), or after 5 s as it is."""
    deadline = time.monotonic() + 5.0
    while True:
        stats: dict[str, Any] = (await client.get(f"{base}/hedge/stats")).json()["pools"][pool]
        if stats["lifetime"]["requests"] >= requests or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def _delta(after: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """What the measured requests added to the pool's counters: hedges, and per backend the
    requests won and the hedges that won there."""
    def count(stats: Mapping[str, Any], *path: str) -> int:
        value: Any = stats
        for key in path:
            value = value[key]
        return int(value)

    return {
        "hedges_started": count(after, "lifetime", "hedges", "started")
        - count(before, "lifetime", "hedges", "started"),
        "hedges_won": count(after, "lifetime", "hedges", "won")
        - count(before, "lifetime", "hedges", "won"),
        "backends": {name: {key: count(b, "lifetime", key)
                            - count(before["backends"][name], "lifetime", key)
                            for key in ("won", "hedges", "hedges_won", "failed")}
                     for name, b in after["backends"].items()},
    }


async def _run_mode(plan: CloudsPlan, mode: str, example: Mapping[str, Any],
                    sims: Mapping[str, str], key_file: str, children: Children,
                    client: httpx.AsyncClient) -> dict[str, Any]:
    port = free_port()
    path = os.path.join(children.logdir, f"claude-everywhere-{mode}.yaml")
    config = gateway_config(example, port, sims, key_file, hedging=mode != "hedging-off")
    with open(path, "w", encoding="utf-8") as file:
        yaml.safe_dump(config, file, sort_keys=False)
    argv, env = servers.server_command(servers.OWN, path, port)
    proc = children.start(f"gateway-claude-everywhere-{mode}", argv, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(client, base + "/healthz", proc, children)
        (pool,) = config["pools"]
        url, model = base + "/v1/messages", pool["name"]
        warm = await _load(client, url, model, [-k for k in range(1, plan.warmup + 1)],
                           plan.concurrency)
        before = await _pool_stats(client, base, model, len(warm))
        started = time.perf_counter()
        samples = await _load(client, url, model, range(plan.requests), plan.concurrency)
        seconds = time.perf_counter() - started
        after = await _pool_stats(client, base, model, len(warm) + len(samples))
    finally:
        children.stop_all([proc])
    providers = {b["name"]: b["provider"] for b in pool["backends"]}
    summary = ttft_summary(samples)
    served = {name: sum(1 for s in samples if s.ok and s.backend == name) for name in providers}
    return {
        "mode": mode, "requests": len(samples), "ok": summary["ok"],
        "errors": sorted({s.error for s in samples if s.error}),
        "warmup_errors": sum(not s.ok for s in warm),
        "ttft_p50_ms": summary["ttft_p50_ms"], "ttft_p99_ms": summary["ttft_p99_ms"],
        "seconds": round(seconds, 1), "providers": providers, "served": served,
        "gateway": _delta(after, before),
    }


async def _run(plan: CloudsPlan, children: Children) -> list[dict[str, Any]]:
    example = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    key_file = os.path.join(children.logdir, "vertex-service-account.json")
    async with httpx.AsyncClient(
            timeout=httpx.Timeout(60.0), trust_env=False,
            limits=httpx.Limits(max_connections=plan.concurrency + 8)) as client:
        sims: dict[str, str] = {}
        for kind, backend in CLOUDS:
            port = free_port()
            proc = children.start(f"sim-{kind}", [
                sys.executable, "-m", "gateway.bench.cloudsims", "--kind", kind, "--port",
                str(port), "--seed", str(plan.seed), "--backend", backend, "--key-file",
                key_file])
            sims[kind] = f"http://127.0.0.1:{port}"
            await wait_ready(client, sims[kind] + "/ready", proc, children)
        return [await _run_mode(plan, mode, example, sims, key_file, children, client)
                for mode in plan.modes]


def run_clouds(plan: CloudsPlan) -> list[dict[str, Any]]:
    """Every mode of `plan` against one set of three simulators (they keep no state between
    requests that a mode could leave to the next)."""
    with tempfile.TemporaryDirectory(prefix="hedge-clouds-") as logdir:
        children = Children(logdir)
        try:
            return asyncio.run(_run(plan, children))
        finally:
            children.close()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per mode: TTFT p50/p99, hedges, and per cloud the requests it answered (the hedges
    that won there in brackets); then the p99 hedging cut."""
    names = list(rows[0]["providers"]) if rows else []
    head = (f"{'mode':<12} {'ok':>5} {'p50 ms':>7} {'p99 ms':>7} {'hedges':>6} {'won':>4}  "
            + "  ".join(f"{n:>20}" for n in names))
    lines = ["answered by each cloud (hedges that won there in brackets)", head,
             "-" * len(head)]
    for row in rows:
        gateway = row["gateway"]
        cells = [f"{row['served'][n]:>13} ({gateway['backends'][n]['hedges_won']:>3})"
                 for n in names]
        lines.append(f"{row['mode']:<12} {row['ok']:>5} {_ms(row['ttft_p50_ms']):>7} "
                     f"{_ms(row['ttft_p99_ms']):>7} {gateway['hedges_started']:>6} "
                     f"{gateway['hedges_won']:>4}  " + "  ".join(f"{c:>20}" for c in cells))
    by_mode = {row["mode"]: row for row in rows}
    off, on = by_mode.get("hedging-off"), by_mode.get("hedging-on")
    if off and on and off["ttft_p99_ms"] and on["ttft_p99_ms"] is not None:
        cut = 1 - on["ttft_p99_ms"] / off["ttft_p99_ms"]
        lines.append(f"hedging cuts TTFT p99 by {100 * cut:.0f} % "
                     f"({_ms(off['ttft_p99_ms'])} -> {_ms(on['ttft_p99_ms'])} ms)")
    return "\n".join(lines)
