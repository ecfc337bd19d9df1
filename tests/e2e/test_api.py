"""The "foundation" acceptance points, over real sockets.

The gateway runs under uvicorn in the harness loop thread; upstreams are real loopback
servers (the simulator for "same content as a direct call", the ScriptedUpstream for hostile
wire behaviour); clients are the official sync `openai` SDK and raw `httpx` reading SSE lines.

Every gateway here has ONE backend: these tests are about what the gateway forwards and
relays, not about hedging, so no second attempt can change what a client receives.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
)
from providers.requestid import upstream_request_id
from providers.sim.server import create_sim_app
from tests.harness import (
    DONE,
    SSE_HEADERS,
    AsgiServerFactory,
    Close,
    Gate,
    Hang,
    Head,
    Reset,
    RunningServer,
    Script,
    Send,
    Step,
    UpstreamFactory,
    Wait,
    chunk_obj,
    comment,
    error_obj,
    finish_chunk,
    json_script,
    role_chunk,
    sse,
    stream_script,
    token_chunk,
    usage_chunk,
)

POOL = "chat"
BACKEND = "only"
BACKEND_MODEL = "backend-model"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "say something short"}
]
#: a request id both the direct call and the gateway call send, so the simulator (which
#: derives its response ids from it) answers both with the same ids; a version-4 UUID, which
#: the gateway passes upstream unchanged (any other id goes upstream mapped to a UUID)
SHARED_REQUEST_ID = "2b0c6f0e-8a4e-4c1b-9f57-0d6b3c2a9e11"
#: the gateway's own ids are version-4 UUIDs (upstreams that validate request ids take only
#: UUIDs)
GENERATED_ID = re.compile(
    r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
#: the simulator as a deterministic upstream: no latency, no stragglers, no faults
SIM_PROFILE = SimProfile(
    ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=6, inter_token=0.0,
    usage=True,
)


# ---- building blocks -----------------------------------------------------------------------


def one_backend(
    base_url: str,
    *,
    api_key: str | None = None,
    gateway_keys: tuple[str, ...] = (),
    keepalive: float = 15.0,
) -> Settings:
    """A gateway with one pool of one OpenAI-compatible backend, hedging off."""
    backend = BackendSettings(
        name=BACKEND, provider="openai", model=BACKEND_MODEL, base_url=base_url, api_key=api_key
    )
    pool = PoolSettings(name=POOL, backends=(backend,), hedging=HedgingSettings(enabled=False))
    server = ServerSettings(api_keys=gateway_keys, keepalive=keepalive)
    return Settings(pools=(pool,), server=server)


def serve_gateway(asgi_server: AsgiServerFactory, settings: Settings) -> RunningServer:
    return asgi_server.build(lambda: create_app(settings, seed=7))


@contextlib.contextmanager
def sdk(base_url: str, api_key: str = "sk-client-key") -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=openai.Timeout(8.0)
    ) as client:
        yield client


@contextlib.contextmanager
def raw_client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=httpx.Timeout(8.0), trust_env=False) as client:
        yield client


def sse_blocks(lines: Iterable[str]) -> list[list[str]]:
    """Group raw SSE lines into blocks (one block per event or comment), blank-line ended."""
    blocks: list[list[str]] = []
    current: list[str] = []
    for line in lines:
        if line == "":
            if current:
                blocks.append(current)
            current = []
        else:
            current.append(line)
    if current:
        blocks.append(current)
    return blocks


def events_and_comments(blocks: list[list[str]]) -> tuple[list[list[str]], list[str]]:
    """Split blocks into events (blocks with a field) and comment lines."""
    events = [b for b in blocks if any(not line.startswith(":") for line in b)]
    comments = [line for b in blocks for line in b if line.startswith(":")]
    return events, comments


def data_line(wire_event: bytes) -> str:
    """The `data: ...` line of a one-line event built by the harness (`sse(...)`)."""
    text = wire_event.decode()
    assert text.startswith("data: ") and text.endswith("\n\n") and text.count("\n") == 2
    return text[:-2]


def stream_chat_raw(
    client: httpx.Client,
    gateway: RunningServer,
    headers: Mapping[str, str] | None = None,
    body: Mapping[str, Any] | None = None,
) -> tuple[httpx.Response, list[list[str]]]:
    """POST a streaming chat request; the response and its SSE blocks, read to the end."""
    sent = dict(body) if body is not None else {"model": POOL, "messages": MESSAGES, "stream": True}
    with client.stream(
        "POST", gateway.url("/v1/chat/completions"), json=sent, headers=dict(headers or {})
    ) as response:
        lines = list(response.iter_lines())
    return response, sse_blocks(lines)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-shaped error body, checked for exactly the four keys."""
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def without_created(obj: Any) -> Any:
    """A response dump minus `created` (the simulator stamps wall-clock seconds)."""
    if isinstance(obj, dict):
        return {k: without_created(v) for k, v in obj.items() if k != "created"}
    if isinstance(obj, list):
        return [without_created(v) for v in obj]
    return obj


# ---- 2. the SDK gets exactly what a direct call to the same upstream gives ------------------


@pytest.fixture
def sim_and_gateway(asgi_server: AsgiServerFactory) -> tuple[RunningServer, RunningServer]:
    """A loopback simulator and a gateway whose one backend is that simulator."""
    sim = asgi_server.build(lambda: create_sim_app(SIM_PROFILE, seed=11))
    gateway = serve_gateway(asgi_server, one_backend(sim.v1))
    return sim, gateway


def test_streamed_chat_through_the_gateway_equals_a_direct_call(
    sim_and_gateway: tuple[RunningServer, RunningServer],
) -> None:
    sim, gateway = sim_and_gateway
    headers = {"x-request-id": SHARED_REQUEST_ID}
    dumps = []
    for base_url, model in ((sim.v1, BACKEND_MODEL), (gateway.v1, POOL)):
        with sdk(base_url) as client:
            # usage asked for: without it the gateway drops the usage-only chunk
            stream = client.chat.completions.create(
                model=model, messages=MESSAGES, stream=True, extra_headers=headers,
                stream_options={"include_usage": True},
            )
            dumps.append([without_created(c.model_dump()) for c in stream])
    direct, via = dumps
    assert via == direct
    # and what both are: role chunk, six tokens, finish, usage
    content = "".join(c["choices"][0]["delta"]["content"] or "" for c in via if c["choices"])
    assert content == "tok0 tok1 tok2 tok3 tok4 tok5 "
    assert via[0]["choices"][0]["delta"]["role"] == "assistant"
    assert via[-2]["choices"][0]["finish_reason"] == "stop"
    assert via[-1]["choices"] == [] and via[-1]["usage"]["completion_tokens"] == 6


def test_non_streaming_chat_through_the_gateway_equals_a_direct_call(
    sim_and_gateway: tuple[RunningServer, RunningServer],
) -> None:
    sim, gateway = sim_and_gateway
    headers = {"x-request-id": SHARED_REQUEST_ID}
    with sdk(sim.v1) as client:
        direct = client.chat.completions.create(
            model=BACKEND_MODEL, messages=MESSAGES, max_tokens=4, extra_headers=headers
        )
    with sdk(gateway.v1) as client:
        via = client.chat.completions.create(
            model=POOL, messages=MESSAGES, max_tokens=4, extra_headers=headers
        )
    assert without_created(via.model_dump()) == without_created(direct.model_dump())
    assert via.choices[0].message.content == "tok0 tok1 tok2 tok3 "
    assert via.choices[0].finish_reason == "length"  # max_tokens cut the 6-token answer
    assert via.usage is not None and via.usage.completion_tokens == 4


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_legacy_completions_through_the_gateway_equal_a_direct_call(
    sim_and_gateway: tuple[RunningServer, RunningServer], stream: bool
) -> None:
    sim, gateway = sim_and_gateway
    headers = {"x-request-id": SHARED_REQUEST_ID}
    results: list[Any] = []
    for base_url, model in ((sim.v1, BACKEND_MODEL), (gateway.v1, POOL)):
        with sdk(base_url) as client:
            if stream:
                chunks = client.completions.create(
                    model=model, prompt="once upon", stream=True, extra_headers=headers
                )
                results.append([without_created(c.model_dump()) for c in chunks])
            else:
                answer = client.completions.create(
                    model=model, prompt="once upon", extra_headers=headers
                )
                results.append(without_created(answer.model_dump()))
    direct, via = results
    assert via == direct
    if stream:
        text = "".join(c["choices"][0]["text"] for c in via if c["choices"])
        finish = [c["choices"][0]["finish_reason"] for c in via if c["choices"]][-1]
        assert via[-1]["usage"]["prompt_tokens"] == 3  # "once upon": 9 bytes
    else:
        text = via["choices"][0]["text"]
        finish = via["choices"][0]["finish_reason"]
        assert via["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
            "completion_tokens_details": None, "prompt_tokens_details": None,
        }
    assert text == "tok0 tok1 tok2 tok3 tok4 tok5 " and finish == "stop"


def test_embeddings_through_the_gateway_equal_a_direct_call(
    sim_and_gateway: tuple[RunningServer, RunningServer],
) -> None:
    sim, gateway = sim_and_gateway
    inputs = ["the quick brown fox", "jumps"]
    with sdk(sim.v1) as client:
        direct = client.embeddings.create(model=BACKEND_MODEL, input=inputs)
    with sdk(gateway.v1) as client:
        via = client.embeddings.create(model=POOL, input=inputs)
    assert via.model_dump() == direct.model_dump()
    assert [d.index for d in via.data] == [0, 1]
    assert len(via.data[0].embedding) == 8 and via.data[0].embedding != via.data[1].embedding
    assert via.usage.prompt_tokens == 5 + 2  # 19 and 5 bytes, about 4 a token


def test_unknown_model_raises_not_found_with_model_not_found(
    sim_and_gateway: tuple[RunningServer, RunningServer],
) -> None:
    sim, gateway = sim_and_gateway
    with sdk(gateway.v1) as client, pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-pool", messages=MESSAGES, stream=True)
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert body["param"] == "model" and body["type"] == "invalid_request_error"
    assert info.value.response.headers["x-request-id"]
    with raw_client() as client:
        stats = client.get(sim.url("/sim/stats")).json()
    assert stats["requests"] == 0  # nothing went upstream


def test_malformed_json_is_a_400_in_openai_shape(
    sim_and_gateway: tuple[RunningServer, RunningServer],
) -> None:
    sim, gateway = sim_and_gateway
    with raw_client() as client:
        response = client.post(
            gateway.url("/v1/chat/completions"),
            content=b'{"model": "chat", "messages": [',
            headers={"content-type": "application/json"},
        )
        stats = client.get(sim.url("/sim/stats")).json()
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]
    assert "Traceback" not in response.text
    assert stats["requests"] == 0


# ---- 3. the relay after commit ---------------------------------------------------------------


def multi_line_token(text: str) -> tuple[bytes, list[str]]:
    """A token event whose JSON is split over two `data:` lines; also its expected lines."""
    body = json.dumps(chunk_obj({"content": text}))
    cut = body.index(', "choices"') + 1
    first, second = body[:cut], body[cut:]
    return f"data: {first}\ndata: {second}\n\n".encode(), [f"data: {first}", f"data: {second}"]


def noisy_stream_steps(gate: Gate | None) -> tuple[list[Step], list[list[str]]]:
    """An upstream that sends comments, `retry:`/`id:` fields, a multi-line event; also the
    event blocks a client must receive (data lines only, in order)."""
    multi, multi_lines = multi_line_token("lo")
    steps: list[Step] = [
        Head(),
        Send(comment("ping")),
        Send(comment("OPENROUTER PROCESSING")),
        Send(role_chunk()),
        Send(b"retry: 3000\n\n"),
        Send(comment("ping")),
        Send(b"id: evt-1\n" + token_chunk("Hel")),
        *([Wait(gate)] if gate is not None else []),
        Send(comment("OPENROUTER PROCESSING")),
        Send(b"id: evt-2\n" + multi),
        Send(b"id: evt-3\nretry: 10\n" + token_chunk(" world")),
        Send(comment("ping")),
        Send(finish_chunk()),
        Send(usage_chunk()),
        Send(DONE),
    ]
    expected = [
        [data_line(role_chunk())],
        [data_line(token_chunk("Hel"))],
        multi_lines,
        [data_line(token_chunk(" world"))],
        [data_line(finish_chunk())],
        [data_line(usage_chunk())],
        ["data: [DONE]"],
    ]
    return steps, expected


def test_relay_sends_role_then_tokens_and_none_of_the_upstream_comments_or_fields(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    up = scripted_upstream.one()
    gate = Gate()
    steps, expected = noisy_stream_steps(gate)
    up.queue(Script(headers=SSE_HEADERS, steps=steps))
    gateway = serve_gateway(asgi_server, one_backend(up.base_url, keepalive=0.02))
    # usage asked for, so the upstream's usage chunk is the client's to see
    body = {"model": POOL, "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}}
    lines: list[str] = []
    with (
        raw_client() as client,
        client.stream("POST", gateway.url("/v1/chat/completions"), json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            lines.append(line)
            # The upstream holds its second token until the gateway's own keep-alive reached
            # us: the keep-alive is caused by the wait, not guessed from a timer.
            if line == ": keep-alive" and not gate.is_open:
                gate.open()
    assert gate.is_open, "the gateway never sent its own keep-alive comment"
    events, comments = events_and_comments(sse_blocks(lines))
    assert events == expected
    # the only comments are the gateway's own keep-alives
    assert comments and set(comments) == {": keep-alive"}
    assert not any(line.startswith(("id:", "retry:")) for line in lines)
    (rec,) = up.requests
    assert up.wait_finished(rec) and rec.outcome == "complete"


def test_sdk_reads_the_relayed_noisy_stream(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    up = scripted_upstream.one()
    steps, _ = noisy_stream_steps(None)
    up.queue(Script(headers=SSE_HEADERS, steps=steps))
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    with sdk(gateway.v1) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Hello world"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 7


TRUNCATIONS: dict[str, tuple[list[Step], str]] = {
    # the body ends properly (chunked terminator) but [DONE] never came
    "clean_end": ([Send(finish_chunk())], "stream_truncated"),
    # the connection is closed mid-body (no chunked terminator)
    "fin": ([Close()], "upstream_failed"),
    # the connection is reset
    "reset": ([Reset()], "upstream_failed"),
}


@pytest.mark.parametrize("how", list(TRUNCATIONS))
def test_a_truncated_upstream_gives_a_final_error_event(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory, how: str
) -> None:
    tail, code = TRUNCATIONS[how]
    up = scripted_upstream.one()
    head: list[Step] = [Head(), Send(role_chunk()), Send(token_chunk("a")), Send(token_chunk("b"))]
    up.queue(Script(headers=SSE_HEADERS, steps=[*head, *tail]))
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    with raw_client() as client:
        response, blocks = stream_chat_raw(client, gateway, {"x-request-id": "trunc-1"})
    assert response.status_code == 200
    events, _ = events_and_comments(blocks)
    sent = [role_chunk(), token_chunk("a"), token_chunk("b")]
    if how == "clean_end":
        sent.append(finish_chunk())
    assert events[:-1] == [[data_line(e)] for e in sent]
    (last,) = events[-1]
    assert last.startswith("data: ")
    payload = json.loads(last[len("data: "):])
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == code
    assert "trunc-1" in payload["error"]["message"]  # the request id, for the operator
    assert ["data: [DONE]"] not in events


@pytest.mark.parametrize("how", list(TRUNCATIONS))
def test_sdk_raises_api_error_on_a_truncated_stream_after_the_tokens(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory, how: str
) -> None:
    """openai 3.x raises `APIError` (not a status error) for an `{"error": ...}` event in a
    stream, with the event's `error` object as `body` and its `code`."""
    tail, code = TRUNCATIONS[how]
    up = scripted_upstream.one()
    head: list[Step] = [Head(), Send(role_chunk()), Send(token_chunk("a")), Send(token_chunk("b"))]
    up.queue(Script(headers=SSE_HEADERS, steps=[*head, *tail]))
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    received: list[str] = []
    with sdk(gateway.v1) as client:
        stream = client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError) as info:
            for chunk in stream:
                received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == "ab"
    assert not isinstance(info.value, openai.APIStatusError)
    assert info.value.code == code
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "upstream_error"


UPSTREAM_ERRORS: dict[str, bytes] = {
    "data_error": sse(error_obj("model overloaded", code="overloaded")),
    "event_error": b"event: error\n" + sse(error_obj("model overloaded", code="overloaded")),
}


@pytest.mark.parametrize("kind", list(UPSTREAM_ERRORS))
def test_an_upstream_error_event_after_commit_is_relayed_as_is_and_ends_the_stream(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory, kind: str
) -> None:
    wire = UPSTREAM_ERRORS[kind]
    up = scripted_upstream.one()
    steps: list[Step] = [
        Head(), Send(role_chunk()), Send(token_chunk("a")), Send(wire),
        Send(token_chunk("never")), Send(DONE), Hang(),
    ]
    up.queue(Script(headers=SSE_HEADERS, steps=steps))
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    with raw_client() as client:
        response, blocks = stream_chat_raw(client, gateway)
    assert response.status_code == 200
    events, _ = events_and_comments(blocks)
    expected_error = wire.decode().rstrip("\n").split("\n")
    assert events == [
        [data_line(role_chunk())], [data_line(token_chunk("a"))], expected_error
    ]
    # the gateway stopped reading and let go of the upstream
    (rec,) = up.requests
    assert up.wait_closed(rec)


def test_an_upstream_error_field_after_commit_reaches_the_client_as_an_openai_error(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    up = scripted_upstream.one()
    steps: list[Step] = [
        Head(), Send(role_chunk()), Send(token_chunk("a")), Send(b"error: backend broke\n\n"),
        Hang(),
    ]
    up.queue(*[Script(headers=SSE_HEADERS, steps=steps)] * 2)
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    with raw_client() as client:
        _, blocks = stream_chat_raw(client, gateway)
    events, _ = events_and_comments(blocks)
    assert events[:2] == [[data_line(role_chunk())], [data_line(token_chunk("a"))]]
    data = "\n".join(line[len("data: "):] for line in events[-1] if line.startswith("data: "))
    payload = json.loads(data)
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    with sdk(gateway.v1) as client:
        stream = client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass


def test_sdk_raises_the_upstream_error_event_after_the_first_tokens(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    up = scripted_upstream.one()
    steps: list[Step] = [
        Head(), Send(role_chunk()), Send(token_chunk("a")),
        Send(UPSTREAM_ERRORS["data_error"]), Hang(),
    ]
    up.queue(Script(headers=SSE_HEADERS, steps=steps))
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    received: list[str] = []
    with sdk(gateway.v1) as client:
        stream = client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError, match="model overloaded") as info:
            for chunk in stream:
                received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == "a"
    assert info.value.code == "overloaded"


# ---- 3. response headers ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_response_headers_echo_or_generate_the_request_id_and_name_the_backend(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory, stream: bool
) -> None:
    """The upstream sends its own x-request-id: the client still sees the gateway's."""
    upstream_headers = {"x-request-id": "upstream-own-id"}

    def answer(_: Any) -> Script:
        if stream:
            return stream_script(["hi"], headers=upstream_headers)
        return json_script(
            {"id": "x", "object": "chat.completion", "created": 1, "model": BACKEND_MODEL,
             "choices": []},
            headers=upstream_headers,
        )

    up = scripted_upstream.one(responder=answer)
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    body = {"model": POOL, "messages": MESSAGES, "stream": stream}
    with raw_client() as client:
        echoed = client.post(
            gateway.url("/v1/chat/completions"), json=body,
            headers={"x-request-id": "client-req-42"},
        )
        generated = client.post(gateway.url("/v1/chat/completions"), json=body)
    for response in (echoed, generated):
        assert response.status_code == 200
        assert response.headers["x-hedge-backend"] == BACKEND
        assert response.headers["x-hedge-attempts"] == "1"
    assert echoed.headers["x-request-id"] == "client-req-42"
    assert GENERATED_ID.match(generated.headers["x-request-id"])
    first, second = up.requests
    # the upstream is told an id its logs line up with: the client's, mapped to a UUID (the
    # client's own beside it), or the gateway's own UUID as it is
    assert first.headers["x-request-id"] == upstream_request_id("client-req-42")
    assert first.headers["x-client-request-id"] == "client-req-42"
    assert second.headers["x-request-id"] == generated.headers["x-request-id"]


def test_error_responses_carry_the_request_id(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    up = scripted_upstream.one()
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    with raw_client() as client:
        echoed = client.post(
            gateway.url("/v1/chat/completions"), json={"model": "nope", "messages": MESSAGES},
            headers={"x-request-id": "client-req-43"},
        )
        generated = client.post(gateway.url("/v1/chat/completions"), content=b"[]",
                                headers={"content-type": "application/json"})
        no_route = client.get(gateway.url("/v1/nowhere"))
        wrong_method = client.get(gateway.url("/v1/chat/completions"))
    assert (no_route.status_code, no_route.json()["error"]["code"]) == (404, "not_found")
    assert (wrong_method.status_code, wrong_method.json()["error"]["code"]) == (
        405, "method_not_allowed")
    assert echoed.status_code == 404 and echoed.headers["x-request-id"] == "client-req-43"
    assert generated.status_code == 400
    assert GENERATED_ID.match(generated.headers["x-request-id"])
    assert up.requests == []


# ---- 4. request checks -----------------------------------------------------------------------

GOOD = {"model": POOL, "messages": MESSAGES}

#: raw body -> (param the error names, a phrase its message must hold)
INVALID_BODIES: dict[str, tuple[bytes, str | None, str]] = {
    "array": (b"[1, 2]", None, "JSON object"),
    "string": (b'"chat"', None, "JSON object"),
    "invalid_utf8": (
        b'{"model": "chat", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        None, "UTF-8",
    ),
    "nan": (b'{"model": "chat", "messages": [], "temperature": NaN}', None, "NaN"),
    "infinity": (b'{"model": "chat", "messages": [], "temperature": Infinity}', None, "Infinity"),
    "stream_yes": (json.dumps({**GOOD, "stream": "yes"}).encode(), "stream", "stream"),
    "negative_max_tokens": (
        json.dumps({**GOOD, "max_tokens": -1}).encode(), "max_tokens", "max_tokens"
    ),
    "model_not_a_string": (json.dumps({**GOOD, "model": 3}).encode(), "model", "model"),
    "no_messages": (json.dumps({"model": POOL}).encode(), "messages", "messages"),
    # 1e400 parses as infinity, which would be forwarded upstream as `Infinity` (not JSON)
    "float_overflow": (
        b'{"model": "chat", "messages": [], "temperature": -1e400}', None, "out of range"
    ),
    # deeper than the JSON parser's recursion limit, far below the size limit
    "deep_nesting": (
        b'{"model": "chat", "messages": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        None, "nested too deeply",
    ),
}


@pytest.mark.parametrize("case", list(INVALID_BODIES))
def test_invalid_bodies_are_refused_with_400_before_anything_goes_upstream(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory, case: str
) -> None:
    raw, param, phrase = INVALID_BODIES[case]
    up = scripted_upstream.one()
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    with raw_client() as client:
        response = client.post(
            gateway.url("/v1/chat/completions"), content=raw,
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert phrase in error["message"]
    assert up.requests == []


#: body -> the field path the 400 must name
FORBIDDEN: dict[str, tuple[dict[str, Any], str]] = {
    "api_base_top": ({**GOOD, "api_base": "http://evil.example/v1"}, "api_base"),
    "api_key_top": ({**GOOD, "api_key": "sk-someone-else"}, "api_key"),
    "extra_body_nested_base_url": (
        {**GOOD, "extra_body": {"nested": {"base_url": "http://evil.example/v1"}}},
        "extra_body.nested.base_url",
    ),
    "extra_body_list_url": (
        {**GOOD, "extra_body": {"targets": [{"ok": 1}, {"url": "http://evil.example"}]}},
        "extra_body.targets[1].url",
    ),
    # metadata is free-form (`headers` passes there), but not for credentials
    "metadata_api_key": (
        {**GOOD, "metadata": {"tenant": {"api_key": "sk-someone-else"}}},
        "metadata.tenant.api_key",
    ),
}


@pytest.mark.parametrize("case", list(FORBIDDEN))
def test_fields_that_could_route_or_authenticate_are_refused_naming_the_field(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory, case: str
) -> None:
    body, field = FORBIDDEN[case]
    up = scripted_upstream.one()
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    with raw_client() as client:
        response = client.post(gateway.url("/v1/chat/completions"), json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == field and field in error["message"]
    assert error["code"] == "forbidden_field"
    assert "evil.example" not in response.text
    assert up.requests == []


def test_the_upstream_receives_the_body_as_sent_but_for_the_model(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    """Message content is data: an image URL inside `messages` goes through untouched, and so
    does every other field, unknown ones included; only `model` becomes the backend's."""
    up = scripted_upstream.one()
    gateway = serve_gateway(asgi_server, one_backend(up.base_url))
    sent: dict[str, Any] = {
        "model": POOL,
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is on this picture? h\u00e9llo \u2713"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "https://images.example/cat.png?sig=a%2Fb",
                                      "detail": "low"},
                    },
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
                ],
            },
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.25,
        "top_p": 1,
        "max_tokens": 7,
        "seed": 3,
        "user": "user-1",
        "logit_bias": {"50256": -100},
        "metadata": {"trace": "abc"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "x_vendor_field": {"nested": [1, "two", None, True, 2.5]},
    }
    with raw_client() as client:
        response, _ = stream_chat_raw(client, gateway, body=sent)
    assert response.status_code == 200
    (rec,) = up.requests
    assert (rec.method, rec.path) == ("POST", "/v1/chat/completions")
    assert rec.headers["content-type"] == "application/json"
    assert rec.body == {**sent, "model": BACKEND_MODEL}
    image = rec.body["messages"][1]["content"][1]["image_url"]
    assert image == {"url": "https://images.example/cat.png?sig=a%2Fb", "detail": "low"}


def test_client_authorization_is_not_forwarded_and_the_backend_key_is_sent(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    keyed, keyless = scripted_upstream(2)
    with_key = serve_gateway(
        asgi_server,
        one_backend(keyed.base_url, api_key="sk-backend-key", gateway_keys=("gw-client-key",)),
    )
    without_key = serve_gateway(asgi_server, one_backend(keyless.base_url))
    with sdk(with_key.v1, api_key="gw-client-key") as client:
        chunks = client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world"
    with sdk(without_key.v1, api_key="sk-client-secret") as client:
        answer = client.chat.completions.create(model=POOL, messages=MESSAGES)
        assert answer.choices[0].message.content == "Hello world"
    (keyed_rec,) = keyed.requests
    assert keyed_rec.headers["authorization"] == "Bearer sk-backend-key"
    (keyless_rec,) = keyless.requests
    assert "authorization" not in keyless_rec.headers
    for rec, secret in ((keyed_rec, "gw-client-key"), (keyless_rec, "sk-client-secret")):
        assert not any(secret in value for value in rec.headers.values()), rec.headers
