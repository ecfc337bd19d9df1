"""The upstream client keeps no cookies: one client's answer must not ride on another's request.

The gateway's upstream client is shared by every request of every client and key. A client
library's cookie jar stores what a server sets and sends it back on later requests to that
host: a backend (or the load balancer in front of it) that sets a session or stickiness
cookie on one tenant's answer would then see it again on every other tenant's request. The
client drops every cookie (`providers.http.UpstreamClient`).

The upstream is a raw asyncio server on 127.0.0.1 that records each request's head; the
client names it `localhost`, since a cookie jar refuses cookies from a bare IP address.
"""

from __future__ import annotations

import asyncio

import aiohttp

from providers.http import UpstreamClient

TIMEOUT = aiohttp.ClientTimeout(sock_connect=2.0, sock_read=5.0)
ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nSet-Cookie: session=tenant-a; Path=/\r\n"
          b"Set-Cookie: AWSALB=target-1; Path=/\r\n\r\nok")


async def test_a_cookie_an_upstream_sets_is_never_sent_back() -> None:
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head)
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = UpstreamClient(max_connections=4)
    try:
        for _ in range(3):
            response = await client.request(
                "POST", f"http://localhost:{port}/v1/chat/completions", content=b"{}",
                headers={"content-type": "application/json"}, timeout=TIMEOUT,
                pool_timeout=1.0)
            try:
                assert b"".join([chunk async for chunk in response.chunks()]) == b"ok"
            finally:
                response.close()
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert len(heads) == 3
    assert all(b"\r\ncookie:" not in head.lower() for head in heads), heads
