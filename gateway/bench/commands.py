"""The bench's two commands once their options are parsed: run, print, write JSON, exit status.

Both run child processes (`gateway.bench.procs`), so both treat SIGTERM like Ctrl-C: the
children are stopped whatever ends the run, and the exit status says how it ended (0 done,
1 a child failed or the soak found a problem, 130 interrupted).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from gateway.bench import report
from gateway.bench.oracle import format_shares
from gateway.bench.procs import ChildFailed, machine
from gateway.bench.run import BenchPlan, run_bench
from gateway.bench.servers import missing

R = TypeVar("R")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run_children(work: Callable[[], R]) -> R | int:
    """`work()`, with SIGTERM ending it like Ctrl-C; an exit status when it did not finish."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return work()
    except ChildFailed as exc:
        print(f"hedge-gateway bench: a child server failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nhedge-gateway bench: interrupted; every child process was stopped",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _default_out(prefix: str) -> str:
    return os.path.join("bench-results", prefix + time.strftime("%Y%m%d-%H%M%S") + ".json")


def run_bench_command(plan: BenchPlan, *, out: str | None, requests: int | None = None,
                      concurrency: int | None = None, quick: bool = False) -> int:
    """`hedge-gateway bench`: run `plan`, print the tables, write the JSON report to `out`
    (default bench-results/<time>.json); the exit status (2: a server of `--servers` is not
    installed)."""
    absent = missing(plan.servers)
    if absent:  # before any child starts
        print(f"hedge-gateway bench: --servers {', '.join(absent)}: not installed; these "
              f"servers are optional: pip install 'hedge-gateway[{','.join(absent)}]'",
              file=sys.stderr)
        return 2
    info = machine()
    print(f"hedge-gateway bench: {', '.join(w.name for w in plan.workloads)}; "
          f"{info['nproc']} CPUs ({info['cpu_model']}), Python {info['python']}",
          file=sys.stderr)
    result = _run_children(
        lambda: run_bench(plan, requests=requests, concurrency=concurrency, quick=quick))
    if isinstance(result, int):
        return result
    shares = format_shares(result["workloads"])
    if shares:
        print(shares)
    path = out or _default_out("")
    report.write_json(path, result)
    print(f"JSON report: {path}")
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

    def work() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="hedge-soak-") as logdir:
            return soak.run_soak(plan, logdir)

    result = _run_children(work)
    if isinstance(result, int):
        return result
    print(soak.format_soak(result))
    path = out or _default_out("soak-")
    report.write_json(path, result)
    print(f"JSON report: {path}")
    return 0 if soak.clean(result) else 1


def run_clouds_command(*, requests: int | None, concurrency: int | None, quick: bool,
                       seed: int, out: str | None) -> int:
    """`--workload claude-everywhere`: the stragglers race over the example Claude pool of
    Anthropic, Bedrock and Vertex simulators, hedging off and on (`gateway.bench.clouds`).
    The simulators check SigV4 and sign tokens with the cloud providers' own libraries, so
    this workload needs the `all` extra."""
    try:
        from gateway.bench import clouds
    except ImportError as exc:
        print(f"hedge-gateway bench: claude-everywhere needs the cloud providers' libraries "
              f"({str(exc).splitlines()[0]}): pip install 'hedge-gateway[all]'", file=sys.stderr)
        return 2

    plan = clouds.CloudsPlan(requests=requests or (120 if quick else 300),
                             concurrency=concurrency or 8, warmup=60 if quick else 90,
                             seed=seed)
    print(f"hedge-gateway bench: claude-everywhere; {plan.requests} requests per mode at "
          f"concurrency {plan.concurrency} after {plan.warmup} warm-up requests, modes "
          f"{', '.join(plan.modes)}", file=sys.stderr)
    result = _run_children(lambda: clouds.run_clouds(plan))
    if isinstance(result, int):
        return result
    print(clouds.format_table(result))
    path = out or _default_out("claude-everywhere-")
    report.write_json(path, {"workload": "claude-everywhere", "machine": machine(),
                             "plan": {"requests": plan.requests, "warmup": plan.warmup,
                                      "concurrency": plan.concurrency, "seed": seed},
                             "modes": result})
    print(f"JSON report: {path}")
    return 0


def run_conversations_command(*, conversations: int | None, quick: bool, seed: int,
                              out: str | None, upstreams: Sequence[str] = (),
                              model: str | None = None, sizes: str | None = None,
                              concurrency: int | None = None,
                              warmup: int | None = None) -> int:
    """`--workload conversations`: sticky client, hedging off, hedging on over multi-turn
    conversations on prefilling, caching simulators (`gateway.bench.conversations`), or on
    the user's own servers (`upstreams`: `gateway.bench.external`); then the best simulated
    policies (`gateway.bench.policies`) and the measured row's distance to them."""
    from gateway.bench import conversations as conv
    from gateway.bench import external
    from gateway.bench.policies import format_policies

    try:
        mix = external.parse_sizes(sizes) if sizes else (
            external.UPSTREAM_SIZES if upstreams else conv.SIZES)
    except ValueError as exc:
        print(f"hedge-gateway bench: --sizes: {exc}", file=sys.stderr)
        return 2
    plan = conv.ConversationPlan(
        conversations=conversations or (24 if quick else 48), turns=3 if quick else 4,
        seed=seed, sizes=mix, upstreams=tuple(upstreams), model=model,
        system_tokens=external.UPSTREAM_SYSTEM_TOKENS if upstreams else conv.SYSTEM_TOKENS,
        concurrency=concurrency or (len(upstreams) if upstreams else None), warmup=warmup)
    backends = len(upstreams) or conv.BACKENDS
    warm = conv.default_warmup(plan, backends) if warmup is None else warmup
    where = f"servers {', '.join(upstreams)}" if upstreams else "simulators"
    print(f"hedge-gateway bench: conversations on {where}; {plan.conversations} conversations "
          f"of {plan.turns} turns after {warm} unmeasured warm-up conversations, modes "
          f"{', '.join(plan.modes)}", file=sys.stderr)
    try:
        result = _run_children(lambda: conv.run_conversations(plan))
    except ValueError as exc:  # an upstream whose model could not be found
        print(f"hedge-gateway bench: {exc}", file=sys.stderr)
        return 2
    if isinstance(result, int):
        return result
    print(conv.format_table(result))
    policies = conv.policy_rows(plan)
    if policies:
        by_mode = {r["mode"]: r for r in result}
        print()
        print(format_policies(policies, by_mode.get("hedging-on"), by_mode.get("sticky")))
    path = out or _default_out("conversations-")
    report.write_json(path, {"workload": "conversations", "machine": machine(),
                             "plan": {"conversations": plan.conversations, "turns": plan.turns,
                                      "warmup": warm, "concurrency": plan.concurrency,
                                      "seed": seed, "sizes": [list(s) for s in plan.sizes],
                                      "upstreams": list(plan.upstreams)},
                             "modes": result, "policies": policies})
    print(f"JSON report: {path}")
    return 0
