"""Load and lifecycle over real sockets: a client that stops reading, admission
control, graceful shutdown of `hedge-gateway serve` with live streams.

The gateway runs under `gateway.server.serve.GatewayServer`, the same server class `serve` uses
(in-process through `tests.harness.limits_kit.GatewayFactory`, or as a real subprocess for SIGTERM).
Every in-process test ends with the automatic leak check (tasks, sockets, fds).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import ServerSettings, Timeouts
from tests.harness import (
    SSE_HEADERS,
    Gate,
    Head,
    LoopThread,
    Script,
    Send,
    UpstreamFactory,
    Wait,
    role_chunk,
    stream_script,
    token_chunk,
)
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import (
    MESSAGES,
    GatewayFactory,
    connect,
    data_lines,
    error_logs,
    held_stream,
    pool_errors,
    request_head,
    sdk,
    stats_of,
    wait_for,
)

_psutil: Any = importlib.import_module("psutil")

STREAM_BODY = json.dumps({"model": POOL, "messages": MESSAGES, "stream": True}).encode()


def stream_request(body: bytes = STREAM_BODY) -> bytes:
    headers = {"content-type": "application/json", "content-length": str(len(body))}
    return request_head("/v1/chat/completions", headers) + body


def server_side_of(sock: socket.socket, gateway_port: int) -> bool:
    """Whether this process still holds the gateway's end of `sock`'s connection."""
    client_port = sock.getsockname()[1]
    for conn in _psutil.Process().net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == gateway_port and conn.raddr \
                and conn.raddr.port == client_port:
            return True
    return False


# ---- a client that stops reading but keeps its socket -----------------------------------------


def test_stuck_client_closes_the_upstream_and_is_counted_without_an_error_log(
    loop_thread: LoopThread,
    scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    big = "x" * 8192
    tokens = [big] * 3000  # ~25 MB: far more than every buffer between us and the client
    upstream = scripted_upstream.one(responder=lambda _: stream_script(tokens))
    settings = gateway_settings([upstream.base_url], timeouts=Timeouts(stuck_client=0.5))
    gateway = GatewayFactory(loop_thread)(settings)

    client = connect(gateway.port, rcvbuf=4096)
    try:
        client.sendall(stream_request())
        assert upstream.wait_requests(1)
        (request,) = upstream.requests
        # the client never reads: the gateway gives up on it and closes the upstream
        assert upstream.wait_closed(request, 10.0), "the upstream was never closed"
        assert request.events_written < len(tokens)
        # and drops the client's connection instead of waiting for it to read
        assert wait_for(lambda: not server_side_of(client, gateway.port))
    finally:
        client.close()
    assert pool_errors(gateway.root, POOL, settle={"stream_stuck_client": 1}) == {
        "stream_stuck_client": 1
    }
    assert error_logs(caplog) == []
    assert "Exception in ASGI application" not in caplog.text
    assert loop_thread.errors == []


# ---- admission control ------------------------------------------------------------------------


def test_beyond_the_concurrency_limit_503_at_once_while_admitted_streams_flow(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gate = Gate()
    upstream = scripted_upstream.one(responder=lambda _: held_stream(gate))
    settings = gateway_settings(
        [upstream.base_url], server=ServerSettings(max_concurrent_requests=2)
    )
    gateway = GatewayFactory(loop_thread)(settings)
    body = {"model": POOL, "messages": MESSAGES, "stream": True}
    with httpx.Client(base_url=gateway.v1, timeout=10.0) as http:
        with http.stream("POST", "/chat/completions", json=body) as one, \
                http.stream("POST", "/chat/completions", json=body) as two:
            lines_one, lines_two = one.iter_lines(), two.iter_lines()
            data_lines(lines_one, "first")
            data_lines(lines_two, "first")
            # both admitted streams are live and held upstream: the third is refused at once
            refused = http.post("/chat/completions", json=body)
            assert not gate.is_open
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.headers["retry-after-ms"] == "1000"
            assert "x-should-retry" not in refused.headers  # retryable
            error = refused.json()["error"]
            assert error["code"] == "overloaded" and error["type"] == "server_error"
            assert len(upstream.requests) == 2  # the refused request never went upstream
            gate.open()
            # the admitted streams keep flowing to their proper end
            assert data_lines(lines_one, "[DONE]")[0].find("second") > 0
            assert data_lines(lines_two, "[DONE]")[0].find("second") > 0
        # the slots are free again once both streams were cleaned up (recorded in the stats)
        assert wait_for(lambda: stats_of(gateway.root)["pools"][POOL]["lifetime"]["requests"]
                        >= 3)
        with http.stream("POST", "/chat/completions", json=body) as three:
            data_lines(three.iter_lines(), "[DONE]")
    assert pool_errors(gateway.root, POOL, settle={"overloaded": 1}) == {"overloaded": 1}


# ---- shutdown ---------------------------------------------------------------------------------


def test_a_request_still_waiting_for_its_first_token_gets_503_when_the_grace_ends(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gate = Gate()
    waiting = Script(headers=SSE_HEADERS, steps=[Head(), Send(role_chunk()), Wait(gate)])
    upstream = scripted_upstream.one(responder=lambda _: waiting)
    settings = gateway_settings(
        [upstream.base_url], max_attempts=1, server=ServerSettings(shutdown_grace=0.3)
    )
    gateway = GatewayFactory(loop_thread)(settings)
    result: list[openai.APIStatusError] = []

    def client() -> None:
        with sdk(gateway.v1) as c:
            try:
                c.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
            except openai.APIStatusError as exc:
                result.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    assert upstream.wait_requests(1)
    loop_thread.call(gateway.app.state.drain.start)
    thread.join(10.0)
    assert not thread.is_alive()
    (error,) = result
    assert error.status_code == 503
    assert "shutting down" in error.message
    (request,) = upstream.requests
    assert upstream.wait_closed(request)
    # new requests during the drain: 503 at once, nothing upstream
    with httpx.Client(base_url=gateway.v1, timeout=5.0) as http:
        reply = http.post("/chat/completions", json={"model": POOL, "messages": MESSAGES})
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert len(upstream.requests) == 1
    gate.open()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def serve_config(path: Path, port: int, upstream_url: str, *, grace: str) -> None:
    path.write_text(
        f"""
server:
  host: 127.0.0.1
  port: {port}
  shutdown_grace: {grace}
pools:
  - name: {POOL}
    hedging: {{enabled: false, max_attempts: 1}}
    backends:
      - name: up
        provider: openai
        base_url: {upstream_url}
"""
    )


def wait_listening(proc: subprocess.Popen[bytes], root: str, log: Path) -> None:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(root + "/healthz", timeout=0.5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # polling for start-up, not a timing assertion
    pytest.fail(f"serve did not start:\n{log.read_text()}")


@pytest.mark.timeout(40)
def test_sigterm_drains_live_streams_closes_every_upstream_and_exits_0(
    scripted_upstream: UpstreamFactory, tmp_path: Path
) -> None:
    gate = Gate()
    hang = Script(headers=SSE_HEADERS,
                  steps=[Head(), Send(role_chunk()), Send(token_chunk("first"))])
    hang = Script(headers=SSE_HEADERS, steps=[*hang.steps, Wait(Gate())])  # never opened

    def respond(request: Any) -> Script:
        return held_stream(gate) if request.body.get("user") == "finishes" else hang

    upstream = scripted_upstream.one(responder=respond)
    port = free_port()
    config = tmp_path / "gateway.yaml"
    serve_config(config, port, upstream.base_url, grace="3s")
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )
    root = f"http://127.0.0.1:{port}"
    try:
        wait_listening(proc, root, log)
        body = {"model": POOL, "messages": MESSAGES, "stream": True}
        with httpx.Client(base_url=root + "/v1", timeout=15.0) as http, \
                http.stream("POST", "/chat/completions",
                            json={**body, "user": "finishes"}) as finishing, \
                http.stream("POST", "/chat/completions", json={**body, "user": "hangs"}) as hanging:
            lines_finishing, lines_hanging = finishing.iter_lines(), hanging.iter_lines()
            data_lines(lines_finishing, "first")
            data_lines(lines_hanging, "first")
            assert len(upstream.requests) == 2

            proc.send_signal(signal.SIGTERM)
            # no new requests: refused at the socket once uvicorn closed its listener; until
            # then (a moment) the app itself answers 503
            assert wait_for(lambda: refused_or_503(root), 10.0), log.read_text()
            # a live stream that ends within the grace period ends normally
            gate.open()
            assert "second" in data_lines(lines_finishing, "[DONE]")[0]
            # one that does not gets a final error event in OpenAI shape, then its end
            final = data_lines(lines_hanging, "gateway_shutdown")[-1]
            error = json.loads(final[len("data:"):])["error"]
            assert error["code"] == "gateway_shutdown" and "shutting down" in error["message"]
            assert [line for line in lines_hanging if line] == []  # and the stream ended
        for request in upstream.requests:
            assert upstream.wait_finished(request, 10.0)
        hung = next(r for r in upstream.requests if r.body.get("user") == "hangs")
        assert upstream.wait_closed(hung, 10.0), "the hanging upstream was never closed"
        code = proc.wait(15.0)
        output = log.read_text()
        assert code == 0, output
        assert "Application shutdown complete" in output, output
        for bad in ("Traceback", "Exception in ASGI application", "ERROR"):
            assert bad not in output, output
        # the request log counts the cut stream as a shutdown, the finished one as ok (and
        # any request refused while draining as overloaded)
        logged = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        streams = [e for e in logged if e["relay_end"] is not None]
        assert sorted((e["relay_end"], e["outcome"]) for e in streams) == [
            ("done", "ok"), ("shutdown", "stream_shutdown")], output
        assert {e["outcome"] for e in logged if e not in streams} <= {"overloaded"}, output
        assert upstream.wait_connections(0), "an upstream connection stayed open"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)


def refused_or_503(root: str) -> bool:
    """One new request after SIGTERM: True if refused at the socket (what we wait for);
    a 503 means the app refused it (fine, keep polling); anything else fails the test."""
    try:
        reply = httpx.post(root + "/v1/chat/completions", timeout=2.0,
                           json={"model": POOL, "messages": MESSAGES, "stream": True})
    except httpx.ConnectError:
        return True
    except httpx.TransportError:
        return False  # the listener closed under us: ask again
    assert reply.status_code == 503, reply.text
    return False
