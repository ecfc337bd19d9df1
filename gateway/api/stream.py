"""The ASGI response that streams a committed attempt to the client.

Why our own instead of sse-starlette's `EventSourceResponse`: importing sse-starlette patches
uvicorn's signal handler process-wide, and each event loop gets a shutdown-watcher task that
polls forever. Both break rules we keep (no global state; nothing left running after a
request), and the relay needs exact control over three things that response does not give:
- cleanup always runs, even when the client left before the first byte was sent;
- a client that stops reading is detected without a timer per event (one ticker task checks
  how long the pending send has been stuck);
- on shutdown, a live stream gets `grace` seconds to finish, then a final error event.

Per stream: the response's own task and nothing else until one tick period has passed (the
ticker task starts from a timer then; the client watcher and the shutdown drain are
callbacks). Per upstream read the pump does three stores, reads no clock and takes no lock:
the ticker, which wakes a few times per keep-alive period, reads the clock and compares a
send counter with what it saw last time (activity for the keep-alive, the same send still
pending for the stuck-client check). The lock only orders the rare sends (keep-alives, the
final message, the shutdown event) among themselves. A pump send may overlap a keep-alive;
the server writes each message whole, and a comment between two events is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import anyio
import anyio.abc
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.drain import Drain
from gateway.server.extensions import ABORT_EXTENSION, HOLD_HEAD_EXTENSION, hook
from gateway.wire.base import Hooks, StreamEnd

KEEPALIVE = b": keep-alive\n\n"
log = logging.getLogger("hedge_gateway.sse")
#: early ends after which the connection is dropped rather than completed
_ABORTED = (StreamEnd.STUCK_CLIENT, StreamEnd.SHUTDOWN)


#: the head every stream's answer starts with; the caller adds its own headers after these
SSE_HEAD: list[tuple[bytes, bytes]] = [(b"content-type", b"text/event-stream; charset=utf-8"),
                                       (b"cache-control", b"no-cache"),
                                       (b"x-accel-buffering", b"no")]


@dataclass(eq=False)
class SSEResponse(Response):
    """Streams `body` (already-encoded SSE bytes) with keep-alives, stuck-client and shutdown
    handling; calls `on_close(end)` exactly once, whatever ends the stream.

    Plain data until it is sent (its fields are what it is given, its run's state is made
    when it runs): the proxy builds it with the request's answer and the app runs it, the one
    time a request steps into this file. `raw_headers`: the answer's head, `SSE_HEAD` and the
    caller's own after it, as the lines the server writes (a key's limits add theirs to it
    before it is sent).
    `internal_event`: the final error event (in the route's shape) a client gets when
    an exception of ours ends its stream, instead of a stream cut without a word.
    `shutdown_event` and `internal_event` may be given as the call that builds them: it
    runs only if the stream ends that way.
    `on_exhausted`: what the stream owes its request once it is complete (`Hooks`, which
    make each call once): called as the stream is done with `body`, once every byte of it
    was handed to the server, before the last body message goes out, or, for a stream that
    ended early, as it closes, before `on_close`; the relay may have called them already, as
    it encoded the stream's end event (`RelayOutcome.on_done`).
    `first_ready`: `body` hands over its first piece without waiting (the relay's first
    piece is the committed attempt's first token): it goes out first, with the head in
    one write where the server can hold the head, before the watchers, the ticker and the
    task group are set up, which the client would otherwise wait behind.
    `on_first_sent`: called (synchronously) once, when the first piece is out (with
    `first_ready`), or, if it never went out, as the stream closes, before `on_close`: work
    that can wait for the first piece (the race's learning) is not on its path, and is done
    whatever happens to the stream."""

    body_iterator: AsyncIterator[bytes]
    _: KW_ONLY
    keepalive: float
    stuck_client: float
    drain: Drain
    grace: float
    shutdown_event: bytes | Callable[[], bytes]
    on_close: Callable[[StreamEnd | None], Awaitable[None]]
    clock: Callable[[], float]
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=SSE_HEAD.copy)
    #: a task already watching the client (the proxy's, from the race on): it ends when
    #: the client disconnects; without one the response watches the client itself
    client_gone: asyncio.Future[None] | None = None
    internal_event: bytes | Callable[[], bytes] = b""
    on_exhausted: Hooks | None = None
    first_ready: bool = False
    on_first_sent: Callable[[], None] | None = None
    status_code: int = 200
    background: BackgroundTask | None = None
    # the run's state: set again as the stream starts to run (`__call__`)
    _lock: asyncio.Lock = field(init=False)
    #: the response head until it is sent (`_send_head`)
    _head: Message | None = field(init=False, default=None)
    #: sends started so far, and whether one is in progress (the pump's only bookkeeping)
    _sends: int = field(init=False, default=0)
    _in_send: bool = field(init=False, default=False)
    #: what the ticker saw: the send count, when it last changed, and (for a pending send)
    #: since when the ticker has seen that same send pending
    _seen_sends: int = field(init=False, default=0)
    _active_at: float = field(init=False, default=0.0)
    _pending_since: float | None = field(init=False, default=None)
    #: why the stream ended early: client gone, stuck client, shutdown, or an exception
    #: of ours that escaped the relay (internal error)
    end: StreamEnd | None = field(init=False, default=None)
    #: the last body message (`more_body: False`) went out
    _completed: bool = field(init=False, default=False)
    #: every byte of `body` was handed to the server: the stream did not end early, even
    #: if the client hangs up before the closing chunk (e.g. right after `[DONE]`)
    _exhausted: bool = field(init=False, default=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ended = False
        forget_drain: Callable[[], None] | None = None
        ticker = _Ticker()
        self._lock = asyncio.Lock()
        self._active_at = self.clock()
        try:
            self._head = {"type": "http.response.start", "status": 200,
                          "headers": self.raw_headers}
            if self.first_ready:  # the client waits for it: out before anything is set up
                await self._first(send, _hold_of(scope))
            else:
                await self._send_head(send, None)
            async with anyio.create_task_group() as tg:
                watching = self._watch(receive, tg)
                ticker.arm(self._period(), lambda: self._tick(send, tg.cancel_scope))
                forget_drain = self.drain.call_at_grace_end(
                    self.grace, self._on_grace_end(tg.cancel_scope))
                await self._pump(send)
                # inside the group: the ticker still watches a client stuck at the very end
                await self._send(send, {"type": "http.response.body", "body": b"",
                                        "more_body": False})
                if watching:  # our own watcher task is in the group: end it. (Only then:
                    # anyio names the cancelling task in the scope's reason, formatting its
                    # repr, some 7 us per stream for a group with nothing to cancel.)
                    tg.cancel_scope.cancel()
            if self.end is StreamEnd.SHUTDOWN:  # the grace ended: a final error event
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    await self._send(send, {"type": "http.response.body",
                                            "body": _built(self.shutdown_event),
                                            "more_body": False})
            ended = True
        except* OSError:  # the socket broke under a send (the task group wraps it in a group)
            self.end = self.end or StreamEnd.CLIENT_GONE
            ended = True
        finally:
            with anyio.CancelScope(shield=True):
                await ticker.stop()
                if self._head is not None:  # nothing was sent: the head alone, as before
                    await self._send_head(send, None)
            if forget_drain is not None:
                forget_drain()
            if not ended and self.end is None and not _being_cancelled():
                # something else escaped (a bug of ours in the relay): it propagates, and the
                # stats must not call it a client that left
                self.end = StreamEnd.INTERNAL_ERROR
                if self.internal_event and not self._completed and not self._in_send:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                        await self._send(send, {"type": "http.response.body",
                                                "body": _built(self.internal_event),
                                                "more_body": False})
            with anyio.CancelScope(shield=True):
                if not self._completed and self.end in _ABORTED:
                    abort = _abort_of(scope)
                    if abort is not None:
                        abort()
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(RuntimeError):
                        await aclose()
                # what the stream owes whatever ended it, once: each hook is cleared as it
                # is called, so one already called (as the first piece went out, as the body
                # was exhausted) is not called again; and each runs, and then `on_close`,
                # even if one before it raised (a bug of ours: it propagates after them)
                try:
                    if self.on_first_sent is not None:
                        self._first_sent()
                finally:
                    try:
                        if self.on_exhausted is not None:
                            self.on_exhausted()
                    finally:
                        await self.on_close(None if self._exhausted else self.end)
                if not self._completed and self.end in _ABORTED:
                    await _await_disconnect(scope, receive)

    async def _send(self, send: Send, message: Message) -> None:
        async with self._lock:
            if self._completed:  # a racing final message (shutdown vs. normal end)
                return
            if self._head is not None:  # the first piece failed: the head first (rare)
                await self._send_head(send, None)
            self._sends += 1
            self._in_send = True
            await send(message)
            self._in_send = False
            if not message.get("more_body", False) and message["type"] == "http.response.body":
                self._completed = True

    async def _send_head(self, send: Send, hold: Callable[[], object] | None) -> None:
        """The response head, once. `hold`: the server's hook that keeps it for the next
        write (the first piece, sent right after it), so both leave in one send."""
        head, self._head = self._head, None
        if head is None:
            return
        if hold is not None:
            hold()
        await send(head)

    async def _first(self, send: Send, hold: Callable[[], object] | None) -> None:
        """The head and the body's first piece (in one write where the server can `hold`
        the head), then `on_first_sent`. Runs before the stream's watchers are set up: the
        body hands its first piece over without waiting (`first_ready`)."""
        async for chunk in self.body_iterator:
            await self._send_head(send, hold)
            self._sends += 1
            self._in_send = True
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._in_send = False
            break
        else:  # no piece at all: the head alone, the end follows
            await self._send_head(send, None)
        self._first_sent()

    def _first_sent(self) -> None:
        """`on_first_sent`, once."""
        hook, self.on_first_sent = self.on_first_sent, None
        if hook is not None:
            hook()

    async def _pump(self, send: Send) -> None:
        async for chunk in self.body_iterator:
            self._sends += 1
            self._in_send = True
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._in_send = False
        self._exhausted = True
        if self.on_exhausted is not None:
            self.on_exhausted()

    def _watch(self, receive: Receive, tg: anyio.abc.TaskGroup) -> bool:
        """End the stream when the client disconnects: through the proxy's watcher when
        there is one (a done-callback, no task of ours), else with a task of our own in
        `tg`. Whether that task was started."""
        gone = self.client_gone
        if gone is None:
            tg.start_soon(self._watch_client, receive, tg.cancel_scope)
            return True
        scope = tg.cancel_scope

        def on_gone(task: asyncio.Future[None]) -> None:
            if task.cancelled():  # the request ended: not the client's doing
                return
            self.end = self.end or StreamEnd.CLIENT_GONE
            scope.cancel()

        gone.add_done_callback(on_gone)
        return False

    async def _watch_client(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.end = self.end or StreamEnd.CLIENT_GONE
                scope.cancel()
                return

    def _period(self) -> float:
        return max(0.01, min(self.keepalive, self.stuck_client) / 4)

    async def _tick(self, send: Send, scope: anyio.CancelScope) -> None:
        """Keep-alive comments when idle; give up on a client that stopped reading. Runs
        from one period into the stream (`_Ticker`), then checks once per period."""
        period = self._period()
        while True:
            now = self.clock()
            sends = self._sends
            if sends != self._seen_sends:  # something went out (or started to) since then
                self._seen_sends = sends
                self._active_at = now
                self._pending_since = now if self._in_send else None
            elif self._in_send:
                since = self._pending_since if self._pending_since is not None else now
                self._pending_since = since
                if now - since >= self.stuck_client:
                    self.end = StreamEnd.STUCK_CLIENT
                    scope.cancel()
                    return
            elif now - self._active_at >= self.keepalive:
                try:
                    await self._send(send, {"type": "http.response.body", "body": KEEPALIVE,
                                            "more_body": True})
                except OSError:  # the socket broke: the client is gone
                    self.end = self.end or StreamEnd.CLIENT_GONE
                    scope.cancel()
                    return
            await anyio.sleep(period)

    def _on_grace_end(self, scope: anyio.CancelScope) -> Callable[[], None]:
        """On shutdown: `grace` seconds to finish (a callback of the drain's, not a task per
        stream), then the stream stops and `__call__` sends a final error event."""

        def stop() -> None:
            if not self._completed:
                self.end = self.end or StreamEnd.SHUTDOWN
                scope.cancel()

        return stop


def _built(event: bytes | Callable[[], bytes]) -> bytes:
    """A final event given as its bytes, or as the call that builds them (built only when a
    stream does end that way: most never do, and building them is JSON encoding)."""
    return event() if callable(event) else event


def _being_cancelled() -> bool:
    """Whether this task is being cancelled from outside (the server shutting down)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _hold_of(scope: Scope) -> Callable[[], object] | None:
    """The server's hook that holds the response head for the next write, if it offers one
    (`gateway.server.connection`)."""
    return hook(scope, HOLD_HEAD_EXTENSION, "hold")


def _abort_of(scope: Scope) -> Callable[[], object] | None:
    """The server's abort hook for this connection, if it offers one (gateway.server.serve)."""
    return hook(scope, ABORT_EXTENSION, "abort")


async def _await_disconnect(scope: Scope, receive: Receive) -> None:
    """After an abort, let the server notice the dropped connection before the app returns
    (else it would log a response that was never completed)."""
    if _abort_of(scope) is None:
        return
    with anyio.move_on_after(1.0):
        while (await receive())["type"] != "http.disconnect":
            pass


class _Ticker:
    """The stream's ticker task, started one period in by a timer: a stream that ends sooner
    (most of them at high request rates) costs a timer, not a task. `stop()` ends either and
    waits for the task, so nothing outlives the response."""

    def __init__(self) -> None:
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def arm(self, delay: float, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        def start() -> None:
            self._timer = None
            self._task = asyncio.get_running_loop().create_task(run())

        self._timer = asyncio.get_running_loop().call_later(delay, start)

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:  # a bug of ours
                log.error("the stream's ticker failed", exc_info=task.exception())
