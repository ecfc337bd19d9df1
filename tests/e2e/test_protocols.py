"""The Responses API and Anthropic Messages through the gateway, over real sockets:
scripted loopback upstreams, the gateway under uvicorn, the official `anthropic` and `openai`
SDKs as clients, unchanged. Each test ends with the automatic leak check."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Sequence

import anthropic
import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
    Timeouts,
)
from providers.sim.server import create_sim_app
from tests.harness import (
    AsgiServerFactory,
    Gate,
    Head,
    LoopThread,
    RecordedRequest,
    Script,
    ScriptedUpstream,
    Send,
    UpstreamFactory,
    Wait,
    error_script,
    json_script,
)
from tests.harness.builders import POOL, InOrder
from tests.harness.limits_kit import GatewayFactory
from tests.harness.protocol_wire import (
    SSE_HEADERS,
    anthropic_error,
    message_start,
    messages_script,
    response_obj,
    responses_script,
    text_block_start,
    text_delta,
)

KEY = "gateway-key"
MESSAGES: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]


def settings_for(backends: Sequence[BackendSettings], *, delay: float = 0.3,
                 timeout: float = 10.0, max_body: int | None = None,
                 translate: bool = True) -> Settings:
    server = ServerSettings(api_keys=(KEY,)) if max_body is None else ServerSettings(
        api_keys=(KEY,), max_body_bytes=max_body)
    pool = PoolSettings(
        name=POOL, backends=tuple(backends), timeout=timeout, timeouts=Timeouts(),
        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=delay)),
        translate=translate,
    )
    return Settings(pools=(pool,), server=server)


def anthropic_backends(upstreams: Sequence[ScriptedUpstream]) -> list[BackendSettings]:
    return [BackendSettings(name=f"b{i}", provider="anthropic", base_url=u.root_url,
                            api_key=f"sk-ant-{i}", model=f"claude-{i}", group=f"g{i}")
            for i, u in enumerate(upstreams)]


def openai_backends(upstreams: Sequence[ScriptedUpstream]) -> list[BackendSettings]:
    return [BackendSettings(name=f"b{i}", provider="openai", base_url=u.base_url,
                            api_key=f"sk-oai-{i}", model=f"gpt-{i}", group=f"g{i}")
            for i, u in enumerate(upstreams)]


def serve(asgi_server: AsgiServerFactory, settings: Settings) -> str:
    """The gateway's root URL (what the Anthropic SDK takes as base_url)."""
    return asgi_server(create_app(settings, seed=3)).base_url


def claude(root: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=20.0)


def gpt(root: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=root + "/v1", api_key=KEY, max_retries=0, timeout=20.0)


def owner(upstreams: Sequence[ScriptedUpstream], request: object) -> str:
    for i, upstream in enumerate(upstreams):
        if any(r is request for r in upstream.requests):
            return f"b{i}"
    raise AssertionError("request not found")


# --- the early-headers trap: the hedge wins, the loser is closed at once ------------------------


def test_messages_hedge_wins_the_early_headers_trap(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(messages_script(["late"], ttft=3.0), messages_script(["fast", " answer"]))
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(anthropic_backends(upstreams)))
    with claude(root) as client, client.messages.with_streaming_response.create(
        model=POOL, max_tokens=16, messages=MESSAGES, stream=True,
        extra_headers={"anthropic-beta": "tools-2024-04-04"},
    ) as response:
        headers = dict(response.headers)
        text = "".join(
            event.delta.text for event in response.parse()
            if event.type == "content_block_delta" and event.delta.type == "text_delta"
        )
    assert text == "fast answer"
    primary, hedge = order.arrivals
    assert headers["x-hedge-backend"] == owner(upstreams, hedge) != owner(upstreams, primary)
    # message_start and ping arrived at once, yet the primary never committed; it was closed
    # at commit: its upstream sees the close well inside the 3 s it would take to send its
    # token (the upstream's reader notices the hang-up on its own thread, so wait for it)
    primary_upstream = upstreams[int(owner(upstreams, primary)[1])]
    assert primary_upstream.wait_closed(primary, 2.5), "the loser was not closed at commit"
    assert primary.events_written == 3
    for request in (primary, hedge):
        assert request.path == "/v1/messages"
        index = owner(upstreams, request)[1]
        assert request.headers["x-api-key"] == f"sk-ant-{index}"
        assert request.headers["anthropic-version"] == "2023-06-01"
        assert request.headers["anthropic-beta"] == "tools-2024-04-04"
        assert "authorization" not in request.headers
        assert request.body["model"] == f"claude-{index}"
    # observability: the route is a label from a fixed set, in stats and metrics; the stats
    # are recorded once the stream has fully ended, so poll briefly
    deadline = time.monotonic() + 5.0
    while True:
        stats = httpx.get(f"{root}/hedge/stats").json()["pools"][POOL]["lifetime"]
        if stats["routes"]["messages"] == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert stats["routes"]["messages"] == 1 and stats["routes"]["chat/completions"] == 0
    metrics = httpx.get(f"{root}/metrics").text
    assert f'hedge_gateway_route_requests_total{{pool="{POOL}",route="messages"}} 1.0' in metrics


def test_responses_hedge_wins_the_early_headers_trap(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(responses_script(["late"], response_id="resp_slow", ttft=3.0),
                    responses_script(["fast", " answer"], response_id="resp_fast"),
                    json_script(response_obj("resp_1", "completed", "again")))
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(openai_backends(upstreams)))
    with gpt(root) as client:
        stream = client.responses.create(model=POOL, input="hi", store=False, stream=True)
        kinds, text, ids = [], "", set()
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.created", "response.completed"):
                ids.add(event.response.id)
    assert text == "fast answer"
    (made,) = ids  # the gateway's id for resp_fast, in every event that carries it
    assert made not in ("resp_fast", "resp_slow")
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    primary, hedge = order.arrivals
    primary_upstream = upstreams[int(owner(upstreams, primary)[1])]
    assert primary_upstream.wait_closed(primary, 2.5), "the loser was not closed at commit"
    assert primary.events_written == 4  # created, in_progress, item and part: no token
    assert hedge.path == "/v1/responses" and hedge.body["store"] is False
    # the winner's response id now routes follow-ups to the backend that made it
    with gpt(root) as client:
        again = client.responses.create(model=POOL, input="more", store=False,
                                        previous_response_id=made)
    assert again.id.startswith("resp_") and again.id not in (made, "resp_1")
    assert order.arrivals[2] in upstreams[int(owner(upstreams, hedge)[1])].requests
    assert order.arrivals[2].body["previous_response_id"] == "resp_fast"


def test_responses_that_store_are_not_hedged(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """The API stores by default: without `"store": false` a hedge would store twice."""
    order = InOrder(responses_script(["only"], ttft=0.8), responses_script(["hedge"]))
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(openai_backends(upstreams), delay=0.05))
    with gpt(root) as client:
        events = list(client.responses.create(model=POOL, input="hi", stream=True))
    assert events[-1].type == "response.completed"
    assert len(order.arrivals) == 1


# --- stored responses: id -> backend ------------------------------------------------------------


def test_stored_response_operations_go_to_the_backend_that_made_it(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    def responder(request: object) -> Script:
        path = getattr(request, "path", "")
        method = getattr(request, "method", "")
        if method == "DELETE":
            body = {"id": "resp_9", "object": "response.deleted", "deleted": True}
        elif path.endswith("/input_items"):
            body = {"object": "list", "data": [], "first_id": None, "last_id": None,
                    "has_more": False}
        else:
            body = response_obj("resp_9", "completed", "stored")
        raw = json.dumps(body).encode()
        return Script(headers={"content-type": "application/json"},
                      steps=[Head(), Send(raw)], framing="length")

    upstreams = scripted_upstream(2, responder=responder)
    root = serve(asgi_server, settings_for(openai_backends(upstreams)))
    with gpt(root) as client:
        made = client.responses.create(model=POOL, input="hi")
        maker = next(u for u in upstreams if u.requests)
        assert client.responses.retrieve(made.id).output_text == "stored"
        client.responses.input_items.list(made.id, limit=5)
        assert client.responses.cancel(made.id).id == made.id
        client.responses.delete(made.id)
    paths = [(r.method, r.path, r.query) for r in maker.requests]
    assert paths[1:] == [("GET", "/v1/responses/resp_9", ""),
                         ("GET", "/v1/responses/resp_9/input_items", "limit=5"),
                         ("POST", "/v1/responses/resp_9/cancel", ""),
                         ("DELETE", "/v1/responses/resp_9", "")]
    assert sum(len(u.requests) for u in upstreams) == 5
    assert made.id != "resp_9"  # the client sees the gateway's id, the upstream its own


def test_unknown_previous_response_id_is_404(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    upstreams = scripted_upstream(1)
    root = serve(asgi_server, settings_for(openai_backends(upstreams)))
    with gpt(root) as client, pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=POOL, input="hi", previous_response_id="resp_nope")
    assert caught.value.body["code"] == "response_not_found"  # type: ignore[index]
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert not upstreams[0].requests


# --- failures in each protocol's shape ----------------------------------------------------------


def test_messages_error_event_before_the_first_token_fails_over(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    broken = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(message_start()), Send(anthropic_error("overloaded_error"))])
    order = InOrder(broken, messages_script(["second"]))
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(anthropic_backends(upstreams), delay=5.0))
    with claude(root) as client, client.messages.stream(
        model=POOL, max_tokens=8, messages=MESSAGES
    ) as stream:
        assert "".join(stream.text_stream) == "second"
    assert len(order.arrivals) == 2


def test_messages_errors_are_anthropic_shaped(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Under the production server (its lingering close lets a client that is still uploading
    read the 413)."""
    cut = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(message_start()), Send(text_block_start()), Send(text_delta("part"))])
    upstreams = scripted_upstream(1, responder=lambda request: cut)
    settings = settings_for(anthropic_backends(upstreams), max_body=2048)
    root = GatewayFactory(loop_thread)(settings).root
    with claude(root) as client:
        with pytest.raises(anthropic.NotFoundError) as not_found:
            client.messages.create(model="no-such-pool", max_tokens=8, messages=MESSAGES)
        assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=POOL, max_tokens=8, messages=MESSAGES,
                                   extra_body={"base_url": "http://elsewhere"})
        with pytest.raises(anthropic.APIStatusError) as too_large:
            client.messages.create(model=POOL, max_tokens=8,
                                   messages=[{"role": "user", "content": "x" * 4096}])
        assert too_large.value.status_code == 413
        with pytest.raises(anthropic.APIStatusError) as truncated, client.messages.stream(
            model=POOL, max_tokens=8, messages=MESSAGES
        ) as stream:
            "".join(stream.text_stream)
        assert truncated.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        assert "stream_truncated" in truncated.value.body["error"]["message"]  # type: ignore[index]
    with claude(root, key="wrong") as client, pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model=POOL, max_tokens=8, messages=MESSAGES)
    # Bearer works too on /v1/messages
    answer = httpx.post(f"{root}/v1/messages/nothing-here",
                        headers={"authorization": f"Bearer {KEY}"}, json={})
    assert answer.status_code == 404
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "not_found_error"


def test_messages_first_token_timeout_is_a_timeout_error(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    upstreams = scripted_upstream(1, responder=lambda r: messages_script(["late"], ttft=5.0))
    root = serve(asgi_server, settings_for(anthropic_backends(upstreams), timeout=0.5))
    with claude(root) as client, pytest.raises(anthropic.APIStatusError) as caught, \
            client.messages.stream(model=POOL, max_tokens=8, messages=MESSAGES) as stream:
        "".join(stream.text_stream)
    assert caught.value.status_code == 504
    assert caught.value.body["error"]["type"] == "timeout_error"  # type: ignore[index]


def test_truncated_responses_stream_ends_with_an_error_event(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    upstreams = scripted_upstream(1, responder=lambda r: responses_script(["cut"], end=False))
    root = serve(asgi_server, settings_for(openai_backends(upstreams)))
    with gpt(root) as client:
        events = list(client.responses.create(model=POOL, input="hi", store=False,
                                              stream=True))
    assert events[-1].type == "error"
    assert events[-1].code == "stream_truncated"


def test_a_route_without_backends_is_404_naming_it(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """In a pool that keeps each request on its own API (`translate: false`; a translating
    pool would send the chat request to the Messages backend, translated)."""
    upstreams = scripted_upstream(1)
    root = serve(asgi_server, settings_for(anthropic_backends(upstreams), translate=False))
    with gpt(root) as client, pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=POOL, messages=[{"role": "user", "content": "x"}])
    assert "/v1/chat/completions" in caught.value.message
    assert not upstreams[0].requests


# --- upstream shapes: classic Azure ---------------------------------------------------------------


def test_classic_azure_shape_sends_api_key_query_and_headers(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    (upstream,) = scripted_upstream(1, responder=lambda r: responses_script(["ok"]))
    backend = BackendSettings(
        name="azure", provider="openai", base_url=f"{upstream.root_url}/openai/deployments/gpt",
        api_key="az-secret", auth="api-key", query=(("api-version", "2024-10-21"),),
        headers=(("x-team", "search"),),
    )
    root = serve(asgi_server, settings_for([backend]))
    with gpt(root) as client:
        list(client.responses.create(model=POOL, input="hi", store=False, stream=True))
    (request,) = upstream.requests
    assert request.path == "/openai/deployments/gpt/responses"
    assert request.query == "api-version=2024-10-21"
    assert request.headers["api-key"] == "az-secret"
    assert request.headers["x-team"] == "search"
    assert "authorization" not in request.headers


# --- the simulator speaks both protocols, trap included -----------------------------------------


def test_simulator_trap_in_both_protocols_the_hedge_wins(
    asgi_server: AsgiServerFactory,
) -> None:
    """Two loopback simulators, one whose first text comes 5 s after its scaffolding: whichever
    is the primary, the answer comes from the fast one and the slow one's streams are cut.
    (Each protocol on its own backends, `translate: false`: the fast one is `a1` for
    Messages and `b1` for the Responses API.)"""
    slow = SimProfile(ttft_median=5.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=3)
    fast = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=3)
    sims = [asgi_server(create_sim_app(profile, seed=1)) for profile in (slow, fast)]
    backends = [BackendSettings(name=f"b{i}", provider="openai",
                                base_url=sim.v1, model="m", group=f"g{i}")
                for i, sim in enumerate(sims)]
    anthropic_side = [BackendSettings(name=f"a{i}", provider="anthropic", base_url=sim.base_url,
                                      model="m", group=f"g{i}") for i, sim in enumerate(sims)]
    root = serve(asgi_server, settings_for([*backends, *anthropic_side], delay=0.2,
                                           translate=False))
    with claude(root) as client:
        for _ in range(2):
            with client.messages.with_streaming_response.create(
                model=POOL, max_tokens=8, messages=MESSAGES, stream=True
            ) as response:
                assert response.headers["x-hedge-backend"] == "a1"
                assert sum(1 for _ in response.parse()) > 3
        assert client.messages.count_tokens(model=POOL, messages=MESSAGES).input_tokens == 1
    with gpt(root) as client:
        for _ in range(2):
            with client.responses.with_streaming_response.create(
                model=POOL, input="hi", store=False, stream=True
            ) as response:
                assert response.headers["x-hedge-backend"] == "b1"
                kinds = [event.type for event in response.parse()]
            assert kinds[-1] == "response.completed"
    slow_stats = httpx.get(sims[0].url("/sim/stats")).json()
    assert slow_stats["streams_completed"] == 0
    assert slow_stats["streams_closed_early"] == slow_stats["streams_started"]


# --- more upstream shapes: JSON bodies, count_tokens, an egress proxy --------------------------


def test_messages_json_and_count_tokens_through_the_anthropic_provider(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    def responder(request: RecordedRequest) -> Script:
        if request.path.endswith("/count_tokens"):
            return json_script({"input_tokens": 7})
        return json_script({"id": "msg_9", "type": "message", "role": "assistant",
                            "model": "claude-0", "stop_reason": "end_turn",
                            "stop_sequence": None,
                            "content": [{"type": "text", "text": "whole answer"}],
                            "usage": {"input_tokens": 3, "output_tokens": 2}})

    upstreams = scripted_upstream(2, responder=responder)
    # the JSON body's path: backends that continue nothing, so a whole answer is read as
    # one body (where they continue, it is read as a stream: test_whole_continuations.py)
    backends = [dataclasses.replace(b, continuation="none")
                for b in anthropic_backends(upstreams)]
    root = serve(asgi_server, settings_for(backends, delay=5.0))
    with claude(root) as client:
        message = client.messages.create(model=POOL, max_tokens=8, messages=MESSAGES)
        counted = client.messages.count_tokens(model=POOL, messages=MESSAGES)
    assert message.content[0].type == "text" and message.content[0].text == "whole answer"
    assert counted.input_tokens == 7
    requests = [r for u in upstreams for r in u.requests]
    assert sorted(r.path for r in requests) == ["/v1/messages", "/v1/messages/count_tokens"]
    counting = next(r for r in requests if r.path.endswith("count_tokens"))
    assert counting.body["model"] in ("claude-0", "claude-1")


def test_a_stored_responses_request_still_fails_over_before_its_first_token(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(error_script(503), responses_script(["after failover"]))
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(openai_backends(upstreams), delay=5.0))
    with gpt(root) as client:
        events = list(client.responses.create(model=POOL, input="hi", stream=True))
    assert events[-1].type == "response.completed"
    assert len(order.arrivals) == 2
    assert owner(upstreams, order.arrivals[0]) != owner(upstreams, order.arrivals[1])


def test_a_backend_proxy_carries_its_requests(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """`proxy:` sends the backend's requests through an egress proxy (here a scripted upstream
    that answers as the proxy would), on the backend's own client."""
    (proxy,) = scripted_upstream(1, responder=lambda r: responses_script(["via proxy"]))
    backend = BackendSettings(name="far", provider="openai",
                              base_url="http://upstream.invalid:8000/v1", api_key="k",
                              proxy=proxy.root_url)
    root = serve(asgi_server, settings_for([backend]))
    with gpt(root) as client:
        events = list(client.responses.create(model=POOL, input="hi", store=False,
                                              stream=True))
    assert events[-1].type == "response.completed"
    (request,) = proxy.requests
    assert request.path == "http://upstream.invalid:8000/v1/responses"  # absolute form
    assert request.headers["authorization"] == "Bearer k"


def test_messages_overload_is_an_overloaded_error(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """The gateway at its concurrency cap answers /v1/messages with Anthropic's
    `overloaded_error` (and the retry headers), not the OpenAI shape."""
    gate = Gate()
    held = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(message_start()), Wait(gate), *[Send(b) for b in (text_delta("x"),)]])
    (upstream,) = scripted_upstream(1, responder=lambda r: held)
    settings = settings_for(anthropic_backends([upstream]))
    settings = Settings(pools=settings.pools, server=ServerSettings(
        api_keys=(KEY,), max_concurrent_requests=1))
    root = serve(asgi_server, settings)
    outcome: list[object] = []

    def first() -> None:
        with claude(root) as client:
            try:  # held before its first token until the gate opens; then cut short
                outcome.extend(client.messages.create(model=POOL, max_tokens=8,
                                                      messages=MESSAGES, stream=True))
            except anthropic.APIError as exc:
                outcome.append(exc)

    worker = threading.Thread(target=first)
    worker.start()
    try:
        assert upstream.wait_requests(1)
        with claude(root) as client, pytest.raises(anthropic.APIStatusError) as caught:
            client.messages.create(model=POOL, max_tokens=8, messages=MESSAGES)
        assert caught.value.status_code == 503
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "overloaded_error"
        assert body["error"]["message"].startswith("the gateway is at its concurrency limit")
        assert caught.value.response.headers["retry-after"]
    finally:
        gate.open()
        worker.join(10)


def test_the_backend_holding_a_response_answers_its_404_itself(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """The one backend that made a response says it no longer has it: the client gets that
    404, not a 502, and no other backend is asked."""
    made = json_script(response_obj("resp_7", "completed", "stored"))
    order = InOrder(made, error_script(404, "no such response"))
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(openai_backends(upstreams)))
    with gpt(root) as client:
        response = client.responses.create(model=POOL, input="hi")
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.retrieve(response.id)
    assert caught.value.body["code"] == "upstream_rejected_request"  # type: ignore[index]
    maker, getter = order.arrivals
    assert owner(upstreams, maker) == owner(upstreams, getter)


def test_both_sdks_list_the_pools_each_in_its_own_shape(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """`GET /v1/models` answers OpenAI's list, or Anthropic's page when the request carries
    `anthropic-version`: each SDK parses the pools with its own types."""
    upstreams = scripted_upstream(1)
    root = serve(asgi_server, settings_for(anthropic_backends(upstreams)))
    with claude(root) as client:
        page = client.models.list()
        assert [m.id for m in page.data] == [POOL]
        assert page.data[0].type == "model" and page.data[0].display_name == POOL
        assert page.has_more is False
    with gpt(root) as client:
        assert [(m.id, m.object) for m in client.models.list()] == [(POOL, "model")]
    assert not any(u.requests for u in upstreams)
