"""What clients and operators hit in production (SPEC §18), over real sockets.

- a client still uploading when it is refused with 413 reads the 413 (lingering close);
- slow clients get 408 after `server.body_timeout`; past `server.max_connections` a new
  connection gets 503 while open streams carry on;

The gateway runs under the server class `hedge-gateway serve` uses
(`tests.harness.limits_kit.GatewayFactory`); every in-process test ends with the leak check.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import ServerSettings
from tests.harness import (
    Gate,
    LoopThread,
    RecordedRequest,
    Script,
    UpstreamFactory,
    stream_script,
)
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import (
    MESSAGES,
    Gateway,
    GatewayFactory,
    closed_by_peer,
    connect,
    data_lines,
    error_logs,
    held_stream,
    read_response,
    request_head,
    wait_for,
)

TRIES = 20
#: bigger than the default body limit (4 MiB) and than what loopback socket buffers absorb
BIG_PROMPT = "x" * (5 * 1024 * 1024)


def one_backend(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, server: ServerSettings
) -> Gateway:
    upstream = scripted_upstream.one()
    return GatewayFactory(loop_thread)(gateway_settings([upstream.base_url], server=server))


# ---- lingering close after 413 ---------------------------------------------------------------


async def _async_openai_uploads(v1: str, tries: int) -> list[str]:
    """What `AsyncOpenAI` sees for each of `tries` oversized prompts (its default retries on)."""
    seen: list[str] = []
    async with openai.AsyncOpenAI(base_url=v1, api_key="sk-client",
                                  timeout=openai.Timeout(20.0)) as client:
        for _ in range(tries):
            try:
                await client.chat.completions.create(
                    model=POOL, messages=[{"role": "user", "content": BIG_PROMPT}]
                )
                seen.append("200")
            except openai.APIStatusError as exc:
                seen.append(f"{exc.status_code} {exc.code}")
            except openai.APIConnectionError as exc:
                seen.append(f"{type(exc).__name__}: {exc.__cause__!r}")
    return seen


async def _httpx_uploads(v1: str, tries: int, *, chunked: bool) -> list[str]:
    """What `httpx.AsyncClient` sees for each of `tries` oversized bodies: with a
    Content-Length (refused before any body byte is read) or chunked (refused mid-body)."""
    raw = json.dumps({"model": POOL, "messages": [{"role": "user", "content": BIG_PROMPT}]})
    payload = raw.encode()

    async def pieces() -> Any:
        for i in range(0, len(payload), 256 * 1024):
            yield payload[i:i + 256 * 1024]

    seen: list[str] = []
    async with httpx.AsyncClient(base_url=v1, timeout=20.0) as client:
        for _ in range(tries):
            content: Any = pieces() if chunked else payload
            try:
                reply = await client.post("/chat/completions", content=content,
                                          headers={"content-type": "application/json"})
                seen.append(f"{reply.status_code} {reply.json()['error']['code']}")
            except httpx.TransportError as exc:
                seen.append(f"{type(exc).__name__}: {exc!r}")
    return seen


@pytest.mark.timeout(90)
def test_async_openai_reads_the_413_for_an_oversized_prompt_every_time(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway = one_backend(loop_thread, scripted_upstream, ServerSettings())
    seen = asyncio.run(_async_openai_uploads(gateway.v1, TRIES))
    assert seen == ["413 payload_too_large"] * TRIES


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_httpx_async_client_reads_the_413_for_an_oversized_body_every_time(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, chunked: bool
) -> None:
    # chunked: a small limit, so the refusal comes while most of the body is still unsent
    server = ServerSettings(max_body_bytes=64 * 1024) if chunked else ServerSettings()
    gateway = one_backend(loop_thread, scripted_upstream, server)
    seen = asyncio.run(_httpx_uploads(gateway.v1, TRIES, chunked=chunked))
    assert seen == ["413 payload_too_large"] * TRIES


# ---- slow clients: server.body_timeout -------------------------------------------------------

BODY_TIMEOUT = 0.5
STREAM = {"model": POOL, "messages": MESSAGES, "stream": True}


def assert_raw_openai_error(raw: Any, status: int, code: str) -> None:
    assert raw.status == status, raw.body
    assert raw.headers["content-type"] == "application/json"
    assert raw.headers["connection"] == "close"
    error = raw.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


#: what a slow client has sent when it stops: nothing, part of the head, the head and part
#: of the body
SLOW = {
    "nothing": b"",
    "half-head": b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n",
    "half-body": request_head(
        "/v1/chat/completions", {"content-type": "application/json", "content-length": "400"}
    ) + b'{"model": "pool", "mess',
}


@pytest.mark.parametrize("sent", list(SLOW))
def test_a_request_that_does_not_arrive_within_the_body_timeout_gets_408_and_is_closed(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture, sent: str,
) -> None:
    caplog.set_level(logging.INFO)
    gate = Gate()
    upstream = scripted_upstream.one(responder=lambda _: held_stream(gate))
    settings = gateway_settings([upstream.base_url],
                                server=ServerSettings(body_timeout=BODY_TIMEOUT))
    gateway = GatewayFactory(loop_thread)(settings)
    with httpx.Client(base_url=gateway.v1, timeout=10.0) as http, \
            http.stream("POST", "/chat/completions", json=STREAM) as live:
        # a stream that arrived in time is opened first: it outlives its own body timer
        lines = live.iter_lines()
        data_lines(lines, "first")
        slow = connect(gateway.port, timeout=10.0)
        try:
            slow.sendall(SLOW[sent])
            assert_raw_openai_error(read_response(slow), 408, "request_timeout")
            assert closed_by_peer(slow)
        finally:
            slow.close()
        # the 408 came more than `body_timeout` after the stream's request began: the stream
        # is unaffected and ends properly
        gate.open()
        assert "second" in data_lines(lines, "[DONE]")[0]
    assert len(upstream.requests) == 1  # the slow request never went upstream
    assert error_logs(caplog) == []
    assert "Exception in ASGI application" not in caplog.text


# ---- connection count: server.max_connections ------------------------------------------------


def test_past_max_connections_a_new_connection_gets_503_while_open_streams_flow(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gate = Gate()

    def respond(request: RecordedRequest) -> Script:
        return held_stream(gate) if request.body.get("user") == "held" else stream_script(["ok"])

    upstream = scripted_upstream.one(responder=respond)
    settings = gateway_settings([upstream.base_url], server=ServerSettings(max_connections=1))
    gateway = GatewayFactory(loop_thread)(settings)
    with httpx.Client(base_url=gateway.v1, timeout=10.0) as http, \
            http.stream("POST", "/chat/completions", json={**STREAM, "user": "held"}) as live:
        lines = live.iter_lines()
        data_lines(lines, "first")
        # the one allowed connection streams: a second one is refused, in OpenAI shape
        refused = httpx.post(gateway.v1 + "/chat/completions", json=STREAM, timeout=10.0)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["retry-after-ms"] == "1000"
        assert "x-should-retry" not in refused.headers
        error = refused.json()["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "server_error"
        raw = connect(gateway.port)
        try:  # and closed
            raw.sendall(request_head("/healthz", {}, method="GET"))
            assert_raw_openai_error(read_response(raw), 503, "too_many_connections")
            assert closed_by_peer(raw)
        finally:
            raw.close()
        gate.open()
        assert "second" in data_lines(lines, "[DONE]")[0]
    assert len(upstream.requests) == 1
    # once the streaming connection is gone, a new one is served
    assert wait_for(lambda: httpx.get(gateway.url("/healthz"), timeout=5.0).status_code == 200)
