"""A cancelled attempt closes its upstream socket, whatever moment the cancel lands.

The soak (`hedge-gateway bench --workload soak`) left upstream sockets in CLOSE_WAIT: the
backend had closed them, the gateway never did. The cause: a hedge that got a `429` closes that
response inside `provider.open`, and the race's `Task.cancel()` (another attempt had just
committed) landed on the close's first await. An anyio or httpcore shield does not hold back a
native cancel, so the close stopped half-way and the HTTP client kept the connection marked in
use for ever. The window is one event-loop iteration, so the test does not try to hit it by
timing: it cancels the attempt after 0, 1, 2, ... loop iterations until the attempt finishes on
its own before the cancel, and after each one requires that the process holds no socket to the
upstream any more. Checked at the socket level (psutil), not in the HTTP client's pool, so it
holds for any client library.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from gateway.app import build_pools, make_http_client
from gateway.clock import monotonic
from gateway.errors import UpstreamError
from gateway.hedge.attempt import open_until_first_token, open_whole_response
from gateway.hedge.prefix import Prefix
from gateway.wire.base import WireProtocol
from gateway.wire.chat import CHAT
from providers.base import Provider, UpstreamCall
from tests.harness import (
    Head,
    LoopThread,
    RecordedRequest,
    Script,
    Send,
    Sleep,
    UpstreamFactory,
    json_script,
)
from tests.harness.builders import POOL, gateway_settings

_psutil: Any = importlib.import_module("psutil")

#: loop iterations swept at most (the attempt ends on its own after a few dozen)
MAX_TICKS = 400
#: the sweep ends once the attempt finished before its cancel this many times in a row
FINISHED_IN_A_ROW = 3

Opener = Callable[[Provider, UpstreamCall, Callable[[], bool], WireProtocol],
                  Coroutine[Any, Any, Prefix]]


def sockets_to(port: int) -> list[str]:
    """This process's TCP sockets connected to `port` (the client side of the upstream)."""
    conns = _psutil.Process().net_connections(kind="tcp")
    return [f"{c.laddr.ip}:{c.laddr.port} -> :{port} ({c.status})"
            for c in conns if c.raddr and c.raddr.port == port]


async def closed_within(port: int, timeout: float) -> list[str]:
    """Poll until no socket to `port` is left (closing is asynchronous); what is left."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (left := sockets_to(port)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return left


async def sweep(provider: Provider, call: UpstreamCall, opener: Opener,
                port: int) -> tuple[int, list[str]]:
    """Cancel an attempt after k loop iterations, k = 0, 1, ...; (ticks swept, first leak)."""
    in_a_row = 0
    for ticks in range(MAX_TICKS):
        attempt = asyncio.create_task(opener(provider, call, lambda: False, CHAT))
        for _ in range(ticks):
            await asyncio.sleep(0)
        in_a_row = in_a_row + 1 if attempt.done() else 0
        attempt.cancel()
        with contextlib.suppress(asyncio.CancelledError, UpstreamError):
            await attempt
        left = await closed_within(port, 2.0)
        if left:
            return ticks, left
        if in_a_row >= FINISHED_IN_A_ROW:
            return ticks, []
    return MAX_TICKS, []


@pytest.mark.parametrize(
    ("script", "stream", "opener"),
    [
        (json_script({"error": {"message": "slow down"}}, 429, headers={"retry-after": "1"}),
         True, open_until_first_token),
        (json_script({"error": {"message": "slow down"}}, 429, headers={"retry-after": "1"}),
         False, open_whole_response),
        (json_script({"not": "sse"}, 200, headers={"content-type": "text/html"}),
         True, open_until_first_token),
    ],
    ids=["429-streaming", "429-whole", "wrong-content-type"],
)
def test_an_attempt_cancelled_at_any_moment_leaves_no_upstream_socket(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, script: Script, stream: bool,
    opener: Opener,
) -> None:
    def respond(_request: RecordedRequest) -> Script:
        return script  # `close=True`: the upstream closes its side after each answer

    upstream = scripted_upstream.one(responder=respond)
    settings = gateway_settings([upstream.base_url])

    async def build() -> tuple[Provider, Callable[[], Awaitable[None]]]:
        client = make_http_client(settings)
        pools = build_pools(settings, client, monotonic, random.Random(1))
        return next(iter(pools[POOL].providers.values())), client.aclose

    provider, close_client = loop_thread.run(build())
    loop_thread.add_cleanup(close_client)
    call = UpstreamCall("chat/completions", {"model": "m", "stream": stream}, stream, "r-1", 10.0)

    ticks, left = loop_thread.run(sweep(provider, call, opener, upstream.port), timeout=120.0)

    assert left == [], f"cancelled after {ticks} loop iterations, left open: {left}"
    assert ticks < MAX_TICKS, "the attempt never finished on its own: the sweep is incomplete"
    assert len(upstream.requests) > FINISHED_IN_A_ROW


def test_a_request_cancelled_while_its_pool_drops_dead_connections_closes_them_all(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
) -> None:
    """A request first closes the pooled connections the upstream has closed meanwhile; a
    cancel landing after the first of several such closes must not orphan the others (they
    left the pool already, so nothing would ever close their sockets: CLOSE_WAIT)."""
    def respond(_request: RecordedRequest) -> Script:
        # the upstream says keep-alive, then closes once the client is done with the response:
        # the client finds out only when it next uses its pool
        body = json.dumps({"data": [{"embedding": [0.0]}]}).encode()
        return Script(headers={"content-type": "application/json", "connection": "keep-alive"},
                      steps=[Head(), Send(body), Sleep(0.1)], framing="length")

    upstream = scripted_upstream.one(responder=respond)
    settings = gateway_settings([upstream.base_url])
    call = UpstreamCall("embeddings", {"model": "m", "input": "x"}, False, "r-1", 10.0)

    async def build() -> tuple[Provider, Callable[[], Awaitable[None]]]:
        client = make_http_client(settings)
        pools = build_pools(settings, client, monotonic, random.Random(1))
        return next(iter(pools[POOL].providers.values())), client.aclose

    provider, close_client = loop_thread.run(build())
    loop_thread.add_cleanup(close_client)

    async def one() -> None:
        prefix = await open_whole_response(provider, call, lambda: False, CHAT)
        await prefix.aclose()

    async def sweep_dead() -> tuple[int, list[str]]:
        in_a_row = 0
        for ticks in range(MAX_TICKS):
            await asyncio.gather(one(), one(), one())  # three idle connections...
            await upstream.until(lambda: upstream.open_connections == 0)  # ...now dead
            attempt = asyncio.create_task(one())
            for _ in range(ticks):
                await asyncio.sleep(0)
            in_a_row = in_a_row + 1 if attempt.done() else 0
            attempt.cancel()
            with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                await attempt
            await upstream.until(lambda: upstream.open_connections == 0)
            await one()  # its pool closes whatever dead connection it still holds
            await upstream.until(lambda: upstream.open_connections == 0)
            left = sockets_to(upstream.port)
            if len(left) > 1:  # the last request's own connection may stay (CLOSE_WAIT)
                return ticks, left
            if in_a_row >= FINISHED_IN_A_ROW:
                return ticks, []
        return MAX_TICKS, []

    ticks, left = loop_thread.run(sweep_dead(), timeout=120.0)

    assert left == [], f"cancelled after {ticks} loop iterations, left open: {left}"
    assert ticks < MAX_TICKS, "the attempt never finished on its own: the sweep is incomplete"
