"""What clients and operators hit in production, over real sockets.

- a client still uploading when it is refused with 413 reads the 413 (lingering close);
- slow clients get 408 after `server.body_timeout`; past `server.max_connections` a new
  connection gets 503 while open streams carry on;
- readiness: one dead pool does not make the replica unready;
- an overload 503 is one the SDK retries after the pause;
- `metadata` is free-form but for destination and credential names.

The gateway runs under the server class `hedge-gateway serve` uses
(`tests.harness.limits_kit.GatewayFactory`); every in-process test ends with the leak check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import threading
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
    chat_completion_obj,
    error_script,
    json_script,
    stream_script,
)
from tests.harness.builders import POOL, backends_for, gateway_settings
from tests.harness.limits_kit import (
    MESSAGES,
    Gateway,
    GatewayFactory,
    closed_by_peer,
    connect,
    data_lines,
    error_logs,
    held_stream,
    holding,
    pool_errors_now,
    read_response,
    request_head,
    sdk,
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
    "half-head": b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n",
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

    upstream = scripted_upstream.one(responder=holding(gate, stream_script(["ok"])))
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


# ---- readiness -------------------------------------------------------------------------------


def two_pools(loop_thread: LoopThread, live_url: str, dead_url: str) -> Gateway:
    base = gateway_settings([live_url], max_attempts=1)
    (live,) = base.pools
    dead = dataclasses.replace(live, name="dead", backends=backends_for([dead_url]))
    return GatewayFactory(loop_thread)(dataclasses.replace(base, pools=(live, dead)))


def pause_by_429(gateway: Gateway, pool: str) -> None:
    """One request that the pool's only backend answers with 429 + Retry-After: paused."""
    with sdk(gateway.v1) as client, pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model=pool, messages=MESSAGES)


def test_readyz_stays_200_and_lists_a_pool_without_a_usable_backend(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    live = scripted_upstream.one()
    dead = scripted_upstream.one(
        responder=lambda _: error_script(429, "slow down", headers={"retry-after": "30"})
    )
    gateway = two_pools(loop_thread, live.base_url, dead.base_url)
    assert httpx.get(gateway.url("/readyz"), timeout=5.0).json() == {
        "status": "ready", "pools_without_usable_backend": []
    }
    pause_by_429(gateway, "dead")
    ready = httpx.get(gateway.url("/readyz"), timeout=5.0)
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "pools_without_usable_backend": ["dead"]}
    # the healthy pool serves on
    with sdk(gateway.v1) as client:
        assert client.chat.completions.create(model=POOL, messages=MESSAGES).choices


def test_readyz_is_503_when_no_pool_can_serve_and_while_draining(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    def paused(_: RecordedRequest) -> Script:
        return error_script(429, "slow down", headers={"retry-after": "30"})

    first, second = scripted_upstream.one(responder=paused), scripted_upstream.one()
    gateway = two_pools(loop_thread, first.base_url, second.base_url)
    pause_by_429(gateway, POOL)
    assert httpx.get(gateway.url("/readyz"), timeout=5.0).status_code == 200
    loop_thread.call(gateway.app.state.drain.start)
    draining = httpx.get(gateway.url("/readyz"), timeout=5.0)
    assert draining.status_code == 503 and draining.json() == {"status": "draining"}

    gateway = two_pools(loop_thread, first.base_url, first.base_url)
    pause_by_429(gateway, POOL)
    pause_by_429(gateway, "dead")
    unready = httpx.get(gateway.url("/readyz"), timeout=5.0)
    assert unready.status_code == 503
    assert unready.json() == {"status": "unready",
                              "pools_without_usable_backend": [POOL, "dead"]}


# ---- a retryable overload --------------------------------------------------------------------


def test_the_sdk_retries_an_overload_503_after_its_pause_and_gets_through(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gate = Gate()

    ok = json_script(chat_completion_obj("ok"))
    upstream = scripted_upstream.one(responder=holding(gate, ok))
    settings = gateway_settings([upstream.base_url],
                                server=ServerSettings(max_concurrent_requests=1))
    gateway = GatewayFactory(loop_thread)(settings)
    answers: list[str] = []

    def retrying_client() -> None:
        with openai.OpenAI(base_url=gateway.v1, api_key="sk-client", max_retries=3,
                           timeout=openai.Timeout(10.0)) as client:
            try:
                reply = client.chat.completions.create(model=POOL, messages=MESSAGES)
                answers.append(reply.choices[0].message.content or "")
            except openai.APIError as exc:
                answers.append(repr(exc))

    with httpx.Client(base_url=gateway.v1, timeout=10.0) as http, \
            http.stream("POST", "/chat/completions", json={**STREAM, "user": "held"}) as live:
        lines = live.iter_lines()  # kept: a dropped iterator closes the response
        data_lines(lines, "first")
        thread = threading.Thread(target=retrying_client)
        thread.start()
        # the SDK's first try was refused (the one slot is held) ...
        assert pool_errors_now(loop_thread, gateway.app, POOL,
                               settle={"overloaded": 1}) == {"overloaded": 1}
        gate.open()  # ... then the slot frees up, and its retry after the pause gets in
        data_lines(lines, "[DONE]")
        thread.join(30.0)
    assert not thread.is_alive()
    assert answers == ["ok"]
    assert len(upstream.requests) == 2


def test_past_the_in_flight_body_bytes_a_request_gets_503_in_its_routes_shape(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Admission counted requests only: a few hundred large bodies to a slow backend took
    the process's memory. With one large request held in flight, a second that would pass
    `server.max_inflight_body` is refused (503, retryable, in the route's shape) and reaches
    no upstream; a small one still fits; once the first ends, the bytes are given back."""
    gate = Gate()

    ok = json_script(chat_completion_obj("ok"))
    upstream = scripted_upstream.one(responder=holding(gate, ok))
    limit = 1024 * 1024
    settings = gateway_settings([upstream.base_url],
                                server=ServerSettings(max_inflight_body_bytes=limit))
    gateway = GatewayFactory(loop_thread)(settings)
    admission = gateway.app.state.proxy.admission
    big = "x" * (limit * 6 // 10)
    large = {"model": POOL, "messages": [{"role": "user", "content": big}]}
    with httpx.Client(base_url=gateway.v1, timeout=10.0) as http, \
            http.stream("POST", "/chat/completions",
                        json={**large, "stream": True, "user": "held"}) as live:
        lines = live.iter_lines()
        data_lines(lines, "first")
        refused = http.post("/chat/completions", json=large)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "overloaded"
        assert refused.headers["retry-after"] == "1"
        assert refused.headers.get("x-should-retry") != "false"
        small = http.post("/chat/completions", json={"model": POOL, "messages": MESSAGES})
        assert small.status_code == 200
        gate.open()
        data_lines(lines, "[DONE]")
    assert wait_for(lambda: admission.active == 0)
    assert admission.active_bytes == 0
    assert len(upstream.requests) == 2  # the held one and the small one
    again = httpx.post(gateway.v1 + "/chat/completions", json=large, timeout=10.0)
    assert again.status_code == 200


def test_bodies_still_arriving_count_against_the_in_flight_bytes_before_they_are_read(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """The bound held only once a body was read and parsed, so uploads left one piece short
    of their end piled up unbounded behind it. Now a body still arriving holds its bytes
    (the declared length before anything is read; a chunked one piece by piece): past the
    bound another upload gets its 503 at once, before its body is read, and reaches no
    upstream; once the first upload ends, it is answered and its bytes given back."""
    upstream = scripted_upstream.one(responder=lambda _: json_script(chat_completion_obj("ok")))
    limit = 1024 * 1024
    settings = gateway_settings([upstream.base_url],
                                server=ServerSettings(max_inflight_body_bytes=limit))
    gateway = GatewayFactory(loop_thread)(settings)
    admission = gateway.app.state.proxy.admission
    body = json.dumps({"model": POOL, "messages": [{"role": "user",
                                                    "content": "x" * (limit * 6 // 10)}]})
    first = connect(gateway.port)
    second = connect(gateway.port)
    try:
        head = request_head("/v1/chat/completions", {"content-type": "application/json",
                                                    "content-length": str(len(body))})
        first.sendall(head + body[:-10].encode())  # all but its end: still arriving
        assert wait_for(lambda: admission.receiving_bytes == len(body))
        second.sendall(head)  # no body byte yet: refused on its declared length alone
        refused = read_response(second)
        assert refused.status == 503, refused.body
        assert refused.json()["error"]["code"] == "overloaded"
        first.sendall(body[-10:].encode())
        answered = read_response(first)
        assert answered.status == 200, answered.body
    finally:
        first.close()
        second.close()
    assert wait_for(lambda: admission.active == 0)
    assert admission.active_bytes == 0 and admission.receiving_bytes == 0
    assert len(upstream.requests) == 1  # the refused upload reached nothing


def test_a_committed_stream_holds_no_copy_of_its_request_body(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """No attempt starts after a race has committed, yet the race kept its runner, which
    holds the parsed body and its serialized copy, to the end of the stream: a large
    request held several times its size for as long as its answer streamed."""
    gate = Gate()
    upstream = scripted_upstream.one(responder=lambda _: held_stream(gate))
    gateway = GatewayFactory(loop_thread)(gateway_settings([upstream.base_url]))
    marker = "marker-" + "m" * 100_000
    body = json.dumps({"model": POOL, "messages": [{"role": "user", "content": marker}],
                       "stream": True}).encode()
    with httpx.Client(base_url=gateway.v1, timeout=10.0) as http, \
            http.stream("POST", "/chat/completions", content=body,
                        headers={"content-type": "application/json"}) as live:
        lines = live.iter_lines()
        data_lines(lines, "first")  # committed; the stream goes on until the gate opens
        (recorded,) = upstream.requests
        theirs = recorded.body  # the upstream's own parse of what it got
        gc.collect()
        held = [o for o in gc.get_objects()  # a dict holding a list is tracked
                if isinstance(o, dict) and o is not theirs
                and _first_content(o.get("messages")) == marker]
        gate.open()
        data_lines(lines, "[DONE]")
    assert held == []


def _first_content(messages: object) -> object:
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        return messages[0].get("content")
    return None


# ---- metadata is free-form -------------------------------------------------------------------

#: OpenAI metadata a client may well send: tags, among them `url` and `headers`
FREE_METADATA = {"url": "https://example.invalid/page", "headers": "x-trace", "user_id": "u1",
                 "extra_headers": "tag", "awesome": "yes", "vertexai": "tag",
                 "nested": {"url": "u", "headers": {"h": "v"}}}
#: destination and credential names, in assorted cases and separators -> the refused path
REFUSED_METADATA = ["api_base", "baseURL", "API-KEY", "apiVersion", "azure_endpoint",
                    "AzureEndpoint", "aws_access_key_id", "AWS-REGION", "awsSecretAccessKey",
                    "vertex_project", "VertexLocation"]


def test_metadata_keys_like_url_and_headers_pass_and_are_forwarded(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    upstream = scripted_upstream.one()
    gateway = GatewayFactory(loop_thread)(gateway_settings([upstream.base_url]))
    reply = httpx.post(gateway.v1 + "/chat/completions", timeout=5.0,
                       json={"model": POOL, "messages": MESSAGES, "metadata": FREE_METADATA})
    assert reply.status_code == 200, reply.text
    (request,) = upstream.requests
    assert request.body["metadata"] == FREE_METADATA


@pytest.mark.parametrize("name", REFUSED_METADATA)
def test_destination_and_credential_names_in_metadata_are_refused_at_any_depth(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, name: str
) -> None:
    upstream = scripted_upstream.one()
    gateway = GatewayFactory(loop_thread)(gateway_settings([upstream.base_url]))
    with httpx.Client(base_url=gateway.v1, timeout=5.0) as http:
        for metadata, param in (({name: "x"}, f"metadata.{name}"),
                                ({"a": [{name: "x"}]}, f"metadata.a[0].{name}")):
            reply = http.post("/chat/completions",
                              json={"model": POOL, "messages": MESSAGES, "metadata": metadata})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "forbidden_field" and error["param"] == param
    assert upstream.requests == []
