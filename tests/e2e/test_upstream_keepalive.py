"""A kept-alive connection the upstream closed while the gateway's loop was busy.

Inference servers close idle connections after a few seconds (uvicorn's default is 5 s, under
vLLM, SGLang and llama-cpp-python); the gateway keeps them for 30. When the server's close
arrives while the gateway's event loop is busy, the close is still unread as the next request
picks that connection, and the request meets a closed socket. Seen in the conversations
benchmark: a turn failed over to another backend, cold for it, and prefilled its whole history
there. So the client drops a pooled connection whose server has closed it before writing on it
(`providers.http`), and takes the next one or a new one. A POST is sent again only when it
could not be written, once at most: one the server read and then dropped unanswered is not
repeated there (the server may have worked on it). The same raw upstream shows that the
client keeps no cookies (the last test).

The upstream is a raw asyncio server in its own thread, so the test decides the order: it
answers, closes, and tells the test; the test then blocks its own loop (as a busy gateway's
is) until the close has surely reached its socket, and sends the next request without
yielding to the loop first.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest

import providers.http as http_module
from gateway.errors import UpstreamDisconnected
from providers.http import UpstreamClient

TIMEOUT = aiohttp.ClientTimeout(sock_connect=2.0, sock_read=5.0)
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"


#: the path `ClosingUpstream` reads whole, works on (`hold`), then closes without an answer
SLOW = b"/v1/slow"


@dataclass
class ClosingUpstream:
    """Answers each connection's requests; closes a connection after `answers` of them
    (None: never) and sets `closed` when it has. A request for `SLOW` is read whole, counted
    in `slow_requests`, and after `hold` seconds its connection is closed unanswered (a
    proxy's timeout, a worker that died on the prompt). `heads`: each request's head, as
    received; `answer`: what each request is answered."""

    answers: int | None
    answer: bytes = ANSWER
    heads: list[bytes] = field(default_factory=list)
    port: int = 0
    connections: int = 0
    requests: int = 0
    closes: int = 0
    slow_requests: int = 0
    hold: float = 0.3
    closed: threading.Event = field(default_factory=threading.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while self.answers is None or served < self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.split(b" ", 2)[1] == SLOW:
                    self.slow_requests += 1
                    await asyncio.sleep(self.hold)
                    return
                self.requests += 1
                served += 1
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closes += 1
            self.closed.set()


@pytest.fixture
def serve() -> Iterator[Callable[..., ClosingUpstream]]:
    """Start `ClosingUpstream`s on 127.0.0.1, in a loop thread of their own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers: list[asyncio.Server] = []

    def start(answers: int | None, answer: bytes = ANSWER) -> ClosingUpstream:
        upstream = ClosingUpstream(answers, answer)
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(upstream.handle, "127.0.0.1", 0), loop).result(5.0)
        servers.append(server)
        upstream.port = server.sockets[0].getsockname()[1]
        return upstream

    yield start

    async def shutdown() -> None:
        """Close the servers and end their connection handlers, so no task is left pending
        for the garbage collector to destroy later (in some other test)."""
        for server in servers:
            server.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        for server in servers:
            await server.wait_closed()

    asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5.0)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5.0)
    loop.close()


async def post(client: UpstreamClient, upstream: ClosingUpstream, path: str = "/v1/x") -> bytes:
    response = await client.request("POST", f"http://127.0.0.1:{upstream.port}{path}",
                                    content=b"{}", headers={"content-type": "application/json"},
                                    timeout=TIMEOUT, pool_timeout=1.0)
    try:
        return b"".join([chunk async for chunk in response.chunks()])
    finally:
        response.close()


def wait_for_close(upstream: ClosingUpstream, closes: int = 1) -> None:
    """Block this thread, and so its loop, until the upstream has closed `closes` connections
    and their FINs have had time to reach our sockets (on loopback far less than 0.2 s)."""
    assert upstream.closed.wait(5.0)
    deadline = time.monotonic() + 5.0
    while upstream.closes < closes and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)


async def stale_pool(client: UpstreamClient, upstream: ClosingUpstream, count: int) -> None:
    """Leave `count` idle connections in the client's pool that the upstream has closed."""
    assert await asyncio.gather(*(post(client, upstream) for _ in range(count))) == \
        [b"ok"] * count
    assert upstream.connections == count
    wait_for_close(upstream, count)


async def test_a_request_on_a_connection_closed_while_idle_is_sent_again(
    serve: Callable[..., ClosingUpstream],
) -> None:
    upstream = serve(1)  # closes each connection after its first answer
    client = UpstreamClient(max_connections=4)
    try:
        assert await post(client, upstream) == b"ok"
        wait_for_close(upstream)
        # the pooled connection still looks open to our unrun loop: the request meets the
        # closed socket, and is sent again on a new connection
        assert await post(client, upstream) == b"ok"
    finally:
        await client.aclose()
    assert (upstream.connections, upstream.requests) == (2, 2)
    assert client.in_use == 0


async def test_a_fresh_connection_closed_unanswered_fails_as_before(
    serve: Callable[..., ClosingUpstream],
) -> None:
    upstream = serve(0)  # closes every connection without an answer
    client = UpstreamClient(max_connections=4)
    try:
        with pytest.raises(UpstreamDisconnected):
            await post(client, upstream)
    finally:
        await client.aclose()
    assert upstream.connections == 1  # not sent again: nothing says the server did not read it
    assert client.in_use == 0


async def test_a_kept_alive_connection_is_reused_while_the_upstream_keeps_it(
    serve: Callable[..., ClosingUpstream],
) -> None:
    upstream = serve(None)
    client = UpstreamClient(max_connections=4)
    try:
        for _ in range(3):
            assert await post(client, upstream) == b"ok"
    finally:
        await client.aclose()
    assert (upstream.connections, upstream.requests) == (1, 3)


async def test_each_request_knows_whether_its_connection_was_pooled_without_tracing(
    serve: Callable[..., ClosingUpstream],
) -> None:
    """Whether a request went out on a pooled connection decides whether it may be sent
    again; the connector knows it from its own record of the connections it handed out, not
    from aiohttp's request tracing (a dozen awaited signals per upstream request, on the
    first byte's path): the session traces nothing, and of three requests in a row the first
    took a new connection and the next two the kept-alive one."""
    upstream = serve(None)
    client = UpstreamClient(max_connections=4)
    records: list[http_module._Reuse] = []
    original = http_module._Reuse

    class Recorded(original):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__()
            records.append(self)

    http_module._Reuse = Recorded  # type: ignore[misc]
    try:
        for _ in range(3):
            assert await post(client, upstream) == b"ok"
        assert client._get_session().trace_configs == []
    finally:
        http_module._Reuse = original  # type: ignore[misc]
        await client.aclose()
    assert [record.reused for record in records] == [False, True, True]
    assert (upstream.connections, upstream.requests) == (1, 3)


async def test_several_stale_connections_are_passed_until_a_fresh_one_answers(
    serve: Callable[..., ClosingUpstream],
) -> None:
    upstream = serve(1)
    client = UpstreamClient(max_connections=8)
    try:
        await stale_pool(client, upstream, 3)
        assert await post(client, upstream) == b"ok"  # three stale, then a new connection
    finally:
        await client.aclose()
    assert (upstream.connections, upstream.requests) == (4, 4)
    assert client.in_use == 0


async def test_a_failed_try_lets_the_loop_read_the_other_closes(
    serve: Callable[..., ClosingUpstream],
) -> None:
    """At most the first try meets a stale connection: while it fails, the loop reads the
    other connections' closes, and the pool drops them before the next try (whether the
    first try still finds one open depends on what the loop ran before it picked one)."""
    upstream = serve(1)
    client = UpstreamClient(max_connections=8)
    tries: list[bool] = []
    original = http_module._closed_idle

    def counted(exc: BaseException, reuse: http_module._Reuse) -> bool:
        tries.append(original(exc, reuse))
        return tries[-1]

    http_module._closed_idle = counted
    try:
        await stale_pool(client, upstream, 5)
        assert await post(client, upstream) == b"ok"
    finally:
        http_module._closed_idle = original
        await client.aclose()
    assert tries in ([], [True])
    assert (upstream.connections, upstream.requests) == (6, 6)
    assert client.in_use == 0


async def test_a_post_the_server_read_and_then_dropped_is_not_sent_again(
    serve: Callable[..., ClosingUpstream],
) -> None:
    """Four answered requests leave four idle kept-alive connections; the server reads the
    next POST whole, works on it, and closes without an answer. It may have done the work
    (a prefill), so the client fails (the race fails over) rather than repeat it there."""
    upstream = serve(None)
    client = UpstreamClient(max_connections=8)
    try:
        assert await asyncio.gather(*(post(client, upstream) for _ in range(4))) == [b"ok"] * 4
        assert upstream.connections == 4
        with pytest.raises(UpstreamDisconnected):
            await post(client, upstream, SLOW.decode())
    finally:
        await client.aclose()
    assert upstream.slow_requests == 1  # received once
    assert upstream.connections == 4  # on a kept-alive connection, and nothing opened after
    assert client.in_use == 0


#: an answer that sets cookies, as a backend's session or a load balancer's stickiness would
COOKIES = (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nSet-Cookie: session=tenant-a; Path=/\r\n"
           b"Set-Cookie: AWSALB=target-1; Path=/\r\n\r\nok")


async def test_a_cookie_an_upstream_sets_is_never_sent_back(
    serve: Callable[..., ClosingUpstream]
) -> None:
    """The upstream client keeps no cookies: it carries every client's and every key's
    requests, and a cookie jar would send what a backend set on one tenant's answer with
    every later request to that host. The upstream is named `localhost` here, since a cookie
    jar refuses cookies from a bare IP address."""
    upstream = serve(None, COOKIES)
    client = UpstreamClient(max_connections=4)
    try:
        for _ in range(3):
            response = await client.request(
                "POST", f"http://localhost:{upstream.port}/v1/chat/completions",
                content=b"{}", headers={"content-type": "application/json"},
                timeout=TIMEOUT, pool_timeout=1.0)
            try:
                assert b"".join([chunk async for chunk in response.chunks()]) == b"ok"
            finally:
                response.close()
    finally:
        await client.aclose()
    assert len(upstream.heads) == 3
    assert all(b"\r\ncookie:" not in head.lower() for head in upstream.heads), upstream.heads
