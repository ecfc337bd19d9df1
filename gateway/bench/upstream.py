"""The benchmark's upstream: a `providers.sim.server` app behind a small control surface.

The bench runs each simulated backend in its own child process (so that the gateway's CPU can
be measured apart) and needs what `hedge-gateway sim` alone does not give it:

- **Per-request seeded TTFT.** A simulator that draws from one seeded sequence gives request
  *i* whatever draw comes next, so under concurrency the pairing of draws with requests
  changes with arrival order, and a hedge shifts the other backend's sequence. Here the TTFT
  of request *i* on backend *b* is drawn from a generator seeded with `(seed, b, i)`, where
  *i* comes from the request id `bench-<i>` the load client sends (the gateway sends upstream
  a UUID as `x-request-id` and its client's own id as `x-client-request-id`; warm-up requests
  are `warmup-<k>`). Every mode of a workload, and every run with the same seed, therefore
  sees exactly the same latency for request *i* on backend *b*, whatever the arrival order;
  the two backends draw independently. The value reaches the simulator through its own
  `x-sim-ttft-ms` override, added here to the request (the gateway never forwards client
  headers upstream, so the load client could not set it). Everything else (tokens, timing
  between tokens, faults) is the simulator's own.
  Messages requests (`/v1/messages`) are seeded and logged the same way.
- **An outage by request index.** Requests `start <= i < end` get `extra_ms` on top, on every
  backend at once (the "outage" workload).
- `POST /bench/reset {"profile", "seed", "backend", "outage"}`: a fresh simulator (new
  counters) and the settings above, between runs, without restarting the process.
- `GET /bench/log`: per upstream request, `[request_id, arrival, status, completed]`, with
  `arrival` from `time.monotonic()` (one clock for every process on the machine) and
  `completed` false for a stream the caller closed early. Joined across backends by request
  id, it tells which attempt of a logical request came second (the hedge) and which won (the
  one that completed), without trusting the gateway's own accounting.

Run as a child: `python -m gateway.bench.upstream --port N [--host H]`. It parses those two
flags itself (`main`): the bench starts it, no user does, and importing the command line
would close a circle (the CLI imports the bench, which starts this module) and load the whole
gateway into every simulator process.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import re
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from gateway.settings import SimProfile
from providers.sim.server import SimApp, create_sim_app, stats_of
from providers.sim.wire import TTFT_HEADER

#: one upstream request: request id, arrival (monotonic seconds), status, completed
LogEntry = tuple[str, float, int, bool]
_BENCH_ID = re.compile(rb"^(bench|warmup)-(\d+)$")
_TTFT_HEADER = TTFT_HEADER.encode()
#: the streams whose TTFT is seeded and which are logged: Chat Completions, and Messages for
#: a gateway that reaches the same simulator through translation (the `translated` mode), so
#: request *i* waits as long in either API
_TRACKED = frozenset({"/v1/chat/completions", "/v1/messages"})


def profile_to_json(profile: SimProfile) -> dict[str, Any]:
    return dataclasses.asdict(profile)


def profile_from_json(data: dict[str, Any]) -> SimProfile:
    names = {f.name for f in dataclasses.fields(SimProfile)}
    return SimProfile(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass(frozen=True, slots=True)
class Outage:
    start: int = 0
    end: int = 0
    extra: float = 0.0


def request_ttft(profile: SimProfile, seed: int, backend: str, index: int,
                 outage: Outage = Outage(), *, warmup: bool = False) -> float:
    """The TTFT (seconds) of request `index` on `backend`: lognormal body, straggler
    probability, plus the outage's extra time inside its index range. Deterministic.
    Warm-up requests get the body only: they must end quickly and look ordinary."""
    rng = random.Random(f"{seed}/{backend}/{'warmup/' if warmup else ''}{index}")
    z, u = rng.gauss(0.0, 1.0), rng.random()
    ttft = profile.ttft_median * math.exp(profile.ttft_sigma * z) if profile.ttft_median else 0.0
    if warmup:
        return ttft
    if u < profile.straggler_probability:
        ttft += profile.straggler_extra
    if outage.start <= index < outage.end:
        ttft += outage.extra
    return ttft


class BenchSim:
    """ASGI app: `/bench/*` controls, everything else goes to the current simulator."""

    def __init__(self) -> None:
        self._reset(SimProfile(), 0, "a", Outage())

    def _reset(self, profile: SimProfile, seed: int, backend: str, outage: Outage) -> None:
        self._profile, self._seed, self._backend, self._outage = profile, seed, backend, outage
        self._inner: SimApp = create_sim_app(profile, seed=seed)
        self._log: list[LogEntry] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith("/bench/"):
            await self._control(scope, receive, send)
        elif scope["type"] == "http" and path in _TRACKED:
            await self._tracked(scope, receive, send)
        else:
            await self._inner(scope, receive, send)

    async def _tracked(self, scope: Scope, receive: Receive, send: Send) -> None:
        log = self._log  # a reset while this request runs must not receive its entry
        headers: list[tuple[bytes, bytes]] = [h for h in scope["headers"] if h[0] != _TTFT_HEADER]
        # the client's own id, which the gateway sends beside the UUID it puts in x-request-id
        raw_id = next((v for n, v in headers if n == b"x-client-request-id"), b"") or next(
            (v for n, v in headers if n == b"x-request-id"), b"")
        match = _BENCH_ID.match(raw_id)
        if match is not None:
            ttft = request_ttft(self._profile, self._seed, self._backend, int(match[2]),
                                self._outage, warmup=match[1] == b"warmup")
            headers.append((_TTFT_HEADER, f"{ttft * 1000.0:.3f}".encode()))
            scope = {**scope, "headers": headers}
        arrival = time.monotonic()
        status = 0
        completed = False

        async def watch(message: Message) -> None:
            nonlocal status, completed
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                completed = True
            await send(message)

        try:
            await self._inner(scope, receive, watch)
        finally:
            log.append((raw_id.decode("latin-1"), arrival, status, completed and status == 200))

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        path = scope["path"]
        response: Response
        if path == "/bench/reset" and request.method == "POST":
            data = await request.json()
            outage = data.get("outage") or {}
            self._reset(
                profile_from_json(data.get("profile", {})),
                int(data.get("seed", 0)),
                str(data.get("backend", "a")),
                Outage(int(outage.get("start", 0)), int(outage.get("end", 0)),
                       float(outage.get("extra_ms", 0.0)) / 1000.0),
            )
            response = JSONResponse({"ok": True})
        elif path == "/bench/log" and request.method == "GET":
            stats = dict(stats_of(self._inner))
            response = JSONResponse({"log": self._log, "stats": stats})
        else:
            response = JSONResponse({"error": "no such control"}, status_code=404)
        await response(scope, receive, send)


def serve_bench_sim(host: str, port: int) -> None:
    """Serve one benchmark backend until terminated."""
    uvicorn.run(
        BenchSim(),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The child's own two flags; the profile and seed come later, per run, through
    `POST /bench/reset`, so nothing else needs a flag."""
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.upstream",
                                     description="one simulated backend of hedge-gateway bench")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gateway.bench.upstream --port N`: serve one bench backend until terminated."""
    ns = parse_args(argv)
    serve_bench_sim(ns.host, ns.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
