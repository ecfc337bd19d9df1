"""The bench's lean load client against real simulators on loopback: keep-alive, the oracle
closing its loser at once, and every transport failure as a labelled Sample."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.bench.load import best_of, stream_one, worker_client
from gateway.settings import SimProfile
from providers.sim.server import create_sim_app
from tests.harness.asgi import RunningServer, serve_asgi, wait_for_sim_stats

FAST = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=5,
                  inter_token=0.0)
#: a TTFT no test waits for: only a closed connection ends these streams early
SLOW = SimProfile(ttft_median=30.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=5)
BODY = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@asynccontextmanager
async def sims(*profiles: SimProfile) -> AsyncIterator[list[RunningServer]]:
    running = [await serve_asgi(create_sim_app(p, seed=1)) for p in profiles]
    try:
        yield running
    finally:
        for server in running:
            await server.stop()


def chat(server: RunningServer) -> str:
    return server.url("/v1/chat/completions")


async def test_streams_are_read_whole_on_one_kept_alive_connection() -> None:
    async with sims(FAST) as (sim,), worker_client() as client:
        samples = [await stream_one(client, chat(sim), i, body=BODY) for i in range(3)]
        assert all(s.ok and s.error is None for s in samples), samples
        assert {s.events for s in samples} == {8}  # role, 5 tokens, finish, usage
        assert all(s.ttft is not None and s.ttft <= s.total for s in samples)
        assert len(sim.server.server_state.connections) == 1  # one connection, reused
        stats = await wait_for_sim_stats(sim.base_url, "streams_completed", 3)
        assert stats["streams_closed_early"] == 0


async def test_the_oracle_closes_the_loser_at_the_winners_first_token() -> None:
    async with sims(FAST, SLOW) as (fast, slow), worker_client() as client:
        sample = await best_of(client, [chat(fast), chat(slow)], 0, body=BODY)
        assert sample.ok and sample.error is None
        # the loser was still waiting for its first token: its connection is gone at once
        stats = await wait_for_sim_stats(slow.base_url, "streams_closed_early", 1)
        assert stats["open_streams"] == 0 and stats["streams_completed"] == 0
        await wait_for_sim_stats(fast.base_url, "streams_completed", 1)


async def test_a_silent_upstream_is_a_read_timeout_and_its_stream_is_closed() -> None:
    async with sims(SLOW) as (slow,), worker_client(timeout=0.3) as client:
        sample = await stream_one(client, chat(slow), 0, body=BODY)
        assert not sample.ok and sample.error == "transport: ReadTimeout"
        assert sample.events == 1  # the role chunk came, then nothing
        stats = await wait_for_sim_stats(slow.base_url, "streams_closed_early", 1)
        assert stats["open_streams"] == 0


async def test_error_statuses_and_refused_connections_are_labelled() -> None:
    failing = SimProfile(fail_probability=1.0, fail_status=503)
    async with sims(failing) as (sim,), worker_client() as client:
        first = await stream_one(client, chat(sim), 0, body=BODY)
        second = await stream_one(client, chat(sim), 1, body=BODY)
        assert first.error == second.error == "status 503"
        assert len(sim.server.server_state.connections) == 1  # drained, so kept alive
    with socket.socket() as sock:  # a port that was free a moment ago: nobody listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with worker_client() as client:
        refused = await stream_one(client, f"http://127.0.0.1:{port}/v1/chat/completions", 0)
        assert refused.error == "transport: ConnectError"
