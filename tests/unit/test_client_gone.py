"""The server's watcher of a request's client (`GONE_EXTENSION`): the real HTTP protocol of
`hedge-gateway serve` (`GatewayHttpProtocol`) on a transport that records its writes. The
proxy watches the client through this future for the whole request, instead of a task
reading `receive` until `http.disconnect`; so it must resolve when the connection is lost,
at once for a request whose connection is already gone, and never for one that ended."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref
from collections.abc import Callable
from typing import Any

from uvicorn.server import ServerState

from gateway.server.connection import ConnectionLimits, GatewayConfig, GatewayHttpProtocol
from gateway.server.extensions import GONE_EXTENSION
from tests.unit.test_head_with_first_event import REQUEST, RecordingTransport


async def _connection(app: Callable[[Any, Any, Any], Any]
                      ) -> tuple[GatewayHttpProtocol, RecordingTransport]:
    config = GatewayConfig(app, limits=ConnectionLimits(), http=GatewayHttpProtocol,
                           lifespan="off", log_config=None, access_log=False)
    config.load()
    protocol = GatewayHttpProtocol(config=config, server_state=ServerState(), app_state={},
                                   _loop=asyncio.get_running_loop())
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


def _gone(scope: Any) -> asyncio.Future[None]:
    future: asyncio.Future[None] = scope["extensions"][GONE_EXTENSION]["gone"]()
    return future


async def test_the_future_resolves_when_the_connection_is_lost_mid_request() -> None:
    asked: asyncio.Future[asyncio.Future[None]] = asyncio.get_running_loop().create_future()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the body
        gone = _gone(scope)
        asked.set_result(gone)
        await gone  # the race, until the client leaves

    protocol, _ = await _connection(app)
    protocol.data_received(REQUEST)
    gone = await asyncio.wait_for(asked, 5.0)
    assert not gone.done()
    protocol.connection_lost(ConnectionResetError())
    await asyncio.wait_for(gone, 5.0)
    assert gone.result() is None and not gone.cancelled()


async def test_a_request_whose_client_already_left_gets_it_resolved() -> None:
    got: list[asyncio.Future[None]] = []
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await release.wait()  # the client leaves while the body is checked
        got.append(_gone(scope))

    protocol, _ = await _connection(app)
    protocol.data_received(REQUEST)
    await asyncio.sleep(0.01)
    protocol.connection_lost(None)
    release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    (gone,) = got
    assert gone.done() and gone.result() is None


async def test_a_cancelled_future_stays_cancelled_and_the_next_request_gets_its_own() -> None:
    """The end of a request cancels its watcher; the connection's loss later must not touch
    it (setting a cancelled future raises), and a kept-alive connection's next request gets a
    future of its own."""
    futures: list[asyncio.Future[None]] = []
    answered = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        gone = _gone(scope)
        futures.append(gone)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        gone.cancel()  # the request's end
        answered.set()

    protocol, transport = await _connection(app)
    for _ in range(2):
        answered.clear()
        protocol.data_received(REQUEST)
        await asyncio.wait_for(answered.wait(), 5.0)
        for _ in range(3):
            await asyncio.sleep(0)
    protocol.connection_lost(None)
    assert len(futures) == 2 and futures[0] is not futures[1]
    assert all(f.cancelled() for f in futures)
    assert sum(w.startswith(b"HTTP/1.1 200") for w in transport.writes) == 2


async def test_a_finished_request_is_freed_without_the_collector() -> None:
    """The hook is the protocol's own method: one holding the request's cycle made the
    cycle and its scope (the request's state, summary and all) a reference cycle, which only
    the collector frees: at c=50 that held some 14 MB more at the peak."""
    cycles: list[weakref.ref[Any]] = []
    answered = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        gone = _gone(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        gone.cancel()
        answered.set()

    protocol, _ = await _connection(app)
    gc.disable()
    try:
        for _ in range(2):
            answered.clear()
            protocol.data_received(REQUEST)
            assert protocol.cycle is not None
            cycles.append(weakref.ref(protocol.cycle))
            await asyncio.wait_for(answered.wait(), 5.0)
            for _ in range(3):
                await asyncio.sleep(0)
        assert cycles[0]() is None  # the first request's cycle, freed as it ended
    finally:
        gc.enable()
        protocol.connection_lost(None)


async def test_a_client_that_leaves_after_a_large_body_is_seen_to_leave() -> None:
    """A body past uvicorn's high-water mark (64 KiB) that arrives in one read pauses the
    connection's reading, and taking it does not resume it: the watcher task did, by reading
    `receive`. Asked for, the future resumes reading, so the client's close is seen. A real
    socket pair: a fake transport cannot pause."""
    loop = asyncio.get_running_loop()
    asked: asyncio.Future[asyncio.Future[None]] = loop.create_future()
    size = 100_000

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive())["more_body"]:  # the body, as the routes read it
            pass
        gone = _gone(scope)
        asked.set_result(gone)
        await gone

    config = GatewayConfig(app, limits=ConnectionLimits(), http=GatewayHttpProtocol,
                           lifespan="off", log_config=None, access_log=False)
    config.load()
    protocol = GatewayHttpProtocol(config=config, server_state=ServerState(), app_state={},
                                   _loop=loop)
    ours, client = socket.socketpair()
    try:
        await loop.connect_accepted_socket(lambda: protocol, ours)
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
                       b"content-length: %d\r\n\r\n" % size)
        await asyncio.sleep(0.05)  # the app waits for the body
        client.sendall(b"x" * size)
        gone = await asyncio.wait_for(asked, 5.0)
        client.close()  # the client leaves
        await asyncio.wait_for(gone, 5.0)
        assert gone.result() is None
    finally:
        client.close()
        if not protocol.transport.is_closing():
            protocol.transport.abort()


async def test_a_closed_connections_last_request_is_freed_without_the_collector() -> None:
    """Its scope's hooks (abort, hold) are the protocol's, and the protocol held the cycle:
    once the connection is lost the protocol lets go of it, so the request's objects go then,
    not at the collector's next pass over a long-lived connection."""
    answered = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        answered.set()

    protocol, _ = await _connection(app)
    gc.disable()
    try:
        protocol.data_received(REQUEST)
        assert protocol.cycle is not None
        last = weakref.ref(protocol.cycle)
        await asyncio.wait_for(answered.wait(), 5.0)
        for _ in range(3):
            await asyncio.sleep(0)
        protocol.connection_lost(None)
        assert last() is None
    finally:
        gc.enable()
