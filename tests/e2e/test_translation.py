"""One pool, any API: Chat Completions and Messages clients against a pool of one Chat-only
and one Messages-only backend, over real sockets, with the official SDKs.

Each backend is a loopback simulator behind the real adapter of its API (`openai` narrowed to
`apis: [chat]`, `anthropic`), and the simulator checks each request as the real API would
(a translated body it would refuse fails the test). The backend that speaks the client's own
API is the slow one (its first token after 5 s) and the pool hedges after 200 ms, so every
answer comes from the other API's backend, translated; the first request of each test is
sent until the slow backend was its primary, so that answer is a hedged race between a Chat
and a Messages backend, won by the translated hedge, its loser cut. Then the tool's result
goes back and the answer is text: a tool round trip in the client's own shape.

`test_every_translated_route_answers_in_its_own_shape` is generated from the route table
(`gateway.api.inference.INFERENCE_ROUTES`) and the translations: a route or a translation
added there is tried here, streamed and whole, with the route matrix's own answer check.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

import gateway.app as gateway_app
from gateway.api.inference import INFERENCE_ROUTES, InferenceRoute
from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    Settings,
)
from gateway.wire.paths import Endpoint
from gateway.wire.translate.routes import TRANSLATIONS
from providers.sim.server import create_sim_app
from tests.e2e.test_route_matrix import check_answer
from tests.e2e.test_sim_tools import (
    FAST,
    QUESTION,
    SLOW,
    Forecast,
    Heard,
    check_the_loser_was_cut,
    claude,
    gpt,
    slow_primary,
    stats,
)
from tests.harness import AsgiServerFactory, RunningServer, UpstreamFactory
from tests.harness.bodies import chat_completion_obj, error_script, json_script, smallest_body
from tests.harness.protocol_wire import (
    SSE_HEADERS,
    anthropic_error,
    message_start,
    text_block_start,
    text_delta,
)
from tests.harness.scripts import Head, Script, Send

POOL = "tools"


def mixed_pool(asgi_server: AsgiServerFactory, slow: str, *, translate: bool = True
               ) -> tuple[list[RunningServer], RunningServer]:
    """A gateway over a Chat-only backend (`chat`) and a Messages-only one (`messages`);
    `slow` names the one whose simulator takes 5 s to its first token (it is `sims[0]`)."""
    slow_sim, fast_sim = (asgi_server(create_sim_app(p, seed=1)) for p in (SLOW, FAST))
    sim_of = {slow: slow_sim, ("messages" if slow == "chat" else "chat"): fast_sim}
    backends = (
        BackendSettings(name="chat", provider="openai", base_url=sim_of["chat"].v1,
                        model="m", group="g0", apis=("chat",)),
        BackendSettings(name="messages", provider="anthropic",
                        base_url=sim_of["messages"].base_url, model="m", group="g1"),
    )
    pool = PoolSettings(name=POOL, backends=backends, timeout=20.0, translate=translate,
                        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=0.2)))
    gateway = asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=5))
    return [slow_sim, fast_sim], gateway


def check_counted(gateway: RunningServer, name: str) -> None:
    """Every translated request of the test is counted under `name` in /hedge/stats and
    /metrics (the requests before it, sent until the race ran, included), the other
    direction under its own, and the dashboard's series carries the rate of each."""
    other = "messages->chat" if name == "chat->messages" else "chat->messages"
    deadline = time.monotonic() + 5.0  # a request is recorded just after its answer is out
    while True:
        pool = httpx.get(gateway.url("/hedge/stats"), timeout=5.0).json()["pools"][POOL]
        counted = pool["lifetime"]["translated"]
        settled = pool["inflight_requests"] == 0 and counted[name] >= 2
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert counted[name] == pool["lifetime"]["requests"] >= 2
    assert sum(counted.values()) == counted[name]
    metrics = httpx.get(gateway.url("/metrics"), timeout=5.0).text
    line = (f'hedge_gateway_translated_requests_total{{pool="{POOL}",translation="{name}"}} '
            f"{float(counted[name])}")
    assert line in metrics.splitlines()
    series = httpx.get(gateway.url("/hedge/series"), timeout=5.0).json()["pools"][POOL]
    assert {name, other} <= set(series[-1]["translated"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_chat_client_round_trips_a_tool_through_a_messages_backend(
    asgi_server: AsgiServerFactory, stream: bool,
) -> None:
    sims, gateway = mixed_pool(asgi_server, slow="chat")
    tool = openai.pydantic_function_tool(Forecast)
    asked: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": QUESTION}]

    def send(headers: dict[str, str], messages: list[Any]) -> tuple[dict[str, str], Any]:
        heard = Heard()
        with gpt(gateway, heard) as client:
            if stream:
                with client.chat.completions.stream(
                    model=POOL, messages=messages, tools=[tool], extra_headers=headers,
                    stream_options={"include_usage": True},
                ) as events:
                    for _ in events:
                        pass
                    return heard.headers, events.get_final_completion()
            answer = client.chat.completions.create(
                model=POOL, messages=messages, tools=[tool], extra_headers=headers)
            return heard.headers, answer

    headers, first = slow_primary(sims, lambda h: send(h, asked))
    assert headers["x-hedge-backend"] == "messages"
    assert headers["x-hedge-translated"] == "chat->messages"
    assert headers["x-hedge-attempts"] == "2"  # the race ran: the slow Chat primary lost
    if stream:
        check_the_loser_was_cut(sims)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "Forecast"
    Forecast.model_validate_json(call.function.arguments)
    assert first.usage is not None and first.usage.completion_tokens > 0
    headers, reply = send({}, [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny all week"}])
    assert headers["x-hedge-translated"] == "chat->messages"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    check_counted(gateway, "chat->messages")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_messages_client_round_trips_a_tool_through_a_chat_backend(
    asgi_server: AsgiServerFactory, stream: bool,
) -> None:
    sims, gateway = mixed_pool(asgi_server, slow="messages")
    tools: list[anthropic.types.ToolParam] = [
        {"name": "forecast", "description": "the forecast",
         "input_schema": Forecast.model_json_schema()}]
    asked: list[anthropic.types.MessageParam] = [{"role": "user", "content": QUESTION}]

    def send(headers: dict[str, str], messages: list[Any]) -> tuple[Any, Any]:
        with claude(gateway) as client:
            if stream:
                with client.messages.stream(
                    model=POOL, max_tokens=512, tools=tools, messages=messages,
                    extra_headers=headers,
                ) as events:
                    kinds = [event.type for event in events]
                    assert kinds[-1] == "message_stop"
                    return events.response.headers, events.get_final_message()
            raw = client.messages.with_raw_response.create(
                model=POOL, max_tokens=512, tools=tools, messages=messages,
                extra_headers=headers)
            return raw.headers, raw.parse()

    headers, first = slow_primary(sims, lambda h: send(h, asked))
    assert headers["x-hedge-backend"] == "chat"
    assert headers["x-hedge-translated"] == "messages->chat"
    assert headers["x-hedge-attempts"] == "2"
    if stream:
        check_the_loser_was_cut(sims)
    assert first.stop_reason == "tool_use"
    (block,) = [b for b in first.content if b.type == "tool_use"]
    assert block.name == "forecast"
    Forecast.model_validate(block.input)  # accumulated from the translated deltas
    assert first.usage.output_tokens > 0
    headers, reply = send({}, [
        *asked,
        {"role": "assistant", "content": [{"type": "tool_use", "id": block.id,
                                           "name": block.name, "input": block.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                      "content": "sunny"}]}])
    assert headers["x-hedge-translated"] == "messages->chat"
    assert reply.stop_reason == "end_turn" and reply.content[0].type == "text"
    check_counted(gateway, "messages->chat")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(("slow", "via"), [("messages", "responses->chat"),
                                           ("chat", "responses->messages")],
                         ids=["to-chat", "to-messages"])
def test_responses_client_without_stored_state_round_trips_a_tool(
    asgi_server: AsgiServerFactory, stream: bool, slow: str, via: str,
) -> None:
    """A Responses client (`store: false`, the whole input each turn) against the pool of a
    Chat-only and a Messages-only backend: neither speaks its API, both are reached by
    translation (Messages through Chat), and the answer is in the Responses shape."""
    _sims, gateway = mixed_pool(asgi_server, slow=slow)
    tool = openai.pydantic_responses_function_tool(Forecast)
    winner = "chat" if slow == "messages" else "messages"

    def send(conversation: Any) -> tuple[dict[str, str], Any]:
        heard = Heard()
        with gpt(gateway, heard) as client:
            if stream:
                with client.responses.stream(model=POOL, input=conversation, tools=[tool],
                                             store=False) as events:
                    kinds = [event.type for event in events]
                    assert kinds[:2] == ["response.created", "response.in_progress"]
                    assert kinds[-1] == "response.completed"
                    return heard.headers, events.get_final_response()
            answer = client.responses.create(model=POOL, input=conversation, tools=[tool],
                                             store=False)
            return heard.headers, answer

    headers, first = send(QUESTION)
    assert (headers["x-hedge-backend"], headers["x-hedge-translated"]) == (winner, via)
    assert first.status == "completed"
    (item,) = [o for o in first.output if o.type == "function_call"]
    assert item.name == "Forecast"
    Forecast.model_validate_json(item.arguments)
    assert first.usage is not None and first.usage.output_tokens > 0
    headers, after = send([
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": item.call_id, "name": item.name,
         "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}])
    assert headers["x-hedge-translated"] == via
    assert after.output[0].type == "message" and after.output_text


def test_a_stored_responses_request_stays_with_responses_backends(
    asgi_server: AsgiServerFactory,
) -> None:
    """`store: true` (the Responses API's default) makes state only a Responses backend
    keeps: a pool without one refuses it, naming `store`."""
    _sims, gateway = mixed_pool(asgi_server, slow="chat")
    with gpt(gateway) as client, pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=POOL, input="hi")
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "store"


def test_a_field_no_backend_can_carry_is_refused_naming_it(
    asgi_server: AsgiServerFactory,
) -> None:
    """n > 1 reaches the Chat backend (its own API); in a pool whose only Chat backend is
    gone from the route (a Messages-only pool), it is a 400 naming `n`, in Chat's shape."""
    slow, fast = (asgi_server(create_sim_app(p, seed=1)) for p in (SLOW, FAST))
    del slow
    pool = PoolSettings(name=POOL, timeout=20.0, backends=(
        BackendSettings(name="messages", provider="anthropic", base_url=fast.base_url,
                        model="m"),))
    gateway = asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=5))
    with gpt(gateway) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=POOL, n=2,
                                       messages=[{"role": "user", "content": "hi"}])
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "n"
    assert error["code"] == "untranslatable_field"
    assert caught.value.response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_paused_backend_serves_in_panic_what_the_other_api_cannot_carry(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory, stream: bool,
) -> None:
    """`n: 2` in a mixed pool: only the Chat backend carries it. Its 429 with Retry-After
    pauses it; the Messages backend is healthy but out of this request's pool (its
    translation refuses it), so the failover finds the request's pool in panic and the
    paused Chat backend serves it, rather than the request failing for want of a backend."""
    chat = scripted_upstream.one()
    chat.queue(error_script(429, "slow down", headers={"retry-after": "30"}))
    messages = asgi_server(create_sim_app(FAST, seed=1))
    backends = (
        BackendSettings(name="chat", provider="openai", base_url=chat.base_url, model="m",
                        group="g0", apis=("chat",)),
        BackendSettings(name="messages", provider="anthropic", base_url=messages.base_url,
                        model="m", group="g1"),
    )
    pool = PoolSettings(name=POOL, backends=backends, timeout=20.0)
    gateway = asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=5))
    question: Any = [{"role": "user", "content": "hi"}]
    heard = Heard()
    with gpt(gateway, heard) as client:
        if stream:
            assert list(client.chat.completions.create(model=POOL, n=2, messages=question,
                                                       stream=True))
        else:
            assert client.chat.completions.create(model=POOL, n=2, messages=question).choices
    assert heard.headers["x-hedge-backend"] == "chat"
    assert heard.headers["x-hedge-attempts"] == "2"  # the 429, then the same backend again
    assert len(chat.requests) == 2 and stats(messages)["requests"] == 0


def test_a_hedge_the_other_api_cannot_carry_is_suppressed_once_as_max_attempts(
    asgi_server: AsgiServerFactory,
) -> None:
    """`min_p` in a mixed pool whose Chat backend is slow (5 s to its first token, hedges due
    every 0.2 s): the Messages backend, whose translation refuses the request, is out of
    the request's pool, so its one attempt is all `max_attempts` allows. The hedges that
    fall due are suppressed once, as `max_attempts` (the timer then stops), never counted
    as `no_backend` at each delay."""
    sims, gateway = mixed_pool(asgi_server, slow="chat")
    heard = Heard()
    with gpt(gateway, heard) as client:
        answer = client.chat.completions.create(
            model=POOL, messages=[{"role": "user", "content": "hi"}],
            extra_body={"min_p": 0.1})
    assert answer.choices and heard.headers["x-hedge-backend"] == "chat"
    assert heard.headers["x-hedge-attempts"] == "1"
    deadline = time.monotonic() + 5.0
    while True:  # a request is counted once it has fully ended
        pool = httpx.get(gateway.url("/hedge/stats"), timeout=5.0).json()["pools"][POOL]
        if pool["lifetime"]["requests"] == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    suppressed = {k: v for k, v in pool["lifetime"]["hedges"]["suppressed"].items() if v}
    assert suppressed == {"max_attempts": 1}
    assert stats(sims[1])["requests"] == 0
    del sims


@pytest.mark.parametrize("translated_only", [False, True], ids=["mixed", "messages-only"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_body_a_translation_could_not_read_is_a_400_before_any_attempt(
    asgi_server: AsgiServerFactory, translated_only: bool, stream: bool,
) -> None:
    """`"messages": 5` (a shape no API takes, which the Messages translation cannot read)
    is refused by the gateway's body check, a 400 naming `messages` in Chat's shape, before
    any backend is asked: never a translation failing inside routing or the race."""
    sims, gateway = mixed_pool(asgi_server, slow="chat")
    if translated_only:
        pool = PoolSettings(name=POOL, timeout=20.0, backends=(
            BackendSettings(name="messages", provider="anthropic", base_url=sims[1].base_url,
                            model="m"),))
        gateway = asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=5))
    before = [stats(sim)["requests"] for sim in sims]
    with gpt(gateway) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=POOL, messages=[], stream=stream,
                                       extra_body={"messages": 5})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "messages"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert [stats(sim)["requests"] for sim in sims] == before


class CountedTranslations:
    """The route table with `chat->messages`'s request translation counted (each call)."""

    def __init__(self) -> None:
        self.calls = 0
        key: tuple[Endpoint, Endpoint] = ("chat/completions", "messages")
        translation = TRANSLATIONS[key]

        def request(body: Any) -> dict[str, Any]:
            self.calls += 1
            return translation.request(body)

        self.table = {**TRANSLATIONS, key: dataclasses.replace(translation, request=request)}


def test_a_request_its_own_api_s_backend_answers_is_never_translated(
    asgi_server: AsgiServerFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a mixed pool, a chat request whose race the Chat backend wins alone (its first
    token before any hedge: the Messages backend is the slow one) pays no translation: the
    body is translated only for an attempt sent to the Messages backend, once."""
    counted = CountedTranslations()
    monkeypatch.setattr(gateway_app, "TRANSLATIONS", counted.table)
    sims, gateway = mixed_pool(asgi_server, slow="messages")
    native = translated = 0
    for key in range(12):
        before, heard = counted.calls, Heard()
        with gpt(gateway, heard) as client:
            client.chat.completions.create(
                model=POOL, messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-session-id": f"lazy-{key}"})
        if heard.headers["x-hedge-attempts"] == "1":  # the Chat primary won alone
            assert heard.headers["x-hedge-backend"] == "chat"
            assert counted.calls == before
            native += 1
        else:  # the slow Messages backend was the primary: translated for it, once
            assert counted.calls == before + 1
            translated += 1
        if native and translated:
            break
    assert native, "the Chat backend was never the primary"
    del sims


def test_a_request_the_other_api_cannot_carry_is_never_sent_there(
    asgi_server: AsgiServerFactory,
) -> None:
    """`min_p` (a Chat server's extension) in a mixed pool: when the race picks the
    Messages backend (its translation refuses the request), it passes it over for the Chat
    one, however slow that is: no attempt and no hedge goes to the Messages backend."""
    sims, gateway = mixed_pool(asgi_server, slow="chat")
    before = stats(sims[1])["requests"]
    for key in range(3):
        heard = Heard()
        with gpt(gateway, heard) as client:
            answer = client.chat.completions.create(
                model=POOL, messages=[{"role": "user", "content": "hi"}],
                extra_body={"min_p": 0.1}, extra_headers={"x-session-id": f"refused-{key}"})
        assert heard.headers["x-hedge-backend"] == "chat"
        assert heard.headers["x-hedge-attempts"] == "1"
        assert "x-hedge-translated" not in heard.headers
        assert answer.choices
    assert stats(sims[1])["requests"] == before


def test_translate_false_keeps_each_request_on_its_own_api(
    asgi_server: AsgiServerFactory,
) -> None:
    """With `translate: false` a Messages client reaches only the Messages backend, however
    slow it is (5 s to its first token): no hedge goes to the Chat one."""
    sims, gateway = mixed_pool(asgi_server, slow="messages", translate=False)
    with claude(gateway) as client:
        raw = client.messages.with_raw_response.create(
            model=POOL, max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-hedge-backend"] == "messages"
    assert raw.headers["x-hedge-attempts"] == "1"
    assert "x-hedge-translated" not in raw.headers
    assert raw.parse().type == "message"
    del sims


def test_a_messages_backend_s_errors_reach_a_chat_client_in_its_shape(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory,
) -> None:
    """A scripted Messages upstream, a Chat client: its 429 is the client's 429 in OpenAI's
    shape with the upstream's retry advice, and its `error` event after the first token ends
    the client's stream with an error chunk the SDK raises; what it was sent is a Messages
    request."""
    busy = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    scripts = iter([
        json_script(busy, 429, headers={"retry-after": "7"}),
        Script(headers=SSE_HEADERS, steps=[
            Head(), Send(message_start()), Send(text_block_start()), Send(text_delta("Hi")),
            Send(anthropic_error("overloaded_error", "Overloaded"))]),
    ])
    (upstream,) = scripted_upstream(1, responder=lambda _request: next(scripts))
    pool = PoolSettings(name=POOL, timeout=20.0, backends=(
        BackendSettings(name="messages", provider="anthropic", base_url=upstream.root_url,
                        api_key="sk-ant-x", model="claude"),))
    gateway = asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=5))
    asked: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with gpt(gateway) as client:
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model=POOL, messages=asked)
        assert limited.value.response.headers["retry-after"] == "7"
        body = limited.value.body
        assert isinstance(body, dict) and body["type"] == "rate_limit_error"  # OpenAI's shape
        seen: list[str] = []
        with pytest.raises(openai.APIError) as cut:
            for chunk in client.chat.completions.create(model=POOL, messages=asked,
                                                         stream=True):
                seen += [c.delta.content or "" for c in chunk.choices]
        assert "".join(seen) == "Hi"  # the token before the error, then the error
        assert "Overloaded" in cut.value.message
    sent = upstream.requests[0]
    assert sent.path == "/v1/messages" and sent.body["model"] == "claude"
    assert sent.body["system"] == [{"type": "text", "text": "be brief"}]
    assert sent.body["max_tokens"] == 4096


def test_a_translated_attempt_is_sent_the_client_s_forwarded_headers(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory,
) -> None:
    """The deadline's `x-slo-ttft-ms` reaches a backend of the other API as it reaches one of
    the client's own; `anthropic-beta`, which only Messages reads, stays behind on the way
    to a Chat backend. The OpenAI SDK to a Messages backend, the Anthropic SDK to a Chat one."""
    messages_up, chat_up = scripted_upstream(2, responder=lambda request: (
        json_script({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
                     "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                     "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}})
        if request.path == "/v1/messages" else json_script(chat_completion_obj("ok"))))
    pools = (
        PoolSettings(name="claude", timeout=20.0, backends=(
            BackendSettings(name="messages", provider="anthropic", base_url=messages_up.root_url,
                            api_key="sk-ant-x", model="claude"),)),
        PoolSettings(name="gpt", timeout=20.0, backends=(
            BackendSettings(name="chat", provider="openai", base_url=chat_up.base_url,
                            model="m", apis=("chat",)),)))
    gateway = asgi_server.build(lambda: create_app(Settings(pools=pools), seed=5))
    with gpt(gateway) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="claude", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-slo-ttft-ms": "300"})
    assert raw.headers["x-hedge-translated"] == "chat->messages"
    assert raw.parse().choices[0].message.content == "ok"
    with claude(gateway) as anthropic_client:
        answer = anthropic_client.messages.with_raw_response.create(
            model="gpt", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-slo-ttft-ms": "250", "anthropic-beta": "tools-2024-04-04"})
    assert answer.headers["x-hedge-translated"] == "messages->chat"
    assert answer.parse().content[0].type == "text"
    (to_messages,), (to_chat,) = messages_up.requests, chat_up.requests
    assert to_messages.path == "/v1/messages"
    assert to_messages.headers.get("x-slo-ttft-ms") == "300"
    assert to_chat.path.endswith("/chat/completions")
    assert to_chat.headers.get("x-slo-ttft-ms") == "250"
    assert "anthropic-beta" not in to_chat.headers


# --- every translated route, generated from the route table and the translations -------------

#: each backend route a translation reaches, as a backend that serves only it
_ONLY: dict[str, Callable[[RunningServer], BackendSettings]] = {
    "chat/completions": lambda sim: BackendSettings(
        name="only", provider="openai", base_url=sim.v1, model="m", apis=("chat",)),
    "messages": lambda sim: BackendSettings(
        name="only", provider="anthropic", base_url=sim.base_url, model="m"),
}
MATRIX = [
    pytest.param(route, backend, stream,
                 id=f"{route.path} {'stream' if stream else 'whole'} -> {backend}")
    for route in INFERENCE_ROUTES if not route.stored and not route.single
    for (client, backend) in TRANSLATIONS if client == route.endpoint
    for stream in ((False, True) if route.streams else (False,))
]


@pytest.mark.parametrize(("route", "backend", "stream"), MATRIX)
def test_every_translated_route_answers_in_its_own_shape(
    asgi_server: AsgiServerFactory, route: InferenceRoute, backend: str, stream: bool,
) -> None:
    """Each route a translation serves, streamed and whole, against a pool whose one backend
    serves only the translation's target: the route's own answer (its end of stream or its
    body), the header naming the translation, and the translation counted."""
    sim = asgi_server(create_sim_app(FAST, seed=1))
    pool = PoolSettings(name=POOL, timeout=20.0, backends=(_ONLY[backend](sim),))
    gateway = asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=5))
    body = smallest_body(route, POOL, stream)
    assert body is not None
    if route.endpoint == "responses":
        body["store"] = False  # only a request without stored state is translated
    with httpx.Client(base_url=gateway.base_url, timeout=20.0) as client, client.stream(
            route.method, route.path, json=body) as response:
        response.read()
    check_answer(route, stream, response)
    name = next(t.name for (c, b), t in TRANSLATIONS.items()
                if (c, b) == (route.endpoint, backend))
    assert response.headers["x-hedge-translated"] == name
