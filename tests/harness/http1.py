"""The HTTP/1.1 wire work of `ScriptedUpstream`: one connection's state, reading a request,
and the byte-level writes (head, chunk framing, TCP reset) its scripts ask for.

Why apart from the upstream: this is plain protocol code with no records or locks; the
upstream decides what to do, this module only knows how bytes look on the socket. Every wait
here ends early when the client hangs up, so a script never outlives its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from tests.harness.records import RecordedRequest
from tests.harness.scripts import Script, Send, Step

MAX_HEAD = 1024 * 1024


class PeerGone(Exception):
    """The client closed the connection while a script was running."""


class BadRequest(Exception):
    """The bytes on the connection are not an HTTP/1.1 request we can read."""


class Conn:
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


@dataclass(frozen=True)
class WireRequest:
    """A request as read off the socket, before the upstream records it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    #: the body parsed as JSON, or the raw bytes when it is not JSON
    body: Any
    raw_body: bytes


# ---- reading a request ----


async def more(conn: Conn) -> bool:
    """Wait for more bytes; False once the client hung up and nothing more can come."""
    if conn.peer_closed.is_set():
        return False
    conn.changed.clear()
    await conn.changed.wait()
    return True


async def read_exact(conn: Conn, n: int) -> bytes | None:
    while len(conn.buf) < n:
        if not await more(conn):
            return None
    data = bytes(conn.buf[:n])
    del conn.buf[:n]
    return data


async def read_line(conn: Conn) -> bytes | None:
    while (end := conn.buf.find(b"\r\n")) < 0:
        if len(conn.buf) > MAX_HEAD:
            raise BadRequest("line too long")
        if not await more(conn):
            return None
    line = bytes(conn.buf[:end])
    del conn.buf[: end + 2]
    return line


async def read_chunked(conn: Conn) -> bytes | None:
    body = bytearray()
    while True:
        size_line = await read_line(conn)
        if size_line is None:
            return None
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError as exc:
            raise BadRequest("bad chunk size") from exc
        if size == 0:
            while (trailer := await read_line(conn)) not in (b"", None):
                pass
            return bytes(body) if trailer is not None else None
        data = await read_exact(conn, size + 2)
        if data is None:
            return None
        body += data[:size]


async def read_request(conn: Conn) -> WireRequest | None:
    """Read one request (head and body); None if the client hung up first. Raises
    `BadRequest` on bytes that are not HTTP/1.1."""
    while conn.buf.startswith(b"\r\n"):
        del conn.buf[:2]
    while (end := conn.buf.find(b"\r\n\r\n")) < 0:
        if len(conn.buf) > MAX_HEAD:
            raise BadRequest("request head too large")
        if not await more(conn):
            return None
    head = bytes(conn.buf[:end]).decode("latin-1")
    del conn.buf[: end + 4]
    lines = head.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(f"bad request line {lines[0]!r}")
    method, target, _ = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(f"bad header line {line!r}")
        key, value = name.strip().lower(), value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raw = await read_chunked(conn)
    else:
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError as exc:
            raise BadRequest("bad content-length") from exc
        raw = await read_exact(conn, length)
    if raw is None:
        return None
    body: Any
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        body = raw
    path, _, query = target.partition("?")
    return WireRequest(method, path, query, headers, body, raw)


# ---- waiting while a script runs ----


async def pause(conn: Conn, seconds: float) -> None:
    """Sleep, but raise `PeerGone` as soon as the client hangs up."""
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(conn.peer_closed.wait(), seconds)
    if conn.peer_closed.is_set():
        raise PeerGone


async def race_peer(conn: Conn, waitable: Coroutine[Any, Any, None]) -> None:
    """Await `waitable`, but raise `PeerGone` as soon as the client hangs up."""
    tasks = [asyncio.ensure_future(waitable), asyncio.ensure_future(conn.peer_closed.wait())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if conn.peer_closed.is_set():
        raise PeerGone


# ---- writing a response, ending a connection ----


def head_bytes(script: Script, steps: Sequence[Step]) -> bytes:
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


def frame(script: Script, data: bytes) -> bytes:
    if script.framing == "chunked":
        return b"%x\r\n%s\r\n" % (len(data), data)
    return data


def reset_conn(conn: Conn) -> None:
    """Abort with RST: SO_LINGER with a zero timeout makes close() drop the connection."""
    conn.server_closing = True
    sock = conn.writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.writer.transport.abort()


async def close_conn(conn: Conn) -> None:
    if conn.server_closing:  # already aborted
        return
    conn.server_closing = True
    conn.writer.close()
    try:
        await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
    except (OSError, TimeoutError):
        conn.writer.transport.abort()
