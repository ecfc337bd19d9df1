"""One simulated cloud of `hedge-gateway bench --workload claude-everywhere`, as a child process.

The workload races one Claude pool over three wire formats: Anthropic's Messages API (SSE at
`/v1/messages`, `providers.sim.server`), Bedrock (SigV4-signed, AWS event-stream frames,
`providers.sim.bedrock`) and Vertex (OAuth from a service account, SSE at Vertex's path,
`providers.sim.vertex`). Each runs here, in a process of its own, with what the bench needs on
top:

- **Seeded TTFT per request.** As for the other workloads (`gateway.bench.upstream`), request
  *i*'s time to first token on backend *b* is `request_ttft(profile, seed, b, i)`, with *i*
  from the client's id `bench-<i>` that the gateway sends upstream as `x-client-request-id`:
  every mode and every run with the same seed sees the same latency per backend and request.
  The three clouds draw independently (backends `a`, `b`, `c`).
- **Credentials the gateway can use.** Bedrock checks a fixed bench key pair (`AWS_KEY`);
  Vertex generates a service account and writes its key file, whose `token_uri` is this
  process, to `--key-file`, for the gateway's config to name.
- `GET /ready`: 200 once serving (the Bedrock and Vertex apps answer only their own routes).

Run as `python -m gateway.bench.cloudsims --kind bedrock --port N --seed S --backend b`; it
parses its own flags, as `gateway.bench.upstream` does and for the same reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Sequence

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.bench.upstream import request_ttft
from gateway.settings import SimProfile
from providers.sim.bedrock import AwsKey, BedrockSimulator
from providers.sim.cloud import CallRecord, Reply, Responder
from providers.sim.server import create_sim_app
from providers.sim.vertex import ServiceAccount, VertexSimulator
from providers.sim.wire import TTFT_HEADER

KINDS = ("anthropic", "bedrock", "vertex")
#: the stragglers workload's latency: lognormal TTFT (median 150 ms, sigma 0.25) and 3 %
#: stragglers 1.5 s later; 20 tokens, sent at once (the race is to the first one)
PROFILE = SimProfile(ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.03,
                     straggler_extra=1.5, tokens=20, inter_token=0.0)
TEXTS = tuple(f"tok{i} " for i in range(PROFILE.tokens))
AWS_KEY = AwsKey("AKIDHEDGEBENCH000001", "bench-secret-key-0123456789abcdef", None)
REGION = "us-east-1"
PROJECT = "bench-project"
VERTEX_REGION = "europe-west1"
_BENCH_ID = re.compile(r"^(bench|warmup)-(\d+)$")


def ttft_of(request_id: str, seed: int, backend: str) -> float:
    """The seeded TTFT of the request with the client id `request_id` on `backend` (0 for an
    id that is no bench request's)."""
    match = _BENCH_ID.match(request_id)
    if match is None:
        return 0.0
    return request_ttft(PROFILE, seed, backend, int(match[2]), warmup=match[1] == "warmup")


class _Ready:
    """`GET /ready` answered here; everything else goes to the simulator. For the Anthropic
    simulator, the seeded TTFT goes in as its `x-sim-ttft-ms` override."""

    def __init__(self, inner: ASGIApp, seed: int, backend: str, *, override: bool) -> None:
        self._inner, self._seed, self._backend, self._override = inner, seed, backend, override

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/ready":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        if self._override and scope["type"] == "http":
            headers = dict(scope["headers"])
            client_id = headers.get(b"x-client-request-id", b"").decode("latin-1")
            ttft = ttft_of(client_id, self._seed, self._backend)
            scope = {**scope, "headers": [*scope["headers"],
                                          (TTFT_HEADER.encode(), f"{ttft * 1000:.3f}".encode())]}
        await self._inner(scope, receive, send)


def _seeded_reply(seed: int, backend: str) -> Responder:
    def respond(call: CallRecord) -> Reply:
        ttft = ttft_of(call.headers.get("x-client-request-id", ""), seed, backend)
        return Reply(texts=TEXTS, hold=lambda: asyncio.sleep(ttft))

    return respond


def build_app(kind: str, port: int, seed: int, backend: str, key_file: str | None) -> ASGIApp:
    """The simulator of `kind`, listening at `port` (Vertex's token URI names it)."""
    if kind == "anthropic":
        return _Ready(create_sim_app(PROFILE, seed=seed), seed, backend, override=True)
    respond = _seeded_reply(seed, backend)
    if kind == "bedrock":
        bedrock = BedrockSimulator(region=REGION, keys=[AWS_KEY], responder=respond)
        return _Ready(bedrock.app, seed, backend, override=False)
    if kind != "vertex" or key_file is None:
        raise ValueError(f"unknown kind {kind!r}, or vertex without --key-file")
    account = ServiceAccount.generate()
    vertex = VertexSimulator(project=PROJECT, region=VERTEX_REGION, service_account=account,
                             responder=respond)
    vertex.bind(f"http://127.0.0.1:{port}")
    with open(key_file, "w", encoding="utf-8") as file:
        json.dump(account.key_file(vertex.token_uri, PROJECT), file)
    return _Ready(vertex.app, seed, backend, override=False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.cloudsims",
                                     description="one simulated cloud of the bench")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backend", default="a", help="the name its latency draws use")
    parser.add_argument("--key-file", help="vertex: where to write its service account's key")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    app = build_app(ns.kind, ns.port, ns.seed, ns.backend, ns.key_file)
    uvicorn.run(app, host="127.0.0.1", port=ns.port, log_level="warning", access_log=False,
                lifespan="off", timeout_graceful_shutdown=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
