"""Chat Completions <-> Messages translation: requests, whole answers, streams, usage, errors.

Pure: no sockets. The round-trip properties run over seeded random answers (a fixed list of
seeds, so a failure names the seed that shows it)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import Unreadable, Untranslatable
from gateway.wire.base import RelayOutcome, StreamEnd
from gateway.wire.messages import classify_messages
from gateway.wire.sse import SSEBatch, SSEDecoder, SSEEvent, named_events
from gateway.wire.translate import chat_messages_stream as stream
from gateway.wire.translate.chat_messages import (
    DEFAULT_MAX_TOKENS,
    JSON_TOOL,
    chat_to_messages,
    messages_to_chat,
)
from gateway.wire.translate.chat_messages_answer import (
    chat_answer_to_messages,
    chat_error_to_messages,
    chat_usage,
    messages_answer_to_chat,
    messages_error_to_chat,
    messages_usage,
)
from gateway.wire.translate.chat_messages_stream import ChatToMessages, MessagesToChat
from gateway.wire.translate.responses_chat import (
    ChatToResponses,
    chat_answer_to_responses,
    responses_to_chat,
)
from gateway.wire.translate.routes import TRANSLATIONS, ThroughChat
from providers.sim.validate import check_request

RECORDED = Path(__file__).parent.parent / "e2e" / "recorded"


def events_of(raw: bytes) -> list[SSEEvent]:
    decoder = SSEDecoder()
    return decoder.feed(raw) + decoder.close()


def chat_stream_to_answer(raw: bytes) -> tuple[dict[str, Any], bool]:
    """A Chat stream's bytes accumulated into a whole completion, as an SDK would; and whether
    it ended with `[DONE]`."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    calls: dict[int, dict[str, Any]] = {}
    answer: dict[str, Any] = {}
    finish = None
    done = False
    for event in events_of(raw):
        if event.data == b"[DONE]":
            done = True
            continue
        chunk = json.loads(event.data)
        answer.setdefault("id", chunk["id"])
        answer.setdefault("model", chunk["model"])
        if chunk.get("usage"):
            answer["usage"] = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            for name in ("content", "reasoning_content"):
                if delta.get(name):
                    message[name] = (message.get(name) or "") + delta[name]
            for call in delta.get("tool_calls") or ():
                into = calls.setdefault(call["index"], {"id": None, "type": "function",
                                                        "function": {"name": None,
                                                                     "arguments": ""}})
                if call.get("id"):
                    into["id"] = call["id"]
                function = call.get("function") or {}
                if function.get("name"):
                    into["function"]["name"] = function["name"]
                into["function"]["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    answer["choices"] = [{"index": 0, "message": message, "finish_reason": finish,
                          "logprobs": None}]
    return answer, done


def chat_answer_to_stream(answer: dict[str, Any], rng: random.Random) -> bytes:
    """A whole completion streamed as a Chat server streams it: a role chunk, reasoning, text
    and each tool call's arguments in random fragments, the finish chunk, usage, `[DONE]`."""
    base = {"id": answer["id"], "object": "chat.completion.chunk", "created": 1,
            "model": answer["model"]}
    # compact as OpenAI writes it (the translation's fast path), or spaced (its parse)
    separators = (",", ":") if rng.random() < 0.7 else (", ", ": ")

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                    "finish_reason": finish}], "usage": None}
        return b"data: " + json.dumps(obj, separators=separators).encode() + b"\n\n"

    def pieces(text: str) -> list[str]:
        cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 \
            else []
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    message = answer["choices"][0]["message"]
    out = [chunk({"role": "assistant", "content": ""})]
    for name in ("reasoning_content", "content"):
        if message.get(name):
            out += [chunk({name: p}) for p in pieces(message[name])]
    for i, call in enumerate(message.get("tool_calls") or ()):
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"],
                                                       "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                for p in pieces(call["function"]["arguments"])]
    out.append(chunk({}, answer["choices"][0]["finish_reason"]))
    if "usage" in answer:
        out.append(b"data: " + json.dumps({**base, "choices": [], "usage": answer["usage"]},
                                          separators=separators).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def random_chat_answer(rng: random.Random) -> dict[str, Any]:
    """A Chat answer of a shape both APIs carry: text and/or reasoning and/or parallel tool
    calls with compact JSON arguments, a finish reason that fits it, usage perhaps cached."""
    words = ["hello", "wörld", "{", "\"q\"", "\n", "   ", "tool", "🙂", "x" * 40]
    text = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if rng.random() < 0.3:
        message["reasoning_content"] = "think " + text[::-1]
    calls = [{"id": f"call_{rng.randrange(10**6)}_{i}", "type": "function",
              "function": {"name": rng.choice(["get_weather", "Bash", "read_file"]),
                           "arguments": json.dumps({"q": text, "n": i, "deep": {"a": [1, None]}},
                                                   separators=(",", ":"),
                                                   ensure_ascii=False)}}
             for i in range(rng.choice([0, 0, 1, 2, 3]))]
    if calls:
        message["tool_calls"] = calls
        if rng.random() < 0.5:
            message["content"] = text
        finish = "tool_calls"
    else:
        message["content"] = text
        finish = rng.choice(["stop", "length", "content_filter"])
    prompt, output = rng.randint(1, 5000), rng.randint(1, 500)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": output,
                             "total_tokens": prompt + output}
    if rng.random() < 0.5:
        usage["prompt_tokens_details"] = {"cached_tokens": rng.randint(0, prompt)}
    return {"id": f"chatcmpl-{rng.randrange(10**9)}", "object": "chat.completion",
            "created": 1700000000, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage}


SEEDS = range(200)


# --- requests: Chat -> Messages ---------------------------------------------------------------


def test_chat_request_carries_system_images_tools_calls_results_stop_and_sampling() -> None:
    body = {
        "model": "m", "max_completion_tokens": 300, "temperature": 0.5, "top_p": 0.9,
        "stop": "END", "stream": True, "stream_options": {"include_usage": True},
        "parallel_tool_calls": False, "tool_choice": "required", "user": "u-1",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": "and kind"}]},
            {"role": "user", "content": [
                {"type": "text", "text": "what is here?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "look", "arguments": "{\"at\":1}"}},
                {"id": "c2", "type": "function",
                 "function": {"name": "look", "arguments": "{\"at\":2}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "tool", "tool_call_id": "c2", "content": "two"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "look", "description": "looks", "parameters": {"type": "object"}}}],
    }
    out = chat_to_messages(body)
    assert out["system"] == [{"type": "text", "text": "be brief"},
                             {"type": "text", "text": "and kind"}]
    assert out["max_tokens"] == 300 and out["temperature"] == 0.5 and out["top_p"] == 0.9
    assert out["stop_sequences"] == ["END"] and out["stream"] is True
    assert out["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert out["tools"] == [{"name": "look", "description": "looks",
                             "input_schema": {"type": "object"}}]
    assert out["metadata"] == {"user_id": "u-1"}
    user, assistant, results = out["messages"]
    assert user["content"][1] == {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}
    assert user["content"][2]["source"] == {"type": "url", "url": "https://x.test/a.png"}
    assert [b["input"] for b in assistant["content"]] == [{"at": 1}, {"at": 2}]
    # parallel results: one user turn holding both, in order
    assert results["role"] == "user"
    assert [(b["tool_use_id"], b["content"][0]["text"]) for b in results["content"]] == [
        ("c1", "one"), ("c2", "two")]
    assert "stream_options" not in out and "parallel_tool_calls" not in out


def test_chat_request_without_max_tokens_gets_the_default_and_reasoning_a_budget() -> None:
    out = chat_to_messages({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "reasoning_effort": "low"})
    assert out["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert out["max_tokens"] == DEFAULT_MAX_TOKENS


def test_chat_json_output_becomes_a_forced_tool() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = chat_to_messages({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": schema}}})
    assert out["tools"][0]["name"] == JSON_TOOL and out["tools"][0]["input_schema"] == schema
    assert out["tool_choice"] == {"type": "tool", "name": JSON_TOOL}


@pytest.mark.parametrize(("extra", "field"), [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"temperature": 1.5}, "temperature"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "response_format"),
    # Messages thinks only where the model may choose no tool: a forced one is refused there
    ({"reasoning_effort": "low", "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "reasoning_effort"),
    ({"reasoning_effort": "low", "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "reasoning_effort"),
    ({"reasoning_effort": "low", "response_format": {"type": "json_object"}},
     "reasoning_effort"),
])
def test_chat_fields_that_change_the_answer_are_refused_naming_them(
        extra: dict[str, Any], field: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(Untranslatable) as caught:
        chat_to_messages(body)
    assert caught.value.status == 400 and caught.value.param == field
    assert caught.value.should_retry is False


def test_chat_fields_at_their_default_or_that_only_tune_are_dropped() -> None:
    out = chat_to_messages({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "n": 1, "logprobs": False, "presence_penalty": 0, "seed": 7,
                            "service_tier": "auto", "store": False, "metadata": {"a": "b"}})
    assert set(out) == {"model", "messages", "max_tokens"}


@pytest.mark.parametrize("field", ["min_p", "repetition_penalty", "guided_json", "top_a"])
def test_chat_fields_neither_carried_nor_dropped_are_refused_naming_them(field: str) -> None:
    """A server's own sampling or guided-decoding field changes the answer: dropped on the
    way to Messages it would change it unseen."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: 0.5}
    with pytest.raises(Untranslatable) as caught:
        chat_to_messages(body)
    assert caught.value.status == 400 and caught.value.param == field


def test_chat_top_k_is_carried_to_messages() -> None:
    out = chat_to_messages({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "top_k": 40})
    assert out["top_k"] == 40


# --- requests: Messages -> Chat ---------------------------------------------------------------


def test_messages_request_carries_tools_calls_results_images_thinking_and_stop() -> None:
    body = {
        "model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "sys",
                                                     "cache_control": {"type": "ephemeral"}}],
        "stop_sequences": ["X", "Y"], "temperature": 0.2, "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 5000},
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "description": "d",
                   "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": "u"},
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "see"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                             "data": "QQ=="}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "sig"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "id": "t2", "name": "f", "input": {"a": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "r1"},
                {"type": "tool_result", "tool_use_id": "t2",
                 "content": [{"type": "text", "text": "r2"}], "is_error": True},
                {"type": "text", "text": "go on"}]},
        ],
    }
    out = messages_to_chat(body)
    assert out["messages"][0] == {"role": "system", "content": "sys"}
    assert out["messages"][1]["content"][1] == {
        "type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QQ=="}}
    assistant = out["messages"][2]
    assert assistant["content"] == "calling"
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [
        '{"a":1}', '{"a":2}']
    assert out["messages"][3:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "r1"},
        {"role": "tool", "tool_call_id": "t2", "content": "r2"},
        {"role": "user", "content": "go on"}]
    assert out["stop"] == ["X", "Y"] and out["max_tokens"] == 100
    assert out["reasoning_effort"] == "medium"
    assert out["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert out["parallel_tool_calls"] is False
    assert out["stream_options"] == {"include_usage": True} and out["user"] == "u"
    assert out["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "description": "d"}}]


@pytest.mark.parametrize(("extra", "field"), [
    ({"top_k": 5}, "top_k"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "u"}}]}]}]},
     "messages[0].content[0].content[0].type"),
])
def test_messages_fields_that_change_the_answer_are_refused_naming_them(
        extra: dict[str, Any], field: str) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            **extra}
    with pytest.raises(Untranslatable) as caught:
        messages_to_chat(body)
    assert caught.value.param == field


@pytest.mark.parametrize("field", ["min_p", "repetition_penalty", "guided_json", "betas"])
def test_messages_fields_neither_carried_nor_dropped_are_refused_naming_them(
        field: str) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            field: 1}
    with pytest.raises(Untranslatable) as caught:
        messages_to_chat(body)
    assert caught.value.status == 400 and caught.value.param == field


@pytest.mark.parametrize("name", ["claude-code-2.1.332-first.json",
                                  "claude-code-2.1.332-retry.json"])
def test_recorded_claude_code_requests_translate_to_chat(name: str) -> None:
    """Claude Code's real first request (every default tool, cache breakpoints, adaptive
    thinking, context management, a mid-conversation system turn) becomes a Chat request
    that keeps its system prompt, its turns and every tool."""
    body = json.loads((RECORDED / name).read_text())["body"]
    out = messages_to_chat(body)
    assert out["messages"][0]["role"] == "system"
    assert "Claude agent" in out["messages"][0]["content"]
    assert "say hi" in json.dumps(out["messages"])
    assert [t["function"]["name"] for t in out["tools"]] == [t["name"] for t in body["tools"]]
    assert out["max_tokens"] == body["max_tokens"] and out["stream"] is True
    assert "thinking" not in out and "reasoning_effort" not in out  # adaptive: left to the model
    assert "cache_control" not in json.dumps(out)
    # and back: a Messages backend would get the same turns and tools
    again = chat_to_messages(out)
    assert [t["name"] for t in again["tools"]] == [t["name"] for t in body["tools"]]


def test_a_request_round_trips_chat_messages_chat() -> None:
    body = {"model": "m", "max_tokens": 50, "temperature": 0.3, "stop": ["a"],
            "messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "c", "tool_calls": [
                             {"id": "1", "type": "function",
                              "function": {"name": "f", "arguments": '{"x":1}'}}]},
                         {"role": "tool", "tool_call_id": "1", "content": "r"}],
            "tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "auto"}
    assert messages_to_chat(chat_to_messages(body)) == body


# --- whole answers ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_a_chat_answer_round_trips_through_messages(seed: int) -> None:
    answer = random_chat_answer(random.Random(seed))
    assert messages_answer_to_chat(chat_answer_to_messages(answer), 1700000000) == answer


def test_a_messages_answer_becomes_a_chat_answer() -> None:
    body = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
            "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                        {"type": "text", "text": "a"},
                        {"type": "tool_use", "id": "tu", "name": "f", "input": {"k": "v"}}],
            "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 3, "cache_read_input_tokens": 90,
                      "cache_creation_input_tokens": 5}}
    out = messages_answer_to_chat(body, 7)
    message = out["choices"][0]["message"]
    assert message["content"] == "a" and message["reasoning_content"] == "t"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"k":"v"}'}
    assert out["choices"][0]["finish_reason"] == "tool_calls" and out["created"] == 7
    assert out["usage"] == {"prompt_tokens": 105, "completion_tokens": 3,
                            "total_tokens": 108, "prompt_tokens_details": {"cached_tokens": 90}}


def test_the_forced_json_tool_comes_back_as_text() -> None:
    body = {"id": "m", "model": "c", "stop_reason": "tool_use", "content": [
        {"type": "tool_use", "id": "t", "name": JSON_TOOL, "input": {"a": 1}}]}
    message = messages_answer_to_chat(body, 0)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"a":1}'}


def test_a_json_answer_finishes_stop_not_tool_calls() -> None:
    """The forced JSON tool is the client's text, not a call: a `tool_calls` finish with no
    call returned would send an SDK's tool loop looking for one."""
    body = {"id": "m", "model": "c", "stop_reason": "tool_use", "content": [
        {"type": "tool_use", "id": "t", "name": JSON_TOOL, "input": {"a": 1}}]}
    assert messages_answer_to_chat(body, 0)["choices"][0]["finish_reason"] == "stop"
    real = {**body, "content": [{"type": "tool_use", "id": "u", "name": "f", "input": {}}]}
    assert messages_answer_to_chat(real, 0)["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("chat", "messages"), [
    ({"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
      "prompt_tokens_details": {"cached_tokens": 60}},
     {"input_tokens": 40, "output_tokens": 5, "cache_read_input_tokens": 60}),
    ({"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
     {"input_tokens": 7, "output_tokens": 1}),
])
def test_usage_with_cached_tokens_both_ways(chat: dict[str, Any],
                                            messages: dict[str, Any]) -> None:
    assert messages_usage(chat) == messages
    assert chat_usage(messages) == chat


def test_errors_keep_their_meaning_in_the_other_shape() -> None:
    assert messages_error_to_chat({"type": "error", "error": {
        "type": "overloaded_error", "message": "busy"}}) == {"error": {
            "message": "busy", "type": "server_error", "param": None,
            "code": "overloaded_error"}}
    assert chat_error_to_messages({"error": {
        "message": "slow down", "type": "requests", "param": None,
        "code": "rate_limit_exceeded"}}) == {"type": "error", "error": {
            "type": "rate_limit_error", "message": "slow down [code rate_limit_exceeded]"}}


# --- streams ----------------------------------------------------------------------------------


def _translate(machine: ChatToMessages | MessagesToChat | ChatToResponses | ThroughChat,
               raw: bytes) -> bytes:
    return b"".join(machine.feed(event) for event in events_of(raw))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_chat_stream_round_trips_through_messages_event_by_event(seed: int) -> None:
    """Chat chunks -> Messages events -> Chat chunks, each event translated as it comes:
    accumulated, the answer is the one streamed (arguments fragment for fragment)."""
    rng = random.Random(seed)
    answer = random_chat_answer(rng)
    upstream = chat_answer_to_stream(answer, rng)
    to_messages = ChatToMessages()
    as_messages = _translate(to_messages, upstream)
    assert to_messages.ended and not to_messages.failed
    back = MessagesToChat(created=1700000000, include_usage=True)
    as_chat = _translate(back, as_messages)
    assert back.ended
    got, done = chat_stream_to_answer(as_chat)
    assert done
    expected = {k: answer[k] for k in ("id", "model", "choices", "usage")}
    assert got == expected
    assert back.usage == to_messages.usage is not None


def test_each_chat_chunk_is_written_as_it_arrives() -> None:
    """No buffering: the text and each argument fragment are out before the next chunk."""
    machine = ChatToMessages()
    role = machine.feed(SSEEvent(b'{"id":"c","model":"m","choices":[{"index":0,"delta":'
                                 b'{"role":"assistant","content":""}}]}'))
    assert b"message_start" in role
    text = machine.feed(SSEEvent(b'{"id":"c","choices":[{"index":0,"delta":{"content":"Hi"}}]}'))
    assert b'"text_delta","text":"Hi"' in text
    start = machine.feed(SSEEvent(
        b'{"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t",'
        b'"function":{"name":"f","arguments":"{\\"a"}}]}}]}'))
    assert start.index(b"content_block_stop") < start.index(b"tool_use") \
        < start.index(b'"partial_json":"{\\"a"')
    more = machine.feed(SSEEvent(
        b'{"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,'
        b'"function":{"arguments":"\\":1}"}}]}}]}'))
    assert b'"partial_json":"\\":1}"' in more
    assert not machine.ended


def test_a_messages_stream_becomes_chat_chunks_with_usage_and_done() -> None:
    raw = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
           b'"model":"claude","usage":{"input_tokens":3,"cache_read_input_tokens":10,'
           b'"output_tokens":1}}}\n\n'
           b'event: ping\ndata: {"type":"ping"}\n\n'
           b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
           b'"content_block":{"type":"thinking","thinking":""}}\n\n'
           b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
           b'"delta":{"type":"thinking_delta","thinking":"hmm"}}\n\n'
           b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
           b'"delta":{"type":"signature_delta","signature":"sig"}}\n\n'
           b'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
           b'"content_block":{"type":"tool_use","id":"tu","name":"f","input":{}}}\n\n'
           b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
           b'"delta":{"type":"input_json_delta","partial_json":"{\\"k\\":"}}\n\n'
           b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
           b'"delta":{"type":"input_json_delta","partial_json":"2}"}}\n\n'
           b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
           b'"tool_use"},"usage":{"output_tokens":9}}\n\n'
           b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    machine = MessagesToChat(created=5, include_usage=True)
    answer, done = chat_stream_to_answer(_translate(machine, raw))
    assert done and machine.ended
    assert answer["choices"][0]["message"]["reasoning_content"] == "hmm"
    assert answer["choices"][0]["message"]["tool_calls"] == [
        {"id": "tu", "type": "function", "function": {"name": "f", "arguments": '{"k":2}'}}]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["usage"] == {"prompt_tokens": 13, "completion_tokens": 9,
                               "total_tokens": 22,
                               "prompt_tokens_details": {"cached_tokens": 10}}
    assert machine.usage is not None and machine.usage.cached == 10


def test_a_streamed_json_answer_finishes_stop_not_tool_calls() -> None:
    raw = (b'data: {"type":"message_start","message":{"id":"m","model":"c"}}\n\n'
           b'data: {"type":"content_block_start","index":0,"content_block":{"type":'
           b'"tool_use","id":"t","name":"' + JSON_TOOL.encode() + b'","input":{}}}\n\n'
           b'data: {"type":"content_block_delta","index":0,"delta":{"type":'
           b'"input_json_delta","partial_json":"{\\"a\\":1}"}}\n\n'
           b'data: {"type":"message_delta","delta":{"stop_reason":"tool_use"},'
           b'"usage":{"output_tokens":4}}\n\n'
           b'data: {"type":"message_stop"}\n\n')
    answer, done = chat_stream_to_answer(_translate(MessagesToChat(created=0,
                                                                   include_usage=False), raw))
    assert done and answer["choices"][0]["message"]["content"] == '{"a":1}'
    assert "tool_calls" not in answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_an_error_event_in_either_stream_ends_it_in_the_other_shape() -> None:
    to_chat = MessagesToChat(created=0, include_usage=False)
    out = to_chat.feed(SSEEvent(b'{"type":"error","error":{"type":"overloaded_error",'
                                b'"message":"busy"}}', b"error"))
    assert to_chat.failed and json.loads(out[6:])["error"]["code"] == "overloaded_error"
    to_messages = ChatToMessages()
    out = to_messages.feed(SSEEvent(b'{"error":{"message":"boom","type":"server_error"}}'))
    assert to_messages.failed and out.startswith(b"event: error\n")


def test_a_chat_stream_without_usage_asked_gets_no_usage_chunk() -> None:
    machine = MessagesToChat(created=0, include_usage=False)
    raw = (b'data: {"type":"message_start","message":{"id":"m","model":"c"}}\n\n'
           b'data: {"type":"message_stop"}\n\n')
    assert _translate(machine, raw).count(b"data: ") == 2  # the role chunk and [DONE]


# --- Responses (store: false) -> Chat, and -> Messages through Chat ---------------------------


def _responses_final(raw: bytes) -> tuple[list[str], dict[str, Any]]:
    """A Responses stream's event types and the response object of its end event."""
    kinds: list[str] = []
    final: dict[str, Any] = {}
    for event in events_of(raw):
        obj = json.loads(event.data)
        assert event.event is not None and obj["type"] == event.event.decode()
        kinds.append(obj["type"])
        if obj["type"] in ("response.completed", "response.incomplete"):
            final = obj["response"]
    return kinds, final


def _without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in output]


def test_a_responses_request_without_stored_state_becomes_chat() -> None:
    body = {"model": "m", "store": False, "instructions": "be brief", "stream": True,
            "max_output_tokens": 99, "temperature": 0.1, "reasoning": {"effort": "low"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
            "tool_choice": {"type": "function", "name": "f"},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"},
                       "strict": True}],
            "input": [
                {"role": "user", "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "https://x.test/i.png"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2", "output": "two"}]}
    out = responses_to_chat(body)
    assert out["messages"][0] == {"role": "system", "content": "be brief"}
    assert out["messages"][1]["content"][1] == {"type": "image_url",
                                                "image_url": {"url": "https://x.test/i.png"}}
    assert [c["id"] for c in out["messages"][2]["tool_calls"]] == ["c1", "c2"]
    assert out["messages"][3:] == [{"role": "tool", "tool_call_id": "c1", "content": "one"},
                                   {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert out["max_tokens"] == 99 and out["reasoning_effort"] == "low"
    assert out["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert out["response_format"]["json_schema"] == {"name": "x", "schema": {}}
    assert out["tools"][0]["function"]["strict"] is True
    assert out["stream_options"] == {"include_usage": True}
    # and on to Messages (JSON output beside tools is refused there: one forced tool)
    with pytest.raises(Untranslatable):
        chat_to_messages(out)
    del out["response_format"]
    with pytest.raises(Untranslatable):  # thinking beside a named (forced) tool: refused too
        chat_to_messages(out)
    del out["reasoning_effort"]
    assert chat_to_messages(out)["system"] == [{"type": "text", "text": "be brief"}]


@pytest.mark.parametrize(("extra", "field"), [
    ({"store": True}, "store"),
    ({"store": None}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
])
def test_a_responses_request_that_needs_stored_state_or_hosted_tools_is_refused(
        extra: dict[str, Any], field: str) -> None:
    with pytest.raises(Untranslatable) as caught:
        responses_to_chat({"model": "m", "store": False, "input": "hi", **extra})
    assert caught.value.param == field


@pytest.mark.parametrize("field", ["top_k", "min_p", "repetition_penalty", "guided_json"])
def test_responses_fields_neither_carried_nor_dropped_are_refused_naming_them(
        field: str) -> None:
    with pytest.raises(Untranslatable) as caught:
        responses_to_chat({"model": "m", "store": False, "input": "hi", field: 1})
    assert caught.value.status == 400 and caught.value.param == field


@pytest.mark.parametrize("seed", range(60))
def test_a_chat_stream_as_responses_events_ends_in_the_whole_answer(seed: int) -> None:
    """Chat chunks -> Responses events, and Messages events -> Responses events through Chat:
    the end event's response holds the output the whole answer's translation holds."""
    rng = random.Random(seed)
    answer = random_chat_answer(rng)
    whole = chat_answer_to_responses(answer, 1700000000)
    upstream = chat_answer_to_stream(answer, rng)
    direct = ChatToResponses(1700000000)
    kinds, final = _responses_final(_translate(direct, upstream))
    assert direct.ended and kinds[:2] == ["response.created", "response.in_progress"]
    assert _without_ids(final["output"]) == _without_ids(whole["output"])
    assert final["status"] == whole["status"] and final["usage"] == whole["usage"]
    assert (final["incomplete_details"] is None) == (whole["incomplete_details"] is None)
    assert kinds.count("response.output_item.added") == len(whole["output"])
    as_messages = _translate(ChatToMessages(), upstream)
    chained = ThroughChat(1700000000)
    _kinds, through = _responses_final(_translate(chained, as_messages))
    assert chained.ended
    assert _without_ids(through["output"]) == _without_ids(whole["output"])


def test_a_chat_error_chunk_is_a_responses_error_event() -> None:
    machine = ChatToResponses(0)
    out = machine.feed(SSEEvent(b'{"error":{"message":"x","type":"server_error"}}'))
    assert machine.failed and out.startswith(b"event: error\n")
    assert json.loads(out.split(b"data: ", 1)[1])["code"] == "server_error"


def test_the_spliced_deltas_are_the_parsed_ones_byte_for_byte() -> None:
    """The fast path (a delta of the usual shape spliced without parsing) writes exactly what
    the parse writes for the same delta in another key order."""
    start = (b'{"type":"message_start","message":{"id":"m","model":"c"}}',
             b'{"type":"content_block_start","index":0,"content_block":{"type":"text",'
             b'"text":""}}',
             b'{"type":"content_block_start","index":1,"content_block":{"type":"tool_use",'
             b'"id":"t","name":"f","input":{}}}')
    fast, slow = MessagesToChat(3, True), MessagesToChat(3, True)
    for data in start:
        assert fast.feed(SSEEvent(data)) == slow.feed(SSEEvent(data))
    for usual, other in (
        (b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
         b'"text":"a\\"b\\u00e9"}}',
         b'{"index":0,"type":"content_block_delta","delta":{"text":"a\\"b\\u00e9",'
         b'"type":"text_delta"}}'),
        (b'{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
         b'"partial_json":"{\\"k"}}',
         b'{"index":1,"type":"content_block_delta","delta":{"partial_json":"{\\"k",'
         b'"type":"input_json_delta"}}'),
    ):
        assert fast.feed(SSEEvent(usual)) == slow.feed(SSEEvent(other))
    chat_fast, chat_slow = ChatToMessages(), ChatToMessages()
    role = b'{"id":"c","model":"m","choices":[{"index":0,"delta":{"content":"x"}}]}'
    assert chat_fast.feed(SSEEvent(role)) == chat_slow.feed(SSEEvent(role))
    usual = (b'{"id":"c","choices":[{"index":0,"delta":{"content":"\\"q\\""},'
             b'"logprobs":null,"finish_reason":null}],"usage":null}')
    other = b'{"id":"c","choices":[{"delta":{"content":"\\"q\\""},"index":0}]}'
    assert chat_fast.feed(SSEEvent(usual)) == chat_slow.feed(SSEEvent(other))


def _spaced(event: SSEEvent) -> SSEEvent:
    """The same event with its payload written spaced, as no fast path reads it: the parse's
    way (the reference for the fast paths)."""
    return SSEEvent(json.dumps(json.loads(event.data), separators=(", ", ": ")).encode(),
                    event.event)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_messages_stream_fed_by_read_is_the_parsed_one_byte_for_byte(seed: int) -> None:
    """`feed_all` (deltas cut from their bytes, scaffolding told by its bytes, chunks built
    from a per-stream opening) writes exactly what parsing every event writes, for streams
    of text, reasoning, parallel calls and the forced JSON tool, cut into random reads; and
    a Messages client's classification of each event is the parse's too."""
    rng = random.Random(seed)
    answer = random_chat_answer(rng)
    events = events_of(_translate(ChatToMessages(), chat_answer_to_stream(answer, rng)))
    # the keep-alive, an empty text block's start and a block's stop as servers send them
    events.insert(1, SSEEvent(b'{"type":"ping"}', b"ping"))
    if rng.random() < 0.3:  # the forced JSON tool: its arguments are the answer's text
        events = [SSEEvent(e.data.replace(b'"name":"get_weather"',
                                          b'"name":"' + JSON_TOOL.encode() + b'"'), e.event)
                  for e in events]
    created = rng.choice([0, 1700000000])
    fast = MessagesToChat(created, include_usage=rng.random() < 0.5)
    slow = MessagesToChat(created, include_usage=fast.include_usage)
    got, at = [], 0
    while at < len(events):
        size = rng.randint(1, 8)
        got.append(fast.feed_all(events[at:at + size]))
        at += size
    expected = [slow.feed(_spaced(e)) for e in events]
    assert b"".join(got) == b"".join(expected)
    assert fast.ended and slow.ended and fast.usage == slow.usage
    for event in events:
        assert classify_messages(event) is classify_messages(_spaced(event)), event


@pytest.mark.parametrize("text", ["", "x", "tok0 ", '"', "\\", "\n", "\t", "é🙂", "a\"b"])
def test_the_usual_delta_s_fast_reads_are_the_parse_s(text: str) -> None:
    """A delta whose text holds an escape, a quote or nothing: the fast paths (the
    classification's and the translation's) read it as the parse does."""
    for kind, field in (("text_delta", "text"), ("input_json_delta", "partial_json"),
                        ("thinking_delta", "thinking")):
        event = SSEEvent(json.dumps({"type": "content_block_delta", "index": 0, "delta": {
            "type": kind, field: text}}, separators=(",", ":")).encode())
        assert classify_messages(event) is classify_messages(_spaced(event))
    start = SSEEvent(b'{"type":"content_block_start","index":0,"content_block":'
                     b'{"type":"text","text":""}}')
    delta = SSEEvent(json.dumps({"type": "content_block_delta", "index": 0, "delta": {
        "type": "text_delta", "text": text}}, separators=(",", ":")).encode())
    fast, slow = MessagesToChat(1, True), MessagesToChat(1, True)
    assert fast.feed_all([start, delta, delta]) == b"".join(
        [slow.feed(_spaced(start)), slow.feed(_spaced(delta)), slow.feed(_spaced(delta))])


@pytest.mark.parametrize("ident", [None, "msg_1", 'q"\\é', 7])
def test_a_chunk_built_from_the_stream_s_opening_is_the_dict_s_json(ident: object) -> None:
    """Each chunk (a delta, a finish, the usage) is what compact JSON of the whole chunk
    object writes, whatever the id and the model hold."""
    machine = MessagesToChat(1700000000, include_usage=True)
    machine.feed(SSEEvent(json.dumps({"type": "message_start", "message": {
        "id": ident, "model": "claude-é", "usage": {"input_tokens": 2}}}).encode()))
    head = {"id": ident, "object": "chat.completion.chunk", "created": 1700000000,
            "model": "claude-é"}

    def data(obj: object) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    for delta, finish in (({"content": "a"}, None), ({}, "stop"),
                          ({"role": "assistant", "content": ""}, None)):
        assert machine._chunk(delta, finish) == data({**head, "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})
    assert machine.feed(SSEEvent(b'{"type":"message_stop"}')) == data(
        {**head, "choices": [], "usage": chat_usage({"input_tokens": 2})}) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("seed", SEEDS)
def test_a_chat_stream_fed_by_read_is_the_parsed_one_byte_for_byte(seed: int) -> None:
    """`ChatToMessages.feed_all` (a text chunk that differs from the last only in its text cut
    by its bytes, the answer's first text opening its block without a parse) writes exactly
    what parsing every chunk writes, over streams of text, reasoning and parallel calls cut
    into random reads."""
    rng = random.Random(seed)
    events = events_of(chat_answer_to_stream(random_chat_answer(rng), rng))
    fast, slow = ChatToMessages(), ChatToMessages()
    got, at = [], 0
    while at < len(events):
        size = rng.randint(1, 8)
        got.append(fast.feed_all(events[at:at + size]))
        at += size
    expected = [slow.feed(e if e.data == b"[DONE]" else _spaced(e)) for e in events]
    assert b"".join(got) == b"".join(expected)
    assert fast.ended and slow.ended and fast.usage == slow.usage


@pytest.mark.parametrize(("translate", "extra", "field"), [
    (chat_to_messages, {"messages": [{"role": "user", "content": 5}]}, "messages[0]"),
    (chat_to_messages, {"messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [5]}]}, "messages[1]"),
    (chat_to_messages, {"tools": [{"type": "function", "function": "f"}]}, "tools[0]"),
    (messages_to_chat, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "tool_result", "content": 5}]}]},
     "messages[0]"),
    (responses_to_chat, {"input": [{"role": "user", "content": 5}]}, "input[0]"),
    (responses_to_chat, {"input": [{"type": "function_call_output", "output": 5}]},
     "input[0]"),
])
def test_a_value_of_a_shape_the_translation_cannot_read_is_refused_naming_its_item(
        translate: Any, extra: dict[str, Any], field: str) -> None:
    """A value the body check lets through (it looks no deeper than the items of `messages`
    and `tools` being objects) that a translation cannot read: refused naming the item
    (`Unreadable`, a 400), never the translation's own TypeError or AttributeError."""
    base: dict[str, Any] = {"model": "m", "store": False} if translate is responses_to_chat \
        else {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body = {**base, **extra}
    with pytest.raises(Unreadable) as caught:
        translate(body)
    assert caught.value.status == 400 and caught.value.param == field
    assert caught.value.should_retry is False and isinstance(caught.value, Untranslatable)


def test_the_stream_translations_byte_checks_read_only_json_block_indexes() -> None:
    """The scaffolding and delta matchers that spare a parse take a block index only as JSON
    writes one: `00` or `01` is no JSON, so such an event takes the parse's way (which drops
    it) rather than being spliced or opening a block."""
    for index in (b"0", b"12"):
        assert stream._block_stop(b'{"type":"content_block_stop","index":%s}' % index)
        assert stream._text_start(b'{"type":"content_block_start","index":%s,'
                                  b'"content_block":{"type":"text","text":""}}' % index)
        assert stream._messages_delta(b'{"type":"content_block_delta","index":%s,"delta":'
                                      b'{"type":"text_delta","text":"a"}}' % index)
    for index in (b"00", b"01"):
        assert stream._block_stop(b'{"type":"content_block_stop","index":%s}' % index) is None
        assert stream._text_start(b'{"type":"content_block_start","index":%s,'
                                  b'"content_block":{"type":"text","text":""}}' % index) is None
        assert stream._messages_delta(b'{"type":"content_block_delta","index":%s,"delta":'
                                      b'{"type":"text_delta","text":"a"}}' % index) is None
        chunk = (b'{"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":%s,'
                 b'"function":{"arguments":"{}"}}]},"finish_reason":null}]}' % index)
        assert stream._chat_delta(chunk, chunk.find(b'"choices"')) is None
    chunk = (b'{"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":3,'
             b'"function":{"arguments":"{}"}}]},"finish_reason":null}]}')
    assert stream._chat_delta(chunk, chunk.find(b'"choices"'))


_OPEN = b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'


def _delta(text: bytes, opening: bytes = _OPEN) -> SSEEvent:
    return SSEEvent(opening + text + b"}}", b"content_block_delta")


#: runs of deltas `splice_run` must leave to `feed` one by one (None), each beside usual
#: deltas: an escape, a quote inside a text, a text of one quote (`"}}`) with a stray quote
#: elsewhere to keep the count, first and last, an extra field, another block's delta, a
#: line feed in the data (a multi-line `data:`), a number for a text
_UNUSUAL_RUNS: list[list[bytes]] = [
    [b'"a"', b'"b\\"c"', b'"d"'],
    [b'"a"', b'"b"c"', b'"d"'],
    [b'"', b'"x"y"', b'"z"'],
    [b'"x"y"', b'"z"', b'"'],
    [b'"a"', b'"b","x":"y"', b'"c"'],
    [b'"a"', b'"b\nc"', b'"d"'],
    [b'"a"', b"7", b'"b""c"'],
]


#: the scaffolding around the runs of deltas the two byte-for-byte tests below feed: the
#: message's and its text block's start, another block's delta, and the stream's end
_RUN_START = SSEEvent(b'{"type":"message_start","message":{"id":"m","model":"c",'
                      b'"usage":{"input_tokens":3,"output_tokens":1}}}', b"message_start")
_RUN_BLOCK = SSEEvent(b'{"type":"content_block_start","index":0,"content_block":'
                      b'{"type":"text","text":""}}', b"content_block_start")
_RUN_OTHER = _delta(b'"o"', _OPEN.replace(b'"index":0', b'"index":1'))
_RUN_END = [SSEEvent(b'{"type":"content_block_stop","index":0}', b"content_block_stop"),
            SSEEvent(b'{"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                     b'"usage":{"output_tokens":5}}', b"message_delta"),
            SSEEvent(b'{"type":"message_stop"}', b"message_stop")]


@pytest.mark.parametrize("texts", [
    [b'"tok0 "', b'"tok1 "', b'"tok2 "'], [b'""', b'" "', b'"x"'], [b'"a"', b'"b"'],
    *_UNUSUAL_RUNS])
def test_a_run_of_deltas_fed_by_read_is_each_fed_byte_for_byte(texts: list[bytes]) -> None:
    """A read that opens with a run of the current block's deltas (`splice_run`, then the
    rest `_each`) writes exactly what feeding each event writes: usual runs, and runs with
    one delta of an unusual or broken shape among them, before the stream's last events."""
    start, block, other, end = _RUN_START, _RUN_BLOCK, _RUN_OTHER, _RUN_END
    run = [_delta(text) for text in texts]
    for read in (run, [*run, *end], [*run, other, *run], [*run, _delta(b'"z"'), *end]):
        fast, slow = MessagesToChat(1, True), MessagesToChat(1, True)
        opened = fast.feed_all([start, block, _delta(b'"first"')])
        assert opened == b"".join(slow.feed(e) for e in [start, block, _delta(b'"first"')])
        assert fast.feed_all(read) == b"".join(slow.feed(e) for e in read)
        assert fast.ended == slow.ended and fast.usage == slow.usage


@pytest.mark.parametrize("texts", _UNUSUAL_RUNS)
def test_a_run_with_an_unusual_delta_is_not_spliced(texts: list[bytes]) -> None:
    """`splice_run` splices only runs whose every event the per-event path would cut."""
    before, after = b"<", b">"
    assert stream.splice_run([_OPEN + t + b"}}" for t in texts], _OPEN, before, after) is None
    usual = [b'"a"', b'""', b'"caf\xc3\xa9 "', b"\"'\""]
    assert stream.splice_run([_OPEN + t + b"}}" for t in usual], _OPEN, before, after) == (
        b'<"a"><""><"caf\xc3\xa9 "><"\'">')


def _framed(events: list[SSEEvent]) -> bytes:
    """`events` as a Messages server writes them: each its name and its one data line."""
    return b"".join(b"event: " + (e.event or b"x") + b"\ndata: " + e.data + b"\n\n"
                    for e in events)


def _relayed(reads: list[bytes]) -> bytes:
    """What the relay writes for a Messages stream read as `reads`, translated to Chat: the
    first read decoded (the race classifies it), each later one through the encoder's batch
    path (`SSEBatch.named`, `feed_named`) as the decoder hands it on."""
    encoder = TRANSLATIONS[("chat/completions", "messages")].encoder(
        1, True, lambda message, code, request_id: b"error\n\n")
    outcome, decoder, out = RelayOutcome(), SSEDecoder(), []
    for i, read in enumerate(reads):
        batch = decoder.feed_batch(read)
        assert batch is not None
        if i == 0:
            out.append(encoder.events(batch.events, "r", outcome))
        else:
            assert encoder.batch is not None
            out.append(encoder.batch(batch, "r", outcome))
    return b"".join(out)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_messages_stream_read_by_its_bytes_is_the_parsed_one_byte_for_byte(
        seed: int) -> None:
    """Reads in the named framing written by `feed_named` (a run of deltas spliced from the
    read's bytes, the rest decoded) give exactly what parsing every event gives, for
    streams of text, reasoning, parallel calls and the forced JSON tool cut into random
    reads."""
    rng = random.Random(seed)
    events = events_of(_translate(ChatToMessages(), chat_answer_to_stream(
        random_chat_answer(rng), rng)))
    events.insert(1, SSEEvent(b'{"type":"ping"}', b"ping"))
    if rng.random() < 0.3:
        events = [SSEEvent(e.data.replace(b'"name":"get_weather"',
                                          b'"name":"' + JSON_TOOL.encode() + b'"'), e.event)
                  for e in events]
    reads, at = [], 0
    while at < len(events):
        size = rng.randint(1, 40)
        reads.append(_framed(events[at:at + size]))
        at += size
    slow = MessagesToChat(1, include_usage=True)
    assert _relayed(reads) == b"".join(slow.feed(_spaced(e)) for e in events)


@pytest.mark.parametrize("texts", [
    [b'"tok0 "', b'"tok1 "', b'"tok2 "'], [b'""', b'" "'], [b'""'], [b'"a"'], *_UNUSUAL_RUNS])
def test_a_read_of_deltas_by_its_bytes_is_each_fed_byte_for_byte(texts: list[bytes]) -> None:
    """`feed_named` over reads that open with a run of the current block's deltas, usual or
    with one of an unusual or broken shape among them, before the stream's last events,
    another block's delta or more of the run: what feeding each decoded event writes."""
    start, other, end = [_RUN_START, _RUN_BLOCK, _delta(b'"f"')], _RUN_OTHER, _RUN_END
    run = [_delta(text) for text in texts]
    for read in (run, [*run, *end], [*run, other, *run], [*run, _delta(b'"z"'), *end]):
        slow = MessagesToChat(1, True)  # (a text's LF breaks its line: the decoder's reading)
        expected = b"".join(slow.feed(e) for e in events_of(_framed([*start, *read])))
        assert _relayed([_framed(start), _framed(read)]) == expected


def test_a_usual_read_of_deltas_is_never_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first read, a run of deltas and the stream's end are written from the
    read's bytes: no later read is decoded, and of the last only the end's events are
    built."""
    start = [SSEEvent(b'{"type":"message_start","message":{"id":"m","model":"c"}}',
                      b"message_start"),
             SSEEvent(b'{"type":"content_block_start","index":0,"content_block":'
                      b'{"type":"text","text":""}}', b"content_block_start"), _delta(b'"f"')]
    run = [_delta(b'"tok%d "' % i) for i in range(30)]
    end = [SSEEvent(b'{"type":"content_block_stop","index":0}', b"content_block_stop"),
           SSEEvent(b'{"type":"message_stop"}', b"message_stop")]
    slow = MessagesToChat(1, True)
    expected = b"".join(slow.feed(e) for e in [*start, *run, *run[:5], *end])
    encoder = TRANSLATIONS[("chat/completions", "messages")].encoder(
        1, True, lambda message, code, request_id: b"error\n\n")
    outcome, decoder = RelayOutcome(), SSEDecoder()
    first = decoder.feed_batch(_framed(start))
    assert first is not None and encoder.batch is not None
    out = [encoder.events(first.events, "r", outcome)]
    built: list[bytes] = []
    real = named_events

    def counting(chunk: bytes) -> list[SSEEvent] | None:
        found = real(chunk)
        built.extend(e.data for e in found or ())
        return found

    monkeypatch.setattr(stream, "named_events", counting)
    monkeypatch.setattr(SSEBatch, "decoded", None)  # a later read decoded: TypeError
    for read in (_framed(run), _framed(run[:5] + end)):
        batch = decoder.feed_batch(read)
        assert batch is not None
        out.append(encoder.batch(batch, "r", outcome))
        assert batch.count() == read.count(b"\n\n")
    assert b"".join(out) == expected and outcome.end is StreamEnd.DONE
    assert built == [e.data for e in end]


def test_the_first_read_s_deltas_after_the_first_are_spliced_as_a_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At zero delay the first read (the one the race decodes) often holds the whole answer:
    once its first delta has named the block, the deltas after it are spliced as a run, the
    stream's end fed, and the bytes are what feeding each event writes."""
    start = [SSEEvent(b'{"type":"message_start","message":{"id":"m","model":"c"}}',
                      b"message_start"),
             SSEEvent(b'{"type":"content_block_start","index":0,"content_block":'
                      b'{"type":"text","text":""}}', b"content_block_start"),
             SSEEvent(b'{"type":"ping"}', b"ping")]
    deltas = [_delta(b'"tok%d "' % i) for i in range(5)]
    end = [SSEEvent(b'{"type":"content_block_stop","index":0}', b"content_block_stop"),
           SSEEvent(b'{"type":"message_stop"}', b"message_stop")]
    runs: list[int] = []
    real = stream.splice_run

    def spy(datas: list[bytes], opening: bytes, before: bytes, after: bytes) -> bytes | None:
        runs.append(len(datas))
        return real(datas, opening, before, after)

    monkeypatch.setattr(stream, "splice_run", spy)
    slow = MessagesToChat(1, True)
    read = [*start, *deltas, *end]
    assert MessagesToChat(1, True).feed_all(read) == b"".join(slow.feed(e) for e in read)
    assert runs == [4]


@pytest.mark.parametrize("delta", [
    # a text delta that names the other kind's field: the parse reads no text in it
    b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"partial_json":"x"}}',
    # a raw line feed inside the string (no JSON has one; a multi-line `data:` makes it):
    # written raw, it would cut the client's event and could add a `data: [DONE]` line
    b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"text":"a\ndata: [DONE]"}}',
])
def test_a_delta_of_an_unusual_shape_is_not_spliced(delta: bytes) -> None:
    """Only the usual delta is spliced from its bytes; one whose kind and field disagree, or
    whose text holds a raw line feed, is left to the parse, whatever that makes of
    it, so the fast path never writes what the parse would not."""
    start = (b'{"type":"message_start","message":{"id":"m","model":"c"}}',
             b'{"type":"content_block_start","index":0,"content_block":{"type":"text",'
             b'"text":""}}')
    machine = MessagesToChat(3, True)
    for data in start:
        machine.feed(SSEEvent(data))
    out = machine.feed(SSEEvent(delta))
    assert b"[DONE]" not in out and b'"x"' not in out


def test_a_messages_tool_choice_without_tools_leaves_chat_without_one() -> None:
    """The Messages API takes `tool_choice` with no tools; Chat refuses one without tools, so
    the translated request would fail only for being translated."""
    body = {"model": "m", "max_tokens": 10, "tool_choice": {"type": "auto"},
            "messages": [{"role": "user", "content": "hi"}]}
    assert check_request("messages", body) is None
    chat = messages_to_chat(body)
    assert "tool_choice" not in chat and check_request("chat/completions", chat) is None


def test_a_responses_tool_output_with_an_image_is_refused_never_dropped() -> None:
    """A Chat tool message carries text only: a tool's output with an image part (the
    Responses API allows it) is refused, naming the part, rather than sent without it."""
    call = {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"}
    text = {"type": "input_text", "text": "here it is"}
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}

    def with_output(*parts: dict[str, Any]) -> dict[str, Any]:
        return {"model": "m", "store": False, "input": [call, {
            "type": "function_call_output", "call_id": "c1", "output": list(parts)}]}

    with pytest.raises(Untranslatable) as caught:
        responses_to_chat(with_output(text, image))
    assert caught.value.param == "input[1].output[1].type"
    text_only = with_output(text)
    assert responses_to_chat(text_only)["messages"][-1] == {
        "role": "tool", "tool_call_id": "c1", "content": "here it is"}
