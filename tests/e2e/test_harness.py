"""The shared harness, exercised over real loopback sockets: the ScriptedUpstream against the
official OpenAI SDK, httpx and raw sockets; serve_asgi with a small streaming Starlette app;
and the leak check, which must pass after all that and fail when something is left open."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests.harness import (
    DONE,
    AsgiServerFactory,
    Close,
    Framing,
    Gate,
    Hang,
    Head,
    LeakBaseline,
    LoopThread,
    RecordedRequest,
    Reset,
    Script,
    ScriptedUpstream,
    Send,
    SSEEventCounter,
    StartupFailed,
    UpstreamFactory,
    Wait,
    comment,
    error_script,
    finish_chunk,
    hang_script,
    json_script,
    reset_script,
    role_chunk,
    serve_asgi,
    stream_script,
    token_chunk,
)
from tests.harness.loop import LOOP_ENV, new_loop

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def sdk(base_url: str, read_timeout: float = 10.0) -> Iterator[openai.OpenAI]:
    timeout = openai.Timeout(10.0, read=read_timeout)
    with openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, timeout=timeout) as c:
        yield c


# ---- the loop the servers run on ----


def test_the_servers_run_on_the_loop_asked_for(
    loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio's loop, or uvloop (the loop `hedge-gateway serve` runs on, whose timers and
    transports production meets) with `HEDGE_TEST_LOOP=uvloop`, as `.ci/run` runs the race's
    integration tests once more."""
    assert isinstance(loop_thread.loop, uvloop.Loop) == (os.environ.get(LOOP_ENV) == "uvloop")
    made = object()  # (a uvloop made and closed here would keep two pipes open for good)
    monkeypatch.setattr(uvloop, "new_event_loop", lambda: made)
    monkeypatch.setenv(LOOP_ENV, "uvloop")
    assert new_loop() is made
    monkeypatch.delenv(LOOP_ENV)
    plain = new_loop()
    plain.close()
    assert plain is not made


# ---- SSEEventCounter (pure) ----


def test_event_counter_counts_events_across_any_split_and_line_end() -> None:
    wire = b": ping\n\ndata: a\r\n\r\ndata: b\rdata: c\r\rid: 7\n\n: only comment\n\ndata: d\n\n"
    for cut in range(len(wire) + 1):
        counter = SSEEventCounter()
        counter.feed(wire[:cut])
        counter.feed(wire[cut:])
        assert counter.total == 4, cut
    one_by_one = SSEEventCounter()
    assert sum(one_by_one.feed(wire[i : i + 1]) for i in range(len(wire))) == 4


# ---- ScriptedUpstream with the OpenAI SDK ----


def test_sdk_receives_streamed_chat_with_comments_role_and_tokens(
    scripted_upstream: UpstreamFactory,
) -> None:
    up = scripted_upstream.one()
    pre = [comment("OPENROUTER PROCESSING"), role_chunk(), comment("ping")]
    up.queue(stream_script(["Hel", "lo", " world"], pre=pre, usage=True))
    with sdk(up.base_url) as client:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Hello world"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 7
    (rec,) = up.requests
    assert up.wait_finished(rec)
    assert (rec.method, rec.path) == ("POST", "/v1/chat/completions")
    assert rec.body["model"] == "m" and rec.body["stream"] is True
    assert rec.headers["authorization"] == "Bearer sk-test"
    # role, 3 tokens, finish, usage, [DONE]; comments are not events
    assert rec.events_written == 7 and len(rec.event_times) == 7
    assert rec.event_times == sorted(rec.event_times)
    assert rec.head_at is not None and rec.received_at <= rec.head_at <= rec.event_times[0]
    assert rec.outcome == "complete"


def test_non_streaming_json_and_errors_reach_the_sdk(
    scripted_upstream: UpstreamFactory,
) -> None:
    up = scripted_upstream.one()
    with sdk(up.base_url) as client:
        answer = client.chat.completions.create(model="m", messages=MESSAGES)
        assert answer.choices[0].message.content == "Hello world"  # default responder
        up.queue(error_script(429, "slow down", headers={"retry-after": "1"}))
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.response.headers["retry-after"] == "1"


def test_closing_the_sdk_stream_early_records_closed_at(
    scripted_upstream: UpstreamFactory,
) -> None:
    up = scripted_upstream.one()
    # the second token would come after a long pause: the close must cut the pause short
    up.queue(
        Script(
            headers=SSE_H, steps=[Send(role_chunk()), Send(token_chunk("a")), Send(b"x", delay=60)]
        )
    )
    with sdk(up.base_url) as client:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        first = [next(iter(stream)), next(iter(stream))]
        assert first[1].choices[0].delta.content == "a"
        (rec,) = up.requests
        assert rec.closed_at is None
        stream.close()
        assert up.wait_closed(rec, timeout=5.0)
        assert up.wait_finished(rec)
    assert rec.closed_at is not None and rec.closed_at > rec.event_times[-1]
    assert rec.outcome == "client_closed" and rec.events_written == 2
    assert up.wait_connections(0)


SSE_H = {"content-type": "text/event-stream"}


def test_reset_mid_stream_makes_the_sdk_raise(scripted_upstream: UpstreamFactory) -> None:
    up = scripted_upstream.one()
    gate = Gate()
    up.queue(
        Script(
            headers=SSE_H, steps=[Send(role_chunk()), Send(token_chunk("a")), Wait(gate), Reset()]
        )
    )
    with sdk(up.base_url) as client:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        it = iter(stream)
        assert next(it).choices[0].delta.role == "assistant"
        assert next(it).choices[0].delta.content == "a"
        gate.open()
        with pytest.raises(openai.APIConnectionError) as info:
            next(it)
        assert not isinstance(info.value, openai.APITimeoutError)
        stream.close()
    (rec,) = up.requests
    assert up.wait_finished(rec) and rec.outcome == "reset"
    assert rec.closed_at is None  # the server hung up, not the client


def test_reset_before_any_byte_is_a_connection_error(scripted_upstream: UpstreamFactory) -> None:
    up = scripted_upstream.one()
    up.queue(reset_script())
    with sdk(up.base_url) as client, pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="m", messages=MESSAGES, stream=True)


def test_reset_sends_a_tcp_rst(scripted_upstream: UpstreamFactory) -> None:
    up = scripted_upstream.one()
    up.queue(Script(steps=[Head(), Reset()]))
    with socket.create_connection(("127.0.0.1", up.port), timeout=5.0) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        assert up.wait_requests(1) and up.wait_finished(up.requests[0])
        with pytest.raises(ConnectionResetError):
            while s.recv(65536):
                pass


def test_a_hang_is_observed_and_the_client_timeout_closes_it(
    scripted_upstream: UpstreamFactory,
) -> None:
    up = scripted_upstream.one()
    up.queue(Script(headers=SSE_H, steps=[Send(role_chunk()), Hang()]), hang_script())
    with sdk(up.base_url, read_timeout=0.3) as client:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        it = iter(stream)
        assert next(it).choices[0].delta.role == "assistant"
        with pytest.raises(openai.APITimeoutError):
            next(it)
        stream.close()
        with pytest.raises(openai.APITimeoutError):  # hang before the head
            client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    hung_body, hung_head = up.requests
    for rec in (hung_body, hung_head):
        assert up.wait_closed(rec) and up.wait_finished(rec)
        assert rec.outcome == "client_closed"
    assert hung_body.events_written == 1 and hung_head.head_at is None


# ---- ScriptedUpstream with httpx and raw sockets ----


def test_keep_alive_serves_several_requests_on_one_connection(
    scripted_upstream: UpstreamFactory,
) -> None:
    up = scripted_upstream.one()
    up.queue(
        json_script({"n": 1}, close=False),
        stream_script(["x"], close=False),
        json_script({"n": 3}),
    )
    with httpx.Client(base_url=up.base_url, timeout=5.0) as client:
        assert client.post("/a", json={"q": 1}).json() == {"n": 1}
        streamed = client.post("/b", content=b"not json").content
        assert streamed.endswith(DONE)
        assert client.get("/c?x=1").json() == {"n": 3}
    a, b, c = up.requests
    assert a.conn_id == b.conn_id == c.conn_id
    # the server closed after the last response: no request saw the client close
    assert up.wait_connections(0) and a.closed_at is b.closed_at is c.closed_at is None
    assert up.connections_total == 1
    assert a.body == {"q": 1} and b.body == b"not json"
    assert (c.method, c.path, c.query) == ("GET", "/v1/c", "x=1")


@pytest.mark.parametrize("framing", ["chunked", "close"])
def test_stream_framings_deliver_the_same_body(
    scripted_upstream: UpstreamFactory, framing: Framing
) -> None:
    up = scripted_upstream.one()
    up.queue(stream_script(["a", "b"], framing=framing))
    with httpx.Client(timeout=5.0) as client:
        response = client.post(up.base_url + "/chat/completions", json={"stream": True})
    expected = role_chunk() + token_chunk("a") + token_chunk("b") + finish_chunk() + DONE
    assert response.content == expected
    assert ("transfer-encoding" in response.headers) == (framing == "chunked")


def test_partial_writes_giant_lines_and_truncation(scripted_upstream: UpstreamFactory) -> None:
    up = scripted_upstream.one()
    giant = b"data: " + b"x" * (4 * 1024 * 1024) + b"\n\n"
    event = 'data: {"choices": [{"delta": {"content": "\u00e9"}}]}\n\n'.encode()
    half = event.index("\u00e9".encode()) + 1  # split inside the two-byte character
    up.queue(
        Script(headers=SSE_H, steps=[Send(event[:half]), Send(event[half:]), Send(giant), Close()]),
    )
    received = b""
    with (
        httpx.Client(timeout=5.0) as client,
        client.stream("POST", up.base_url + "/chat/completions", json={}) as response,
        pytest.raises(httpx.RemoteProtocolError),  # incomplete chunked body
    ):
        for part in response.iter_raw():
            received += part
    assert received == event + giant
    (rec,) = up.requests
    assert up.wait_finished(rec) and rec.outcome == "closed" and rec.events_written == 2


def test_causality_loser_closed_before_winners_third_event(
    scripted_upstream: UpstreamFactory,
) -> None:
    """The shape of the assertions the hedging tests make, with the test as the 'gateway'."""
    loser, winner = scripted_upstream(2)
    loser.queue(Script(headers=SSE_H, steps=[Send(role_chunk()), Hang()]))
    gate = Gate()
    tokens = [Send(token_chunk(t)) for t in "abc"]
    winner.queue(
        Script(headers=SSE_H, steps=[Send(role_chunk()), tokens[0], Wait(gate), *tokens[1:]])
    )
    with (
        httpx.Client(timeout=5.0) as client,
        client.stream("POST", loser.base_url + "/chat/completions", json={}) as lose,
        client.stream("POST", winner.base_url + "/chat/completions", json={}) as win,
    ):
        next(lose.iter_raw())
        win_parts = win.iter_raw()
        next(win_parts)
        assert winner.wait_events(winner.requests[0], 2)
        lose.close()
        (lost,) = loser.requests
        assert loser.wait_closed(lost)
        gate.open()
        assert b"".join(win_parts).endswith(token_chunk("c"))
    (won,) = winner.requests
    assert winner.wait_finished(won) and won.events_written == 4
    assert lost.closed_at is not None and lost.closed_at < won.event_times[2]


def test_responder_sees_the_request_and_bad_requests_get_400(
    scripted_upstream: UpstreamFactory,
) -> None:
    up = scripted_upstream.one(responder=lambda r: json_script({"echo": r.body["n"]}))
    with httpx.Client(timeout=5.0) as client:
        assert client.post(up.base_url + "/x", json={"n": 5}).json() == {"echo": 5}
    with socket.create_connection(("127.0.0.1", up.port), timeout=5.0) as s:
        s.sendall(b"garbage\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")


def test_a_broken_responder_surfaces_at_stop(loop_thread: LoopThread) -> None:
    def broken(_: RecordedRequest) -> Script:
        raise ValueError("responder bug")

    async def start() -> ScriptedUpstream:
        up = ScriptedUpstream(broken)
        await up.start()
        return up

    up = loop_thread.run(start())
    with httpx.Client(timeout=5.0) as client, pytest.raises(httpx.RemoteProtocolError):
        client.get(up.base_url + "/models")
    with pytest.raises(ValueError, match="responder bug"):
        loop_thread.run(up.stop())


def test_stop_ends_hanging_requests(loop_thread: LoopThread) -> None:
    async def start() -> ScriptedUpstream:
        up = ScriptedUpstream(lambda _: hang_script())
        await up.start()
        return up

    up = loop_thread.run(start())
    with socket.create_connection(("127.0.0.1", up.port), timeout=5.0) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert up.wait_requests(1)
        loop_thread.run(up.stop())
        assert s.recv(10) == b""
    (rec,) = up.requests
    assert rec.outcome == "server_stopped" and up.open_connections == 0


# ---- serve_asgi ----


def make_app(events: list[str]) -> Starlette:
    release = asyncio.Event()

    async def stream(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b"first\n"
            await release.wait()
            yield b"second\n"

        return StreamingResponse(body(), media_type="text/plain")

    async def endless(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            while True:
                yield b"tick\n"
                await asyncio.sleep(0.01)

        return StreamingResponse(body(), media_type="text/plain")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        events.append("startup")
        yield
        events.append("shutdown")

    app = Starlette(
        routes=[Route("/stream", stream), Route("/endless", endless)], lifespan=lifespan
    )
    app.state.release = release
    return app


def test_serve_asgi_streams_over_a_real_socket(
    loop_thread: LoopThread, leak_check: LeakBaseline
) -> None:
    events: list[str] = []
    app = make_app(events)
    running = loop_thread.run(serve_asgi(app))
    assert events == ["startup"]
    with (
        httpx.Client(timeout=5.0) as client,
        client.stream("GET", running.url("/stream")) as response,
    ):
        parts = response.iter_raw()
        # the app cannot produce "second" before the test releases it: not buffered
        assert next(parts) == b"first\n"
        loop_thread.call(app.state.release.set)
        assert b"".join(parts) == b"second\n"
    loop_thread.run(running.stop())
    assert events == ["startup", "shutdown"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", running.port), timeout=5.0).close()
    leak_check.check()


def test_serve_asgi_stop_cuts_a_stream_that_never_ends(
    loop_thread: LoopThread, leak_check: LeakBaseline
) -> None:
    events: list[str] = []
    running = loop_thread.run(serve_asgi(make_app(events), graceful_timeout=1))
    with (
        httpx.Client(timeout=5.0) as client,
        client.stream("GET", running.url("/endless")) as response,
    ):
        parts = response.iter_raw()
        assert next(parts).startswith(b"tick")
        loop_thread.run(running.stop(), timeout=15.0)
        with contextlib.suppress(httpx.HTTPError):
            for _ in parts:
                pass
    assert events == ["startup", "shutdown"]
    leak_check.check()


def test_serve_asgi_reports_a_failed_startup(loop_thread: LoopThread) -> None:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        raise RuntimeError("no config")
        yield

    with pytest.raises(StartupFailed):
        loop_thread.run(serve_asgi(Starlette(lifespan=lifespan)))
    assert loop_thread.run(asyncio.sleep(0, "still alive")) == "still alive"


def test_asgi_server_fixture_serves_the_openai_route_shape(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """An ASGI app that forwards to an upstream, as the gateway does, driven by the SDK."""
    up = scripted_upstream.one()
    up.queue(stream_script(["via ", "proxy"]))

    async def proxy(request: Request) -> StreamingResponse:
        body = await request.body()
        client = httpx.AsyncClient(timeout=5.0)
        upstream = await client.send(
            client.build_request("POST", up.base_url + "/chat/completions", content=body),
            stream=True,
        )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for part in upstream.aiter_raw():
                    yield part
            finally:
                await upstream.aclose()
                await client.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", proxy, methods=["POST"])])
    running = asgi_server(app)
    with sdk(running.v1) as client:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "via proxy"


# ---- LoopThread ----


def test_loop_thread_run_times_out_and_cancels(loop_thread: LoopThread) -> None:
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    with pytest.raises(TimeoutError):
        loop_thread.run(forever(), timeout=0.1)
    assert loop_thread.run(asyncio.wait_for(cancelled.wait(), 5.0)) is True


# ---- conftest guards ----


def test_every_test_gets_a_timeout(request: pytest.FixtureRequest) -> None:
    if not request.config.pluginmanager.hasplugin("timeout"):
        pytest.skip("pytest-timeout not installed: the faulthandler fallback guards the run")
    marker = request.node.get_closest_marker("timeout")
    configured = request.config.getoption("timeout") or request.config.getini("timeout")
    assert marker is not None or configured


# ---- the leak check ----


@pytest.mark.no_leak_check
def test_leak_check_fails_on_a_leftover_task(loop_thread: LoopThread) -> None:
    baseline = LeakBaseline(loop_thread)

    async def spawn() -> asyncio.Task[None]:
        return asyncio.create_task(asyncio.sleep(3600), name="forgotten-sleeper")

    task = loop_thread.run(spawn())
    with pytest.raises(AssertionError, match="forgotten-sleeper"):
        baseline.check(settle_timeout=0.2)
    loop_thread.call(task.cancel)
    baseline.check()


@pytest.mark.no_leak_check
def test_leak_check_fails_on_an_open_socket_and_fd(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    up = scripted_upstream.one()
    baseline = LeakBaseline(loop_thread)
    sock = socket.create_connection(("127.0.0.1", up.port), timeout=5.0)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(AssertionError) as info:
            baseline.check(settle_timeout=0.2)
        message = str(info.value)
        assert f"127.0.0.1:{up.port} (ESTABLISHED)" in message
        assert f"fd {read_end} -> pipe:" in message
        assert "pump" in message  # the upstream's reader task for that connection
    finally:
        sock.close()
        os.close(read_end)
        os.close(write_end)
    baseline.check()


def test_fixtures_leak_check_end_to_end(tmp_path: Path) -> None:
    """The autouse guard, in a pytest subprocess: leftovers fail the test at teardown;
    upstreams and servers made through the fixtures are stopped before the check, whatever
    the fixture order; a test that failed is not also reported for leaks."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]\n')
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(
            """
            import asyncio, socket

            def test_leaks_task(loop_thread):
                async def spawn():
                    asyncio.create_task(asyncio.sleep(3600), name="left-behind")
                loop_thread.run(spawn())

            SOCKS = []
            def test_leaks_socket(scripted_upstream):
                up = scripted_upstream.one()
                SOCKS.append(socket.create_connection(("127.0.0.1", up.port)))

            def test_fixture_order_does_not_matter(scripted_upstream, leak_check):
                up = scripted_upstream.one()
                assert up.open_connections == 0

            def test_failing_test_is_not_double_reported(loop_thread):
                async def spawn():
                    asyncio.create_task(asyncio.sleep(3600))
                loop_thread.run(spawn())
                assert False, "the real failure"
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_LEAK_SETTLE_TIMEOUT": "0.3"}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"),
            *("-o", "asyncio_default_fixture_loop_scope=function", "test_inner.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout
    assert "ERROR test_inner.py::test_leaks_task" in out, out
    assert "left-behind" in out
    assert "ERROR test_inner.py::test_leaks_socket" in out
    assert "PASSED test_inner.py::test_fixture_order_does_not_matter" in out
    assert "FAILED test_inner.py::test_failing_test_is_not_double_reported" in out
    assert "ERROR test_inner.py::test_failing_test_is_not_double_reported" not in out


def test_the_live_check_sees_a_response_still_held_while_the_servers_run(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """The leak check looks before the cleanups: stopping the servers would close a response
    a gateway leaked, and a check after that would see nothing."""
    held = Script(headers=SSE_H, steps=[Head(), Send(role_chunk()), Hang()])
    upstream = scripted_upstream.one(responder=lambda _: held)
    baseline = LeakBaseline(loop_thread)

    async def open_and_hold() -> tuple[httpx.AsyncClient, httpx.Response]:
        client = httpx.AsyncClient()
        request = client.build_request("POST", upstream.base_url + "/chat/completions",
                                       json={})
        return client, await client.send(request, stream=True)

    client, response = loop_thread.run(open_and_hold())
    with pytest.raises(AssertionError, match=r"request 0 .* still open"):
        baseline.check_live(settle_timeout=0.2)

    async def release() -> None:
        await response.aclose()
        await client.aclose()

    loop_thread.run(release())
    baseline.check_live()
