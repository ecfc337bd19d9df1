"""The gateway under test, seen from the bench: the configuration it is started with, the
environment that runs another checkout's code, and reading its `/hedge/stats` and the
simulators' request logs once a pass has settled (polls, where a fixed pause either wasted
time or was short). `gateway.bench.run` starts the processes and runs the passes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any

import httpx
import yaml

from gateway.bench.variants import Variant, merged

POOL = "bench"


def gateway_config(port: int, sim_ports: Sequence[int], hedging: bool,
                   delay_window: float | None = None,
                   max_concurrent_requests: int | None = None,
                   variant: Variant | None = None, continuation: bool | None = None,
                   stall_min: float | None = None) -> str:
    """The generated configuration of a gateway mode; `variant` (`bench --features`) merged
    in last: its overrides of the document and of the pool. `continuation` (the `stalls`
    workload's modes): the backends continue by prefill (the simulator continues a final
    assistant message), and the pool's `hedging.stall` is on or off, its `min` `stall_min`
    seconds when given (the workload's); None: the defaults. A `translated` variant's
    backends are the same simulators spoken to in Messages (`anthropic`, which the simulator
    serves too), so every chat request is translated both ways."""
    translated = variant is not None and variant.translated
    backends = [
        {"name": f"sim-{chr(97 + k)}", "model": "sim", "group": f"zone-{chr(97 + k)}",
         **({"provider": "anthropic", "base_url": f"http://127.0.0.1:{p}",
             "api_key": "unused"} if translated
            else {"provider": "openai", "base_url": f"http://127.0.0.1:{p}/v1"})}
        for k, p in enumerate(sim_ports)
    ]
    server: dict[str, Any] = {"host": "127.0.0.1", "port": port}
    if max_concurrent_requests is not None:
        server["max_concurrent_requests"] = max_concurrent_requests
    pool: dict[str, Any] = {"name": POOL, "backends": backends}
    if delay_window is not None:
        pool["hedging"] = {"delay": {"window": delay_window}}
    if continuation is not None:
        for backend in backends:
            backend["continuation"] = "prefill"
        stall: dict[str, Any] = {"enabled": continuation}
        if stall_min is not None:
            stall["min"] = f"{round(stall_min * 1000)}ms"
        pool["hedging"] = {**pool.get("hedging", {}), "stall": stall}
    config: dict[str, Any] = {"server": server, "hedging": {"enabled": hedging},
                              "pools": [pool]}
    if variant is not None:
        config = merged(config, variant.top)
        config["pools"] = [merged(pool, variant.pool)]
    return yaml.safe_dump(config, sort_keys=False)


def baseline_env(src: str) -> tuple[dict[str, str], str]:
    """The environment and working directory that make `python -m gateway.cli` import the
    checkout at `src`: both, since `-m` puts the working directory first on `sys.path`, before
    `PYTHONPATH` (with only the variable, a bench started from this checkout ran its own code
    as the baseline)."""
    root = os.path.abspath(src)
    return {"PYTHONPATH": root}, root


async def hedge_stats(client: httpx.AsyncClient, base: str) -> object:
    """The gateway's `/hedge/stats` document, or None when it has none."""
    try:
        response = await client.get(f"{base}/hedge/stats", timeout=5.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def counted_requests(stats: object) -> int:
    """Lifetime requests of the bench pool in a `/hedge/stats` document (0 without one)."""
    try:
        return int(stats["pools"][POOL]["lifetime"]["requests"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return 0


def _has_count(stats: object) -> bool:
    """Whether a `/hedge/stats` document counts the bench pool's requests at all (another
    checkout's gateway may not, and must not be waited for)."""
    try:
        return isinstance(stats["pools"][POOL]["lifetime"]["requests"], int)  # type: ignore[index]
    except (TypeError, KeyError):
        return False


async def counted_stats(client: httpx.AsyncClient, base: str, expect: int | None,
                         workers: int, wait: float = 5.0) -> object:
    """The gateway's stats once they count `expect` requests and, with workers, list every
    worker (each publishes every 0.5 s); after `wait` seconds as they are. A request is
    counted after its answer and its losers' reaping, so this is also the moment the
    gateway is done with them: a poll, where a fixed pause either wasted time or was short."""
    deadline = time.monotonic() + wait
    while True:
        stats = await hedge_stats(client, base)
        counted = expect is None or not _has_count(stats) or counted_requests(stats) >= expect
        listed = workers <= 1 or (isinstance(stats, dict)
                                  and len(stats.get("workers", [])) >= workers)
        if (counted and listed) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05 if workers <= 1 else 0.2)


async def sim_logs(client: httpx.AsyncClient, sims: Sequence[str], mode: str,
                    requests: int) -> list[Any]:
    """Every simulator's request log after a pass, once it has settled: an entry for each
    measured request, and no new entry over the last 50 ms. An entry lands when its request
    ends at the simulator, and a loser's when the simulator sees its close (it watches for
    the disconnect, so within milliseconds of it; a gateway's losers are closed before
    `counted_stats` returns, the oracle's before the pass ends). At most 0.5 s: a fixed
    0.3 s pause per mode was 4 s of a quick run."""
    deadline = time.monotonic() + 0.5
    previous = -1
    while True:
        logs = [(await client.get(f"{s}/bench/log")).json() for s in sims]
        entries = sum(1 for entry in logs for item in entry["log"]
                      if str(item[0]).startswith("bench-"))
        one_each = entries >= requests
        if ((one_each and (mode == "direct" or entries == previous))
                or time.monotonic() > deadline):
            return logs
        previous = entries
        await asyncio.sleep(0.05)
