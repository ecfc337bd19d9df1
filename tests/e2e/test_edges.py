"""Edges of the HTTP face, through `GatewayServer` (what `serve` runs): a 405 says what is
allowed, a trailing slash is not redirected, repeated query parameters all reach the
upstream, an oversized head is answered rather than reset, and the answers given below the
app (431, 408, the connection cap's 503) take Anthropic's shape under /v1/messages."""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest

from gateway.settings import (
    BackendSettings,
    PoolSettings,
    ServerSettings,
    Settings,
)
from tests.harness import Head, LoopThread, Script, Send, UpstreamFactory
from tests.harness.limits_kit import (
    Gateway,
    GatewayFactory,
    closed_by_peer,
    connect,
    read_response,
    request_head,
)

POOL = "pool"
CHAT = {"model": POOL, "messages": [{"role": "user", "content": "hi"}]}


def json_responder(request: Any) -> Script:
    """Every request: a stored Responses object (or an item list), as JSON."""
    if getattr(request, "path", "").endswith("/input_items"):
        body: dict[str, Any] = {"object": "list", "data": [], "has_more": False}
    else:
        body = {"id": "resp_1", "object": "response", "status": "completed", "output": []}
    return Script(headers={"content-type": "application/json"},
                  steps=[Head(), Send(json.dumps(body).encode())], framing="length")


def gateway_for(loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
                server: ServerSettings | None = None) -> tuple[Gateway, Any]:
    upstream = scripted_upstream.one(responder=json_responder)
    backend = BackendSettings(name="b0", provider="openai", base_url=upstream.base_url,
                              model="m")
    settings = Settings(pools=(PoolSettings(name=POOL, backends=(backend,)),),
                        server=server or ServerSettings())
    return GatewayFactory(loop_thread)(settings), upstream


def test_a_405_says_which_methods_are_allowed(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, _ = gateway_for(loop_thread, scripted_upstream)
    chat = httpx.get(gateway.v1 + "/chat/completions", timeout=5.0)
    assert chat.status_code == 405
    assert chat.headers["allow"] == "POST"
    assert chat.json()["error"]["code"] == "method_not_allowed"
    messages = httpx.get(gateway.v1 + "/messages", timeout=5.0)
    assert messages.status_code == 405 and messages.headers["allow"] == "POST"
    assert messages.json()["type"] == "error"  # Anthropic's shape


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1/messages/"])
def test_a_trailing_slash_is_a_404_in_the_route_shape_not_a_redirect(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, path: str
) -> None:
    """A 307 would point at a URL built from the client's own Host header (and have the
    body sent twice)."""
    gateway, upstream = gateway_for(loop_thread, scripted_upstream)
    reply = httpx.post(gateway.url(path), json=CHAT, timeout=5.0, follow_redirects=False,
                       headers={"host": "attacker.example"})
    assert reply.status_code == 404, reply.headers
    assert "location" not in reply.headers
    body = reply.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    else:
        assert body["error"]["code"] == "not_found"
    assert upstream.requests == []


def test_repeated_query_parameters_all_reach_the_upstream(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, upstream = gateway_for(loop_thread, scripted_upstream)
    made = httpx.post(gateway.v1 + "/responses", json={"model": POOL, "input": "hi"},
                      timeout=5.0)
    assert made.status_code == 200, made.text
    made_id = made.json()["id"]  # the gateway's own id for the upstream's resp_1
    items = httpx.get(gateway.v1 + f"/responses/{made_id}/input_items?include[]=a&include[]=b"
                      "&limit=2&unknown=x", timeout=5.0)
    assert items.status_code == 200, items.text
    sent = upstream.requests[-1]
    assert sent.path == "/v1/responses/resp_1/input_items"
    assert parse_qsl(sent.query) == [("include[]", "a"), ("include[]", "b"), ("limit", "2")]


def _big_head(path: str, size: int) -> bytes:
    return request_head(path, {"content-type": "application/json", "x-padding": "p" * size,
                               "content-length": "2"}) + b"{}"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_70_kb_head_is_answered_431_in_the_route_shape_not_reset(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, path: str
) -> None:
    gateway, upstream = gateway_for(loop_thread, scripted_upstream)
    sock = connect(gateway.port)
    try:
        head = _big_head(path, 70 * 1024)
        for start in range(0, len(head), 4096):  # all of it, in a slow client's writes,
            sock.sendall(head[start:start + 4096])  # most after the gateway has refused it
            time.sleep(0.005)
        reply = read_response(sock)
        assert reply.status == 431
        body = reply.json()
        if path == "/v1/messages":
            assert body["type"] == "error", body
            assert body["error"]["type"] == "invalid_request_error", body
        else:
            assert body["error"]["code"] == "headers_too_large"
        assert closed_by_peer(sock)
    finally:
        sock.close()
    assert upstream.requests == []


def test_a_408_under_messages_is_in_anthropic_shape(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, _ = gateway_for(loop_thread, scripted_upstream,
                             ServerSettings(body_timeout=0.3))
    sock = connect(gateway.port)
    try:
        sock.sendall(request_head("/v1/messages", {"content-type": "application/json",
                                                   "content-length": "400"}) + b'{"mod')
        reply = read_response(sock)
        assert reply.status == 408
        body = reply.json()
        assert body["type"] == "error" and body["error"]["type"] == "timeout_error", body
        assert closed_by_peer(sock)
    finally:
        sock.close()


def test_the_connection_cap_answers_in_the_shape_of_the_request_line(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway, _ = gateway_for(loop_thread, scripted_upstream, ServerSettings(max_connections=1))
    held = connect(gateway.port)  # the one connection allowed, kept open
    try:
        held.sendall(request_head("/healthz", {}, method="GET"))
        assert read_response(held).status == 200
        for path, anthropic_shape in (("/v1/messages", True), ("/v1/chat/completions", False)):
            sock = connect(gateway.port)
            try:
                sock.sendall(request_head(path, {"content-type": "application/json",
                                                 "content-length": "2"}) + b"{}")
                reply = read_response(sock)
                assert reply.status == 503
                assert reply.headers["retry-after"] == "1"
                body = reply.json()
                if anthropic_shape:
                    assert body["type"] == "error"
                    assert body["error"]["type"] == "overloaded_error"
                else:
                    assert body["error"]["code"] == "too_many_connections"
                assert closed_by_peer(sock)
            finally:
                sock.close()
        silent = connect(gateway.port)  # says nothing: answered all the same, OpenAI shape
        try:
            silent.shutdown(socket.SHUT_WR)
            reply = read_response(silent)
            assert reply.status == 503
            assert reply.json()["error"]["code"] == "too_many_connections"
        finally:
            silent.close()
    finally:
        held.close()


def test_a_70_kb_header_from_an_sdk_client_gets_its_431(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """httpx, as the SDKs use it: it writes the whole head and body, then reads."""
    gateway, upstream = gateway_for(loop_thread, scripted_upstream)
    for _ in range(5):
        reply = httpx.post(gateway.v1 + "/chat/completions", json=CHAT, timeout=5.0,
                           headers={"x-padding": "p" * (70 * 1024)})
        assert reply.status_code == 431
        assert reply.json()["error"]["code"] == "headers_too_large"
    assert upstream.requests == []
