"""How `hedge-gateway serve` runs the app under uvicorn: shutdown, header limit, stuck clients.

Three things plain `uvicorn.run` does not do the way a gateway needs:

- Graceful shutdown. uvicorn tells the app only at the *end* of its graceful period, so live
  streams would be cut without a word. `GatewayServer` starts the app's `Drain` the moment
  SIGTERM/SIGINT arrives: new requests get 503, live streams get `shutdown_grace` seconds to
  finish and then a final error event, and uvicorn's own hard timeout is set a little later.
  It also exits with status 0 after a graceful stop instead of re-raising the signal (which
  uvicorn does so that an embedding program sees it; for our CLI it turns a clean stop into
  "killed by SIGTERM").
- A bound on the request head. uvicorn applies `h11_max_incomplete_event_size` only to its
  h11 parser; with httptools (the fast parser `uvicorn[standard]` installs and prefers) a
  client can send an endless header line or URL and the server buffers all of it.
  `GatewayHttpProtocol` counts head bytes as they arrive and answers 431 past the limit.
- Aborting a stuck client. A response that stops because its client stopped reading cannot
  complete, and uvicorn then only `close()`s the transport, which waits for the unsent
  buffer to drain: forever, for a client that never reads. The protocol puts an `abort`
  callable into the ASGI scope (extension `ABORT_EXTENSION`) that drops the connection at
  once; `SSEResponse` uses it when present.

It also installs the SIGHUP handler (reload the configuration, SPEC §18) on the running loop
while it serves: the loop runs the reload between requests, so none sees half of it. Without
a handler SIGHUP would kill the process, so one is installed even with nothing to reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.drain import Drain
from gateway.settings import ServerSettings
from gateway.sseresponse import ABORT_EXTENSION

#: uvicorn's hard graceful-shutdown timeout is `shutdown_grace` plus this: our final error
#: events go out first, and the app's own cleanup (closing upstreams) has time to finish
SHUTDOWN_MARGIN = 3.0
DEFAULT_HEAD_LIMIT = 16 * 1024


class HeadTooLarge(Exception):
    """Raised inside the parser callback to stop parsing a head that is over the limit."""


def _head_too_large_response(limit: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"request line and headers exceed {limit} bytes",
                "type": "invalid_request_error",
                "param": None,
                "code": "headers_too_large",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head and an abort extension.

    The limit is the config's `h11_max_incomplete_event_size` (the same setting h11 uses).
    While a head is being read, every received chunk counts against the limit (an upper
    bound: a chunk may also hold body bytes), so memory stays bounded by the limit plus one
    read; when the head completes, its exact size is checked too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_limit = self.config.h11_max_incomplete_event_size or DEFAULT_HEAD_LIMIT
        self._reading_head = True
        self._head_bytes = 0
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > self._head_limit and not self._refused:
            self._refuse()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions = self.scope.get("extensions") or {}
        extensions[ABORT_EXTENSION] = {"abort": self._abort}
        self.scope["extensions"] = extensions

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self._head_limit:
            self._refused = True
            raise HeadTooLarge  # httptools wraps it; uvicorn calls send_400_response
        self._reading_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True
        self._head_bytes = 0

    def send_400_response(self, msg: str) -> None:
        if self._refused:
            self._refuse()
            return
        super().send_400_response(msg)

    def _refuse(self) -> None:
        self._refused = True
        if not self.transport.is_closing():
            self.transport.write(_head_too_large_response(self._head_limit))
            self.transport.close()

    def _abort(self) -> None:
        """Drop the connection now, unsent bytes and all (a client that stopped reading)."""
        self.transport.abort()


class GatewayServer(uvicorn.Server):
    """uvicorn.Server that drains the app on the first SIGTERM/SIGINT and exits 0, and calls
    `on_hangup` on SIGHUP."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        on_hangup: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.on_hangup = on_hangup
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = loop = asyncio.get_running_loop()
        hangup = threading.current_thread() is threading.main_thread()
        if hangup:
            loop.add_signal_handler(signal.SIGHUP, self._hangup)
        try:
            await super().serve(sockets=sockets)
        finally:
            if hangup:
                loop.remove_signal_handler(signal.SIGHUP)

    def _hangup(self) -> None:
        """SIGHUP, run by the loop: reload, or say there is nothing to reload."""
        if self.drain.draining:
            return
        if self.on_hangup is None:
            logging.getLogger("hedge_gateway.config").warning(
                "SIGHUP: no configuration file to re-read (serve was started without --config)"
            )
            return
        self.on_hangup()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # from a signal handler: hand the work to the loop instead of touching its state
            loop.call_soon_threadsafe(self.drain.start)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Route SIGINT/SIGTERM to `handle_exit`; unlike uvicorn's, never re-raise them after
        the graceful shutdown (so a clean stop exits with status 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def graceful_timeout(server: ServerSettings) -> int:
    """uvicorn's hard limit for the graceful shutdown, a little after our own grace."""
    return math.ceil(server.shutdown_grace + SHUTDOWN_MARGIN)


def build_server(
    app: Any,
    server: ServerSettings,
    drain: Drain,
    *,
    log_config: dict[str, Any] | None,
    on_hangup: Callable[[], object] | None = None,
) -> GatewayServer:
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        http=GatewayHttpProtocol,
        log_config=log_config,
        timeout_graceful_shutdown=graceful_timeout(server),
        h11_max_incomplete_event_size=server.max_header_bytes,
        ws="none",
        lifespan="on",
    )
    return GatewayServer(config, drain, on_hangup)
