"""The wire side of a continued answer (`gateway.wire.resume`): what the client holds, the
request that continues it, and how the continuation's events join the relayed ones."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from gateway.wire.resume import (
    Splice,
    continuation_body,
    ended_at_limit,
    limit_reached,
    relayed_answer,
)
from gateway.wire.sse import SSEEvent


def chat(delta: dict[str, Any], finish: str | None = None, **head: Any) -> SSEEvent:
    obj = {"id": head.get("id", "c1"), "created": head.get("created", 1),
           "model": head.get("model", "m"),
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return SSEEvent(json.dumps(obj).encode())


def named(kind: str, **payload: Any) -> SSEEvent:
    return SSEEvent(json.dumps({"type": kind, **payload}).encode(), kind.encode())


RELAYED_CHAT = [chat({"role": "assistant", "content": ""}), chat({"content": "tok0 "}),
                chat({"content": "tok1 "})]


def test_the_relayed_chat_text_and_what_is_not_continued() -> None:
    answer = relayed_answer("chat", RELAYED_CHAT)
    assert answer is not None and (answer.text, answer.tokens) == ("tok0 tok1 ", 2)
    assert answer.head == {"id": "c1", "created": 1, "model": "m"}
    tool = chat({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]})
    assert relayed_answer("chat", [*RELAYED_CHAT, tool]) is None
    assert relayed_answer("chat", [*RELAYED_CHAT, chat({}, "stop")]) is None
    assert relayed_answer("chat", [chat({"reasoning_content": "hmm"})]) is None
    assert relayed_answer("responses", RELAYED_CHAT) is None  # not a continued route


def test_continuation_bodies_per_style() -> None:
    answer = relayed_answer("chat", RELAYED_CHAT)
    assert answer is not None
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    prefill, dropped = continuation_body(body, answer, "prefill")
    assert prefill["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 "}
    assert prefill["max_tokens"] == 8 and dropped == "" and body["max_tokens"] == 10
    assert "continue_final_message" not in prefill
    vllm, _ = continuation_body(body, answer, "continue_final_message")
    assert vllm["continue_final_message"] is True and vllm["add_generation_prompt"] is False
    # the client's own prefill goes on with the relayed text
    own = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "Sure: "}]}
    merged, _ = continuation_body(own, answer, "prefill")
    assert merged["messages"][-1]["content"] == "Sure: tok0 tok1 "
    assert len(merged["messages"]) == 2


MESSAGES_RELAYED = [
    named("message_start", message={"id": "msg_1", "model": "m", "usage": {"input_tokens": 5}}),
    named("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    named("ping"),
    named("content_block_delta", index=0, delta={"type": "text_delta", "text": "tok0 "}),
]


def test_a_messages_continuation_joins_the_open_text_block() -> None:
    answer = relayed_answer("messages", MESSAGES_RELAYED)
    assert answer is not None and answer.open_index == 0 and answer.tokens == 1
    body, dropped = continuation_body({"messages": [{"role": "user", "content": "hi"}]},
                                      answer, "prefill")
    assert body["messages"][-1]["content"] == "tok0" and dropped == " "
    splice = Splice(answer, dropped)
    out = splice.events([
        named("message_start", message={"id": "msg_2", "model": "m2"}),
        named("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        named("ping"),
        named("content_block_delta", index=0, delta={"type": "text_delta", "text": " tok1 "}),
        named("content_block_stop", index=0),
        named("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 4}),
        named("message_stop"),
    ])
    kinds = [json.loads(e.data)["type"] for e in out]
    assert kinds == ["content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert json.loads(out[0].data)["delta"]["text"] == "tok1 "
    assert json.loads(out[2].data)["usage"]["output_tokens"] == 5


def test_a_chat_splice_drops_the_role_chunk_and_keeps_the_ids() -> None:
    answer = relayed_answer("chat", RELAYED_CHAT)
    assert answer is not None
    out = Splice(answer).events([
        chat({"role": "assistant", "content": ""}, id="c2", created=9, model="other"),
        chat({"content": "tok2 "}, id="c2", created=9, model="other"),
        chat({}, "stop", id="c2", created=9, model="other"),
        SSEEvent(json.dumps({"id": "c2", "choices": [], "usage": {
            "prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}).encode()),
        SSEEvent(b"[DONE]"),
    ])
    objs = [json.loads(e.data) for e in out[:-1]]
    assert [o["id"] for o in objs] == ["c1"] * 3 and out[-1].data == b"[DONE]"
    assert objs[0]["choices"][0]["delta"] == {"content": "tok2 "}
    assert objs[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3,
                                "total_tokens": 13}


def test_the_responses_api_continues_one_open_message_item_only() -> None:
    created = named("response.created", sequence_number=0,
                    response={"id": "resp_1", "model": "m", "output": []})
    message = named("response.output_item.added", sequence_number=1, output_index=0,
                    item={"id": "msg_1", "type": "message", "content": []})
    part = named("response.content_part.added", sequence_number=2, item_id="msg_1",
                 output_index=0, content_index=0, part={"type": "output_text", "text": ""})
    delta = named("response.output_text.delta", sequence_number=3, item_id="msg_1",
                  output_index=0, content_index=0, delta="tok0 ")
    answer = relayed_answer("responses", [created, message, part, delta])
    assert answer is not None and answer.text == "tok0 " and answer.head["seq"] == 4
    body, _ = continuation_body({"input": "hi", "max_output_tokens": 5}, answer, "prefill")
    assert body["input"] == [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "tok0 "}]
    assert body["max_output_tokens"] == 4
    call = named("response.output_item.added", sequence_number=1, output_index=0,
                 item={"id": "fc_1", "type": "function_call"})
    assert relayed_answer("responses", [created, call]) is None
    done = named("response.output_text.done", sequence_number=4, item_id="msg_1", text="x")
    assert relayed_answer("responses", [created, message, part, delta, done]) is None


def test_a_chat_usage_chunk_before_any_continued_text_is_kept() -> None:
    """A break after the last text delta: the continuation sends only its finish and usage
    chunks, and the usage chunk (include_usage) reaches the client, counted as one answer."""
    answer = relayed_answer("chat", RELAYED_CHAT)
    assert answer is not None
    out = Splice(answer).events([
        chat({"role": "assistant", "content": ""}, id="c2"),
        chat({}, "stop", id="c2"),
        SSEEvent(json.dumps({"id": "c2", "choices": [], "usage": {
            "prompt_tokens": 12, "completion_tokens": 0, "total_tokens": 12}}).encode()),
        SSEEvent(b"[DONE]"),
    ])
    objs = [json.loads(e.data) for e in out[:-1]]
    assert [o["choices"] for o in objs][1] == []
    assert objs[0]["choices"][0]["finish_reason"] == "stop"
    assert objs[1]["id"] == "c1" and objs[1]["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    assert out[-1].data == b"[DONE]"


def test_a_messages_continuation_keeps_the_original_input_usage() -> None:
    """The continuation's message_delta carries its own (cumulative) input usage; the
    answer's input is the original message_start's, so those fields are left out."""
    answer = relayed_answer("messages", MESSAGES_RELAYED)
    assert answer is not None
    out = Splice(answer).events([
        named("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        named("content_block_delta", index=0, delta={"type": "text_delta", "text": "x"}),
        named("message_delta", delta={"stop_reason": "end_turn"}, usage={
            "input_tokens": 101, "cache_read_input_tokens": 7,
            "cache_creation_input_tokens": 3, "output_tokens": 4}),
    ])
    assert json.loads(out[-1].data)["usage"] == {"output_tokens": 5}


def test_an_answer_at_its_output_limit_is_not_continued_but_ends_at_the_limit() -> None:
    """The relayed text holds max_tokens already: no continuation (it would be asked for
    one token more than the client allowed); the answer ends as a limit ends it."""
    chat_answer = relayed_answer("chat", RELAYED_CHAT)
    assert chat_answer is not None and chat_answer.tokens == 2
    assert limit_reached({"max_tokens": 2}, chat_answer)
    assert limit_reached({"max_completion_tokens": 1}, chat_answer)
    assert not limit_reached({"max_tokens": 3}, chat_answer)
    ending = ended_at_limit(chat_answer)
    assert ending is not None
    out = Splice(chat_answer).events(ending)
    last = json.loads(out[0].data)
    assert last["id"] == "c1" and last["choices"][0]["finish_reason"] == "length"
    assert out[-1].data == b"[DONE]"

    answer = relayed_answer("messages", MESSAGES_RELAYED)
    assert answer is not None and limit_reached({"max_tokens": 1}, answer)
    ending = ended_at_limit(answer)
    assert ending is not None
    objs = [json.loads(e.data) for e in Splice(answer).events(ending)]
    assert [o["type"] for o in objs] == ["content_block_stop", "message_delta", "message_stop"]
    assert objs[0]["index"] == 0 and objs[1]["delta"]["stop_reason"] == "max_tokens"
    assert objs[1]["usage"] == {"output_tokens": 1}
    assert ended_at_limit(replace(answer, api="responses")) is None


# ---- a continuation that goes on with a tool call ------------------------------------------


def test_a_chat_continuation_that_goes_on_with_a_tool_call_keeps_it() -> None:
    """The relayed text, then the continuation's first output is a tool call: its deltas are
    the answer going on, not scaffolding (the client would read `finish_reason: tool_calls`
    with no call)."""
    answer = relayed_answer("chat", RELAYED_CHAT)
    assert answer is not None
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": ""}}
    out = Splice(answer).events([
        chat({"role": "assistant", "content": ""}, id="c2"),
        chat({"tool_calls": [call]}, id="c2"),
        chat({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, id="c2"),
        chat({}, "tool_calls", id="c2"),
        SSEEvent(b"[DONE]"),
    ])
    deltas = [json.loads(e.data)["choices"][0]["delta"] for e in out[:-1]]
    assert deltas[0] == {"tool_calls": [call]} and deltas[1]["tool_calls"][0]["function"] == {
        "arguments": "{}"}
    assert len(deltas) == 3 and json.loads(out[2].data)["id"] == "c1"


def test_a_messages_continuation_that_begins_with_a_tool_use_closes_the_text_first() -> None:
    """The relayed text block is open; the continuation's first block is a tool use: the
    client gets the text block's stop, then the tool use as the next block."""
    answer = relayed_answer("messages", MESSAGES_RELAYED)
    assert answer is not None
    out = Splice(answer).events([
        named("message_start", message={"id": "msg_2", "model": "m"}),
        named("content_block_start", index=0, content_block={
            "type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}),
        named("content_block_delta", index=0, delta={"type": "input_json_delta",
                                                     "partial_json": "{}"}),
        named("content_block_stop", index=0),
        named("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 3}),
        named("message_stop"),
    ])
    got = [(e.event, json.loads(e.data).get("index")) for e in out]
    assert got == [(b"content_block_stop", 0), (b"content_block_start", 1),
                   (b"content_block_delta", 1), (b"content_block_stop", 1),
                   (b"message_delta", None), (b"message_stop", None)]


RESPONSES_RELAYED = [
    named("response.created", sequence_number=0, response={"id": "resp_1", "model": "m"}),
    named("response.output_item.added", sequence_number=1, output_index=0,
          item={"id": "msg_1", "type": "message", "content": []}),
    named("response.content_part.added", sequence_number=2, item_id="msg_1", output_index=0,
          content_index=0, part={"type": "output_text", "text": ""}),
    named("response.output_text.delta", sequence_number=3, item_id="msg_1", output_index=0,
          content_index=0, delta="Let me check."),
]


def function_call(place: int, seq: int = 1) -> list[SSEEvent]:
    """A continuation's function call item at `place` of its output."""
    return [named("response.output_item.added", sequence_number=seq, output_index=place,
                  item={"id": "fc_1", "type": "function_call", "call_id": "call_1",
                        "name": "weather", "arguments": ""}),
            named("response.function_call_arguments.delta", sequence_number=seq + 1,
                  item_id="fc_1", output_index=place, delta="{}"),
            named("response.output_item.done", sequence_number=seq + 2, output_index=place,
                  item={"id": "fc_1", "type": "function_call", "arguments": "{}"})]


def test_a_responses_continuation_that_begins_with_a_function_call_ends_the_message_first(
        ) -> None:
    """The relayed message item is open; the continuation's first item is a function call:
    the message item's done events come first (with the relayed text), then the call with its
    own id, in the place after the message; the final response holds both."""
    answer = relayed_answer("responses", RESPONSES_RELAYED)
    assert answer is not None
    completed = named("response.completed", sequence_number=9, response={
        "id": "resp_9", "output": [{"id": "fc_1", "type": "function_call"}],
        "usage": {"input_tokens": 10, "output_tokens": 2}})
    out = [json.loads(e.data) for e in Splice(answer).events([
        named("response.created", sequence_number=0, response={"id": "resp_9"}),
        *function_call(0), completed])]
    assert [o["type"] for o in out] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.output_item.done", "response.completed"]
    assert out[0]["text"] == "Let me check." and out[2]["item"]["id"] == "msg_1"
    assert [o["sequence_number"] for o in out] == list(range(4, 11))
    assert all(o["output_index"] == 1 for o in out[3:6]) and out[4]["item_id"] == "fc_1"
    final = out[-1]["response"]
    assert final["id"] == "resp_1"
    assert [item["id"] for item in final["output"]] == ["msg_1", "fc_1"]


def test_a_responses_continuation_that_joins_the_message_then_calls_keeps_the_call_apart(
        ) -> None:
    answer = relayed_answer("responses", RESPONSES_RELAYED)
    assert answer is not None
    out = [json.loads(e.data) for e in Splice(answer).events([
        named("response.created", sequence_number=0, response={"id": "resp_9"}),
        named("response.output_item.added", sequence_number=1, output_index=0,
              item={"id": "msg_9", "type": "message", "content": []}),
        named("response.content_part.added", sequence_number=2, item_id="msg_9",
              output_index=0, content_index=0, part={"type": "output_text", "text": ""}),
        named("response.output_text.delta", sequence_number=3, item_id="msg_9",
              output_index=0, content_index=0, delta=" More."),
        named("response.output_item.done", sequence_number=4, output_index=0,
              item={"id": "msg_9", "type": "message", "content": [
                  {"type": "output_text", "text": " More."}]}),
        *function_call(1, seq=5)])]
    assert out[0]["item_id"] == "msg_1" and out[0]["output_index"] == 0
    assert out[1]["item"]["id"] == "msg_1"
    assert out[1]["item"]["content"][0]["text"] == "Let me check. More."
    assert out[2]["item"]["id"] == "fc_1" and out[2]["output_index"] == 1
    assert out[3]["item_id"] == "fc_1" and out[3]["output_index"] == 1
