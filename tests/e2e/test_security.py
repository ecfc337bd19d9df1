"""Hostile client input and gateway keys, over real sockets.

Each bad request must get the OpenAI error shape with a fitting status, never a 500, and must
send nothing upstream; nothing a client sends may choose where the gateway connects (an
attacker's listener on another loopback port stays silent) or be echoed back when it is a
key. The gateway runs under the server class `hedge-gateway serve` uses
(`tests.harness.limits_kit.GatewayFactory`), so the request-head limit is the production one. Every
test ends with the automatic leak check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.settings import BackendSettings, PoolSettings, ServerSettings
from tests.harness import LoopThread, ScriptedUpstream, UpstreamFactory, error_script
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import (
    MESSAGES,
    Canary,
    Gateway,
    GatewayFactory,
    closed_by_peer,
    connect,
    error_logs,
    read_response,
    request_head,
    sdk,
    verbose_logs,
    wait_for,
)
from tests.harness.protocol_wire import messages_script

GOOD: dict[str, Any] = {"model": POOL, "messages": MESSAGES}


def start(
    loop_thread: LoopThread,
    scripted_upstream: UpstreamFactory,
    *,
    server: ServerSettings | None = None,
    api_key: str | None = None,
) -> tuple[Gateway, ScriptedUpstream, ScriptedUpstream]:
    """The gateway with one healthy backend, and an attacker's listener nobody should reach."""
    upstream = scripted_upstream.one(name="upstream")
    attacker = scripted_upstream.one(name="attacker")
    settings = gateway_settings([upstream.base_url], server=server, api_key=api_key)
    return GatewayFactory(loop_thread)(settings), upstream, attacker


def assert_openai_error(reply: httpx.Response, status: int, code: str | None = None) -> dict[
    str, Any
]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    assert reply.headers["x-request-id"]
    return error


def untouched(*listeners: ScriptedUpstream) -> None:
    for listener in listeners:
        assert listener.connections_total == 0, f"{listener.name} was contacted"


# ---- body size -------------------------------------------------------------------------------

LIMIT = 1024


def test_a_declared_body_over_the_limit_gets_413_before_any_body_byte_is_sent(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, attacker = start(
        loop_thread, scripted_upstream, server=ServerSettings(max_body_bytes=LIMIT)
    )
    sock = connect(gateway.port)
    try:
        headers = {"content-type": "application/json", "content-length": str(100 * 1024 * 1024)}
        sock.sendall(request_head("/v1/chat/completions", headers))
        # not one body byte sent: an answer now proves nothing was waited for or buffered
        reply = read_response(sock)
        assert reply.status == 413
        assert reply.headers["connection"] == "close"
        assert reply.json()["error"]["code"] == "payload_too_large"
        assert closed_by_peer(sock)
    finally:
        sock.close()
    untouched(upstream, attacker)


def test_a_chunked_body_over_the_limit_gets_413_once_the_limit_is_crossed(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, attacker = start(
        loop_thread, scripted_upstream, server=ServerSettings(max_body_bytes=LIMIT)
    )
    sock = connect(gateway.port)
    try:
        headers = {"content-type": "application/json", "transfer-encoding": "chunked"}
        sock.sendall(request_head("/v1/chat/completions", headers))
        piece = b'{"model": "' + b"x" * 200
        sent = 0
        while sent <= LIMIT:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        # the body never ends (no terminating chunk): only a gateway that stops at the limit
        # can answer now
        reply = read_response(sock)
        assert reply.status == 413
        assert reply.json()["error"]["code"] == "payload_too_large"
        assert closed_by_peer(sock)
    finally:
        sock.close()
    untouched(upstream, attacker)


def test_a_body_at_the_limit_is_accepted(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, _ = start(
        loop_thread, scripted_upstream, server=ServerSettings(max_body_bytes=LIMIT)
    )
    body = json.dumps({**GOOD, "user": ""}).encode()
    body = json.dumps({**GOOD, "user": "u" * (LIMIT - len(body))}).encode()
    assert len(body) == LIMIT
    reply = httpx.post(gateway.v1 + "/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=5.0)
    assert reply.status_code == 200, reply.text
    assert len(upstream.requests) == 1


# ---- request heads ---------------------------------------------------------------------------


def test_headers_over_the_limit_get_431_in_openai_shape(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    limit = ServerSettings().max_header_bytes
    sock = connect(gateway.port)
    try:
        headers = {"content-type": "application/json", "x-padding": "p" * (limit + 1024),
                   "content-length": "2"}
        sock.sendall(request_head("/v1/chat/completions", headers) + b"{}")
        reply = read_response(sock)
        assert reply.status == 431
        error = reply.json()["error"]
        assert error["code"] == "headers_too_large" and error["type"] == "invalid_request_error"
        assert closed_by_peer(sock)
    finally:
        sock.close()
    # well under the limit is fine
    fine = httpx.post(gateway.v1 + "/chat/completions", json=GOOD, timeout=5.0,
                      headers={"x-padding": "p" * (limit // 2)})
    assert fine.status_code == 200
    assert len(upstream.requests) == 1
    untouched(attacker)


def test_an_endless_header_line_is_cut_off_not_buffered(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """A header that never ends: the gateway must refuse it near the limit and hang up. If it
    buffered everything, all 16 MiB would be accepted without an error; if it just stopped
    reading without closing, `sendall` would block into the socket timeout instead."""
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    sock = connect(gateway.port)
    sent = 0
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-endless: ")
        with pytest.raises(OSError) as info:  # refused: broken pipe or reset
            while sent < 16 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        assert not isinstance(info.value, TimeoutError)
    finally:
        sock.close()
    untouched(upstream, attacker)


# ---- chunked-body trailers -------------------------------------------------------------------


def _scope_headers(seen: list[list[tuple[bytes, bytes]]]) -> Callable[[ASGIApp], ASGIApp]:
    """An ASGI layer that keeps each request's header list: the scope's own list object,
    which is where the server would append trailer fields after the head was checked."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def recorder(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                seen.append(scope["headers"])
            await app(scope, receive, send)

        return recorder

    return wrap


def _trailers(total: int, name: bytes = b"x-t") -> Iterator[bytes]:
    """Trailer fields of about `total` bytes in all, in pieces to send one by one."""
    line = name + b": " + b"A" * 1000 + b"\r\n"
    for _ in range(total // len(line) + 1):
        yield line


def test_trailers_past_the_head_limit_never_join_the_headers_of_an_answered_request(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """`/healthz` answers before its chunked body ends; the server used to go on appending
    every trailer field to the request's header list (the scope's), without a bound and with
    no key needed. Now none joins it and the connection ends near the head limit."""
    upstream = scripted_upstream.one(name="upstream")
    seen: list[list[tuple[bytes, bytes]]] = []
    gateway = GatewayFactory(loop_thread)(gateway_settings([upstream.base_url]),
                                          wrap=_scope_headers(seen))
    limit = ServerSettings().max_header_bytes
    sock = connect(gateway.port)
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n"
                     b"transfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n")
        assert read_response(sock).status == 200
        with contextlib.suppress(OSError):  # refused part-way: a reset or a broken pipe
            for line in _trailers(64 * limit):
                sock.sendall(line)
            sock.sendall(b"\r\n")
        assert closed_by_peer(sock)
    finally:
        sock.close()
    (headers,) = seen
    assert not [name for name, _ in headers if name == b"x-t"]


def test_trailers_past_the_head_limit_of_a_chat_request_get_431_and_reach_nothing(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    limit = ServerSettings().max_header_bytes
    body = json.dumps(GOOD).encode()
    sock = connect(gateway.port)
    try:
        headers = {"content-type": "application/json", "transfer-encoding": "chunked"}
        sock.sendall(request_head("/v1/chat/completions", headers)
                     + b"%x\r\n%s\r\n0\r\n" % (len(body), body))
        with contextlib.suppress(OSError):
            for line in _trailers(4 * limit):
                sock.sendall(line)
        reply = read_response(sock)
        assert reply.status == 431
        assert reply.json()["error"]["code"] == "headers_too_large"
        assert closed_by_peer(sock)
    finally:
        sock.close()
    untouched(upstream, attacker)


def test_a_trailer_never_reaches_the_upstream_as_a_header(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """`anthropic-beta` is the one client header /v1/messages forwards; sent as a trailer,
    after the head was checked, it used to be forwarded as if the client had sent it."""
    upstream = scripted_upstream.one(name="anthropic",
                                    responder=lambda _: messages_script(["hi"]))
    backend = BackendSettings(name="b0", provider="anthropic", base_url=upstream.root_url,
                              api_key="sk-ant-0", model="claude-0")
    settings = dataclasses.replace(gateway_settings([upstream.base_url]), pools=(
        PoolSettings(name=POOL, backends=(backend,)),))
    gateway = GatewayFactory(loop_thread)(settings)
    body = json.dumps({**GOOD, "max_tokens": 8, "stream": True}).encode()
    sock = connect(gateway.port)
    try:
        headers = {"content-type": "application/json", "transfer-encoding": "chunked"}
        sock.sendall(request_head("/v1/messages", headers)
                     + b"%x\r\n%s\r\n0\r\n" % (len(body), body)
                     + b"anthropic-beta: injected-by-trailer\r\n\r\n")
        assert read_response(sock).status == 200
    finally:
        sock.close()
    (request,) = upstream.requests
    assert "anthropic-beta" not in request.headers


# ---- request smuggling -----------------------------------------------------------------------

#: a good request's body, and heads whose framing a proxy in front could read another way than
#: the gateway does (so one connection could carry a request the proxy never saw): each must be
#: refused outright, never guessed at
SMUGGLED_BODY = json.dumps(GOOD).encode()
_CT = b"content-type: application/json"
_CL = b"content-length: %d" % len(SMUGGLED_BODY)
SMUGGLING = {
    "content-length and transfer-encoding": [_CT, _CL, b"transfer-encoding: chunked"],
    "two content-lengths": [_CT, _CL, b"content-length: 5"],
    "obsolete line folding": [_CT, b"x-folded: a", b" b", _CL],
    "bare LF line endings": [_CT, _CL],
    "transfer-encoding xchunked": [_CT, b"transfer-encoding: xchunked"],
    "chunked then another coding": [_CT, b"transfer-encoding: chunked", b"transfer-encoding: x"],
}


def smuggling_request(case: str) -> bytes:
    end = b"\n" if case == "bare LF line endings" else b"\r\n"
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"host: localhost", *SMUGGLING[case]]
    return end.join(lines) + end + end + SMUGGLED_BODY


def everything_until_closed(sock: socket.socket) -> bytes:
    """What the gateway sends before it hangs up (the socket timeout fails a gateway that
    keeps the connection open waiting for more)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            received += data
    return received


@pytest.mark.parametrize("case", list(SMUGGLING))
def test_a_request_framed_ambiguously_gets_400_and_reaches_no_upstream(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, case: str
) -> None:
    seen: list[str] = []

    def recorder(app: ASGIApp) -> ASGIApp:
        async def front(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                seen.append(scope["path"])
            await app(scope, receive, send)
        return front

    upstream = scripted_upstream.one(name="upstream")
    gateway = GatewayFactory(loop_thread)(gateway_settings([upstream.base_url]), wrap=recorder)
    sock = connect(gateway.port)
    try:
        sock.sendall(smuggling_request(case))
        answer = everything_until_closed(sock)
    finally:
        sock.close()
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert seen == [], "the app was handed the request"
    untouched(upstream)
    # the same request framed plainly is answered: the refusal is the framing's
    plain = httpx.post(gateway.v1 + "/chat/completions", content=SMUGGLED_BODY,
                       headers={"content-type": "application/json"}, timeout=5.0)
    assert plain.status_code == 200, plain.text


# ---- malformed requests ----------------------------------------------------------------------

CONTENT_TYPES = ["text/plain", "multipart/form-data; boundary=x",
                 "application/x-www-form-urlencoded"]


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_a_body_that_is_not_json_by_content_type_gets_415(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, content_type: str
) -> None:
    """The types a web page may post without a CORS preflight are refused on every
    inference route, in that route's shape."""
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    for route in ("/chat/completions", "/completions", "/embeddings", "/responses"):
        reply = httpx.post(gateway.v1 + route, content=json.dumps(GOOD).encode(),
                           headers={"content-type": content_type}, timeout=5.0)
        error = assert_openai_error(reply, 415, "unsupported_media_type")
        assert "content type" in error["message"]
    reply = httpx.post(gateway.v1 + "/messages", content=json.dumps(GOOD).encode(),
                       headers={"content-type": content_type}, timeout=5.0)
    assert reply.status_code == 415
    assert reply.json()["error"]["type"] == "invalid_request_error"
    untouched(upstream, attacker)


def test_a_body_without_a_content_type_gets_415(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """A page's `fetch` of an untyped Blob posts with no content type and no preflight: that
    is refused too, not read as JSON."""
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    request = httpx.Request("POST", gateway.v1 + "/chat/completions",
                            content=json.dumps(GOOD).encode())
    assert "content-type" not in request.headers  # httpx declares no type for raw bytes
    with httpx.Client(timeout=5.0) as client:
        reply = client.send(request)
    assert_openai_error(reply, 415, "unsupported_media_type")
    untouched(upstream, attacker)


def test_json_with_a_charset_parameter_is_accepted(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, _ = start(loop_thread, scripted_upstream)
    reply = httpx.post(gateway.v1 + "/chat/completions", content=json.dumps(GOOD).encode(),
                       headers={"content-type": "Application/JSON; charset=utf-8"}, timeout=5.0)
    assert reply.status_code == 200
    assert len(upstream.requests) == 1


# ---- browsers: origins and DNS rebinding ------------------------------------------------------

FOREIGN_ORIGINS = ["https://evil.example", "http://evil.example:8080", "null",
                   "http://localhost.evil.example"]


@pytest.mark.parametrize("origin", FOREIGN_ORIGINS)
def test_a_request_from_a_foreign_web_origin_is_refused_before_any_upstream_attempt(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, origin: str
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    headers = {"origin": origin}
    reply = httpx.post(gateway.v1 + "/chat/completions", json=GOOD, headers=headers,
                       timeout=5.0)
    error = assert_openai_error(reply, 403, "origin_not_allowed")
    assert origin not in error["message"]
    reply = httpx.post(gateway.v1 + "/messages", json={**GOOD, "max_tokens": 8},
                       headers=headers, timeout=5.0)
    assert reply.status_code == 403
    assert reply.json()["error"]["type"] == "permission_error"
    assert httpx.get(gateway.url("/hedge/stats"), headers=headers).status_code == 403
    untouched(upstream, attacker)


def test_the_gateways_own_origin_and_configured_origins_are_answered(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    server = ServerSettings(allowed_origins=("https://app.example.com",))
    gateway, upstream, _ = start(loop_thread, scripted_upstream, server=server)
    own = gateway.root
    for origin in (own, "https://app.example.com", "HTTPS://APP.EXAMPLE.COM"):
        reply = httpx.post(gateway.v1 + "/chat/completions", json=GOOD,
                           headers={"origin": origin}, timeout=5.0)
        assert reply.status_code == 200, (origin, reply.text)
    assert len(upstream.requests) == 3


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.2.nip.io",
                                  "localhost.evil.example"])
def test_a_rebound_host_name_is_refused_on_a_loopback_listener(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, host: str
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    for path in ("/v1/chat/completions", "/hedge/stats", "/dashboard"):
        if path.startswith("/v1"):
            reply = httpx.post(gateway.url(path), json=GOOD, headers={"host": host})
        else:
            reply = httpx.get(gateway.url(path), headers={"host": host})
        assert_openai_error(reply, 403, "origin_not_allowed")
    untouched(upstream, attacker)


def test_loopback_names_and_configured_hosts_are_answered(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    server = ServerSettings(allowed_hosts=("gateway.internal",))
    gateway, upstream, _ = start(loop_thread, scripted_upstream, server=server)
    port = gateway.port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST",
                 f"gateway.internal:{port}"):
        reply = httpx.post(gateway.v1 + "/chat/completions", json=GOOD,
                           headers={"host": host}, timeout=5.0)
        assert reply.status_code == 200, (host, reply.text)
    assert len(upstream.requests) == 5


def test_allowed_hosts_are_enforced_on_a_listener_off_loopback_too(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """`server.allowed_hosts` used to be read only on a loopback listener: in a container
    (`--host 0.0.0.0`) a rebound name was answered whatever the list said. The listening
    address is what the guard reads (`server.host`); the test's socket stays on 127.0.0.1."""
    server = ServerSettings(host="0.0.0.0", allowed_hosts=("gateway.internal",))
    gateway, upstream, attacker = start(loop_thread, scripted_upstream, server=server)
    port = gateway.port
    rebound = f"rebind.attacker.example:{port}"
    reply = httpx.post(gateway.v1 + "/chat/completions", json=GOOD, timeout=5.0,
                       headers={"host": rebound, "origin": f"http://{rebound}"})
    assert_openai_error(reply, 403, "origin_not_allowed")
    assert upstream.requests == []
    for host in (f"gateway.internal:{port}", f"127.0.0.1:{port}"):
        reply = httpx.post(gateway.v1 + "/chat/completions", json=GOOD,
                           headers={"host": host}, timeout=5.0)
        assert reply.status_code == 200, (host, reply.text)
    # a kubelet's probe names the pod's address: the probes answer any host
    for probe in ("/healthz", "/readyz"):
        reply = httpx.get(gateway.url(probe), headers={"host": f"10.1.2.3:{port}"}, timeout=5.0)
        assert reply.status_code == 200, probe
    # without the list, a listener off loopback checks no host (as documented)
    open_gateway, _, _ = start(loop_thread, scripted_upstream,
                               server=ServerSettings(host="0.0.0.0"))
    reply = httpx.post(open_gateway.v1 + "/chat/completions", json=GOOD, timeout=5.0,
                       headers={"host": rebound})
    assert reply.status_code == 200
    untouched(attacker)


#: raw body -> the field the 400 must name (None: the body as a whole)
MALFORMED: dict[str, tuple[bytes, str | None]] = {
    "truncated": (b'{"model": "pool", "messages": [{"role": "us', None),
    "invalid-utf8": (b'{"model": "pool", "messages": [], "user": "\xc3\x28"}', None),
    "top-level-array": (b'[{"model": "pool", "messages": []}]', None),
    "nan": (b'{"model": "pool", "messages": [], "temperature": NaN}', None),
    "empty": (b"", None),
    "huge-integer": (b'{"model": "pool", "messages": [], "seed": ' + b"9" * 5000 + b"}", None),
    "stream-yes": (b'{"model": "pool", "messages": [], "stream": "yes"}', "stream"),
    "negative-max-tokens": (b'{"model": "pool", "messages": [], "max_tokens": -5}',
                            "max_tokens"),
    "zero-n": (b'{"model": "pool", "messages": [], "n": 0}', "n"),
    "model-null": (b'{"model": null, "messages": []}', "model"),
    "no-messages": (b'{"model": "pool"}', "messages"),
    "streamed-embeddings": (b'{"model": "pool", "input": "x", "stream": true}', "stream"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_bodies_get_400_naming_the_field_and_reach_nothing(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, case: str
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    raw, param = MALFORMED[case]
    route = "/embeddings" if "embeddings" in case else "/chat/completions"
    reply = httpx.post(gateway.v1 + route, content=raw, timeout=5.0,
                       headers={"content-type": "application/json"})
    error = assert_openai_error(reply, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "Traceback" not in reply.text
    untouched(upstream, attacker)


@pytest.mark.parametrize("depth", [64, 200, 900, 980, 999, 1100, 100_000])
def test_deep_nesting_is_refused_with_400_never_a_server_error(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, depth: int
) -> None:
    """Near the interpreter's recursion limit a body may parse but fail to be re-encoded for
    the upstream: nesting is bounded before that (64 levels), so it is a 400, never a 5xx
    (which would also count as a backend failure) and never a held admission slot."""
    server = ServerSettings(max_concurrent_requests=1)
    gateway, upstream, _ = start(loop_thread, scripted_upstream, server=server)
    raw = b'{"model": "pool", "messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}"
    with httpx.Client(base_url=gateway.v1, timeout=10.0,
                      headers={"content-type": "application/json"}) as http:
        for _ in range(3):
            reply = http.post("/chat/completions", content=raw)
            error = assert_openai_error(reply, 400, "invalid_request")
            assert "nested too deeply" in error["message"] or "too many" in error["message"]
        assert upstream.requests == []
        assert http.post("/chat/completions", json=GOOD).status_code == 200  # slot is free
    pool = gateway.app.state.pools[POOL]
    assert loop_thread.call(lambda: pool.balancer.state("b0", 0.0)[0]) != "ejected"


def test_a_body_of_too_many_values_is_refused_in_the_shape_of_its_route(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    raw = b'{"model": "pool", "messages": [], "x": [' + b"{}," * 1_000_000 + b"{}]}"
    headers = {"content-type": "application/json"}
    reply = httpx.post(gateway.v1 + "/chat/completions", content=raw, headers=headers,
                       timeout=10.0)
    assert "too many values" in assert_openai_error(reply, 400, "invalid_request")["message"]
    reply = httpx.post(gateway.v1 + "/messages", content=raw, headers=headers, timeout=10.0)
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "too many values" in body["error"]["message"]
    untouched(upstream, attacker)


# ---- model names -----------------------------------------------------------------------------

HOSTILE_MODELS = [
    "../x",
    "../../v1/chat/completions",
    "http://evil/",
    "//127.0.0.1:1/v1",
    "pool\r\nX-Injected: 1",
    "pool/../pool",
    "pool%2f..",
    "pool\x00",
    "p" * 100_000,
]


@pytest.mark.parametrize("model", HOSTILE_MODELS, ids=range(len(HOSTILE_MODELS)))
def test_unknown_or_hostile_model_names_get_404_and_reach_nothing(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, model: str
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    model = model.replace("evil", f"127.0.0.1:{attacker.port}")
    reply = httpx.post(gateway.v1 + "/chat/completions", json={**GOOD, "model": model},
                       timeout=5.0)
    error = assert_openai_error(reply, 404, "model_not_found")
    assert error["param"] == "model"
    assert model not in reply.text  # never echoed (the body stays small and inert)
    assert len(reply.content) < 1024
    assert "x-injected" not in reply.headers
    untouched(upstream, attacker)


# ---- destination and credential fields -------------------------------------------------------

#: where to put a field (name, value) in a request body; `metadata` is free-form and has its
#: own, shorter list (tests/e2e/test_hardening.py)
PLACES: dict[str, Callable[[str, object], dict[str, object]]] = {
    "top": lambda name, value: {name: value},
    "extra_body": lambda name, value: {"extra_body": {name: value}},
    "extra_body_deep": lambda name, value: {"extra_body": {"a": [{"b": {"c": [{name: value}]}}]}},
}
FIELDS = ["api_base", "base_url", "api_key", "api_version", "extra_headers", "headers", "url"]
#: spellings other clients use for the same things
VARIANTS = ["baseURL", "apiKey", "API_BASE", "Base-Url", "extraHeaders", "URL"]


def _param_of(place: str, name: str) -> str:
    return {
        "top": name,
        "extra_body": f"extra_body.{name}",
        "extra_body_deep": f"extra_body.a[0].b.c[0].{name}",
    }[place]


@pytest.mark.parametrize("place", list(PLACES))
def test_destination_and_credential_fields_are_refused_and_the_attacker_hears_nothing(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, place: str
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    evil = attacker.base_url
    values: dict[str, Any] = {
        "api_base": evil, "base_url": evil, "api_key": "sk-attacker", "api_version": evil,
        "extra_headers": {"host": f"127.0.0.1:{attacker.port}"},
        "headers": {"x-forwarded-host": evil}, "url": evil,
    }
    with httpx.Client(base_url=gateway.v1, timeout=5.0) as http:
        for name in FIELDS + VARIANTS:
            value = values.get(name, evil)
            body = {**GOOD, **PLACES[place](name, value), "stream": True}
            reply = http.post("/chat/completions", json=body)
            error = assert_openai_error(reply, 400, "forbidden_field")
            assert error["param"] == _param_of(place, name)
            assert str(attacker.port) not in reply.text
    untouched(upstream, attacker)


#: the names refused inside `metadata` are refused at the top level too
TOP_LEVEL_ONLY_IN_METADATA = ["azure_endpoint", "AzureEndpoint", "aws_region",
                              "AWS-Secret-Access-Key", "awsProfile", "vertex_project",
                              "VERTEX-LOCATION", "vertexCredentials"]


def test_cloud_destination_names_at_the_top_level_are_refused_naming_the_field(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    with httpx.Client(base_url=gateway.v1, timeout=5.0) as http:
        for name in TOP_LEVEL_ONLY_IN_METADATA:
            reply = http.post("/chat/completions", json={**GOOD, name: attacker.base_url})
            error = assert_openai_error(reply, 400, "forbidden_field")
            assert error["param"] == name and name in error["message"]
            reply = http.post("/messages", json={**GOOD, "max_tokens": 8, name: "x"})
            assert reply.status_code == 400
            assert reply.json()["error"]["type"] == "invalid_request_error"
    untouched(upstream, attacker)


def test_a_url_inside_message_content_is_data_and_is_forwarded(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    image = {"type": "image_url", "image_url": {"url": attacker.base_url}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
    tools = [{"type": "function", "function": {
        "name": "fetch", "parameters": {"type": "object", "properties": {"url": {}}}}}]
    reply = httpx.post(gateway.v1 + "/chat/completions", timeout=5.0,
                       json={"model": POOL, "messages": messages, "tools": tools})
    assert reply.status_code == 200
    (request,) = upstream.requests
    assert request.body["messages"] == messages and request.body["tools"] == tools
    untouched(attacker)


# ---- gateway API keys ------------------------------------------------------------------------

KEYS = ("gw-key-first-0001", "gw-key-second-0002")


def keyed(loop_thread: LoopThread, scripted_upstream: UpstreamFactory) -> tuple[
    Gateway, ScriptedUpstream
]:
    gateway, upstream, _ = start(
        loop_thread, scripted_upstream, server=ServerSettings(api_keys=KEYS),
        api_key="sk-backend-0003",
    )
    return gateway, upstream


def test_missing_or_wrong_keys_get_401_that_never_echoes_the_key(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, caplog: pytest.LogCaptureFixture
) -> None:
    verbose_logs(caplog)
    gateway, upstream = keyed(loop_thread, scripted_upstream)
    canary = Canary("sk-CANARY-wrong-key-5d1e")
    attempts: dict[str, dict[str, str]] = {
        "missing": {},
        "wrong": {"authorization": f"Bearer {canary.value}"},
        "wrong-scheme": {"authorization": f"Basic {canary.value}"},
        "bare": {"authorization": canary.value},
        "prefix-of-a-key": {"authorization": f"Bearer {KEYS[0][:-1]}"},
        "key-plus-suffix": {"authorization": f"Bearer {KEYS[0]}{canary.value}"},
        "x-api-key": {"x-api-key": KEYS[0]},
    }
    texts = []
    with httpx.Client(base_url=gateway.v1, timeout=5.0) as http:
        for name, headers in attempts.items():
            reply = http.post("/chat/completions", json={**GOOD, "stream": True},
                              headers=headers)
            error = assert_openai_error(reply, 401, "invalid_api_key")
            assert error["type"] == "authentication_error", name
            texts += [reply.text, str(reply.headers)]
    untouched(upstream)
    with sdk(gateway.v1, api_key=canary.value) as client, \
            pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
    texts.append(str(info.value))
    canary.assert_absent_everywhere(gateway.root, caplog, *texts)
    assert error_logs(caplog) == []


def test_wrong_keys_on_one_connection_are_slowed_then_the_connection_is_closed(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One keep-alive connection used to take thousands of guesses a second, and the log
    said nothing of who sent them. Now the connection ends with the `MAX_FAILURES`-th wrong
    key (the back-off's waits are shortened here; their schedule is tested pure), each
    refusal's log line names the peer, and a fresh connection with the key is served."""
    import gateway.api.common as common
    from gateway.api.keys import MAX_FAILURES, backoff

    monkeypatch.setattr(common, "backoff", functools.partial(backoff, first=0.001, cap=0.002))
    caplog.set_level(logging.INFO, logger="hedge_gateway.requests")
    gateway, upstream = keyed(loop_thread, scripted_upstream)
    body = json.dumps(GOOD).encode()
    head = request_head("/v1/chat/completions", {
        "content-type": "application/json", "content-length": str(len(body)),
        "authorization": "Bearer guess"})
    sock = connect(gateway.port)
    try:
        for attempt in range(1, MAX_FAILURES + 1):
            sock.sendall(head + body)
            reply = read_response(sock)
            assert reply.status == 401, attempt
            closing = reply.headers.get("connection") == "close"
            assert closing == (attempt == MAX_FAILURES), attempt
        assert closed_by_peer(sock)
    finally:
        sock.close()
    refusals = [json.loads(r.getMessage()) for r in caplog.records
                if r.name == "hedge_gateway.requests"]
    assert len(refusals) == MAX_FAILURES
    assert all(line["reason"] == "unauthorized" and line["peer"] == "127.0.0.1"
               for line in refusals)
    served = httpx.post(gateway.v1 + "/chat/completions", json=GOOD, timeout=5.0,
                        headers={"authorization": f"Bearer {KEYS[0]}"})
    assert served.status_code == 200
    assert len(upstream.requests) == 1


def test_either_configured_key_is_accepted_and_never_forwarded(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, caplog: pytest.LogCaptureFixture
) -> None:
    verbose_logs(caplog)
    gateway, upstream = keyed(loop_thread, scripted_upstream)
    for key in KEYS:
        with sdk(gateway.v1, api_key=key) as client:
            stream = client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with httpx.Client(base_url=gateway.v1, timeout=5.0) as http:  # scheme is case-insensitive
        assert http.post("/chat/completions", json=GOOD,
                         headers={"authorization": f"bearer {KEYS[1]}"}).status_code == 200
    assert len(upstream.requests) == 3
    for request in upstream.requests:
        assert request.headers["authorization"] == "Bearer sk-backend-0003"
    Canary(*KEYS).assert_absent_everywhere(gateway.root, caplog)


def walk_routes(routes: Iterable[object]) -> Iterator[Route]:
    """Every endpoint route, through included routers and mounts (whatever their class)."""
    for route in routes:
        if isinstance(route, Route):
            yield route
            continue
        inner = getattr(route, "original_router", route)
        nested = getattr(inner, "routes", None)
        if nested is not None:
            yield from walk_routes(nested)


#: routes that must answer without a key (liveness probes and scrapers, and the dashboard
#: with its data, which the gateway exposes as `/hedge/stats` is)
PUBLIC = {"/healthz", "/readyz", "/metrics", "/hedge/stats", "/hedge/series", "/hedge/races",
          "/dashboard", "/dashboard/{name}"}


def test_every_route_but_the_public_probes_requires_the_key(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Walks the app's route table, so a route added later without the guard fails here."""
    gateway, upstream = keyed(loop_thread, scripted_upstream)
    routes = list(walk_routes(gateway.app.routes))
    walked = set()
    with httpx.Client(base_url=gateway.root, timeout=5.0) as http:
        for route in routes:
            for method in sorted(route.methods or ()):
                if method == "HEAD":
                    continue
                reply = http.request(method, route.path, json=GOOD)
                walked.add(route.path)
                if route.path in PUBLIC:
                    assert reply.status_code != 401, route.path
                elif route.path.startswith("/v1/messages"):  # Anthropic's shape
                    assert reply.status_code == 401, route.path
                    assert reply.json() == {"type": "error", "error": {
                        "type": "authentication_error",
                        "message": "missing or invalid gateway API key"}}
                else:
                    assert_openai_error(reply, 401, "invalid_api_key")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models",
            "/v1/responses", "/v1/responses/{response_id}", "/v1/messages",
            "/v1/messages/count_tokens"} <= walked
    assert walked >= PUBLIC
    untouched(upstream)


def test_keys_are_compared_in_constant_time_against_every_key(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No timing measurement (flaky by nature): the guard must use `hmac.compare_digest` on
    equal-length values, once per configured key, whether or not an early key matched."""
    gateway, _ = keyed(loop_thread, scripted_upstream)
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with httpx.Client(base_url=gateway.v1, timeout=5.0) as http:
        for supplied in (KEYS[0], "short", "x" * 300):
            calls.clear()
            http.get("/models", headers={"authorization": f"Bearer {supplied}"})
            assert len(calls) == len(KEYS)
            assert all(a == b for a, b in calls), "lengths differ: the comparison leaks length"


# ---- the request log never holds a key either ------------------------------------------------


def test_keys_stay_out_of_the_request_log_for_proxied_requests(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    gateway, upstream = keyed(loop_thread, scripted_upstream)
    with sdk(gateway.v1, api_key=KEYS[0]) as client:
        client.chat.completions.create(model=POOL, messages=MESSAGES)
    # the line is written once the answer is out (the client is answered first)
    assert wait_for(lambda: any(r.name == "hedge_gateway.requests" for r in caplog.records))
    Canary(KEYS[0], "sk-backend-0003").assert_absent_everywhere(gateway.root, caplog)
    assert len(upstream.requests) == 1



def test_answers_a_retry_cannot_change_say_so_and_each_sdk_sends_them_once(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """A wrong key or an unknown model is answered with `x-should-retry: false`, so neither
    SDK (nor an agent CLI built on one, which would otherwise retry a 401 for ever) sends the
    request again: each reaches the gateway exactly once, whatever `max_retries` says."""
    import anthropic

    gateway, upstream = keyed(loop_thread, scripted_upstream)
    sent: list[str] = []

    def count(request: Any) -> None:  # each SDK's own HTTP client calls it per request sent
        sent.append(str(request.url.path))

    hooks = {"request": [count]}
    for name in ("wrong key, OpenAI", "unknown model, OpenAI", "wrong key, Anthropic"):
        sent.clear()
        if name.endswith("Anthropic"):
            with anthropic.Anthropic(
                base_url=gateway.root, api_key="sk-wrong", max_retries=3,
                http_client=anthropic.DefaultHttpxClient(event_hooks=hooks),
            ) as claude, pytest.raises(anthropic.AuthenticationError) as info:
                claude.messages.create(model=POOL, max_tokens=8,
                                       messages=[{"role": "user", "content": "hi"}])
            response = info.value.response
        else:
            key, model = ("sk-wrong", POOL) if "key" in name else (KEYS[0], "gpt-none")
            wanted: type[openai.APIStatusError] = (
                openai.AuthenticationError if "key" in name else openai.NotFoundError)
            with openai.OpenAI(
                base_url=gateway.v1, api_key=key, max_retries=3,
                http_client=openai.DefaultHttpxClient(event_hooks=hooks),
            ) as client, pytest.raises(wanted) as failed:
                client.chat.completions.create(model=model, messages=MESSAGES)
            response = failed.value.response
        assert response.headers["x-should-retry"] == "false", name
        assert len(sent) == 1, (name, sent)
    untouched(upstream)


# ---- text JSON may parse but UTF-8 cannot carry ----------------------------------------------

#: a refused field whose name holds a lone surrogate (`"\ud800"` is valid JSON, and parses
#: into a `str` that cannot be encoded as UTF-8), on each OpenAI-shaped route, with the
#: `param` the answer names
LONE_SURROGATES = {
    "chat": ("/chat/completions",
             b'{"model":"pool","messages":[],"\\ud800api_key":1}', "\ud800api_key"),
    "responses": ("/responses",
                  b'{"model":"pool","input":"x","metadata":{"\\ud800api_key":"1"}}',
                  "metadata.\ud800api_key"),
    "embeddings": ("/embeddings",
                   b'{"model":"pool","input":"x","extra_body":{"a":{"\\udfffbase_url":1}}}',
                   "extra_body.a.\udfffbase_url"),
}


@pytest.mark.parametrize("case", list(LONE_SURROGATES))
def test_a_refused_field_named_with_a_lone_surrogate_gets_a_shaped_400(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, case: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The answer quotes the field's name in `param`: it was rendered as UTF-8 and failed,
    and the server answered a bare 500 of its own (plain text) with a traceback logged."""
    verbose_logs(caplog)
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    path, raw, param = LONE_SURROGATES[case]
    reply = httpx.post(gateway.v1 + path, content=raw, timeout=5.0,
                       headers={"content-type": "application/json"})
    error = assert_openai_error(reply, 400, "forbidden_field")
    assert error["param"] == param
    assert error_logs(caplog) == []
    untouched(upstream, attacker)


def test_an_unrenderable_answer_after_a_race_still_gives_back_every_slot(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error raised after the race carries the request's end (slots, counts, upstreams);
    the shaped internal error that replaces an answer which cannot render carries it too,
    or the admission slot and the pool's counts were never given back."""
    from gateway.errors import UpstreamClientError

    # JSON refuses to render it (the shown code only: the stats keep their own `code`)
    monkeypatch.setattr(UpstreamClientError, "shown_code", float("nan"))
    upstream = scripted_upstream.one(responder=lambda _: error_script(400, "no such field"))
    gateway = GatewayFactory(loop_thread)(gateway_settings([upstream.base_url]))
    reply = httpx.post(gateway.v1 + "/chat/completions", json=GOOD, timeout=5.0)
    assert_openai_error(reply, 500, "internal_error")
    admission = gateway.app.state.proxy.admission
    pool = gateway.app.state.live.current.pools[POOL]
    assert wait_for(lambda: admission.active == 0 and pool.holding == 0), (
        admission.active, pool.holding)
    assert pool.inflight_requests == 0 and admission.active_bytes == 0


def test_an_error_answer_that_cannot_be_rendered_becomes_a_shaped_internal_error(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the reason an error's answer fails to render, the client gets the route's
    shaped 500, never the server's bare one, and the bug is counted."""
    from gateway.errors import ForbiddenField

    monkeypatch.setattr(ForbiddenField, "code", float("nan"))  # JSON refuses to render it
    gateway, upstream, attacker = start(loop_thread, scripted_upstream)
    reply = httpx.post(gateway.v1 + "/chat/completions", json={**GOOD, "api_key": "x"},
                       timeout=5.0)
    error = assert_openai_error(reply, 500, "internal_error")
    assert "request id" in error["message"]
    assert httpx.get(gateway.url("/hedge/stats"), timeout=5.0).json()[
        "internal_errors"] >= 1
    untouched(upstream, attacker)
