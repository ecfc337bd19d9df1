"""The ASGI response that streams a committed attempt to the client.

Why our own instead of sse-starlette's `EventSourceResponse`: importing sse-starlette patches
uvicorn's signal handler process-wide, and each event loop gets a shutdown-watcher task that
polls forever. Both break rules we keep (no global state; nothing left running after a
request), and the relay needs exact control over three things that response does not give:
- cleanup always runs, even when the client left before the first byte was sent;
- a client that stops reading is detected without a timer per event (one ticker task checks
  how long the pending send has been stuck);
- on shutdown, a live stream gets `grace` seconds to finish, then a final error event.

Per event the pump does one lock acquire (uncontended, no await) and two stores.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import anyio
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.drain import Drain
from gateway.streamend import StreamEnd

KEEPALIVE = b": keep-alive\n\n"
#: ASGI scope extension through which the server offers `abort()`: drop the connection now,
#: unsent bytes and all (see gateway.server). Without it, a stuck client's connection can only
#: be left to the server, which waits for the unsent bytes to drain before it closes.
ABORT_EXTENSION = "hedge_gateway.abort"
#: early ends after which the connection is dropped rather than completed
_ABORTED = (StreamEnd.STUCK_CLIENT, StreamEnd.SHUTDOWN)


class SSEResponse(Response):
    """Streams `body` (already-encoded SSE bytes) with keep-alives, stuck-client and shutdown
    handling; calls `on_close(end)` exactly once, whatever ends the stream."""

    background: BackgroundTask | None = None

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        headers: Mapping[str, str],
        keepalive: float,
        stuck_client: float,
        drain: Drain,
        grace: float,
        shutdown_event: bytes,
        on_close: Callable[[StreamEnd | None], Awaitable[None]],
        clock: Callable[[], float],
    ) -> None:
        self.status_code = 200
        self.body_iterator = body
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")]
        self.raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                         for k, v in headers.items()]
        self.keepalive = keepalive
        self.stuck_client = stuck_client
        self.drain = drain
        self.grace = grace
        self.shutdown_event = shutdown_event
        self.on_close = on_close
        self.clock = clock
        self._lock = asyncio.Lock()
        self._last_send = 0.0
        #: when the send in progress started (None: no send in progress)
        self._sending_since: float | None = None
        #: why the stream ended early: client gone, stuck client, shutdown, or an exception
        #: of ours that escaped the relay (internal error)
        self.end: StreamEnd | None = None
        #: the last body message (`more_body: False`) went out
        self._completed = False
        #: every byte of `body` was handed to the server: the stream did not end early, even
        #: if the client hangs up before the closing chunk (e.g. right after `[DONE]`)
        self._exhausted = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ended = False
        try:
            await self._send(send, {"type": "http.response.start", "status": 200,
                                    "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_client, receive, tg.cancel_scope)
                tg.start_soon(self._tick, send, tg.cancel_scope)
                tg.start_soon(self._watch_drain, send, tg.cancel_scope)
                await self._pump(send)
                # inside the group: the ticker still watches a client stuck at the very end
                await self._send(send, {"type": "http.response.body", "body": b"",
                                        "more_body": False})
                tg.cancel_scope.cancel()
            ended = True
        except* OSError:  # the socket broke under a send (the task group wraps it in a group)
            self.end = self.end or StreamEnd.CLIENT_GONE
            ended = True
        finally:
            if not ended and self.end is None and not _being_cancelled():
                # something else escaped (a bug of ours in the relay): it propagates, and the
                # stats must not call it a client that left
                self.end = StreamEnd.INTERNAL_ERROR
            with anyio.CancelScope(shield=True):
                if not self._completed and self.end in _ABORTED:
                    abort = _abort_of(scope)
                    if abort is not None:
                        abort()
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(RuntimeError):
                        await aclose()
                await self.on_close(None if self._exhausted else self.end)
                if not self._completed and self.end in _ABORTED:
                    await _await_disconnect(scope, receive)

    async def _send(self, send: Send, message: Message) -> None:
        async with self._lock:
            if self._completed:  # a racing final message (shutdown vs. normal end)
                return
            self._sending_since = self.clock()
            await send(message)
            self._sending_since = None
            self._last_send = self.clock()
            if not message.get("more_body", False) and message["type"] == "http.response.body":
                self._completed = True

    async def _pump(self, send: Send) -> None:
        lock = self._lock
        clock = self.clock
        async for chunk in self.body_iterator:
            async with lock:
                self._sending_since = clock()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._sending_since = None
                self._last_send = clock()
        self._exhausted = True

    async def _watch_client(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.end = self.end or StreamEnd.CLIENT_GONE
                scope.cancel()
                return

    async def _tick(self, send: Send, scope: anyio.CancelScope) -> None:
        """Keep-alive comments when idle; give up on a client that stopped reading."""
        period = max(0.01, min(self.keepalive, self.stuck_client) / 4)
        while True:
            await anyio.sleep(period)
            now = self.clock()
            since = self._sending_since
            if since is not None and now - since >= self.stuck_client:
                self.end = StreamEnd.STUCK_CLIENT
                scope.cancel()
                return
            if since is None and now - self._last_send >= self.keepalive:
                await self._send(send, {"type": "http.response.body", "body": KEEPALIVE,
                                        "more_body": True})

    async def _watch_drain(self, send: Send, scope: anyio.CancelScope) -> None:
        """On shutdown: `grace` seconds to finish, then a final error event and the end."""
        await self.drain.wait_grace(self.grace)
        self.end = StreamEnd.SHUTDOWN
        scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
            await self._send(send, {"type": "http.response.body", "body": self.shutdown_event,
                                    "more_body": False})


def _being_cancelled() -> bool:
    """Whether this task is being cancelled from outside (the server shutting down)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _abort_of(scope: Scope) -> Callable[[], object] | None:
    """The server's abort hook for this connection, if it offers one (gateway.server)."""
    extensions = scope.get("extensions") or {}
    hook = (extensions.get(ABORT_EXTENSION) or {}).get("abort")
    return hook if callable(hook) else None


async def _await_disconnect(scope: Scope, receive: Receive) -> None:
    """After an abort, let the server notice the dropped connection before the app returns
    (else it would log a response that was never completed)."""
    if _abort_of(scope) is None:
        return
    with anyio.move_on_after(1.0):
        while (await receive())["type"] != "http.disconnect":
            pass
