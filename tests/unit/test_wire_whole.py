"""The pure assembly of a whole answer from its stream (`gateway.wire.whole`): text, tool
calls and usage rebuilt; anything that is not one complete answer is None."""

from __future__ import annotations

import json
from typing import Any

from gateway.wire.sse import SSEEvent
from gateway.wire.whole import streamed_body, whole_answer


def data(obj: Any) -> SSEEvent:
    return SSEEvent(json.dumps(obj).encode())


def named(obj: dict[str, Any]) -> SSEEvent:
    return SSEEvent(json.dumps(obj).encode(), obj["type"].encode())


HEAD = {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def chunk(delta: dict[str, Any], finish: str | None = None) -> SSEEvent:
    return data({**HEAD, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_a_chat_stream_becomes_one_completion() -> None:
    events = [chunk({"role": "assistant", "content": ""}), chunk({"content": "a "}),
              chunk({"content": "b"}), chunk({}, "stop"),
              data({**HEAD, "choices": [], "usage": USAGE}), SSEEvent(b"[DONE]")]
    assert whole_answer("chat", events) == {
        "id": "c1", "object": "chat.completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b",
                                             "refusal": None},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE}


def test_a_chat_tool_call_is_joined_by_index() -> None:
    events = [chunk({"role": "assistant", "tool_calls": [
                  {"index": 0, "id": "t1", "type": "function",
                   "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
              chunk({}, "tool_calls"), SSEEvent(b"[DONE]")]
    answer = whole_answer("chat", events)
    assert answer is not None
    message = answer["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]


def test_a_chat_stream_with_an_error_or_without_its_end_is_no_answer() -> None:
    start = [chunk({"role": "assistant"}), chunk({"content": "a"})]
    assert whole_answer("chat", [*start, data({"error": {"message": "x"}})]) is None
    assert whole_answer("chat", start) is None
    assert whole_answer("chat", [*start, chunk({}, "stop")]) is None  # no [DONE]
    assert whole_answer("chat", [SSEEvent(b"not json")]) is None


def test_a_messages_stream_becomes_one_message() -> None:
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 1}}}
    events = [named(start),
              named({"type": "content_block_start", "index": 0,
                     "content_block": {"type": "text", "text": ""}}),
              named({"type": "ping"}),
              named({"type": "content_block_delta", "index": 0,
                     "delta": {"type": "text_delta", "text": "a "}}),
              named({"type": "content_block_delta", "index": 0,
                     "delta": {"type": "text_delta", "text": "b"}}),
              named({"type": "content_block_stop", "index": 0}),
              named({"type": "content_block_start", "index": 1, "content_block": {
                  "type": "tool_use", "id": "t", "name": "f", "input": {}}}),
              named({"type": "content_block_delta", "index": 1,
                     "delta": {"type": "input_json_delta", "partial_json": '{"x": 2}'}}),
              named({"type": "content_block_stop", "index": 1}),
              named({"type": "message_delta", "delta": {"stop_reason": "tool_use",
                                                        "stop_sequence": None},
                     "usage": {"output_tokens": 9}}),
              named({"type": "message_stop"})]
    assert whole_answer("messages", events) == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "a b"},
                    {"type": "tool_use", "id": "t", "name": "f", "input": {"x": 2}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 9}}
    assert whole_answer("messages", events[:-1]) is None
    assert whole_answer("messages", [*events[:4], named(
        {"type": "error", "error": {"type": "overloaded_error", "message": "x"}})]) is None


def test_what_is_read_as_a_stream() -> None:
    body = {"model": "m", "messages": []}
    assert streamed_body("chat/completions", body) == {
        **body, "stream": True, "stream_options": {"include_usage": True}}
    assert streamed_body("messages", body) == {**body, "stream": True}
    assert streamed_body("chat/completions", {**body, "n": 2}) is None
    assert streamed_body("chat/completions", {**body, "logprobs": True}) is None
    assert streamed_body("responses", {"model": "m", "input": "hi"}) == {
        "model": "m", "input": "hi", "stream": True}
    for other in ("completions", "embeddings"):
        assert streamed_body(other, body) is None


RESPONSE = {"id": "resp_1", "object": "response", "created_at": 7, "status": "completed",
            "model": "m", "output": [{"id": "msg_1", "type": "message", "role": "assistant",
                                      "status": "completed", "content": [
                                          {"type": "output_text", "text": "a b",
                                           "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}


def responses_stream(end: str = "response.completed") -> list[SSEEvent]:
    """A Responses stream of "a b", ending with `end` and the whole response."""
    open_response = {**RESPONSE, "status": "in_progress", "output": [], "usage": None}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress",
            "content": []}
    return [named({"type": "response.created", "response": open_response}),
            named({"type": "response.in_progress", "response": open_response}),
            named({"type": "response.output_item.added", "output_index": 0, "item": item}),
            named({"type": "response.content_part.added", "item_id": "msg_1",
                   "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
            named({"type": "response.output_text.delta", "item_id": "msg_1",
                   "output_index": 0, "content_index": 0, "delta": "a "}),
            named({"type": "response.output_text.delta", "item_id": "msg_1",
                   "output_index": 0, "content_index": 0, "delta": "b"}),
            named({"type": "response.output_text.done", "item_id": "msg_1",
                   "output_index": 0, "content_index": 0, "text": "a b"}),
            named({"type": end, "response": {
                **RESPONSE, "status": end.removeprefix("response.")}})]


def test_a_responses_stream_becomes_the_response_it_ends_with() -> None:
    """The Responses API's end event holds the whole response: that is the answer, at its
    output limit (`incomplete`) too."""
    assert whole_answer("responses", responses_stream()) == RESPONSE
    incomplete = whole_answer("responses", responses_stream("response.incomplete"))
    assert incomplete == {**RESPONSE, "status": "incomplete"}


def test_a_responses_stream_that_failed_or_has_no_end_is_no_answer() -> None:
    events = responses_stream()
    assert whole_answer("responses", events[:-1]) is None
    assert whole_answer("responses", responses_stream("response.failed")) is None
    error = named({"type": "error", "code": "server_error", "message": "x"})
    assert whole_answer("responses", [*events[:5], error, events[-1]]) is None
    assert whole_answer("responses", [*events[:-1], named(
        {"type": "response.completed", "response": ["not", "a", "response"]})]) is None
