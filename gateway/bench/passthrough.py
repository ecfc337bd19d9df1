"""The least proxy this stack can be: the bench's `passthrough` mode.

uvicorn (httptools, uvloop, no access log: as `hedge-gateway serve` runs) in front of one
shared aiohttp client session with kept-alive connections (as the gateway's upstream client
pools them), and between them a bare ASGI callable that reads the request body, sends it
with the client's headers (as nginx's `proxy_pass` does: the bench's request id, which seeds
the simulator's timing and names its log entry, included) to the next upstream in turn, and
copies the answer's status, content type and body chunks back as they arrive. No parsing of
the request or the answer, no pool, no race, no statistics: the same front server and
upstream client as the gateway with nothing of the gateway between them.

So a run that has nginx and this beside the gateway splits the gateway's added latency and
CPU in two: what this stack costs by itself (this mode over nginx), and what the gateway
adds on it (the gateway over this mode). Run as
`python -m gateway.bench.passthrough --port P --upstream http://127.0.0.1:Q ...`
(`gateway.bench.servers.passthrough_command`).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Sequence

import aiohttp
import uvicorn
from starlette.types import Receive, Scope, Send

#: the client's headers not sent on: the connection's own, and those aiohttp writes itself
#: for the request it sends (its host, its body's length)
_NOT_FORWARDED = frozenset({b"host", b"connection", b"keep-alive", b"content-length",
                            b"transfer-encoding", b"upgrade", b"te", b"trailer",
                            b"proxy-connection"})


class Passthrough:
    """The ASGI app: each request to the next of `upstreams`, its answer copied back."""

    def __init__(self, upstreams: Sequence[str]) -> None:
        self._upstreams: Iterator[str] = itertools.cycle(upstreams)
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._proxy(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self._session is not None, "served before the lifespan's startup"
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        query = scope.get("query_string", b"")
        url = next(self._upstreams) + scope["path"] + ("?" + query.decode("latin-1")
                                                       if query else "")
        headers = [(name.decode("latin-1"), value.decode("latin-1"))
                   for name, value in scope["headers"] if name not in _NOT_FORWARDED]
        async with self._session.request(scope["method"], url, data=body,
                                         headers=headers) as answer:
            kind = answer.headers.get("content-type")
            await send({"type": "http.response.start", "status": answer.status, "headers": [
                (b"content-type", kind.encode("latin-1"))] if kind else []})
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.passthrough",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True,
                        help="an upstream's base URL (repeat: each request to the next)")
    ns = parser.parse_args(argv)
    uvicorn.run(Passthrough(ns.upstream), host="127.0.0.1", port=ns.port, loop="uvloop",
                http="httptools", ws="none", lifespan="on", log_level="warning",
                access_log=False, proxy_headers=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
