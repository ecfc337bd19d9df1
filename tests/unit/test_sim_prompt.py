"""How the simulator reads a request: input tokens counted from its content in every API's
shape (and the cached part inside them), the tools it offers, its `tool_choice`, whether its
last input is a tool's result, and the tool call that follows from them. Pure."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.settings import SimProfile
from providers.sim.prompt import (
    Segment,
    count_tokens,
    embedding_inputs,
    ends_with_tool_result,
    offered_tools,
    prompt_tokens,
    segments,
    tool_choice,
)
from providers.sim.tools import PIECE_CHARS, plan_tool_call
from providers.sim.wire import SimModel

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "time"}}]
RESPONSES_TOOLS = [{"type": "function", "name": "weather", "parameters": WEATHER},
                   {"type": "web_search"}]
MESSAGES_TOOLS = [{"name": "weather", "input_schema": WEATHER},
                  {"type": "web_search_20250305", "name": "web_search"}]


def test_a_token_is_about_four_bytes_of_text() -> None:
    assert [count_tokens(t) for t in ("", "a", "abcd", "abcde", "tok " * 250)] == [0, 1, 1, 2,
                                                                                   250]
    assert count_tokens("\u00e9t\u00e9") == 2  # 5 bytes of UTF-8, not 3 characters
    assert count_tokens("\ud800") == 1  # a lone surrogate (valid JSON) does not break it


def test_each_api_counts_what_its_request_holds() -> None:
    chat = {"messages": [
        {"role": "system", "content": "abcd" * 3},
        {"role": "user", "content": [{"type": "text", "text": "abcd" * 2},
                                     {"type": "image_url", "image_url": {"url": "x" * 400}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "wx", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}]}
    assert [s.tokens for s in segments(chat, "chat")] == [3, 2, 1, 2]  # no image bytes
    responses = {"instructions": "abcd", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "abcdabcd"}]},
        {"type": "function_call", "call_id": "c", "name": "wx", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "sunny"}]}
    assert [s.tokens for s in segments(responses, "responses")] == [1, 2, 1, 2]
    assert prompt_tokens(segments({"input": "abcdabcdx"}, "responses")) == 3
    messages = {"system": [{"type": "text", "text": "abcd"}], "messages": [
        {"role": "user", "content": "abcdabcd"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "wx",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "text", "text": "sunny"}]}]}]}
    assert [s.tokens for s in segments(messages, "messages")] == [1, 2, 1, 2]
    assert prompt_tokens(segments({"prompt": ["abcd", "abcdabcd"]}, "completions")) == 3
    # the tool listing is the first segment of every API that takes tools
    listed = segments({"tools": CHAT_TOOLS, "messages": []}, "chat")
    assert listed == [Segment("tools", listed[0].text)] and listed[0].tokens > 10
    assert embedding_inputs(["abcdabcd", [1, 2, 3], "x"]) == (("abcdabcd", 2), ("[1,2,3]", 3),
                                                              ("x", 1))
    assert embedding_inputs([5, 6]) == (("[5,6]", 2),)  # one input as token ids


@pytest.mark.parametrize("prefill", [0.0, 60.0])
def test_usage_counts_the_content_and_the_cache_stays_inside_it(prefill: float) -> None:
    model = SimModel(SimProfile(prefill_ms_per_1k=prefill), random.Random(1))
    turn = {"messages": [{"role": "system", "content": "abcd" * 100},
                         {"role": "user", "content": "abcd" * 20}]}
    later = {"messages": [*turn["messages"], {"role": "assistant", "content": "abcd"},
                          {"role": "user", "content": "abcd" * 5}]}
    first, second = model.plan(turn), model.plan(later)
    assert (first.prompt_tokens, second.prompt_tokens) == (120, 126)
    if prefill:
        assert (first.cached_tokens, second.cached_tokens) == (0, 120)
    for plan in (first, second):
        assert (plan.cached_tokens or 0) <= plan.prompt_tokens
    # a longer prompt is more tokens, whatever API carries it
    assert model.plan({"input": "abcd" * 50}, endpoint="responses").prompt_tokens == 50
    counted = model.plan({"messages": turn["messages"]}, endpoint="messages/count_tokens")
    assert counted.prompt_tokens == 120
    if prefill:
        assert counted.cached_tokens == 0  # counting tokens prefills nothing, caches nothing


def test_offered_tools_per_api() -> None:
    chat = offered_tools({"tools": CHAT_TOOLS}, "chat")
    assert [(t.name, t.schema) for t in chat] == [
        ("weather", WEATHER), ("time", {"type": "object", "properties": {}})]
    assert [t.name for t in offered_tools({"tools": RESPONSES_TOOLS}, "responses")] == [
        "weather"]  # a built-in tool is not ours to call
    assert [t.name for t in offered_tools({"tools": MESSAGES_TOOLS}, "messages")] == ["weather"]
    assert offered_tools({"tools": "nonsense"}, "chat") == []


def test_tool_choice_in_each_api_s_words() -> None:
    assert tool_choice({}, "chat") == ("auto", "")
    assert tool_choice({"tool_choice": "none"}, "responses") == ("none", "")
    assert tool_choice({"tool_choice": "required"}, "chat") == ("required", "")
    named = {"type": "function", "function": {"name": "weather"}}
    assert tool_choice({"tool_choice": named}, "chat") == ("named", "weather")
    assert tool_choice({"tool_choice": {"type": "function", "name": "weather"}},
                       "responses") == ("named", "weather")
    assert tool_choice({"tool_choice": {"type": "any"}}, "messages") == ("required", "")
    assert tool_choice({"tool_choice": {"type": "tool", "name": "w"}}, "messages") == (
        "named", "w")
    assert tool_choice({"tool_choice": {"type": "none"}}, "messages") == ("none", "")


def test_the_last_input_being_a_tool_result() -> None:
    assert ends_with_tool_result({"messages": [{"role": "tool", "content": "x"}]}, "chat")
    assert not ends_with_tool_result({"messages": [{"role": "user", "content": "x"}]}, "chat")
    output = {"type": "function_call_output", "call_id": "c", "output": "x"}
    assert ends_with_tool_result({"input": [output]}, "responses")
    assert not ends_with_tool_result({"input": [output, {"role": "user", "content": "y"}]},
                                     "responses")
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
    assert ends_with_tool_result({"messages": [result]}, "messages")
    assert not ends_with_tool_result({"messages": [{"role": "user", "content": "x"}]},
                                     "messages")


# --- the call ---------------------------------------------------------------------------------


def asking(i: int, **more: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}],
            "tools": CHAT_TOOLS, **more}


def test_auto_calls_a_tool_every_time_and_the_same_request_alike() -> None:
    calls = [plan_tool_call(asking(i), "chat") for i in range(400)]
    assert all(c is not None for c in calls)
    assert {c.name for c in calls if c is not None} == {"weather", "time"}
    # the model name and stream flag differ per backend and copy: the call does not
    again = [plan_tool_call({**asking(i), "model": "other", "stream": True}, "chat")
             for i in range(400)]
    assert again == calls
    weather = [c for c in calls if c is not None and c.name == "weather"]
    assert all("city" in json.loads(c.arguments) for c in weather)


def test_forced_named_none_and_after_a_tool_result() -> None:
    for i in range(50):  # `required` forces a call, and naming a tool calls that one
        assert plan_tool_call(asking(i, tool_choice="required"), "chat") is not None
        named = {"type": "function", "function": {"name": "time"}}
        call = plan_tool_call(asking(i, tool_choice=named), "chat")
        assert call is not None and call.name == "time" and call.arguments == "{}"
    assert all(plan_tool_call(asking(i, tool_choice="none"), "chat") is None for i in range(50))
    answered = [{**asking(i), "messages": [
        {"role": "user", "content": f"question {i}"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "noon"}]} for i in range(50)]
    assert all(plan_tool_call(body, "chat") is None for body in answered)
    assert plan_tool_call({**answered[0], "tool_choice": "required"}, "chat") is not None
    assert plan_tool_call({"messages": [], "tools": CHAT_TOOLS}, "completions") is None


def test_each_api_calls_its_own_tools() -> None:
    responses = {"input": "hi", "tools": RESPONSES_TOOLS, "tool_choice": "required"}
    messages = {"messages": [{"role": "user", "content": "hi"}], "tools": MESSAGES_TOOLS,
                "tool_choice": {"type": "any"}}
    for body, api in ((responses, "responses"), (messages, "messages")):
        call = plan_tool_call(body, api)  # type: ignore[arg-type]
        assert call is not None and call.name == "weather"
        assert set(json.loads(call.arguments)) >= {"city"}


def test_a_call_streams_in_pieces_and_a_cut_call_has_no_input() -> None:
    call = plan_tool_call(asking(0, tool_choice="required"), "chat")
    assert call is not None
    assert "".join(call.pieces) == call.arguments
    assert all(0 < len(p) <= PIECE_CHARS for p in call.pieces)
    assert call.input_of(len(call.pieces)) == json.loads(call.arguments)
    assert call.input_of(1) == {}
    model = SimModel(SimProfile(tokens=30), random.Random(1))
    cut = model.plan({**asking(0, tool_choice="required"), "max_tokens": 2})
    assert cut.tool_call == call and cut.tokens == call.pieces[:2] and cut.truncated
    whole = model.plan(asking(0, tool_choice="required"))
    assert whole.tokens == call.pieces and not whole.truncated
