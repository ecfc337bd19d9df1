"""The hot path's regression guard: CPU instructions per request, counted, not timed.

Seconds are noise on a shared two-core machine; the number of instructions a fixed piece of
work executes is not. `valgrind --tool=callgrind` runs the gateway (`serve`, a real process on
loopback) with its counting off through start-up and warm-up, then on for a fixed number of
requests of each kind (a streamed chat completion, a streamed Messages answer, a whole chat
completion), sent one at a time by a standard-library client over one keep-alive connection to
a pool of two backends served by the simulator in another process (not counted). Each kind's
instructions divided by its requests (the lowest of three rounds) is compared with the
committed baseline (`bench/instructions.json`): more than `TOLERANCE` above it fails.

    python -m gateway.bench.instructions               # measure and compare: exit 1 if over
    python -m gateway.bench.instructions --update      # measure and write the baseline
    python -m gateway.bench.instructions --variant no-affinity --variant no-request-log
                                                       # each feature's cost: see below

`--variant NAME` (repeatable, or `all`) measures the same requests with one feature switched
(`VARIANTS`: each an override of the public configuration, or a `serve` flag), next to the
default configuration, and prints each kind's count and its difference from the default: what
the feature costs a request. `--cpu` adds CPU microseconds per request, measured without
valgrind from the gateway process's own CPU counters over `CPU_REQUESTS` requests (the best
of `ROUNDS`): seconds, so noisier than the counts, but in the unit an operator reads.
`--keep DIR` keeps callgrind's output files there, for `callgrind_annotate` (which C
functions the interpreter spent the instructions in).

The count is repeatable for the same interpreter and library versions, which is why `.ci/run`
runs it in the virtualenv installed from `requirements.lock`; a baseline recorded under
another Python is reported, not judged. A change that adds cost on purpose updates the
baseline in the same commit (`--update`), so the cost is seen in review.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.bench.variants import VARIANTS, Variant, merged

#: how far above the baseline a kind's count may go before the guard fails
TOLERANCE = 0.15
#: requests of each kind before counting (imports, caches, first connections) and counted
#: per round; a kind's count is its lowest round's, since what else runs in a window (a timer
#: that fell due, a collection) only ever adds
WARMUP = 10
COUNTED = 20
ROUNDS = 3
BASELINE = Path(__file__).resolve().parents[2] / "bench" / "instructions.json"
#: bounds on each wait, so a broken gateway fails the guard instead of hanging it
START_TIMEOUT = 120.0
REQUEST_TIMEOUT = 60.0

#: requests of each kind per round of the CPU-time measurement (`--cpu`)
CPU_REQUESTS = 200


def _backend(name: str, provider: str, base_url: str, **extra: str) -> dict[str, Any]:
    return {"name": name, "provider": provider, "base_url": base_url, "model": "m", **extra}


def gateway_config(port: int, top: Mapping[str, Any] | None = None,
                   pool: Mapping[str, Any] | None = None, *, translated: bool = False,
                   continued: bool = False) -> str:
    """The measured gateway's configuration: a chat pool and a Messages pool of two backends
    each, all served by the simulator on `port`; `top` is merged into the document, `pool`
    into every pool (a variant's overrides). `translated`: each pool's backends speak the
    other API (Messages for the chat pool, Chat Completions only for the Messages pool), so
    the same requests are translated both ways. `continued`: the chat pool's backends
    continue answers (`continue_final_message`), so a whole chat request is read upstream as
    a stream."""
    extra = {"continuation": "continue_final_message"} if continued else {}
    chat = [_backend(b, "openai", f"http://127.0.0.1:{port}/v1", **extra) for b in ("a", "b")]
    messages = [_backend(b, "anthropic", f"http://127.0.0.1:{port}", api_key="unused")
                for b in ("c", "d")]
    if translated:
        chat, messages = messages, [{**b, "apis": ["chat"]} for b in chat]
    pools = [{"name": "chat", "backends": chat}, {"name": "claude", "backends": messages}]
    document: dict[str, Any] = merged({}, top or {})
    document["pools"] = [merged(p, pool or {}) for p in pools]
    return yaml.safe_dump(document, sort_keys=False)


#: kind -> (path, body): what a client of each API sends
KINDS: dict[str, tuple[str, dict[str, object]]] = {
    "chat_stream": ("/v1/chat/completions", {
        "model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
    "messages_stream": ("/v1/messages", {
        "model": "claude", "stream": True, "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}]}),
    "chat_whole": ("/v1/chat/completions", {
        "model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """One kind's count against its baseline."""

    kind: str
    measured: int
    baseline: int | None

    @property
    def ratio(self) -> float | None:
        return None if not self.baseline else self.measured / self.baseline

    @property
    def over(self) -> bool:
        return self.ratio is not None and self.ratio > 1 + TOLERANCE

    def line(self) -> str:
        if self.ratio is None:
            return f"{self.kind:16} {self.measured:>12,} instructions/request  (no baseline)"
        word = "OVER" if self.over else "ok"
        return (f"{self.kind:16} {self.measured:>12,} instructions/request  baseline "
                f"{self.baseline:>12,}  x{self.ratio:.3f}  {word}")


def judge(measured: Mapping[str, int], baseline: Mapping[str, int]) -> list[Verdict]:
    """Each kind's verdict; the guard fails when any is `over`."""
    return [Verdict(kind, count, baseline.get(kind)) for kind, count in measured.items()]


def environment() -> dict[str, str]:
    """What a count depends on besides the code: recorded with the baseline."""
    return {"python": platform.python_version(), "machine": platform.machine()}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.1)  # polling for start-up
    raise RuntimeError(f"did not listen within {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")


def _wait_for_line(text: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the log shows `text` (not a request: a readiness probe would be counted)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if text in log.read_text(errors="replace"):
            return
        time.sleep(0.1)  # polling for start-up
    raise RuntimeError(f"no {text!r} within {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def _process(argv: list[str], log: Path, env: Mapping[str, str]) -> Iterator[
        subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def bodies(prompt_bytes: int = 0) -> dict[str, tuple[str, bytes]]:
    """Each kind's path and serialized body; `prompt_bytes` > 0 makes the user message that
    long (a request then has a conversation key and a size class: "hi" is below any key's
    threshold, so its affinity work ends at the threshold test)."""
    text = "hi" if prompt_bytes <= 0 else ("lorem ipsum " * (prompt_bytes // 12 + 1))[
        :prompt_bytes]
    out = {}
    for kind, (path, body) in KINDS.items():
        messages = [{"role": "user", "content": text}]
        out[kind] = (path, json.dumps({**body, "messages": messages}).encode())
    return out


def _send(connection: http.client.HTTPConnection, kind: str,
          sent: Mapping[str, tuple[str, bytes]], headers: Mapping[str, str] | None = None
          ) -> None:
    path, body = sent[kind]
    connection.request("POST", path, body,
                       {"content-type": "application/json",
                        "anthropic-version": "2023-06-01", **(headers or {})})
    response = connection.getresponse()
    payload = response.read()
    if response.status != 200:
        raise RuntimeError(f"{kind}: status {response.status}: {payload[:300]!r}")


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True,
                   capture_output=True, timeout=60)


def _dump_total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{path}: no instruction total")


@contextlib.contextmanager
def _gateway(workdir: Path, variant: Variant, prefix: list[str],
             extra_env: Mapping[str, str] | None) -> Iterator[
        tuple[subprocess.Popen[bytes], http.client.HTTPConnection]]:
    """The simulator and `serve` (under `prefix`, e.g. valgrind) with `variant`'s
    configuration, and a keep-alive connection to it once it listens."""
    sim_port, port = _free_port(), _free_port()
    config = workdir / "config.yaml"
    config.write_text(gateway_config(sim_port, variant.top, variant.pool,
                                     translated=variant.translated,
                                     continued=variant.continued))
    # the same hash seed every run: dict and set orders, hence the work done, repeat
    env = {"PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1",
           # a store the configuration opens (named keys) is the measurement's own
           "XDG_STATE_HOME": str(workdir / "state"), **(extra_env or {})}
    sim = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(sim_port),
           "--seed", "1", "--ttft-median-ms", "0", "--ttft-sigma", "0",
           "--straggler-probability", "0", "--tokens", "50", "--inter-token-ms", "0"]
    gateway = [*prefix, sys.executable, "-m", "gateway.cli", "serve",
               "--config", str(config), "--port", str(port), *variant.serve_args]
    with _process(sim, workdir / "sim.log", {"PYTHONHASHSEED": "0"}) as sim_proc:
        _wait_for_port(sim_port, sim_proc, workdir / "sim.log")
        log = workdir / "gateway.log"
        with _process(gateway, log, env) as proc:
            # not a request: a readiness probe would be counted (and --log-level warning
            # hides uvicorn's line, so the port is polled then)
            if variant.serve_args:
                _wait_for_port(port, proc, log)
            else:
                _wait_for_line("Uvicorn running on", proc, log)
            connection = http.client.HTTPConnection("127.0.0.1", port,
                                                    timeout=REQUEST_TIMEOUT)
            try:
                yield proc, connection
            finally:
                connection.close()


def measure(workdir: Path, *, counted: int = COUNTED,
            extra_env: Mapping[str, str] | None = None,
            variant: Variant = VARIANTS["default"], prompt_bytes: int = 0) -> dict[str, int]:
    """Instructions per request of each kind, counted by callgrind in a real `serve`.
    `extra_env`: added to the gateway's environment (the guard's own test uses it);
    `variant`: the configuration; `prompt_bytes`: the user message's length (`bodies`).
    Callgrind's output files stay in `workdir` (`callgrind.out.N`, one per kind and round)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise RuntimeError("valgrind is not installed (Debian's package `valgrind`)")
    sent = bodies(prompt_bytes)
    out = workdir / "callgrind.out"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out}"]
    with _gateway(workdir, variant, valgrind, extra_env) as (proc, connection):
        for kind in KINDS:
            for _ in range(WARMUP):
                _send(connection, kind, sent, variant.headers)
        counts: dict[str, int] = {}
        dumps = 0
        for _ in range(ROUNDS):
            for kind in KINDS:
                _control(proc.pid, "--zero")
                _control(proc.pid, "--instr=on")
                for _ in range(counted):
                    _send(connection, kind, sent, variant.headers)
                _control(proc.pid, "--instr=off")
                _control(proc.pid, "--dump")
                dumps += 1
                each = _dump_total(Path(f"{out}.{dumps}")) // counted
                counts[kind] = min(counts.get(kind, each), each)
    return counts


def _cpu_seconds(pid: int) -> float:
    """The process's own CPU time so far, every thread's, in nanoseconds' resolution (Linux's
    /proc/PID/task/*/schedstat: the clock-tick counters of /proc/PID/stat are 10 ms steps)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread may have ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def measure_cpu(workdir: Path, *, counted: int = CPU_REQUESTS,
                variant: Variant = VARIANTS["default"], prompt_bytes: int = 0
                ) -> dict[str, float]:
    """CPU microseconds per request of each kind: the gateway's own CPU time (no valgrind)
    over `counted` requests, the lowest of `ROUNDS` rounds. Seconds of a process's own
    counters: other load slows a run but is not billed to it (a thread that ended within a
    round is not counted)."""
    sent = bodies(prompt_bytes)
    with _gateway(workdir, variant, [], None) as (proc, connection):
        for kind in KINDS:
            for _ in range(WARMUP * 3):
                _send(connection, kind, sent, variant.headers)
        result: dict[str, float] = {}
        for _ in range(ROUNDS):
            for kind in KINDS:
                before = _cpu_seconds(proc.pid)
                for _ in range(counted):
                    _send(connection, kind, sent, variant.headers)
                each = (_cpu_seconds(proc.pid) - before) * 1e6 / counted
                result[kind] = min(result.get(kind, each), each)
    return {kind: round(value, 1) for kind, value in result.items()}


def profile_lines(variants: Mapping[str, Mapping[str, int]],
                  cpu: Mapping[str, Mapping[str, float]] | None = None) -> list[str]:
    """Each variant's count per kind and its difference from `default` (what the switched
    feature costs a request: a feature turned off shows what it saved as a negative delta);
    with `cpu`, its microseconds per request too."""
    base = variants.get("default", {})
    lines = [f"{'variant':16} " + "  ".join(f"{kind:>28}" for kind in KINDS)]
    for name, counts in variants.items():
        cells = []
        for kind in KINDS:
            count = counts.get(kind)
            if count is None:
                cells.append(f"{'-':>28}")
                continue
            delta = "" if name == "default" or kind not in base else \
                f" {count - base[kind]:+,}"
            micro = "" if cpu is None or kind not in cpu.get(name, {}) else \
                f" {cpu[name][kind]:.0f}us"
            cells.append(f"{f'{count:,}{delta}{micro}':>28}")
        lines.append(f"{name:16} " + "  ".join(cells))
    return lines


def _profile(names: list[str], *, prompt_bytes: int, cpu: bool, keep: Path | None) -> int:
    wanted = list(VARIANTS) if "all" in names else ["default", *dict.fromkeys(
        n for n in names if n != "default")]
    unknown = [n for n in wanted if n not in VARIANTS]
    if unknown:
        print(f"instructions: unknown variant {', '.join(unknown)} (known: "
              f"{', '.join(VARIANTS)}, all)", file=sys.stderr)
        return 2
    counts: dict[str, dict[str, int]] = {}
    micros: dict[str, dict[str, float]] | None = {} if cpu else None
    for name in wanted:
        variant = VARIANTS[name]
        with tempfile.TemporaryDirectory(prefix="hedge-gateway-instructions-") as tmp:
            try:
                counts[name] = measure(Path(tmp), variant=variant, prompt_bytes=prompt_bytes)
                if micros is not None:
                    micros[name] = measure_cpu(Path(tmp), variant=variant,
                                               prompt_bytes=prompt_bytes)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                print(f"instructions: {name}: could not measure: {exc}", file=sys.stderr)
                return 2
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                for dump in Path(tmp).glob("callgrind.out.*"):
                    shutil.copy(dump, keep / f"{name}.{dump.name}")
        print(f"{name}: {variant.feature}", file=sys.stderr, flush=True)
    for line in profile_lines(counts, micros):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.instructions",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true",
                        help="write the measured counts as the new baseline")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME",
                        help="measure with one feature switched (repeatable; `all`: every "
                        f"one): {', '.join(VARIANTS)}; printed next to the default, not "
                        "judged")
    parser.add_argument("--prompt-bytes", type=int, default=0, metavar="N",
                        help="with --variant: the user message's length (default: 'hi')")
    parser.add_argument("--cpu", action="store_true",
                        help="with --variant: also CPU microseconds per request (no valgrind)")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="with --variant: keep callgrind's output files in DIR")
    ns = parser.parse_args(argv)
    if ns.variant:
        return _profile(ns.variant, prompt_bytes=ns.prompt_bytes, cpu=ns.cpu, keep=ns.keep)
    with tempfile.TemporaryDirectory(prefix="hedge-gateway-instructions-") as tmp:
        try:
            counts = measure(Path(tmp))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            print(f"instructions: could not measure: {exc}", file=sys.stderr)
            return 2
    if ns.update:
        ns.baseline.write_text(json.dumps({"environment": environment(),
                                           "per_request": counts}, indent=2) + "\n")
        print(f"instructions: baseline written to {ns.baseline}")
        for verdict in judge(counts, {}):
            print(verdict.line())
        return 0
    recorded = json.loads(ns.baseline.read_text())
    verdicts = judge(counts, recorded["per_request"])
    for verdict in verdicts:
        print(verdict.line())
    if recorded["environment"] != environment():
        print(f"instructions: the baseline was counted under {recorded['environment']}, "
              f"this is {environment()}: not judged", file=sys.stderr)
        return 0
    over = [v.kind for v in verdicts if v.over]
    if over:
        print(f"instructions: {', '.join(over)} cost more than {TOLERANCE:.0%} over the "
              "baseline. If that is meant, run `python -m gateway.bench.instructions "
              "--update` and commit bench/instructions.json with the change.", file=sys.stderr)
        return 1
    print(f"instructions: every kind within {TOLERANCE:.0%} of the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
