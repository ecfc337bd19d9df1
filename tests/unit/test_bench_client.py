"""The bench's lean load client: its stream scan (pure, a fake clock) and its HTTP/1.1
connection fed bytes by hand (a fake transport, no sockets)."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.bench.client import (
    Buffered,
    Target,
    TransportError,
    _Connection,
    request_bytes,
    target,
)
from gateway.bench.load import MAX_LINE, StreamScan


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKEN = event({"choices": [{"index": 0, "delta": {"content": "tok0 "}}]})
FINISH = event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
ERROR = event({"error": {"message": "boom"}})
DONE = b"data: [DONE]\n\n"
STREAM = b": keep-alive\n\n" + ROLE + TOKEN + TOKEN + FINISH + DONE


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def scan_of(chunks: list[bytes], status: int = 200, claim: bool = True,
            headers: dict[bytes, bytes] | None = None) -> tuple[StreamScan, list[bool]]:
    clock = Clock()
    scan = StreamScan(start=10.0, claim=lambda: claim, clock=clock)
    scan.head(status, headers or {})
    results = []
    for k, chunk in enumerate(chunks):
        clock.now = 10.0 + k  # chunk k lands at second k
        results.append(scan.body(chunk))
        if not results[-1]:
            break  # as the connection does: a stop reads nothing more
    return scan, results


def test_a_stream_cut_anywhere_reads_the_same() -> None:
    """Every split point of the body, and CRLF line ends: the same events, and the first
    content token (not the role chunk or the comment) timed at the chunk that completed it."""
    for body in (STREAM, STREAM.replace(b"\n", b"\r\n")):
        for cut in range(1, len(body)):
            scan, results = scan_of([body[:cut], body[cut:]])
            sample = scan.sample(7)
            assert results == [True, True]
            assert sample.ok and sample.error is None and sample.index == 7
            assert sample.events == 4  # role, two tokens, finish
            line_end = body.index(b"\n", body.index(b"tok0"))  # the token's line is whole
            assert sample.ttft == (0.0 if cut > line_end else 1.0)


def test_the_gateways_headers_are_read() -> None:
    scan, _ = scan_of([STREAM], headers={b"x-hedge-attempts": b"2", b"x-hedge-backend": b"b"})
    sample = scan.sample(0)
    assert (sample.attempts, sample.backend) == (2, "b")
    scan, _ = scan_of([STREAM], headers={b"x-hedge-attempts": b"many"})
    assert scan.sample(0).attempts is None


@pytest.mark.parametrize(("chunks", "error", "stops"), [
    ([ROLE, ERROR, TOKEN, DONE], "error event before the first token", True),
    ([ROLE, TOKEN, ERROR, DONE], "error event after the first token", True),
    ([ROLE, b"data: {not json\n\n", DONE], "malformed event", True),
    ([ROLE, TOKEN, FINISH], "truncated (no [DONE])", False),
    ([ROLE, FINISH, DONE], "no token", False),
    ([b"data: " + b"x" * (MAX_LINE + 1)], "event line too long", True),
])
def test_each_failure_has_its_label(chunks: list[bytes], error: str, stops: bool) -> None:
    scan, results = scan_of(chunks)
    sample = scan.sample(0)
    assert not sample.ok and sample.error == error
    assert (False in results) == stops
    assert scan.body(DONE) is not stops  # once stopped, it stays stopped


def test_an_error_status_is_drained_not_scanned() -> None:
    scan, results = scan_of([b'{"error": {"message": "busy"}}'], status=503)
    assert results == [True]  # read to its end: the connection stays reusable
    assert scan.sample(0).error == "status 503"


def test_a_lost_claim_stops_at_the_first_token() -> None:
    scan, results = scan_of([ROLE, TOKEN, DONE], claim=False)
    assert results == [True, False]
    sample = scan.sample(0)
    assert sample.error == "lost" and sample.ttft is None


def test_bytes_after_done_are_not_scanned() -> None:
    scan, results = scan_of([DONE, b"data: {not json\n\n"])
    assert results == [True, True]
    assert scan.sample(0).error == "no token"


def test_a_transport_error_wins_over_what_was_read() -> None:
    scan, _ = scan_of([ROLE, TOKEN])
    sample = scan.sample(3, "ReadTimeout")
    assert sample.error == "transport: ReadTimeout" and sample.ttft == 1.0


def test_target_and_request_bytes() -> None:
    t = target("http://127.0.0.1:8080/v1/chat/completions?x=1")
    assert t == Target("127.0.0.1", 8080, "/v1/chat/completions?x=1")
    assert target("http://localhost").path == "/"
    with pytest.raises(ValueError, match="plain http"):
        target("https://example.com/")
    raw = request_bytes("POST", t, b"{}", {"x-request-id": "bench-1"})
    assert raw == (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:8080\r\n"
                   b"content-length: 2\r\nx-request-id: bench-1\r\n\r\n{}")


def test_buffered_keeps_a_body_up_to_its_limit() -> None:
    sink = Buffered(limit=5)
    sink.head(200, {})
    assert sink.body(b"abc") and sink.content == b"abc"
    assert not sink.body(b"def") and sink.too_large


# --- the connection, fed by hand -------------------------------------------------------------


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-hedge-backend: a\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n")


def connection() -> tuple[_Connection, FakeTransport]:
    conn = _Connection(asyncio.get_running_loop())
    transport = FakeTransport()
    conn.connection_made(transport)
    return conn, transport


async def test_a_whole_response_leaves_the_connection_reusable() -> None:
    conn, transport = connection()
    scan = StreamScan(start=0.0)
    done = conn.start(b"GET / HTTP/1.1\r\n\r\n", scan, timeout=60.0)
    assert transport.written == [b"GET / HTTP/1.1\r\n\r\n"]
    wire = chunked(ROLE, TOKEN, FINISH, DONE)
    for k in range(0, len(wire), 7):  # any framing
        conn.data_received(wire[k:k + 7])
    await done
    assert scan.sample(0).ok and scan.backend == "a"
    assert conn.reusable and not transport.closed


async def test_a_sink_that_stops_closes_the_connection() -> None:
    conn, transport = connection()
    scan = StreamScan(start=0.0)
    done = conn.start(b"x", scan, timeout=60.0)
    conn.data_received(chunked(ROLE, ERROR, TOKEN, DONE))
    await done
    assert scan.sample(0).error == "error event before the first token"
    assert transport.closed and not conn.reusable


@pytest.mark.parametrize(("exc", "kind"), [(None, "RemoteProtocolError"),
                                           (ConnectionResetError(), "ReadError")])
async def test_a_peer_that_goes_away_mid_body_is_a_transport_error(
        exc: Exception | None, kind: str) -> None:
    conn, _ = connection()
    done = conn.start(b"x", StreamScan(start=0.0), timeout=60.0)
    conn.data_received(chunked(ROLE)[:-5])  # no last chunk
    conn.connection_lost(exc)
    with pytest.raises(TransportError) as info:
        await done
    assert info.value.kind == kind and conn.closed


async def test_garbage_is_a_protocol_error() -> None:
    conn, transport = connection()
    done = conn.start(b"x", StreamScan(start=0.0), timeout=60.0)
    conn.data_received(b"SMTP ready\r\n\r\n")
    with pytest.raises(TransportError, match="RemoteProtocolError"):
        await done
    assert transport.closed
