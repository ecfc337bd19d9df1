"""The simulator speaks each API as the real one does, read by the official SDKs over real
sockets, straight from a loopback simulator and through the gateway: complete streams and
their usage, output limits that cut the answer and say so, input tokens counted from the
request (the cached part inside them), embeddings as the SDK asks for them, and the real APIs'
400s, which the gateway relays as final (`x-should-retry: false`, no second backend tried).
Each test ends with the automatic leak check."""

from __future__ import annotations

import time
from typing import Any

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
    Settings,
    SimProfile,
)
from providers.sim.embeddings import embedding_vector
from providers.sim.server import create_sim_app
from tests.harness import AsgiServerFactory, RunningServer

POOL = "sim"
PROFILE = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=24,
                     inter_token=0.0, usage=False)
#: the same, with a prefix cache (and a prefill time too small to matter)
CACHING = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=24,
                     inter_token=0.0, usage=False, prefill_ms_per_1k=1.0)
#: 44 bytes of text: 11 tokens at about four bytes each
QUESTION = "how long is the coastline of norway, really?"
QUESTION_TOKENS = 11


def sims_and_gateway(asgi_server: AsgiServerFactory, *, in_process: bool = False,
                     ) -> tuple[list[RunningServer], RunningServer]:
    """Two loopback simulators behind an OpenAI and an Anthropic backend each (or two
    in-process simulators), and a gateway whose hedges wait 5 s, so every request here is
    one attempt unless it fails. Each API's requests stay on its own backends
    (`translate: false`): what is checked here is each API's own answers and refusals."""
    sims = [asgi_server(create_sim_app(PROFILE, seed=i)) for i in range(2)]
    if in_process:
        backends = [BackendSettings(name=f"s{i}", provider="sim", model="m", group=f"g{i}",
                                    sim=PROFILE) for i in range(2)]
    else:
        backends = [backend for i, sim in enumerate(sims) for backend in (
            BackendSettings(name=f"o{i}", provider="openai", base_url=sim.v1, model="m",
                            group=f"g{i}"),
            BackendSettings(name=f"a{i}", provider="anthropic", base_url=sim.base_url,
                            model="m", group=f"g{i}"))]
    hedging = HedgingSettings(delay=DelaySettings(mode="fixed", value=5.0))
    pool = PoolSettings(name=POOL, backends=tuple(backends), hedging=hedging, timeout=20.0,
                        translate=False)
    settings = Settings(pools=(pool,))
    return sims, asgi_server.build(lambda: create_app(settings, seed=2))


def gpt(base: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="none", max_retries=retries, timeout=20.0)


def claude(base: str, retries: int = 0) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=retries, timeout=20.0)


def requests_to(sims: list[RunningServer]) -> int:
    return sum(int(httpx.get(s.url("/sim/stats"), timeout=5.0).json()["requests"]) for s in sims)


# --- complete streams, read by the SDKs' stream helpers ----------------------------------------


def test_each_api_s_stream_reaches_the_sdk_complete(asgi_server: AsgiServerFactory) -> None:
    _sims, gateway = sims_and_gateway(asgi_server)
    text = "".join(f"tok{i} " for i in range(24))
    with gpt(gateway.v1) as client:
        with client.chat.completions.stream(
            model=POOL, messages=[{"role": "user", "content": QUESTION}],
            stream_options={"include_usage": True},
        ) as chat:
            chat_kinds: list[str] = [event.type for event in chat]
            completion = chat.get_final_completion()
        assert "content.delta" in chat_kinds and chat_kinds.count("content.done") == 1
        assert completion.choices[0].message.content == text
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage is not None
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
            QUESTION_TOKENS, 24)
        with client.responses.stream(model=POOL, input=QUESTION, store=False) as responses:
            kinds: list[str] = [event.type for event in responses]
            final = responses.get_final_response()
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         *["response.output_text.delta"] * 24, "response.output_text.done",
                         "response.content_part.done", "response.output_item.done",
                         "response.completed"]
        assert final.output_text == text and final.status == "completed"
        assert final.usage is not None
        assert final.usage.input_tokens == QUESTION_TOKENS
        assert final.usage.input_tokens_details.cached_tokens == 0
        assert final.usage.output_tokens_details.reasoning_tokens == 0
        assert final.usage.total_tokens == QUESTION_TOKENS + 24
    with claude(gateway.base_url) as anthropic_client, anthropic_client.messages.stream(
        model=POOL, max_tokens=100, messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        names: list[str] = [event.type for event in stream]
        message = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names.count("text") == 24 and "content_block_stop" in names
    assert message.content[0].type == "text" and message.content[0].text == text
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (QUESTION_TOKENS, 24)


# --- output limits ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_output_limits_cut_the_answer_and_say_so(asgi_server: AsgiServerFactory,
                                                 stream: bool) -> None:
    _sims, gateway = sims_and_gateway(asgi_server)
    with gpt(gateway.v1) as client:
        for completion in chat_cut_at_5(client, stream):
            assert completion.choices[0].finish_reason == "length"
            assert completion.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 "
        if stream:  # (the stream helper wants `response.completed`: the events by hand)
            events = list(client.responses.create(model=POOL, input=QUESTION, store=False,
                                                  max_output_tokens=16, stream=True))
            assert events[-1].type == "response.incomplete"
            final = events[-1].response
        else:
            final = client.responses.create(model=POOL, input=QUESTION, store=False,
                                            max_output_tokens=16)
        assert final.status == "incomplete"
        assert final.incomplete_details is not None
        assert final.incomplete_details.reason == "max_output_tokens"
        assert final.usage is not None and final.usage.output_tokens == 16
        assert final.output_text == "".join(f"tok{i} " for i in range(16))
    message: anthropic.types.Message
    with claude(gateway.base_url) as anthropic_client:
        if stream:
            with anthropic_client.messages.stream(
                model=POOL, max_tokens=3, messages=[{"role": "user", "content": QUESTION}],
            ) as message_stream:
                message = message_stream.get_final_message()
        else:
            message = anthropic_client.messages.create(
                model=POOL, max_tokens=3, messages=[{"role": "user", "content": QUESTION}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    # the gateway counted the cut answers' tokens too (the Responses one ends incomplete)
    deadline = time.monotonic() + 5.0
    while True:
        pool = httpx.get(gateway.url("/hedge/stats"), timeout=5.0).json()["pools"][POOL]
        if pool["lifetime"]["requests"] >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert pool["lifetime"]["tokens"]["output"] == 5 + 5 + 16 + 3


def chat_cut_at_5(client: openai.OpenAI, stream: bool) -> list[Any]:
    """A chat answer capped at 5 tokens by `max_tokens`, then by `max_completion_tokens`,
    streamed (read by the stream helper) or whole."""
    asked: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": QUESTION}]
    out: list[Any] = []
    if stream:  # (the stream helper refuses a cut answer: the chunks, read by hand)
        for chunks in (
            client.chat.completions.create(model=POOL, messages=asked, max_tokens=5,
                                           stream=True),
            client.chat.completions.create(model=POOL, messages=asked,
                                           max_completion_tokens=5, stream=True),
        ):
            pieces = [c.choices[0] for c in chunks if c.choices]
            out.append(openai.types.chat.ChatCompletion.model_construct(choices=[
                openai.types.chat.chat_completion.Choice.model_construct(
                    finish_reason=pieces[-1].finish_reason,
                    message=openai.types.chat.ChatCompletionMessage.model_construct(
                        content="".join(p.delta.content or "" for p in pieces)))]))
    else:
        out.append(client.chat.completions.create(model=POOL, messages=asked, max_tokens=5))
        out.append(client.chat.completions.create(model=POOL, messages=asked,
                                                  max_completion_tokens=5))
    return out


# --- input tokens from the content, and the cache inside them -------------------------------------


def test_input_tokens_grow_with_the_conversation_and_the_cache_stays_inside(
    asgi_server: AsgiServerFactory,
) -> None:
    """A conversation's second turn, on the simulator that served its first: more input
    tokens, all of the first turn's read from the cache, in each API's own usage fields."""
    sim = asgi_server(create_sim_app(CACHING, seed=1))
    long = "the history of the fjords " * 40  # 1,040 bytes: 260 tokens
    with gpt(sim.v1) as client:
        first = client.responses.create(model="m", input=long, store=False)
        assert first.usage is not None and first.usage.input_tokens == 260
        assert first.usage.input_tokens_details.cached_tokens == 0
        second = client.responses.create(model="m", store=False, input=[
            {"role": "user", "content": long},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": QUESTION}])
        assert second.usage is not None
        answered = -(-len(first.output_text.encode()) // 4)
        assert second.usage.input_tokens == 260 + answered + QUESTION_TOKENS
        assert second.usage.input_tokens_details.cached_tokens == 260
        chat = client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": long}, {"role": "user", "content": QUESTION}])
        assert chat.usage is not None and chat.usage.prompt_tokens == 260 + QUESTION_TOKENS
        assert chat.usage.prompt_tokens_details is not None
        # the same words sent to another API: its prompt is its own, nothing is cached
        assert chat.usage.prompt_tokens_details.cached_tokens == 0
    with claude(sim.base_url) as anthropic_client:
        turn: list[anthropic.types.MessageParam] = [{"role": "user", "content": long}]
        answer = anthropic_client.messages.create(model="m", max_tokens=100, messages=turn)
        again = anthropic_client.messages.create(model="m", max_tokens=100, messages=[
            *turn, {"role": "assistant", "content": "tok0 tok1"},
            {"role": "user", "content": QUESTION}])
        counted = anthropic_client.messages.count_tokens(model="m", messages=turn)
    assert (answer.usage.input_tokens, answer.usage.cache_read_input_tokens) == (260, 0)
    # Anthropic counts cache reads apart from the input tokens
    assert again.usage.cache_read_input_tokens == 260
    assert again.usage.input_tokens == 3 + QUESTION_TOKENS
    assert counted.input_tokens == 260


# --- embeddings -------------------------------------------------------------------------------


def test_embeddings_as_the_sdk_asks_for_them(asgi_server: AsgiServerFactory) -> None:
    """The SDK asks for base64 unless told otherwise and decodes it; `dimensions` sets the
    length; usage counts the inputs' tokens; through the gateway, as straight from the
    simulator."""
    sims, gateway = sims_and_gateway(asgi_server)
    inputs = ["the quick brown fox", "jumps"]
    for base, model in ((sims[0].v1, "m"), (gateway.v1, POOL)):
        with gpt(base) as client:
            decoded = client.embeddings.create(model=model, input=inputs, dimensions=16)
            floats = client.embeddings.create(model=model, input=inputs, dimensions=16,
                                              encoding_format="float")
            packed = client.embeddings.create(model=model, input=inputs,
                                              encoding_format="base64")
        for i, text in enumerate(inputs):
            assert floats.data[i].embedding == embedding_vector(text, 16)
            assert decoded.data[i].embedding == pytest.approx(embedding_vector(text, 16),
                                                              abs=1e-6)
            assert isinstance(packed.data[i].embedding, str)  # asked for: left as sent
        assert decoded.usage.prompt_tokens == 5 + 2


# --- the real APIs' 400s, relayed as final ------------------------------------------------------


def test_the_simulator_refuses_in_each_api_s_shape(asgi_server: AsgiServerFactory) -> None:
    sim = asgi_server(create_sim_app(PROFILE, seed=1))
    with gpt(sim.v1) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=[])
        assert refused.value.code == "empty_array" and refused.value.param == "messages"
        assert refused.value.type == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="m", messages=[{"role": "robot", "content": "x"}],  # type: ignore[misc,list-item]
            )
        assert refused.value.code == "invalid_value"
        assert refused.value.param == "messages[0].role"
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="m", input="x", max_output_tokens=4)
        assert refused.value.code == "integer_below_min_value"
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="", messages=[{"role": "user", "content": "x"}])
        assert "you must provide a model parameter" in refused.value.message
    with claude(sim.base_url) as anthropic_client, pytest.raises(
        anthropic.BadRequestError
    ) as rejected:
        anthropic_client.messages.create(model="m", max_tokens=0,
                                         messages=[{"role": "user", "content": "x"}])
    assert rejected.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "max_tokens: Input should be greater than or equal to 1"}}


@pytest.mark.parametrize("in_process", [False, True], ids=["loopback", "in-process"])
def test_the_gateway_relays_a_refusal_as_final(asgi_server: AsgiServerFactory,
                                               in_process: bool) -> None:
    """What the simulator refuses, the gateway answers with a 400 in the route's shape and
    `x-should-retry: false`, after one attempt: no other backend is tried, and the SDKs (here
    allowed two retries) send it once."""
    sims, gateway = sims_and_gateway(asgi_server, in_process=in_process)
    cases: list[tuple[str, Any]] = []
    with gpt(gateway.v1, retries=2) as client:
        for send in (
            lambda: client.chat.completions.create(model=POOL, n=2, messages=[
                {"role": "user", "content": "x"}]),
            lambda: client.chat.completions.create(model=POOL, messages=[
                {"role": "robot", "content": "x"}]),  # type: ignore[misc,list-item]
            lambda: client.responses.create(model=POOL, input="x", max_output_tokens=4,
                                            store=False),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                send()
            cases.append(("openai", refused.value))
    with claude(gateway.base_url, retries=2) as anthropic_client, pytest.raises(
        anthropic.BadRequestError
    ) as rejected:
        anthropic_client.messages.create(model=POOL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nobody"}]}])
    cases.append(("anthropic", rejected.value))
    for shape, error in cases:
        assert error.status_code == 400
        assert error.response.headers["x-should-retry"] == "false"
        body = error.body
        assert isinstance(body, dict)
        if shape == "anthropic":
            assert body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error"
        else:
            assert body["type"] == "invalid_request_error"
    if not in_process:  # one attempt each, on one backend: nothing failed over or retried
        assert requests_to(sims) == len(cases)
