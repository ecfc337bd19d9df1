"""Tool calls through the gateway, over real sockets, with the official SDKs and their helpers
that accumulate calls: the simulator answers a request that offers tools with a call, streamed
the way each API streams calls, and the gateway must take the call's first delta as the first
token (commit, hedge, cancel the loser) and relay the call whole.

The race: two loopback simulators make the same call for the same request (a call is seeded
by the request's content), one of them only after 5 s. A request whose primary is the slow one
is answered by the fast hedge, and the slow stream is closed: were a tool-call delta not a
token, the fast stream would end "empty", the race would wait for the slow one and relay it.
Which backend is primary is the gateway's choice; the tests send requests under a few session
keys until the slow one was (its `/sim/stats` says so) and check that request.
Each test ends with the automatic leak check.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import anthropic
import httpx
import openai
import pydantic
import pytest

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    Settings,
    SimProfile,
    load_settings,
)
from gateway.settings.load import default_settings
from providers.sim.server import create_sim_app
from providers.sim.tools import plan_tool_call
from tests.harness import AsgiServerFactory, RunningServer

POOL = "tools"
SLOW = SimProfile(ttft_median=5.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=3,
                  inter_token=0.001)
FAST = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=3,
                  inter_token=0.001)


class City(pydantic.BaseModel):
    name: str
    country: str | None


class Forecast(pydantic.BaseModel):
    """The forecast for a city: a schema with a nested model, an enum and bounds."""

    city: City
    days: int = pydantic.Field(ge=1, le=7)
    unit: str = pydantic.Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


QUESTION = "what will the weather be in paris this week?"


def serve(asgi_server: AsgiServerFactory, settings: Settings) -> RunningServer:
    return asgi_server.build(lambda: create_app(settings, seed=5))


def race(asgi_server: AsgiServerFactory) -> tuple[list[RunningServer], RunningServer]:
    """A slow and a fast simulator, each behind an OpenAI and an Anthropic backend (one zone
    each), and a gateway that hedges after 200 ms; each API's requests stay on its own
    backends (`translate: false`), so the fast one of that API answers."""
    sims = [asgi_server(create_sim_app(profile, seed=1)) for profile in (SLOW, FAST)]
    backends = [backend for i, sim in enumerate(sims) for backend in (
        BackendSettings(name=f"o{i}", provider="openai", base_url=sim.v1, model="m",
                        group=f"g{i}"),
        BackendSettings(name=f"a{i}", provider="anthropic", base_url=sim.base_url, model="m",
                        group=f"g{i}"))]
    hedging = HedgingSettings(delay=DelaySettings(mode="fixed", value=0.2))
    pool = PoolSettings(name=POOL, backends=tuple(backends), hedging=hedging, timeout=20.0,
                        translate=False)
    return sims, serve(asgi_server, Settings(pools=(pool,)))


def stats(sim: RunningServer) -> dict[str, int]:
    answer: dict[str, int] = httpx.get(sim.url("/sim/stats"), timeout=5.0).json()
    return answer


def wait_closed(sim: RunningServer) -> dict[str, int]:
    """The slow simulator's counters once every stream it started was closed early (a
    bounded wait for it to notice the hang-up, not a timing assertion)."""
    deadline = time.monotonic() + 5.0
    while True:
        now = stats(sim)
        if now["open_streams"] == 0 or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


def slow_primary(sims: Sequence[RunningServer], send: Callable[[dict[str, str]], Any]) -> Any:
    """`send(headers)` under session keys until one request went to the slow simulator first
    (only then does it see a request: a fast primary commits before any hedge); that
    request's result."""
    for key in range(12):
        before = stats(sims[0])["requests"]
        result = send({"x-session-id": f"tools-{key}"})
        if stats(sims[0])["requests"] > before:
            return result
    raise AssertionError("the slow simulator was never the primary: the race was not run")


def check_the_loser_was_cut(sims: Sequence[RunningServer]) -> None:
    slow = wait_closed(sims[0])
    assert slow["streams_started"] >= 1
    assert slow["streams_completed"] == 0
    assert slow["streams_closed_early"] == slow["streams_started"]


class Heard:
    """The headers of the last response a client received (the stream helpers keep theirs
    to themselves)."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}

    def __call__(self, response: Any) -> None:
        self.headers = dict(response.headers)


def gpt(gateway: RunningServer, heard: Heard | None = None) -> openai.OpenAI:
    hooks: dict[str, list[Callable[..., Any]]] = {"response": [heard]} if heard else {}
    return openai.OpenAI(base_url=gateway.v1, api_key="none", max_retries=0, timeout=20.0,
                         http_client=openai.DefaultHttpxClient(event_hooks=hooks))


def claude(gateway: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key="none", max_retries=0,
                               timeout=20.0)


# --- streams: the hedge commits on the call, the helpers accumulate it whole ----------------------


def test_chat_tool_call_stream_commits_and_the_helper_parses_it(
    asgi_server: AsgiServerFactory,
) -> None:
    sims, gateway = race(asgi_server)
    tool = openai.pydantic_function_tool(Forecast)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": QUESTION}]

    def send(headers: dict[str, str]) -> tuple[str, Any, list[str]]:
        heard = Heard()
        with gpt(gateway, heard) as client, client.chat.completions.stream(
            model=POOL, messages=messages, tools=[tool], tool_choice="required",
            extra_headers=headers,
        ) as stream:
            kinds: list[str] = [event.type for event in stream]
            final = stream.get_final_completion()
            return heard.headers["x-hedge-backend"], final, kinds

    backend, final, kinds = slow_primary(sims, send)
    assert backend == "o1"  # the fast hedge won
    check_the_loser_was_cut(sims)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "Forecast" and call.id.startswith("call_")
    # the strict tool's arguments, parsed and validated into the model by the SDK
    parsed = call.function.parsed_arguments
    assert isinstance(parsed, Forecast) and 1 <= parsed.days <= 7
    assert "tool_calls.function.arguments.delta" in kinds
    assert kinds.count("tool_calls.function.arguments.done") == 1
    # exactly the call the fast simulator makes for this request when asked directly
    with openai.OpenAI(base_url=sims[1].v1, api_key="x", max_retries=0) as direct:
        alone = direct.chat.completions.create(model="m", messages=messages, tools=[tool],
                                               tool_choice="required")
    assert alone.choices[0].message.tool_calls is not None
    direct_call = alone.choices[0].message.tool_calls[0]
    assert direct_call.type == "function"
    assert (direct_call.id, direct_call.function.arguments) == (call.id, call.function.arguments)


def test_responses_function_call_stream_commits_and_the_helper_parses_it(
    asgi_server: AsgiServerFactory,
) -> None:
    sims, gateway = race(asgi_server)
    tool = openai.pydantic_responses_function_tool(Forecast)

    def send(headers: dict[str, str]) -> tuple[str, Any, list[str]]:
        heard = Heard()
        with gpt(gateway, heard) as client, client.responses.stream(
            model=POOL, input=QUESTION, tools=[tool], tool_choice="required", store=False,
            extra_headers=headers,
        ) as stream:
            kinds: list[str] = [event.type for event in stream]
            final = stream.get_final_response()
            return heard.headers["x-hedge-backend"], final, kinds

    backend, final, kinds = slow_primary(sims, send)
    assert backend == "o1"
    check_the_loser_was_cut(sims)
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert final.status == "completed"
    (item,) = final.output
    assert item.type == "function_call" and item.name == "Forecast"
    assert item.call_id.startswith("call_") and item.status == "completed"
    assert isinstance(item.parsed_arguments, Forecast)
    assert final.usage is not None and final.usage.output_tokens > 0


def test_messages_tool_use_stream_commits_and_the_helper_accumulates_it(
    asgi_server: AsgiServerFactory,
) -> None:
    sims, gateway = race(asgi_server)
    tools: list[anthropic.types.ToolParam] = [
        {"name": "forecast", "description": "the forecast",
         "input_schema": Forecast.model_json_schema()}]

    def send(headers: dict[str, str]) -> tuple[str, Any, list[str]]:
        with claude(gateway) as client, client.messages.stream(
            model=POOL, max_tokens=512, tools=tools, tool_choice={"type": "any"},
            messages=[{"role": "user", "content": QUESTION}], extra_headers=headers,
        ) as stream:
            kinds: list[str] = [event.type for event in stream]
            return stream.response.headers["x-hedge-backend"], stream.get_final_message(), \
                kinds

    backend, final, kinds = slow_primary(sims, send)
    assert backend == "a1"
    check_the_loser_was_cut(sims)
    assert final.stop_reason == "tool_use"
    (block,) = final.content
    assert block.type == "tool_use" and block.name == "forecast"
    assert block.id.startswith("toolu_")
    Forecast.model_validate(block.input)  # the arguments, accumulated from their deltas
    assert "input_json" in kinds and kinds[-1] == "message_stop"


# --- whole bodies and the way back: a tool's result is answered in text ------------------------


def test_whole_bodies_carry_the_call_and_a_result_gets_text(
    asgi_server: AsgiServerFactory,
) -> None:
    """Non-streaming, each API: the call in its body shape; then the conversation with the
    tool's result as its last input gets a text answer."""
    _sims, gateway = race(asgi_server)
    chat_tool = openai.pydantic_function_tool(Forecast)
    with gpt(gateway) as client:
        asked: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": QUESTION}]
        first = client.chat.completions.create(model=POOL, messages=asked, tools=[chat_tool],
                                               tool_choice="required")
        assert first.choices[0].finish_reason == "tool_calls"
        assert first.choices[0].message.tool_calls is not None
        call = first.choices[0].message.tool_calls[0]
        assert call.type == "function"
        Forecast.model_validate_json(call.function.arguments)
        answered = client.chat.completions.create(model=POOL, tools=[chat_tool], messages=[
            *asked,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny all week"}])
        assert answered.choices[0].finish_reason == "stop"
        assert answered.choices[0].message.content and not answered.choices[0].message.tool_calls

        tool = openai.pydantic_responses_function_tool(Forecast)
        response = client.responses.create(model=POOL, input=QUESTION, tools=[tool],
                                           tool_choice="required", store=False)
        (item,) = response.output
        assert item.type == "function_call"
        after = client.responses.create(model=POOL, tools=[tool], store=False, input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": item.call_id, "name": item.name,
             "arguments": item.arguments},
            {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}])
        assert after.output[0].type == "message" and after.output_text
    with claude(gateway) as anthropic_client:
        tools: list[anthropic.types.ToolParam] = [
            {"name": "forecast", "input_schema": Forecast.model_json_schema()}]
        message = anthropic_client.messages.create(
            model=POOL, max_tokens=256, tools=tools, tool_choice={"type": "any"},
            messages=[{"role": "user", "content": QUESTION}])
        (block,) = message.content
        assert block.type == "tool_use" and message.stop_reason == "tool_use"
        reply = anthropic_client.messages.create(
            model=POOL, max_tokens=256, tools=tools, messages=[
                {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": [{"type": "tool_use", "id": block.id,
                                                   "name": block.name, "input": block.input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                              "content": "sunny"}]}])
        assert reply.stop_reason == "end_turn" and reply.content[0].type == "text"


def test_anthropic_tool_runner_runs_the_agent_loop(asgi_server: AsgiServerFactory) -> None:
    """The Anthropic SDK's tool runner, streaming, through the gateway: the simulator calls
    the tool, the runner runs it and sends its result back, the simulator answers in text."""
    _sims, gateway = race(asgi_server)
    ran: list[dict[str, Any]] = []

    @anthropic.beta_tool
    def forecast(city: str, days: int) -> str:
        """The weather in a city for some days."""
        ran.append({"city": city, "days": days})
        return f"sunny in {city}"

    # a question the simulator answers with a call on its own (tool_choice auto)
    question = next(q for q in (f"{QUESTION} ({i})" for i in range(20)) if plan_tool_call(
        {"messages": [{"role": "user", "content": q}],
         "tools": [forecast.to_dict()]}, "messages") is not None)
    with claude(gateway) as client:
        runner = client.beta.messages.tool_runner(
            model=POOL, max_tokens=256, tools=[forecast], stream=True,
            messages=[{"role": "user", "content": question}])
        finals = []
        for message_stream in runner:
            finals.append(message_stream.get_final_message())
    assert [m.stop_reason for m in finals] == ["tool_use", "end_turn"]
    assert len(ran) == 1 and isinstance(ran[0]["city"], str) and isinstance(ran[0]["days"], int)
    assert finals[-1].content[0].type == "text"


# --- the demo ----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["embedded", "config/demo.yaml"])
def test_the_demo_answers_offered_tools_with_a_call(
    asgi_server: AsgiServerFactory, source: str,
) -> None:
    """`serve` with no config (and its file twin) runs in-process simulators: a request that
    offers a tool and requires it gets a call, streamed through the gateway, in each API."""
    settings = default_settings() if source == "embedded" else load_settings(source)
    gateway = serve(asgi_server, settings)
    weather: dict[str, object] = {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}
    chat_tool: openai.types.chat.ChatCompletionFunctionToolParam = {
        "type": "function", "function": {"name": "weather", "parameters": weather}}
    responses_tool: openai.types.responses.FunctionToolParam = {
        "type": "function", "name": "weather", "parameters": weather, "strict": False}
    messages_tool: anthropic.types.ToolParam = {
        "name": "weather", "input_schema": {"type": "object", "properties": {
            "city": {"type": "string"}}, "required": ["city"]}}
    with gpt(gateway) as client:
        chunks = list(client.chat.completions.create(
            model="demo", stream=True, tool_choice="required", tools=[chat_tool],
            messages=[{"role": "user", "content": "weather in oslo?"}]))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        arguments = "".join(call.function.arguments or "" for d in deltas
                            for call in d.tool_calls or () if call.function)
        assert json.loads(arguments)["city"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        events = list(client.responses.create(
            model="demo", input="weather in oslo?", stream=True, store=False,
            tool_choice="required", tools=[responses_tool]))
        assert events[-1].type == "response.completed"
        assert events[-1].response.output[0].type == "function_call"
    with claude(gateway) as anthropic_client:
        message = anthropic_client.messages.create(
            model="demo", max_tokens=64, tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "weather in oslo?"}], tools=[messages_tool])
    assert message.stop_reason == "tool_use" and message.content[0].type == "tool_use"
