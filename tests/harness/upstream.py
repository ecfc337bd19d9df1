"""`ScriptedUpstream`: a deliberately hostile HTTP/1.1 upstream on raw `asyncio.start_server`.

It answers each request with a `Script` (from its queue, else from its responder) and records
what happened in a `RecordedRequest` (when it arrived, which SSE events were written when, when
the client hung up). Why raw sockets and not a web framework: a framework would hide exactly
what the gateway must survive (resets, hangs, broken chunking, exact write times). The wire
details live in `tests.harness.http1`; this module owns the records and their locking.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable

from tests.harness.bodies import chat_completion_obj, json_script, stream_script
from tests.harness.http1 import (
    BadRequest,
    Conn,
    PeerGone,
    close_conn,
    frame,
    head_bytes,
    pause,
    race_peer,
    read_request,
    reset_conn,
)
from tests.harness.records import Outcome, RecordedRequest, Responder, SSEEventCounter
from tests.harness.scripts import Hang, Head, Reset, Script, Send, Sleep, Wait, resolve


def default_responder(request: RecordedRequest) -> Script:
    """A short successful answer: a stream when the body asks for one (or there is no JSON
    body), a chat.completion JSON for `"stream": false`/absent, an empty list for GET."""
    if request.method == "GET":
        return json_script({"object": "list", "data": []})
    body = request.body
    if isinstance(body, dict) and not body.get("stream"):
        return json_script(chat_completion_obj())
    return stream_script(["Hello", " world"])


class ScriptedUpstream:
    """A hostile, scriptable HTTP/1.1 upstream (see the module docstring).

    Create and `start()`/`stop()` it inside the loop thread; read its records and call its
    `wait_*` helpers from the test thread. Scripts come from `queue()` first (FIFO), then from
    `responder(request)`."""

    def __init__(self, responder: Responder | None = None, *, name: str = "upstream") -> None:
        self.name = name
        self.responder: Responder = responder or default_responder
        #: exceptions that escaped a connection handler (a broken responder); `stop` raises
        self.errors: list[BaseException] = []
        self._cond = threading.Condition()
        self._queue: deque[Script] = deque()
        self._requests: list[RecordedRequest] = []
        self._open = 0
        self._total = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._loop_thread_id: int | None = None
        self._async_waiters: list[asyncio.Future[None]] = []
        self.port = 0

    # ---- lifecycle (in the loop) ----

    async def start(self) -> str:
        """Listen on 127.0.0.1 at an ephemeral port; return the base URL `http://.../v1`."""
        self._loop_thread_id = threading.get_ident()
        self._server = await asyncio.start_server(self._handle, host="127.0.0.1", port=0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.base_url

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop listening, drop every connection (requests in flight end as
        "server_stopped"), wait for the handlers; raise the first handler error, if any."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for _ in range(3):  # handlers accepted while we were cancelling the previous ones
            tasks = set(self._handlers)
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=timeout)
        if self._server is not None:
            await asyncio.wait_for(self._server.wait_closed(), timeout)
            self._server = None
        if self.errors:
            raise self.errors[0]

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL (with `/v1`)."""
        return f"{self.root_url}/v1"

    # ---- test-facing state (any thread) ----

    def queue(self, *scripts: Script) -> None:
        """Answer the next requests with these scripts, in order, before the responder."""
        with self._cond:
            self._queue.extend(scripts)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._cond:
            return list(self._requests)

    @property
    def open_connections(self) -> int:
        with self._cond:
            return self._open

    @property
    def connections_total(self) -> int:
        with self._cond:
            return self._total

    def unfinished(self) -> list[str]:
        """Requests whose response is still in progress: after a test, that is a client (the
        gateway) holding an upstream response it should have read to the end or closed."""
        with self._cond:
            return [
                f"{self.name}:{self.port} request {r.index} ({r.method} {r.path}) still open"
                for r in self._requests
                if r.finished_at is None
            ]

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Block the calling (test) thread until `predicate()` holds; False on timeout."""
        if threading.get_ident() == self._loop_thread_id:
            raise RuntimeError("wait_* would block the event loop; use `await until(...)`")
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait_requests(self, count: int, timeout: float = 5.0) -> bool:
        return self.wait_until(lambda: len(self._requests) >= count, timeout)

    def wait_closed(self, request: RecordedRequest, timeout: float = 5.0) -> bool:
        """True once the client closed the connection that carried `request`."""
        return self.wait_until(lambda: request.closed_at is not None, timeout)

    def wait_finished(self, request: RecordedRequest, timeout: float = 5.0) -> bool:
        return self.wait_until(lambda: request.finished_at is not None, timeout)

    def wait_events(self, request: RecordedRequest, count: int, timeout: float = 5.0) -> bool:
        return self.wait_until(lambda: request.events_written >= count, timeout)

    def wait_connections(self, count: int, timeout: float = 5.0) -> bool:
        """True once exactly `count` connections are open (e.g. 0 after cancellation)."""
        return self.wait_until(lambda: self._open == count, timeout)

    async def until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """`wait_until` for code running inside the loop thread."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            self._async_waiters.append(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, remaining)
        return True

    def _changed(self) -> None:
        """Call with `_cond` held, in the loop thread, after any change to the records."""
        self._cond.notify_all()
        waiters, self._async_waiters = self._async_waiters, []
        for fut in waiters:
            resolve(fut)

    # ---- connections ----

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._stopping or task is None:
            writer.transport.abort()
            return
        self._handlers.add(task)
        task.add_done_callback(self._handler_done)
        # Drain only returns once every byte reached the kernel: "event written at t" is exact.
        writer.transport.set_write_buffer_limits(high=0)
        with self._cond:
            self._total += 1
            self._open += 1
            conn = Conn(self._total, reader, writer)
            self._changed()
        pump = asyncio.create_task(self._pump(conn), name=f"{self.name}-pump-{conn.id}")
        try:
            while await self._serve_one(conn):
                pass
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            await close_conn(conn)
            with self._cond:
                self._open -= 1
                self._changed()

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        self._handlers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            assert exc is not None
            self.errors.append(exc)

    async def _pump(self, conn: Conn) -> None:
        """Read everything the client sends; notice at once when it hangs up."""
        try:
            while data := await conn.reader.read(65536):
                conn.buf += data
                conn.changed.set()
        except OSError:  # reset by peer
            pass
        if conn.server_closing:
            return
        now = time.monotonic()
        conn.peer_closed.set()
        conn.changed.set()
        with self._cond:
            rec = conn.current or conn.last
            if rec is not None and rec.closed_at is None:
                rec.closed_at = now
            self._changed()

    async def _serve_one(self, conn: Conn) -> bool:
        """Read one request and answer it; True if the connection stays open for another."""
        try:
            rec = await self._read_request(conn)
        except BadRequest as exc:
            msg = str(exc).encode()
            conn.writer.write(
                b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                % (len(msg), msg)
            )
            return False
        if rec is None:
            return False
        with self._cond:
            script = self._queue.popleft() if self._queue else None
        if script is None:
            script = self.responder(rec)
        with self._cond:
            rec.script = script
            conn.current = rec
        try:
            return await self._respond(conn, rec, script)
        finally:
            conn.current = None
            conn.last = rec

    async def _read_request(self, conn: Conn) -> RecordedRequest | None:
        wire = await read_request(conn)
        if wire is None:
            return None
        with self._cond:
            rec = RecordedRequest(
                index=len(self._requests),
                conn_id=conn.id,
                method=wire.method,
                path=wire.path,
                query=wire.query,
                headers=wire.headers,
                body=wire.body,
                raw_body=wire.raw_body,
                received_at=time.monotonic(),
            )
            self._requests.append(rec)
            self._changed()
        return rec

    # ---- writing a response ----

    async def _respond(self, conn: Conn, rec: RecordedRequest, script: Script) -> bool:
        steps = list(script.steps)
        if not any(isinstance(s, Head) for s in steps):
            steps.insert(0, Head())
        counter = SSEEventCounter()
        outcome: Outcome = "server_stopped"
        keep_alive = False
        try:
            for step in steps:
                if isinstance(step, Head):
                    await pause(conn, step.delay)
                    await self._write(conn, rec, head_bytes(script, steps), None, b"")
                    with self._cond:
                        rec.head_at = time.monotonic()
                elif isinstance(step, Send):
                    await pause(conn, step.delay)
                    if step.raw:
                        await self._write(conn, rec, step.data, None, b"")
                    elif step.data:
                        await self._write(conn, rec, frame(script, step.data), counter, step.data)
                elif isinstance(step, Sleep):
                    await pause(conn, step.seconds)
                elif isinstance(step, Wait):
                    await race_peer(conn, step.gate.wait())
                elif isinstance(step, Hang):
                    await conn.peer_closed.wait()
                    raise PeerGone
                elif isinstance(step, Reset):
                    reset_conn(conn)
                    outcome = "reset"
                    return False
                else:  # Close
                    outcome = "closed"
                    return False
            if script.framing == "chunked":
                await self._write(conn, rec, b"0\r\n\r\n", None, b"")
            outcome = "complete"
            keep_alive = not script.close and script.framing != "close"
            return keep_alive
        except (PeerGone, OSError):
            outcome = "client_closed"
            return False
        finally:
            now = time.monotonic()
            with self._cond:
                rec.finished_at = now
                rec.outcome = outcome
                if outcome == "client_closed" and rec.closed_at is None:
                    rec.closed_at = now  # a write failed before the reader noticed
                self._changed()

    async def _write(
        self,
        conn: Conn,
        rec: RecordedRequest,
        wire: bytes,
        counter: SSEEventCounter | None,
        payload: bytes,
    ) -> None:
        if conn.peer_closed.is_set():
            raise PeerGone
        conn.writer.write(wire)
        await conn.writer.drain()
        now = time.monotonic()
        events = counter.feed(payload) if counter is not None else 0
        with self._cond:
            rec.bytes_written += len(wire)
            if events:
                rec.events_written += events
                rec.event_times.extend([now] * events)
            self._changed()
