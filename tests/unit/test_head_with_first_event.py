"""A stream's response head leaves with its first event, in one write to the socket: the
real HTTP protocol of `hedge-gateway serve` (`GatewayHttpProtocol`, uvicorn's httptools
protocol underneath) and the real `SSEResponse`, on a transport that records each write.
Written apart, the head cost a system call and a packet of its own before the client's first
token; the hold is the server's, asked for by the response (`HOLD_HEAD_EXTENSION`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from uvicorn.server import ServerState

from gateway.api.stream import SSEResponse
from gateway.drain import Drain
from gateway.server.connection import (
    ConnectionLimits,
    GatewayConfig,
    GatewayHttpProtocol,
    _CloseHook,
)

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}"
FIRST, SECOND = b"data: first\n\n", b"data: second\n\n"


class RecordingTransport(asyncio.Transport):
    """What the protocol writes, one entry per `write` (one send on a real socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default)


def serve_one(body: AsyncIterator[bytes],
              on_first_sent: Callable[[], None] | None = None) -> list[bytes]:
    """One request through the protocol; the app answers with an `SSEResponse` of `body`.
    The transport's writes, in order."""

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            async def on_close(_end: object) -> None:
                pass

            try:
                await SSEResponse(body, keepalive=15.0, stuck_client=30.0,
                                  drain=Drain(loop.time), grace=1.0, shutdown_event=b"",
                                  on_close=on_close, clock=loop.time,
                                  first_ready=True, on_first_sent=on_first_sent,
                                  )(scope, receive, send)
            finally:
                done.set_result(None)

        config = GatewayConfig(app, limits=ConnectionLimits(), http=GatewayHttpProtocol,
                               lifespan="off", log_config=None, access_log=False)
        config.load()
        protocol = GatewayHttpProtocol(config=config, server_state=ServerState(),
                                       app_state={}, _loop=loop)
        transport = RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(REQUEST)
        await asyncio.wait_for(done, 5.0)
        for _ in range(3):  # the server's own end of the response
            await asyncio.sleep(0)
        protocol.connection_lost(None)
        return transport.writes

    return asyncio.run(main())


async def two_events() -> AsyncIterator[bytes]:
    yield FIRST
    await asyncio.sleep(0)
    yield SECOND


def test_the_head_and_the_first_event_leave_in_one_write() -> None:
    writes = serve_one(two_events())
    first = writes[0]
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    head, _, rest = first.partition(b"\r\n\r\n")
    assert b"content-type: text/event-stream" in head
    assert FIRST in rest and SECOND not in rest  # the first event, and only it
    assert any(SECOND in w for w in writes[1:])  # the rest as before, after it
    assert writes[-1].endswith(b"0\r\n\r\n")  # the chunked body ended


async def no_events() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator that yields nothing


def test_a_stream_without_events_still_sends_its_head_and_its_end() -> None:
    writes = serve_one(no_events())
    joined = b"".join(writes)
    assert joined.startswith(b"HTTP/1.1 200 OK\r\n")
    assert joined.endswith(b"0\r\n\r\n")



def test_the_first_sent_hook_runs_once_the_first_event_is_out_before_the_second() -> None:
    """What waits for the first bytes (the race's learning) runs after they left, and before
    the response asks its body for more."""
    seen: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        seen.append("first taken")
        yield FIRST
        seen.append("second taken")
        yield SECOND

    writes = serve_one(body(), on_first_sent=lambda: seen.append("hook"))
    assert seen == ["first taken", "hook", "second taken"]
    assert FIRST in writes[0]


def test_a_held_head_joins_the_next_write_only_and_a_close_still_sends_it() -> None:
    """The hold covers two writes: the head, then the piece it goes out with; every later
    write is the plain one, and a close sends a head whose piece never came."""
    transport = RecordingTransport()
    closed: list[bool] = []
    hook = _CloseHook(transport, lambda: closed.append(True))
    hook.hold()
    hook.write(b"head")
    assert transport.writes == []
    hook.write(b"first")
    hook.write(b"second")
    assert transport.writes == [b"headfirst", b"second"]

    transport = RecordingTransport()
    hook = _CloseHook(transport, lambda: closed.append(True))
    hook.hold()
    hook.write(b"head")
    hook.close()
    hook.write(b"late")
    assert transport.writes == [b"head", b"late"] and closed == [True]
