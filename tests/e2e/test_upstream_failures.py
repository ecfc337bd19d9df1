"""Broken upstreams over real sockets: each ends in a clear result for the
client and a closed upstream connection.

- after commit (reset, stall, close without `[DONE]`, a giant line, an event that never
  ends): the client gets what was relayed, then a final error event in OpenAI shape;
- before commit (refused, blackholed, silent, redirect, wrong content type or encoding, a
  giant line): failover to another backend, or 502/504 when none is left;
- an upstream's error body, headers and content type never reach the client: a canary key
  and an internal hostname are planted and looked for in responses, logs, stats and metrics.

Every test ends with the automatic leak check, so "the upstream connection was closed" also
means no socket, task or fd of the gateway's is left behind. Loopback only: a "blackholed"
backend is a listener whose accept queue is full (connects time out), or one that accepts and
never answers.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import providers.http
import providers.openai
from gateway.settings import ServerSettings, Timeouts
from tests.harness import (
    DONE,
    SSE_HEADERS,
    Close,
    Hang,
    Head,
    LoopThread,
    RecordedRequest,
    Reset,
    Script,
    ScriptedUpstream,
    Send,
    Step,
    UpstreamFactory,
    chat_completion_obj,
    comment,
    error_obj,
    finish_chunk,
    hang_script,
    json_script,
    role_chunk,
    stream_script,
    token_chunk,
)
from tests.harness.builders import POOL, InOrder, gateway_settings
from tests.harness.limits_kit import (
    MESSAGES,
    Canary,
    Gateway,
    GatewayFactory,
    error_logs,
    pool_errors,
    sdk,
    verbose_logs,
)

Responder = Callable[[RecordedRequest], Script]


def owner(upstreams: Sequence[ScriptedUpstream], request: RecordedRequest) -> ScriptedUpstream:
    return next(u for u in upstreams if any(r is request for r in u.requests))


def start(
    loop_thread: LoopThread,
    scripted_upstream: UpstreamFactory,
    responder: Responder,
    *,
    count: int = 1,
    extra_urls: Sequence[str] = (),
    **settings: Any,
) -> tuple[Gateway, list[ScriptedUpstream]]:
    upstreams = scripted_upstream(count, responder=responder)
    urls = [*extra_urls, *(u.base_url for u in upstreams)]
    return GatewayFactory(loop_thread)(gateway_settings(urls, **settings)), upstreams


def read_stream(gateway: Gateway) -> tuple[str, openai.APIError | None, str]:
    """Stream one chat completion with the SDK: (content received, the error raised at the
    end if any, the request id)."""
    text = ""
    with sdk(gateway.v1) as client, client.chat.completions.with_streaming_response.create(
        model=POOL, messages=MESSAGES, stream=True
    ) as response:
        request_id = response.headers["x-request-id"]
        try:
            for chunk in response.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        except openai.APIError as exc:
            return text, exc, request_id
    return text, None, request_id


def status_error(gateway: Gateway, *, stream: bool = True) -> openai.APIStatusError:
    with sdk(gateway.v1) as client, pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=POOL, messages=MESSAGES, stream=stream)
    return info.value


def committed(*tail: Step) -> Script:
    """Head, role chunk and two tokens ("a", "b"), then `tail`."""
    steps: list[Step] = [Head(), Send(role_chunk()), Send(token_chunk("a")),
                         Send(token_chunk("b")), *tail]
    return Script(headers=SSE_HEADERS, steps=steps)


GIANT_LINE = b"data: " + b"x" * (1024 * 1024 + 16)  # past the decoder's 1 MiB line limit

# ---- after commit: a final error event -------------------------------------------------------

#: name -> (script, timeouts, the final event's code, words its message holds)
AFTER_COMMIT: dict[str, tuple[Script, Timeouts | None, str, str]] = {
    "reset": (committed(Reset()), None, "upstream_failed", "reset"),
    "stall": (committed(Hang()), Timeouts(idle=0.5), "upstream_failed", "read timeout"),
    "eof-without-done": (
        stream_script(["a", "b"], done=False), None, "stream_truncated", "ended before"
    ),
    "eof-without-done-close-framing": (
        stream_script(["a", "b"], done=False, framing="close"), None, "stream_truncated",
        "ended before",
    ),
    "close-mid-body": (committed(Close()), None, "upstream_failed", "closed"),
    "giant-line": (committed(Send(GIANT_LINE), Hang()), None, "upstream_failed", "malformed"),
    "event-that-never-ends": (
        committed(*[Send(b"data: x\n" * 8192)] * 8, Hang()), None, "upstream_failed",
        "malformed",
    ),
}


@pytest.mark.parametrize("case", list(AFTER_COMMIT))
def test_a_stream_broken_after_commit_ends_with_a_final_error_event(
    loop_thread: LoopThread,
    scripted_upstream: UpstreamFactory,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    script, timeouts, code, words = AFTER_COMMIT[case]
    monkeypatch.setattr(providers.http, "MAX_EVENT_BYTES", 256 * 1024)
    gateway, (upstream,) = start(
        loop_thread, scripted_upstream, lambda _: script, max_attempts=1, timeouts=timeouts
    )
    text, error, request_id = read_stream(gateway)
    assert text == "ab"  # everything relayed before the break, nothing invented
    assert error is not None, "the stream ended as if it had succeeded"
    assert error.code == code
    assert words in error.message and request_id in error.message
    (request,) = upstream.requests
    if isinstance(script.steps[-1], Hang):  # the upstream would wait forever: we hang up
        assert upstream.wait_closed(request), "the gateway never closed the upstream"
    end = "stream_truncated" if code == "stream_truncated" else "stream_failed"
    assert pool_errors(gateway.root, POOL, settle={end: 1}) == {end: 1}


def chatty_then_token(comments: int, every: float) -> Script:
    """Committed ("a", "b"), then only `: ping` comments every `every` s, then "c" and
    `[DONE]`: an upstream that keeps the socket busy without sending any event."""
    pings: list[Step] = [Send(comment("ping"), every) for _ in range(comments)]
    return committed(*pings, Send(token_chunk("c")), Send(finish_chunk()), Send(DONE))


#: name -> (timeouts, the final event's code, words its message holds, the stats' end)
PER_EVENT_DEADLINES: dict[str, tuple[Timeouts, str, str, str]] = {
    "idle": (Timeouts(idle=0.5), "upstream_failed", "read timeout", "stream_failed"),
    "max_stream": (
        Timeouts(idle=30.0, max_stream=1.0), "stream_timeout", "maximum duration",
        "stream_too_long",
    ),
}


@pytest.mark.parametrize("case", list(PER_EVENT_DEADLINES))
def test_comments_after_commit_neither_reset_idle_nor_outlast_max_stream(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, case: str
) -> None:
    """The deadlines after commit are per event. Comments every 0.1 s restart
    httpx's read timeout on every byte, so only a deadline per event ends this stream before
    the upstream's late "c" (after 6 s of comments)."""
    timeouts, code, words, end = PER_EVENT_DEADLINES[case]
    gateway, (upstream,) = start(
        loop_thread, scripted_upstream, lambda _: chatty_then_token(60, 0.1), max_attempts=1,
        timeouts=timeouts,
    )
    text, error, request_id = read_stream(gateway)
    (request,) = upstream.requests
    assert upstream.wait_closed(request), "the gateway never closed the upstream"
    # causality: the gateway hung up while the upstream was still sending only comments
    assert request.events_written == 3 and request.outcome != "complete", request.outcome
    assert text == "ab"
    assert error is not None, "the stream outlived its deadline"
    assert error.code == code
    assert words in error.message and request_id in error.message
    assert pool_errors(gateway.root, POOL, settle={end: 1}) == {end: 1}


EMBEDDING = {
    "object": "list",
    "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
    "model": "model-0",
    "usage": {"prompt_tokens": 1, "total_tokens": 1},
}


def non_streaming(gateway: Gateway, endpoint: str) -> Any:
    with sdk(gateway.v1) as client:
        if endpoint == "embeddings":
            return client.embeddings.create(model=POOL, input="x")
        return client.chat.completions.create(model=POOL, messages=MESSAGES)


@pytest.mark.parametrize("endpoint", ["chat", "embeddings"])
def test_a_non_streaming_answer_is_bounded_by_the_pool_timeout_not_first_token(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, endpoint: str
) -> None:
    """A whole body is its own "first token"; `timeouts.first_token` and the idle
    gap between reads must not cut off an answer the pool's `timeout` allows."""
    body = EMBEDDING if endpoint == "embeddings" else chat_completion_obj("slow but fine")
    slow = json_script(body, delay=1.2)
    short = Timeouts(first_token=0.4, idle=0.4)
    gateway, (upstream,) = start(
        loop_thread, scripted_upstream, lambda _: slow, max_attempts=1, timeout=5.0,
        timeouts=short,
    )
    answer = non_streaming(gateway, endpoint)
    if endpoint == "embeddings":
        assert answer.data[0].embedding == [0.25, -0.5]
    else:
        assert answer.choices[0].message.content == "slow but fine"
    # the pool's `timeout` still bounds the whole response
    gateway, (upstream,) = start(
        loop_thread, scripted_upstream, lambda _: json_script(body, delay=3.0),
        max_attempts=1, timeout=0.8, timeouts=short,
    )
    with pytest.raises(openai.APIStatusError) as info:
        non_streaming(gateway, endpoint)
    assert info.value.status_code == 504
    (request,) = upstream.requests
    assert upstream.wait_closed(request)


# ---- before commit: failover, or 502/504 ------------------------------------------------------


def refused_url() -> str:
    """A loopback port with nothing listening (connection refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@contextlib.contextmanager
def blackhole_url() -> Iterator[str]:
    """A loopback listener whose accept queue is full and never drained: the kernel drops
    new SYNs, so connects hang until the client's connect timeout (a blackholed host)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(4):
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.3)
            try:
                probe.connect(("127.0.0.1", port))
            except TimeoutError:
                pass
            else:
                pytest.skip("this kernel accepts connections beyond a full backlog")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for sock in fillers:
            sock.close()
        listener.close()


CONNECT = Timeouts(connect=0.3)


@contextlib.contextmanager
def untrusted_tls_url(workdir: Path) -> Iterator[tuple[str, list[bytes]]]:
    """An HTTPS listener on loopback with a self-signed certificate (valid for 127.0.0.1 but
    signed by no trusted CA), and what it received after each handshake: a client that
    verifies certificates must refuse it before sending a byte of its request."""
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-days", "1"], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    with context.wrap_socket(conn, server_side=True) as tls:
                        received.append(tls.recv(65536))
                except OSError:  # ssl.SSLError included: the client refused the handshake
                    pass

    thread = threading.Thread(target=serve, name="untrusted-tls", daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{listener.getsockname()[1]}/v1", received
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_an_upstream_with_an_untrusted_certificate_is_refused(
    loop_thread: LoopThread, tmp_path: Path
) -> None:
    """TLS is verified: a backend whose certificate no trusted CA signed is a connect error,
    and not one byte of the request (body, backend key) reaches it."""
    with untrusted_tls_url(tmp_path) as (url, received):
        settings = gateway_settings([url], timeouts=CONNECT)
        gateway = GatewayFactory(loop_thread)(settings)
        error = status_error(gateway)
        assert error.status_code == 502
        assert "b0: connect error" in error.response.json()["error"]["message"]
        assert received == []


def failover_runs(gateway: Gateway, runs: int = 6) -> list[int]:
    """Stream `runs` requests; each must succeed; return how many attempts each took."""
    attempts = []
    with sdk(gateway.v1) as client:
        for _ in range(runs):
            with client.chat.completions.with_streaming_response.create(
                model=POOL, messages=MESSAGES, stream=True
            ) as response:
                text = "".join(
                    c.choices[0].delta.content or "" for c in response.parse() if c.choices
                )
                assert text == "Hello world"
                attempts.append(int(response.headers["x-hedge-attempts"]))
    return attempts


@pytest.mark.parametrize("broken", ["refused", "blackholed"])
def test_an_unreachable_backend_fails_over_to_a_healthy_one(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, broken: str
) -> None:
    with contextlib.ExitStack() as stack:
        url = refused_url() if broken == "refused" else stack.enter_context(blackhole_url())
        # hedging off and a long delay: a second attempt can only be a failover
        gateway, _ = start(loop_thread, scripted_upstream, lambda _: stream_script(
            ["Hello", " world"]), extra_urls=[url], hedging=False, delay=5.0, timeouts=CONNECT)
        attempts = failover_runs(gateway)
        assert set(attempts) <= {1, 2} and 2 in attempts, attempts


@pytest.mark.parametrize("broken", ["refused", "blackholed"])
def test_no_reachable_backend_gives_502_naming_each_failure(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, broken: str
) -> None:
    with contextlib.ExitStack() as stack:
        urls = [refused_url() if broken == "refused" else stack.enter_context(blackhole_url())
                for _ in range(2)]
        gateway = GatewayFactory(loop_thread)(gateway_settings(urls, timeouts=CONNECT))
        error = status_error(gateway)
        reason = "connect error" if broken == "refused" else "connect timeout"
        assert error.status_code == 502
        assert error.response.headers["x-should-retry"] == "false"
        body = error.response.json()["error"]
        assert body["code"] == "upstream_failed"
        assert f"b0: {reason}" in body["message"] and f"b1: {reason}" in body["message"]
        assert error.response.headers["x-request-id"] in body["message"]
        assert "127.0.0.1" not in body["message"]


def test_a_backend_that_accepts_and_never_answers_is_hedged_around_or_gives_504(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(hang_script(), stream_script(["Hello", " world"]))
    gateway, upstreams = start(loop_thread, scripted_upstream, order, count=2, delay=0.1)
    text, error, _ = read_stream(gateway)
    assert (text, error) == ("Hello world", None)
    silent = order.arrivals[0]
    assert owner(upstreams, silent).wait_closed(silent)

    silent_only = InOrder(hang_script())
    gateway, upstreams = start(loop_thread, scripted_upstream, silent_only, count=2,
                               delay=0.1, timeout=0.8)
    assert status_error(gateway).status_code == 504
    for request in silent_only.arrivals:
        assert owner(upstreams, request).wait_closed(request)


def test_a_redirect_is_never_followed(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    attacker = scripted_upstream.one(name="attacker")
    redirect = Script(status=307, headers={"location": attacker.base_url + "/chat/completions"},
                      steps=[Head()], framing="length")
    gateway, _ = start(loop_thread, scripted_upstream, lambda _: redirect, count=2)
    error = status_error(gateway)
    assert error.status_code == 502
    assert "status 307" in error.message
    assert str(attacker.port) not in error.response.text
    assert "location" not in error.response.headers
    order = InOrder(redirect, stream_script(["Hello", " world"]))
    gateway, _ = start(loop_thread, scripted_upstream, order, count=2, hedging=False)
    assert read_stream(gateway)[:2] == ("Hello world", None)
    assert attacker.connections_total == 0


#: 200 answers a gateway must not accept as a stream (or as JSON), each with a canary
CANARY = Canary("sk-CANARY-9e8d7c6b5a", "db-7.internal")
NOT_A_STREAM: dict[str, tuple[Script, bool, str]] = {
    "json-for-a-stream": (
        json_script(error_obj(f"{CANARY.value} at db-7.internal")), True,
        "unexpected content type application/json",
    ),
    "html-for-a-stream": (
        Script(headers={"content-type": f"text/html; x={CANARY.value}"},
               steps=[Head(), Send(f"<h1>{CANARY.value} db-7.internal</h1>".encode())]),
        True, "unexpected content type text/html",
    ),
    "html-for-json": (
        Script(headers={"content-type": "text/html"},
               steps=[Head(), Send(f"<h1>{CANARY.value} db-7.internal</h1>".encode())]),
        False, "unexpected content type text/html",
    ),
    "mangled-content-type": (
        Script(headers={"content-type": f"{CANARY.value}/db-7.internal\\x"},
               steps=[Head(), Send(b"x")]),
        True, "unexpected content type unknown",
    ),
    "gzip-stream": (
        Script(headers={**SSE_HEADERS, "content-encoding": "gzip"},
               steps=[Head(), Send(b"\x1f\x8b\x08\x00garbage")]),
        True, "unexpected content encoding",
    ),
    "giant-line-before-the-first-token": (
        Script(headers=SSE_HEADERS, steps=[Head(), Send(role_chunk()), Send(GIANT_LINE)]),
        True, "malformed stream",
    ),
}


@pytest.mark.parametrize("case", list(NOT_A_STREAM))
def test_a_wrong_kind_of_200_fails_over_or_gives_502_without_its_content(
    loop_thread: LoopThread,
    scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    verbose_logs(caplog)
    script, stream, reason = NOT_A_STREAM[case]
    gateway, upstreams = start(loop_thread, scripted_upstream, lambda _: script, count=2)
    error = status_error(gateway, stream=stream)
    assert error.status_code == 502
    assert f"b0: {reason}" in error.message and f"b1: {reason}" in error.message
    for upstream in upstreams:
        for request in upstream.requests:
            assert request.outcome in ("client_closed", "complete")
    CANARY.assert_absent_everywhere(gateway.root, caplog, error.response.text,
                                    str(error.response.headers))

    healthy = stream_script(["Hello", " world"]) if stream else json_script(
        {"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello world"},
             "finish_reason": "stop"}]})
    order = InOrder(script, healthy)
    gateway, _ = start(loop_thread, scripted_upstream, order, count=2, hedging=False)
    with sdk(gateway.v1) as client:
        if stream:
            assert read_stream(gateway)[:2] == ("Hello world", None)
        else:
            reply = client.chat.completions.create(model=POOL, messages=MESSAGES)
            assert reply.choices[0].message.content == "Hello world"


# ---- upstream error bodies and headers never reach the client --------------------------------

LEAKY_HEADERS = {
    "x-internal-host": "db-7.internal",
    "set-cookie": f"session={CANARY.value}",
    "server": "db-7.internal",
    "www-authenticate": f"Bearer realm={CANARY.value}",
}


def leaky_error(status: int) -> Script:
    body = error_obj(f"invalid key {CANARY.value} for tenant at db-7.internal:5432",
                     code=CANARY.value)
    return json_script(body, status, headers={**LEAKY_HEADERS, "retry-after": "0"})


@pytest.mark.parametrize("status", [500, 503, 429, 401, 403, 404, 400, 422])
def test_an_upstream_error_body_never_reaches_the_client(
    loop_thread: LoopThread,
    scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture,
    status: int,
) -> None:
    verbose_logs(caplog)
    gateway, upstreams = start(loop_thread, scripted_upstream, lambda _: leaky_error(status),
                               count=2, api_key=CANARY.value)
    texts = []
    for stream in (True, False):
        error = status_error(gateway, stream=stream)
        request_id = error.response.headers["x-request-id"]
        if status in (400, 422):  # fails everywhere: the client's own error, with the status
            assert error.status_code == status
            assert error.code == "upstream_rejected_request"
        elif status in (429, 503):  # pushback everywhere, with a Retry-After
            assert error.status_code == status
            assert error.code == "upstream_pushback"
            assert f"status {status}" in error.message
            assert error.response.headers["x-request-id"] == request_id
        else:
            assert error.status_code == 502
            assert f"status {status}" in error.message and request_id in error.message
        texts += [error.response.text, str(error.response.headers)]
    sent = [r for u in upstreams for r in u.requests]
    assert sent and all(r.headers["authorization"] == f"Bearer {CANARY.value}" for r in sent)
    CANARY.assert_absent_everywhere(gateway.root, caplog, *texts)
    assert error_logs(caplog) == []


def test_only_allowlisted_upstream_headers_reach_the_client(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, caplog: pytest.LogCaptureFixture
) -> None:
    verbose_logs(caplog)
    headers = {**LEAKY_HEADERS, "x-ratelimit-remaining-requests": "99",
               "x-request-id": "upstream-internal-id", "openai-processing-ms": "12"}
    script = stream_script(["Hello", " world"], headers=headers)
    gateway, _ = start(loop_thread, scripted_upstream, lambda _: script)
    with httpx.Client(timeout=5.0) as http, http.stream(
        "POST", gateway.v1 + "/chat/completions",
        json={"model": POOL, "messages": MESSAGES, "stream": True},
    ) as reply:
        body = reply.read().decode()
    assert reply.status_code == 200 and body.endswith("data: [DONE]\n\n")
    assert reply.headers["x-ratelimit-remaining-requests"] == "99"
    assert reply.headers["openai-processing-ms"] == "12"
    assert reply.headers["x-request-id"] != "upstream-internal-id"
    for name in ("x-internal-host", "set-cookie", "www-authenticate"):
        assert name not in reply.headers
    assert reply.headers.get("server", "") != "db-7.internal"
    CANARY.assert_absent_everywhere(gateway.root, caplog, str(reply.headers))


def test_an_upstream_error_event_before_the_first_token_stays_behind(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Before commit an in-band error is an attempt failure: its text is not relayed."""
    verbose_logs(caplog)
    leaky = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(role_chunk()),
        Send(b"data: " + json.dumps(error_obj(f"{CANARY.value} db-7.internal")).encode()
             + b"\n\n"), Send(DONE)])
    gateway, _ = start(loop_thread, scripted_upstream, lambda _: leaky, count=2)
    error = status_error(gateway)
    assert error.status_code == 502
    CANARY.assert_absent_everywhere(gateway.root, caplog, error.response.text)



@pytest.mark.parametrize("stream", [True, False])
def test_non_ascii_bytes_in_an_allowlisted_upstream_header_are_not_a_server_error(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, stream: bool
) -> None:
    """httpx decodes header bytes as UTF-8 when they are not ASCII; re-encoded for the client
    as Latin-1 (what HTTP headers are), a character beyond Latin-1 must not crash the reply."""
    utf8_check_mark = "\u2713".encode().decode("latin-1")  # the UTF-8 bytes, sent as they are
    headers = {"x-ratelimit-remaining-requests": utf8_check_mark}
    script = (stream_script(["Hello", " world"], headers=headers) if stream else
              json_script({"object": "chat.completion", "choices": []}, headers=headers))
    gateway, _ = start(loop_thread, scripted_upstream, lambda _: script)
    reply = httpx.post(gateway.v1 + "/chat/completions", timeout=5.0,
                       json={"model": POOL, "messages": MESSAGES, "stream": stream})
    assert reply.status_code == 200
    raw = dict(reply.headers.raw)[b"x-ratelimit-remaining-requests"]
    assert raw == "\u2713".encode()  # passed on byte for byte


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "30"}, 30.0),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after": "-5"}, 0.0),
        ({"retry-after": "1e308"}, 1e308),  # finite: the balancer caps the pause
        ({"retry-after": "inf"}, None),
        ({"retry-after-ms": "nan"}, None),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),
        ({}, None),
    ],
)
def test_an_upstream_retry_after_is_bounded(
    headers: dict[str, str], expected: float | None
) -> None:
    """A backend's Retry-After is read as a finite, non-negative number (the balancer caps
    the pause it causes), so a hostile value cannot pause it for ever."""
    assert providers.openai.parse_retry_after(httpx.Headers(headers)) == expected


def test_a_hostile_deeply_nested_event_after_commit_does_not_break_the_relay(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay parses an event only when it may be an error; nesting past the parser's
    recursion limit must not escape as an exception (a cut stream and a traceback)."""
    verbose_logs(caplog)
    deep = b'data: {"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n\n"
    script = committed(Send(deep), Send(token_chunk("c")), Send(DONE))
    gateway, _ = start(loop_thread, scripted_upstream, lambda _: script, max_attempts=1)
    with httpx.Client(timeout=5.0) as http, http.stream(
        "POST", gateway.v1 + "/chat/completions",
        json={"model": POOL, "messages": MESSAGES, "stream": True},
    ) as reply:
        body = reply.read()
    assert reply.status_code == 200
    assert body.endswith(DONE) and b'"c"' in body
    assert error_logs(caplog) == []
    assert loop_thread.errors == []


def test_a_full_gateway_pool_is_not_held_against_the_backend(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """One admitted request, so the shared client has two upstream
    connections; the primary and the first hedge hold them, the second hedge waits for a
    free one past `timeouts.connect` (httpx's PoolTimeout). That backend was never asked:
    it must not get a failure on its health record."""
    silent = Script(headers=SSE_HEADERS, steps=[Head(), Send(role_chunk()), Hang()])
    gateway, upstreams = start(
        loop_thread, scripted_upstream, lambda _: silent, count=3, delay=0.1, max_attempts=3,
        timeout=1.5, timeouts=Timeouts(connect=0.3),
        server=ServerSettings(max_concurrent_requests=1),
    )
    error = status_error(gateway)
    assert error.status_code == 504
    assert "no free upstream connection" in error.message
    asked = {f"b{i}" for i, u in enumerate(upstreams) if u.requests}
    (never_asked,) = {"b0", "b1", "b2"} - asked
    pool = gateway.app.state.pools[POOL]
    assert pool.balancer._backends[never_asked].failures == 0
    for name in asked:  # the silent ones timed out: the deadline, not a failure either
        assert pool.balancer.state(name, 0.0)[0] == "ok"
