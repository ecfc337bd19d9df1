"""Every simulated API's complete event sequence and body, as the real API sends them: text,
a tool call and an answer cut by the output limit, for chat completions, the Responses API and
Anthropic Messages; the gateway's own first-token rules find the first output (a tool call's
included) where the TTFT puts it; embeddings in floats or base64 at any dimension. Pure: the
plans come from `SimModel`, a fake sleep records the delays."""

from __future__ import annotations

import base64
import dataclasses
import json
import random
import struct
from typing import Any

import pytest

from gateway.settings import SimProfile
from gateway.wire.base import Kind, WireProtocol
from gateway.wire.chat import CHAT
from gateway.wire.messages import MESSAGES
from gateway.wire.responses import RESPONSES
from gateway.wire.sse import SSEEvent
from gateway.wire.usage import body_usage, read_usage
from providers.sim.chat import sim_payloads, sim_response
from providers.sim.embeddings import embedding_vector
from providers.sim.protocols import protocol_body, protocol_stream
from providers.sim.wire import SimModel, SimPlan

TTFT = 0.25
PROFILE = SimProfile(ttft_median=TTFT, ttft_sigma=0.0, straggler_probability=0.0, tokens=20,
                     inter_token=0.01, usage=False)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "days": {"type": "integer", "minimum": 1}},
          "required": ["city", "days"]}
TOOLS = {
    "chat/completions": [{"type": "function", "function": {"name": "weather",
                                                           "parameters": SCHEMA}}],
    "responses": [{"type": "function", "name": "weather", "parameters": SCHEMA}],
    "messages": [{"name": "weather", "input_schema": SCHEMA}],
}
FORCED = {"chat/completions": "required", "responses": "required",
          "messages": {"type": "any"}}
PROTOCOLS: dict[str, WireProtocol] = {"chat/completions": CHAT, "responses": RESPONSES,
                                      "messages": MESSAGES}


def body(endpoint: str, *, tools: bool = False, limit: int | None = None,
         **more: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "m", "stream": True, **more}
    if endpoint == "responses":
        out["input"] = "what is the weather in paris"
    else:
        out["messages"] = [{"role": "user", "content": "what is the weather in paris"}]
    if endpoint == "messages":
        out["max_tokens"] = 1000
    if tools:
        out["tools"], out["tool_choice"] = TOOLS[endpoint], FORCED[endpoint]
    if limit is not None:
        out[{"chat/completions": "max_completion_tokens", "responses": "max_output_tokens",
             "messages": "max_tokens"}[endpoint]] = limit
    return out


def plan_of(endpoint: str, request: dict[str, Any]) -> SimPlan:
    return SimModel(PROFILE, random.Random(1)).plan(request, endpoint=endpoint)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    async def __call__(self, delay: float) -> None:
        self.now += delay


async def stream(endpoint: str, plan: SimPlan) -> list[tuple[float, SSEEvent]]:
    """(when, event) of every event the simulator sends for `plan`."""
    clock = Clock()
    out: list[tuple[float, SSEEvent]] = []
    if endpoint == "chat/completions":
        async for data in sim_payloads(plan, endpoint="chat/completions", model="m",
                                       request_id="r", sleep=clock, created=1):
            out.append((clock.now, SSEEvent(data)))
    else:
        async for name, data in protocol_stream(plan, endpoint, model="m", request_id="r",
                                                sleep=clock, created=1):
            out.append((clock.now, SSEEvent(data, name)))
    return out


def first_token(endpoint: str, events: list[tuple[float, SSEEvent]]) -> int:
    protocol = PROTOCOLS[endpoint]
    return next(i for i, (_, e) in enumerate(events) if protocol.classify(e) is Kind.TOKEN)


def names(events: list[tuple[float, SSEEvent]]) -> list[str]:
    return [(e.event or b"").decode() for _, e in events]


def payloads(events: list[tuple[float, SSEEvent]]) -> list[Any]:
    return [json.loads(e.data) for _, e in events if e.data != b"[DONE]"]


# --- chat completions -------------------------------------------------------------------------


async def test_chat_text_stream_with_usage_asked_for() -> None:
    request = body("chat/completions", stream_options={"include_usage": True})
    events = await stream("chat/completions", plan_of("chat/completions", request))
    chunks = payloads(events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first_token("chat/completions", events) == 1 and events[1][0] == TTFT
    text = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert "".join(text) == "".join(f"tok{i} " for i in range(20))
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "stop"}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 20, "total_tokens": 27,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0}}
    assert events[-1][1].data == b"[DONE]"
    # without asking (and a profile that sends usage only then): no usage chunk, no nulls
    quiet = payloads(await stream("chat/completions",
                                  plan_of("chat/completions", body("chat/completions"))))
    assert quiet[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in quiet)


async def test_chat_tool_call_stream() -> None:
    plan = plan_of("chat/completions", body("chat/completions", tools=True))
    assert plan.tool_call is not None
    events = await stream("chat/completions", plan)
    chunks = payloads(events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    index = first_token("chat/completions", events)
    assert index == 1 and events[index][0] == TTFT  # the call's head is the first token
    head = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert head == [{"index": 0, "id": f"call_{plan.tool_call.key}", "type": "function",
                     "function": {"name": "weather", "arguments": ""}}]
    pieces = [c["choices"][0]["delta"]["tool_calls"] for c in chunks[2:-1]]
    assert all(p[0]["index"] == 0 and set(p[0]) == {"index", "function"} for p in pieces)
    arguments = "".join(p[0]["function"]["arguments"] for p in pieces)
    assert json.loads(arguments)["city"] and json.loads(arguments)["days"] >= 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = sim_response(plan, "chat/completions", "m", "r", created=1)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": head[0]["id"], "type": "function",
         "function": {"name": "weather", "arguments": arguments}}]


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_chat_output_limit_cuts_and_says_length(key: str) -> None:
    request = {**body("chat/completions"), key: 3}
    plan = plan_of("chat/completions", request)
    chunks = payloads(await stream("chat/completions", plan))
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:4]] == [
        "tok0 ", "tok1 ", "tok2 "]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = sim_response(plan, "chat/completions", "m", "r")
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 3
    cut_call = plan_of("chat/completions", {**body("chat/completions", tools=True), key: 2})
    chunks = payloads(await stream("chat/completions", cut_call))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) == 1 + 1 + 2 + 1  # role, the call's head, two pieces, finish


# --- the Responses API --------------------------------------------------------------------------


def check_sequence(events: list[tuple[float, SSEEvent]]) -> None:
    datas = payloads(events)
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert [d["type"] for d in datas] == names(events)


def check_responses_usage(usage: dict[str, Any], output: int) -> None:
    assert usage == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": 7 + output}


async def test_responses_text_stream_event_for_event() -> None:
    plan = plan_of("responses", body("responses", store=False))
    events = await stream("responses", plan)
    check_sequence(events)
    assert names(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 20,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    index = first_token("responses", events)
    assert index == 4 and events[index][0] == TTFT
    assert all(at == 0.0 for at, _ in events[:index])  # the scaffolding at once
    datas = payloads(events)
    text = "".join(f"tok{i} " for i in range(20))
    assert datas[-4]["text"] == text and datas[-3]["part"]["text"] == text
    item = datas[-2]["item"]
    assert item["type"] == "message" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "annotations": [], "logprobs": [],
                                "text": text}]
    done = datas[-1]["response"]
    assert done["status"] == "completed" and done["store"] is False
    assert done["output"] == [item] and done["incomplete_details"] is None
    check_responses_usage(done["usage"], 20)
    assert datas[0]["response"]["usage"] is None and datas[0]["response"]["output"] == []
    found = read_usage(events[-1][1].data)
    assert found is not None and found[0].output == 20
    assert protocol_body(plan, "responses", method="POST", path=None, model="m",
                         request_id="r", created=1) == done


async def test_responses_function_call_stream() -> None:
    plan = plan_of("responses", body("responses", tools=True))
    assert plan.tool_call is not None
    events = await stream("responses", plan)
    check_sequence(events)
    pieces = len(plan.tokens)
    assert names(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * pieces,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    index = first_token("responses", events)
    assert index == 2 and events[index][0] == TTFT  # the item naming the function
    datas = payloads(events)
    added = datas[2]["item"]
    assert added == {"id": f"fc_{plan.tool_call.key}", "type": "function_call",
                     "status": "in_progress", "arguments": "",
                     "call_id": f"call_{plan.tool_call.key}", "name": "weather"}
    arguments = "".join(d["delta"] for d in datas[3:3 + pieces])
    assert {d["item_id"] for d in datas[3:3 + pieces]} == {added["id"]}
    assert datas[-3]["arguments"] == arguments and datas[-3]["name"] == "weather"
    final = {**added, "status": "completed", "arguments": arguments}
    assert datas[-2]["item"] == final
    assert datas[-1]["response"]["output"] == [final]
    assert json.loads(arguments)["days"] >= 1
    assert datas[-1]["response"]["tool_choice"] == "required"
    assert datas[-1]["response"]["tools"] == TOOLS["responses"]


async def test_responses_max_output_tokens_makes_it_incomplete() -> None:
    plan = plan_of("responses", body("responses", limit=16))
    events = await stream("responses", plan)
    check_sequence(events)
    assert names(events)[-1] == "response.incomplete"
    assert RESPONSES.classify(events[-1][1]) is Kind.DONE
    done = payloads(events)[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["output"][0]["status"] == "incomplete"
    assert done["max_output_tokens"] == 16
    check_responses_usage(done["usage"], 16)
    whole = protocol_body(plan, "responses", method="POST", path=None, model="m",
                          request_id="r", created=1)
    assert whole["status"] == "incomplete" and RESPONSES.classify_body(whole) is Kind.TOKEN


# --- Anthropic Messages -----------------------------------------------------------------------


def check_message_usage(start: dict[str, Any]) -> None:
    assert start["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 0, "output_tokens": 1}


async def test_messages_text_stream() -> None:
    plan = plan_of("messages", body("messages"))
    events = await stream("messages", plan)
    assert names(events) == ["message_start", "content_block_start", "ping",
                             *["content_block_delta"] * 20, "content_block_stop",
                             "message_delta", "message_stop"]
    assert first_token("messages", events) == 3 and events[3][0] == TTFT
    datas = payloads(events)
    check_message_usage(datas[0]["message"])
    assert datas[1]["content_block"] == {"type": "text", "text": ""}
    assert datas[-2] == {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                            "stop_sequence": None},
                         "usage": {"output_tokens": 20}}
    whole = protocol_body(plan, "messages", method="POST", path=None, model="m",
                          request_id="r", created=1)
    assert whole["content"] == [{"type": "text", "text": plan.content}]
    assert whole["stop_reason"] == "end_turn"
    usage = body_usage(json.dumps(whole).encode())
    assert usage is not None and (usage.input, usage.output) == (7, 20)


async def test_messages_tool_use_stream() -> None:
    plan = plan_of("messages", body("messages", tools=True))
    assert plan.tool_call is not None
    events = await stream("messages", plan)
    pieces = len(plan.tokens)
    assert names(events) == ["message_start", "ping", "content_block_start",
                             *["content_block_delta"] * (pieces + 1), "content_block_stop",
                             "message_delta", "message_stop"]
    index = first_token("messages", events)
    assert index == 2 and events[index][0] == TTFT  # the tool_use block names the tool
    datas = payloads(events)
    block = {"type": "tool_use", "id": f"toolu_{plan.tool_call.key}", "name": "weather",
             "input": {}}
    assert datas[2]["content_block"] == block
    deltas = [d["delta"] for d in datas[3:3 + pieces + 1]]
    assert deltas[0] == {"type": "input_json_delta", "partial_json": ""}
    arguments = "".join(d["partial_json"] for d in deltas)
    assert datas[-2]["delta"]["stop_reason"] == "tool_use"
    whole = protocol_body(plan, "messages", method="POST", path=None, model="m",
                          request_id="r", created=1)
    assert whole["content"] == [{**block, "input": json.loads(arguments)}]
    assert whole["stop_reason"] == "tool_use"


async def test_messages_max_tokens_stops_with_max_tokens() -> None:
    plan = plan_of("messages", body("messages", limit=4))
    datas = payloads(await stream("messages", plan))
    assert [d["delta"]["text"] for d in datas if d["type"] == "content_block_delta"] == [
        "tok0 ", "tok1 ", "tok2 ", "tok3 "]
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"
    assert datas[-2]["usage"] == {"output_tokens": 4}
    cut = plan_of("messages", body("messages", tools=True, limit=2))
    whole = protocol_body(cut, "messages", method="POST", path=None, model="m",
                          request_id="r", created=1)
    assert whole["stop_reason"] == "max_tokens" and whole["content"][0]["input"] == {}


async def test_cached_tokens_are_anthropic_s_cache_reads() -> None:
    model = SimModel(SimProfile(prefill_ms_per_1k=10.0, tokens=2), random.Random(1))
    first = body("messages")
    model.plan(first, endpoint="messages")
    later = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "and in rome"}]}
    plan = model.plan(later, endpoint="messages")
    start = payloads(await stream("messages", plan))[0]["message"]
    assert start["usage"]["cache_read_input_tokens"] == 7
    assert start["usage"]["input_tokens"] == plan.prompt_tokens - 7 == 4


# --- faults keep their shape with a tool call ---------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat/completions", "responses", "messages"])
async def test_a_hanging_tool_call_sends_only_the_scaffolding(endpoint: str) -> None:
    plan = plan_of(endpoint, body(endpoint, tools=True))
    hung = dataclasses.replace(plan, hang=True)
    events = await stream(endpoint, hung)
    protocol = PROTOCOLS[endpoint]
    assert events and all(protocol.classify(e) is Kind.OTHER for _, e in events)


@pytest.mark.parametrize("endpoint", ["chat/completions", "responses", "messages"])
async def test_a_tool_call_fails_midstream_after_its_first_token(endpoint: str) -> None:
    plan = plan_of(endpoint, body(endpoint, tools=True))
    failing = dataclasses.replace(plan, midstream_error_after=2)
    kinds = [PROTOCOLS[endpoint].classify(e) for _, e in await stream(endpoint, failing)]
    assert Kind.TOKEN in kinds and kinds[-1] is Kind.ERROR
    assert kinds.index(Kind.TOKEN) < kinds.index(Kind.ERROR)


# --- embeddings -------------------------------------------------------------------------------


def test_embeddings_in_base64_and_any_dimension() -> None:
    model = SimModel(PROFILE, random.Random(1))
    request = {"model": "e", "input": ["abcdabcd", "x"], "dimensions": 5}
    floats = sim_response(model.plan(request, endpoint="embeddings"), "embeddings", "e", "r")
    packed = sim_response(model.plan({**request, "encoding_format": "base64"},
                                     endpoint="embeddings"), "embeddings", "e", "r")
    for as_floats, as_text in zip(floats["data"], packed["data"], strict=True):
        vector = as_floats["embedding"]
        assert len(vector) == 5
        raw = base64.b64decode(as_text["embedding"])
        assert len(raw) == 5 * 4
        assert list(struct.unpack("<5f", raw)) == pytest.approx(vector, abs=1e-7)
    assert floats["data"][0]["embedding"] == embedding_vector("abcdabcd", 5)
    assert floats["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert len(sim_response(model.plan({"input": "a"}, endpoint="embeddings"), "embeddings",
                            "e", "r")["data"][0]["embedding"]) == 8
