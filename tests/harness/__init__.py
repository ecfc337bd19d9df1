"""Shared harness for integration tests over real loopback sockets.

Why it exists: streaming behaviour (first token, hedges, cancellation) can only be tested over
real sockets, because in-memory ASGI transports buffer whole responses. So every integration
test runs real servers in one background event loop (`LoopThread`) and drives them from the
test thread with sync clients (the official `openai.OpenAI`, `httpx.Client`, raw sockets):

- `ScriptedUpstream`: a deliberately hostile upstream on raw `asyncio.start_server`, answering
  each request with a `Script` (data: status, headers, steps such as `Send`, `Hang`, `Reset`),
  and recording what happened (`RecordedRequest`: when it arrived, which SSE events were
  written when, when the client hung up). Tests assert order and causality from these records.
- `serve_asgi`: any ASGI app (the gateway, the simulator, a test app) under a real uvicorn.
- `LeakBaseline`: after a test, no asyncio task, file descriptor or TCP socket may remain.

Everything that waits takes a timeout, so a broken product fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import json
import os
import re
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal, TypeVar

import uvicorn
from starlette.types import ASGIApp

# psutil ships no type information; importing it as a plain module object keeps mypy --strict
# quiet without an ignore comment that would turn into an error once stubs are installed.
_psutil: Any = importlib.import_module("psutil")

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Scripts: what an upstream does with one request, as plain data.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Head:
    """Write the status line and headers here, after `delay` seconds.

    A script without a `Head` step writes its head first. Put steps before an explicit `Head()`
    to act before any byte of the response (`[Hang(), Head()]` never answers at all)."""

    delay: float = 0.0


@dataclass(frozen=True)
class Send:
    """Write `data` as one piece (one chunk when chunked) after `delay` seconds.

    `raw=True` bypasses the body framing: the bytes go to the socket as they are (for broken
    chunk syntax and the like); raw bytes are not counted as SSE events."""

    data: bytes
    delay: float = 0.0
    raw: bool = False


@dataclass(frozen=True)
class Sleep:
    """Wait `seconds` without writing (the wait ends early if the client hangs up)."""

    seconds: float


class Gate:
    """A latch a test opens from any thread; a `Wait(gate)` step blocks until it is open.

    Lets a test order events by causality ("hold the primary until the hedge arrived") instead
    of by sleeping. One gate may hold any number of steps, in any upstream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def open(self) -> None:
        with self._lock:
            self._open = True
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    @property
    def is_open(self) -> bool:
        return self._open

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._open:
                return
            self._waiters.append((loop, fut))
        try:
            await fut
        finally:  # a cancelled wait must not be resolved later, maybe after its loop closed
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove((loop, fut))


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass(frozen=True)
class Wait:
    """Block until `gate` is opened (or the client hangs up)."""

    gate: Gate


@dataclass(frozen=True)
class Hang:
    """Stop writing; keep the socket open until the client closes it or the server stops."""


@dataclass(frozen=True)
class Reset:
    """Abort the connection with a TCP RST (SO_LINGER 0), mid-response or before any byte."""


@dataclass(frozen=True)
class Close:
    """Close the connection (FIN) right now, without ending the body properly."""


Step = Head | Send | Sleep | Wait | Hang | Reset | Close
#: chunked: Transfer-Encoding chunked; close: no length, the body ends when the socket closes;
#: length: Content-Length = the sum of the non-raw `Send` data.
Framing = Literal["chunked", "close", "length"]


@dataclass(frozen=True, kw_only=True)
class Script:
    """One response. After the last step the body is ended properly (the chunked terminator);
    then the connection is closed if `close` (or framing is "close"), else kept alive for the
    next request. Framing and `connection` headers are added unless `headers` sets them."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    steps: Sequence[Step] = ()
    close: bool = True
    framing: Framing = "chunked"


# --------------------------------------------------------------------------------------------
# Body builders: OpenAI-shaped SSE events and JSON bodies.
# --------------------------------------------------------------------------------------------

DONE = b"data: [DONE]\n\n"
CHUNK_ID = "chatcmpl-harness"
MODEL = "upstream-model"
CREATED = 1_700_000_000
SSE_HEADERS: Mapping[str, str] = {"content-type": "text/event-stream", "cache-control": "no-cache"}


def sse(obj: object) -> bytes:
    """One SSE event whose data is `obj` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def comment(text: str = "ping") -> bytes:
    """An SSE comment block (keep-alives such as `: ping`); never a token."""
    return b": " + text.encode() + b"\n\n"


def chunk_obj(
    delta: Mapping[str, Any] | None,
    *,
    finish_reason: str | None = None,
    usage: Mapping[str, int] | None = None,
    model: str = MODEL,
) -> dict[str, Any]:
    """A chat.completion.chunk dict (for tests that need a custom shape); `delta=None` gives
    `choices: []` (the usage-only shape)."""
    choices: list[dict[str, Any]] = []
    if delta is not None:
        choices.append(
            {"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish_reason}
        )
    obj: dict[str, Any] = {
        "id": CHUNK_ID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        obj["usage"] = dict(usage)
    return obj


def role_chunk(role: str = "assistant") -> bytes:
    """The role-only first chunk OpenAI sends (empty content: not a token)."""
    return sse(chunk_obj({"role": role, "content": "", "refusal": None}))


def token_chunk(text: str) -> bytes:
    return sse(chunk_obj({"content": text}))


def finish_chunk(reason: str = "stop") -> bytes:
    return sse(chunk_obj({}, finish_reason=reason))


def usage_chunk(prompt_tokens: int = 5, completion_tokens: int = 2) -> bytes:
    total = prompt_tokens + completion_tokens
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
    }
    return sse(chunk_obj(None, usage=usage))


def text_chunk(text: str, finish_reason: str | None = None) -> bytes:
    """A legacy /v1/completions stream event."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    obj = {
        "id": "cmpl-harness",
        "object": "text_completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [choice],
    }
    return sse(obj)


def chat_completion_obj(content: str = "Hello world", *, model: str = MODEL) -> dict[str, Any]:
    """A non-streaming chat.completion body."""
    return {
        "id": CHUNK_ID,
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def error_obj(
    message: str, *, type: str = "server_error", code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def stream_script(
    tokens: Sequence[str],
    ttft: float = 0.0,
    gap: float = 0.0,
    pre: Sequence[bytes] | None = None,
    *,
    finish: str | None = "stop",
    usage: bool = False,
    done: bool = True,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
    close: bool = True,
    framing: Framing = "chunked",
) -> Script:
    """A chat stream: head and `pre` (default: the role chunk) at once, the first token after
    `ttft`, each later token `gap` after the previous, then finish, optional usage, `[DONE]`."""
    steps: list[Step] = [Head()]
    steps += [Send(b) for b in (pre if pre is not None else [role_chunk()])]
    steps += [Send(token_chunk(t), ttft if i == 0 else gap) for i, t in enumerate(tokens)]
    if finish is not None:
        steps.append(Send(finish_chunk(finish)))
    if usage:
        steps.append(Send(usage_chunk()))
    if done:
        steps.append(Send(DONE))
    all_headers = {**SSE_HEADERS, **(headers or {})}
    return Script(status=status, headers=all_headers, steps=steps, close=close, framing=framing)


def json_script(
    obj: object,
    status: int = 200,
    *,
    headers: Mapping[str, str] | None = None,
    delay: float = 0.0,
    close: bool = True,
) -> Script:
    """A non-streaming JSON response with Content-Length, written `delay` seconds after the
    request arrived."""
    all_headers = {"content-type": "application/json", **(headers or {})}
    steps: list[Step] = [Head(delay), Send(json.dumps(obj).encode())]
    return Script(status=status, headers=all_headers, steps=steps, close=close, framing="length")


def error_script(
    status: int,
    message: str = "upstream error",
    *,
    headers: Mapping[str, str] | None = None,
    close: bool = True,
) -> Script:
    """An OpenAI-shaped error response (add `{"retry-after": "1"}` for a 429)."""
    return json_script(error_obj(message), status, headers=headers, close=close)


def hang_script() -> Script:
    """Accept the request and never send a byte."""
    return Script(steps=[Hang(), Head()])


def reset_script() -> Script:
    """Reset the connection before any byte of the response."""
    return Script(steps=[Reset(), Head()])


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEEventCounter:
    """Counts SSE events completed in a byte stream that arrives in arbitrary pieces.

    An event is a block of lines ended by a blank line with at least one field that is not a
    comment; comment-only blocks (`: ping`) are not events. LF, CRLF and CR line ends, split
    anywhere, are handled. Pure: the upstream feeds it what it wrote."""

    def __init__(self) -> None:
        self.total = 0
        self._line_len = 0
        self._comment = False
        self._has_field = False
        self._pending_cr = False

    def feed(self, data: bytes) -> int:
        """Consume `data`; return how many events it completed."""
        done = 0
        pos = 1 if self._pending_cr and data[:1] == b"\n" else 0
        self._pending_cr = False
        while True:
            m = _LINE_END.search(data, pos)
            if m is None:
                self._take(data[pos:])
                break
            self._take(data[pos : m.start()])
            done += self._end_line()
            pos = m.end()
            if pos == len(data) and m.group() == b"\r":
                self._pending_cr = True
        self.total += done
        return done

    def _take(self, segment: bytes) -> None:
        if segment:
            if self._line_len == 0 and segment[:1] == b":":
                self._comment = True
            self._line_len += len(segment)

    def _end_line(self) -> int:
        if self._line_len == 0:
            ended = 1 if self._has_field else 0
            self._has_field = False
            return ended
        if not self._comment:
            self._has_field = True
        self._line_len = 0
        self._comment = False
        return 0


Outcome = Literal["complete", "client_closed", "reset", "closed", "server_stopped"]


@dataclass(eq=False)
class RecordedRequest:
    """One request as the upstream saw it, and what became of its response.

    Times are `time.monotonic()`. Fields are updated in the loop thread under the upstream's
    lock; read them from the test thread after one of the upstream's `wait_*` helpers."""

    index: int
    conn_id: int
    method: str
    path: str
    query: str
    headers: dict[str, str]
    #: the body parsed as JSON, or the raw bytes when it is not JSON
    body: Any
    raw_body: bytes
    received_at: float
    script: Script | None = None
    #: when the status line and headers were written (None: never)
    head_at: float | None = None
    #: when the CLIENT closed or reset the connection that carried this request, during the
    #: response or later while the connection sat idle; None if the server closed first
    closed_at: float | None = None
    #: when the upstream was done with this request, for whatever reason (`outcome`)
    finished_at: float | None = None
    outcome: Outcome | None = None
    #: every byte written on the socket for this response (head, framing, body)
    bytes_written: int = 0
    #: SSE events (not comments) fully written to the socket, and when each one was
    events_written: int = 0
    event_times: list[float] = field(default_factory=list)


Responder = Callable[[RecordedRequest], Script]


def default_responder(request: RecordedRequest) -> Script:
    """A short successful answer: a stream when the body asks for one (or there is no JSON
    body), a chat.completion JSON for `"stream": false`/absent, an empty list for GET."""
    if request.method == "GET":
        return json_script({"object": "list", "data": []})
    body = request.body
    if isinstance(body, dict) and not body.get("stream"):
        return json_script(chat_completion_obj())
    return stream_script(["Hello", " world"])


class _PeerGone(Exception):
    """The client closed the connection while a script was running."""


class _BadRequest(Exception):
    """The bytes on the connection are not an HTTP/1.1 request we can read."""


class _Conn:
    """One accepted connection: a background reader watches for the client hanging up."""

    def __init__(self, conn_id: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.id = conn_id
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.changed = asyncio.Event()
        self.peer_closed = asyncio.Event()
        self.server_closing = False
        self.current: RecordedRequest | None = None
        self.last: RecordedRequest | None = None


_MAX_HEAD = 1024 * 1024


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
            _resolve(fut)

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
            conn = _Conn(self._total, reader, writer)
            self._changed()
        pump = asyncio.create_task(self._pump(conn), name=f"{self.name}-pump-{conn.id}")
        try:
            while await self._serve_one(conn):
                pass
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            await self._close(conn)
            with self._cond:
                self._open -= 1
                self._changed()

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        self._handlers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            assert exc is not None
            self.errors.append(exc)

    async def _pump(self, conn: _Conn) -> None:
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

    async def _close(self, conn: _Conn) -> None:
        if conn.server_closing:  # already aborted
            return
        conn.server_closing = True
        conn.writer.close()
        try:
            await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
        except (OSError, TimeoutError):
            conn.writer.transport.abort()

    async def _serve_one(self, conn: _Conn) -> bool:
        """Read one request and answer it; True if the connection stays open for another."""
        try:
            rec = await self._read_request(conn)
        except _BadRequest as exc:
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

    # ---- reading a request ----

    async def _more(self, conn: _Conn) -> bool:
        """Wait for more bytes; False once the client hung up and nothing more can come."""
        if conn.peer_closed.is_set():
            return False
        conn.changed.clear()
        await conn.changed.wait()
        return True

    async def _read_exact(self, conn: _Conn, n: int) -> bytes | None:
        while len(conn.buf) < n:
            if not await self._more(conn):
                return None
        data = bytes(conn.buf[:n])
        del conn.buf[:n]
        return data

    async def _read_line(self, conn: _Conn) -> bytes | None:
        while (end := conn.buf.find(b"\r\n")) < 0:
            if len(conn.buf) > _MAX_HEAD:
                raise _BadRequest("line too long")
            if not await self._more(conn):
                return None
        line = bytes(conn.buf[:end])
        del conn.buf[: end + 2]
        return line

    async def _read_chunked(self, conn: _Conn) -> bytes | None:
        body = bytearray()
        while True:
            size_line = await self._read_line(conn)
            if size_line is None:
                return None
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError as exc:
                raise _BadRequest("bad chunk size") from exc
            if size == 0:
                while (trailer := await self._read_line(conn)) not in (b"", None):
                    pass
                return bytes(body) if trailer is not None else None
            data = await self._read_exact(conn, size + 2)
            if data is None:
                return None
            body += data[:size]

    async def _read_request(self, conn: _Conn) -> RecordedRequest | None:
        while conn.buf.startswith(b"\r\n"):
            del conn.buf[:2]
        while (end := conn.buf.find(b"\r\n\r\n")) < 0:
            if len(conn.buf) > _MAX_HEAD:
                raise _BadRequest("request head too large")
            if not await self._more(conn):
                return None
        head = bytes(conn.buf[:end]).decode("latin-1")
        del conn.buf[: end + 4]
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(f"bad request line {lines[0]!r}")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise _BadRequest(f"bad header line {line!r}")
            key, value = name.strip().lower(), value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raw = await self._read_chunked(conn)
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError as exc:
                raise _BadRequest("bad content-length") from exc
            raw = await self._read_exact(conn, length)
        if raw is None:
            return None
        body: Any
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = raw
        path, _, query = target.partition("?")
        with self._cond:
            rec = RecordedRequest(
                index=len(self._requests),
                conn_id=conn.id,
                method=method,
                path=path,
                query=query,
                headers=headers,
                body=body,
                raw_body=raw,
                received_at=time.monotonic(),
            )
            self._requests.append(rec)
            self._changed()
        return rec

    # ---- writing a response ----

    async def _respond(self, conn: _Conn, rec: RecordedRequest, script: Script) -> bool:
        steps = list(script.steps)
        if not any(isinstance(s, Head) for s in steps):
            steps.insert(0, Head())
        counter = SSEEventCounter()
        outcome: Outcome = "server_stopped"
        keep_alive = False
        try:
            for step in steps:
                if isinstance(step, Head):
                    await self._pause(conn, step.delay)
                    await self._write(conn, rec, _head_bytes(script, steps), None, b"")
                    with self._cond:
                        rec.head_at = time.monotonic()
                elif isinstance(step, Send):
                    await self._pause(conn, step.delay)
                    if step.raw:
                        await self._write(conn, rec, step.data, None, b"")
                    elif step.data:
                        await self._write(conn, rec, _frame(script, step.data), counter, step.data)
                elif isinstance(step, Sleep):
                    await self._pause(conn, step.seconds)
                elif isinstance(step, Wait):
                    await self._race_peer(conn, step.gate.wait())
                elif isinstance(step, Hang):
                    await conn.peer_closed.wait()
                    raise _PeerGone
                elif isinstance(step, Reset):
                    _reset(conn)
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
        except (_PeerGone, OSError):
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

    async def _pause(self, conn: _Conn, seconds: float) -> None:
        """Sleep, but raise `_PeerGone` as soon as the client hangs up."""
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.peer_closed.wait(), seconds)
        if conn.peer_closed.is_set():
            raise _PeerGone

    async def _race_peer(self, conn: _Conn, waitable: Coroutine[Any, Any, None]) -> None:
        """Await `waitable`, but raise `_PeerGone` as soon as the client hangs up."""
        tasks = [asyncio.ensure_future(waitable), asyncio.ensure_future(conn.peer_closed.wait())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if conn.peer_closed.is_set():
            raise _PeerGone

    async def _write(
        self,
        conn: _Conn,
        rec: RecordedRequest,
        wire: bytes,
        counter: SSEEventCounter | None,
        payload: bytes,
    ) -> None:
        if conn.peer_closed.is_set():
            raise _PeerGone
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


def _head_bytes(script: Script, steps: Sequence[Step]) -> bytes:
    try:
        reason = HTTPStatus(script.status).phrase
    except ValueError:
        reason = "Unknown"
    given = {k.lower() for k in script.headers}
    lines = [f"HTTP/1.1 {script.status} {reason}"]
    if script.framing == "chunked" and not given & {"transfer-encoding", "content-length"}:
        lines.append("transfer-encoding: chunked")
    elif script.framing == "length" and "content-length" not in given:
        length = sum(len(s.data) for s in steps if isinstance(s, Send) and not s.raw)
        lines.append(f"content-length: {length}")
    if "connection" not in given:
        closing = script.close or script.framing == "close"
        lines.append("connection: close" if closing else "connection: keep-alive")
    lines += [f"{k}: {v}" for k, v in script.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _frame(script: Script, data: bytes) -> bytes:
    if script.framing == "chunked":
        return b"%x\r\n%s\r\n" % (len(data), data)
    return data


def _reset(conn: _Conn) -> None:
    """Abort with RST: SO_LINGER with a zero timeout makes close() drop the connection."""
    conn.server_closing = True
    sock = conn.writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.writer.transport.abort()


# --------------------------------------------------------------------------------------------
# The background event loop
# --------------------------------------------------------------------------------------------


class LoopThread:
    """An asyncio event loop in a daemon thread, driven from the test thread.

    Servers (gateway, upstreams) live in this loop; the test thread talks to them over sockets
    with sync clients, so streaming is exercised exactly as in production. `add_cleanup`
    registers async teardown steps (server stops) that `run_cleanups`/`stop` run LIFO."""

    def __init__(self, name: str = "harness-loop") -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        #: contexts the loop's exception handler saw ("Task exception was never retrieved"...)
        self.errors: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._cleanups: list[Callable[[], Awaitable[object]]] = []
        self._lock = threading.Lock()

    def start(self) -> LoopThread:
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.loop.set_exception_handler(self._on_loop_error)
        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(5.0):
            raise RuntimeError("event loop thread did not start")
        return self

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.errors.append(context)
        loop.default_exception_handler(context)

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident if self._thread is not None else None

    def submit(self, aw: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Schedule `aw` (a coroutine or any awaitable) in the loop; return a future the test
        thread can wait on."""
        coro = aw if asyncio.iscoroutine(aw) else _await(aw)
        if threading.get_ident() == self.thread_id:
            coro.close()
            raise RuntimeError("LoopThread.run/submit called from inside its own loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, aw: Awaitable[T], timeout: float = 10.0) -> T:
        """Run `aw` in the loop and return its result; on timeout cancel it and raise
        TimeoutError."""
        fut = self.submit(aw)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout}s") from None

    def call(self, fn: Callable[[], T], timeout: float = 5.0) -> T:
        """Run a plain function in the loop thread (to read loop-owned state safely)."""

        async def invoke() -> T:
            return fn()

        return self.run(invoke(), timeout)

    def tasks(self) -> set[asyncio.Task[Any]]:
        """Every unfinished task of the loop (except the one that asks)."""

        async def collect() -> set[asyncio.Task[Any]]:
            return asyncio.all_tasks() - {asyncio.current_task()}

        return self.run(collect(), 5.0)

    def add_cleanup(self, fn: Callable[[], Awaitable[object]]) -> None:
        with self._lock:
            self._cleanups.append(fn)

    def run_cleanups(self, timeout: float = 15.0) -> None:
        """Run registered cleanups LIFO; each runs even if an earlier one raised (the first
        error propagates, later ones are chained to it)."""
        with self._lock:
            if not self._cleanups:
                return
            fn = self._cleanups.pop()
        try:
            self.run(fn(), timeout)
        finally:
            self.run_cleanups(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Run cleanups, cancel what is left, shut the loop down and join the thread."""
        if self._thread is None:
            return
        try:
            self.run_cleanups()
        finally:
            try:
                self.run(self._cancel_everything(timeout), timeout + 5.0)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout)
                if not self._thread.is_alive():
                    self.loop.close()
                self._thread = None

    async def _cancel_everything(self, timeout: float) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        await self.loop.shutdown_asyncgens()
        await asyncio.wait_for(self.loop.shutdown_default_executor(), timeout)

    def __enter__(self) -> LoopThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _await(aw: Awaitable[T]) -> T:
    return await aw


# --------------------------------------------------------------------------------------------
# ASGI apps under a real uvicorn
# --------------------------------------------------------------------------------------------


class _ThreadFriendlyServer(uvicorn.Server):
    """uvicorn.Server that never installs signal handlers (the test runner owns SIGINT and
    pytest-timeout's SIGALRM) and tells when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


class StartupFailed(RuntimeError):
    """The ASGI app's lifespan startup failed (uvicorn would have called sys.exit)."""


@dataclass(frozen=True)
class RunningServer:
    """An ASGI app listening on 127.0.0.1. `base_url` is the root (no `/v1`)."""

    base_url: str
    port: int
    stop: Callable[[], Awaitable[None]]
    server: uvicorn.Server

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def v1(self) -> str:
        """The OpenAI-style base URL for SDK clients."""
        return self.base_url + "/v1"


async def serve_asgi(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 10.0,
    graceful_timeout: int = 2,
) -> RunningServer:
    """Run `app` under uvicorn (lifespan on) on a socket bound to an ephemeral port; return
    once it accepts connections. `await running.stop()` shuts it down gracefully (connections
    still streaming after `graceful_timeout` s are cut) and waits for it; it is idempotent."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    port: int = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level="warning",
        log_config=None,
        access_log=False,
        ws="none",
        proxy_headers=False,
        timeout_graceful_shutdown=graceful_timeout,
    )
    server = _ThreadFriendlyServer(config)
    serve_task = asyncio.create_task(_serve(server, sock), name=f"uvicorn-{port}")
    ready = asyncio.create_task(server.ready.wait(), name=f"uvicorn-{port}-ready")
    await asyncio.wait(
        {serve_task, ready}, timeout=startup_timeout, return_when=asyncio.FIRST_COMPLETED
    )

    async def stop(timeout: float = 10.0) -> None:
        if not serve_task.done():
            server.should_exit = True
            await asyncio.wait({serve_task}, timeout=timeout)
        if not serve_task.done():
            server.force_exit = True
            serve_task.cancel()
            await asyncio.wait({serve_task}, timeout=2.0)
        # Connections whose tasks uvicorn cancelled at the graceful timeout keep their sockets.
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if isinstance(transport, asyncio.BaseTransport):
                transport.close()
        if serve_task.done() and not serve_task.cancelled():
            serve_task.result()

    if not ready.done():
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ready
        if serve_task.done():
            serve_task.result()  # raises StartupFailed
        await stop()
        raise TimeoutError(f"ASGI app did not start within {startup_timeout}s")
    return RunningServer(f"http://{host}:{port}", port, stop, server)


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn's way to report a failed lifespan startup
        raise StartupFailed(f"ASGI app failed to start (exit status {exc.code})") from None
    finally:
        sock.close()


# --------------------------------------------------------------------------------------------
# Leak checks
# --------------------------------------------------------------------------------------------


def _open_fds() -> dict[int, str]:
    fds: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


def _addr(addr: Any) -> str:
    return f"{addr.ip}:{addr.port}" if addr else "-"


def _tcp_sockets() -> dict[tuple[str, str], str]:
    """This process's TCP sockets: (local, remote) -> status."""
    conns = _psutil.Process().net_connections(kind="tcp")
    return {(_addr(c.laddr), _addr(c.raddr)): str(c.status) for c in conns}


def _describe_task(task: asyncio.Task[Any]) -> str:
    where = ""
    stack = task.get_stack(limit=1)
    if stack:
        code = stack[-1].f_code
        where = f" at {code.co_filename}:{stack[-1].f_lineno} in {code.co_name}"
    return f"task {task.get_name()!r}: {task.get_coro()!r}{where}"


class LeakBaseline:
    """What was open when a test started: tasks of the loop thread's loop, file descriptors,
    TCP sockets of this process. `check()` fails if anything beyond that is still open.

    Capture it before the test opens anything, and call `check` from the test thread after
    every server, client and response of the test is closed."""

    def __init__(self, loop_thread: LoopThread | None = None) -> None:
        self._loop_thread = loop_thread
        self.tasks = self._tasks()
        self.fds = _open_fds()
        self.tcp = _tcp_sockets()

    def _tasks(self) -> set[asyncio.Task[Any]]:
        return self._loop_thread.tasks() if self._loop_thread is not None else set()

    def leaks(self) -> list[str]:
        """What is open now and was not at the baseline, one line each."""
        problems: list[str] = []
        if self._loop_thread is not None:
            new = self._tasks() - self.tasks
            if new:
                problems += self._loop_thread.call(lambda: [_describe_task(t) for t in new])
        fds = _open_fds()
        problems += [
            f"fd {fd} -> {target}" for fd, target in fds.items() if self.fds.get(fd) != target
        ]
        tcp = _tcp_sockets()
        problems += [
            f"tcp {local} -> {remote} ({status})"
            for (local, remote), status in tcp.items()
            if (local, remote) not in self.tcp
        ]
        return sorted(problems)

    def check(self, settle_timeout: float = 2.0) -> None:
        """Poll until nothing is left over (closing is asynchronous), or raise AssertionError
        listing what leaked. The short sleeps here are polling, not a timing assertion."""
        deadline = time.monotonic() + settle_timeout
        while problems := self.leaks():
            if time.monotonic() >= deadline:
                listing = "\n  ".join(problems)
                raise AssertionError(f"resources leaked by the test:\n  {listing}")
            time.sleep(0.02)


# --------------------------------------------------------------------------------------------
# Factories behind the conftest fixtures
# --------------------------------------------------------------------------------------------


class UpstreamFactory:
    """`factory(n)` starts n `ScriptedUpstream`s in the loop thread, stopped at teardown."""

    def __init__(self, loop_thread: LoopThread) -> None:
        self._loop_thread = loop_thread

    def __call__(
        self, count: int = 1, *, responder: Responder | None = None
    ) -> list[ScriptedUpstream]:
        return [self.one(responder=responder) for _ in range(count)]

    def one(self, *, responder: Responder | None = None, name: str = "") -> ScriptedUpstream:
        async def create() -> ScriptedUpstream:
            # constructed in the loop thread: its asyncio objects belong to that loop
            up = ScriptedUpstream(responder, name=name or "upstream")
            await up.start()
            return up

        upstream = self._loop_thread.run(create())
        self._loop_thread.add_cleanup(upstream.stop)
        return upstream


class AsgiServerFactory:
    """`factory(app)` serves an ASGI app under uvicorn in the loop thread, stopped at
    teardown; `factory.build(make_app)` first calls `make_app()` inside the loop thread."""

    def __init__(self, loop_thread: LoopThread) -> None:
        self._loop_thread = loop_thread

    def __call__(self, app: ASGIApp, **kwargs: Any) -> RunningServer:
        return self.build(lambda: app, **kwargs)

    def build(self, make_app: Callable[[], ASGIApp], **kwargs: Any) -> RunningServer:
        async def create() -> RunningServer:
            return await serve_asgi(make_app(), **kwargs)

        running = self._loop_thread.run(create(), 30.0)
        self._loop_thread.add_cleanup(running.stop)
        return running
