"""Wire bytes of the Responses API and Anthropic Messages streams, as the real APIs
send them: named events whose payload repeats the name as `type`. Pure data and small builders,
shared by the predicate table tests (tests/unit) and the scripted upstreams (tests/e2e)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tests.harness.scripts import Head, Script, Send, Sleep, Step

SSE_HEADERS = {"content-type": "text/event-stream"}


def named(name: str, payload: dict[str, Any] | None = None) -> bytes:
    """`event: name` and `data:` with `{"type": name, ...payload}`."""
    data = json.dumps({"type": name, **(payload or {})}, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


# --- Anthropic Messages -----------------------------------------------------------------------


def message_start(message_id: str = "msg_1", model: str = "claude") -> bytes:
    return named("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1}}})


def text_block_start(index: int = 0) -> bytes:
    return named("content_block_start",
                 {"index": index, "content_block": {"type": "text", "text": ""}})


def text_delta(text: str, index: int = 0) -> bytes:
    return named("content_block_delta",
                 {"index": index, "delta": {"type": "text_delta", "text": text}})


PING = named("ping")


def message_end(output_tokens: int = 2) -> list[bytes]:
    return [
        named("content_block_stop", {"index": 0}),
        named("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                "usage": {"output_tokens": output_tokens}}),
        named("message_stop"),
    ]


def anthropic_error(kind: str = "overloaded_error", message: str = "Overloaded") -> bytes:
    return named("error", {"error": {"type": kind, "message": message}})


def messages_script(texts: Sequence[str], *, ttft: float = 0.0, end: bool = True) -> Script:
    """The early-headers trap when `ttft` is long: message_start, the block start and a ping
    at once, the first text after `ttft`."""
    steps: list[Step] = [Head(), Send(message_start()), Send(text_block_start()), Send(PING)]
    if ttft:
        steps.append(Sleep(ttft))
    steps += [Send(text_delta(t)) for t in texts]
    if end:
        steps += [Send(b) for b in message_end(len(texts))]
    return Script(headers=SSE_HEADERS, steps=steps)


# --- the Responses API --------------------------------------------------------------------------


def response_obj(response_id: str, status: str, text: str | None = None) -> dict[str, Any]:
    output = [] if text is None else [{
        "id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return {"id": response_id, "object": "response", "created_at": 1, "model": "gpt",
            "status": status, "output": output, "error": None, "tools": [],
            "tool_choice": "auto", "parallel_tool_calls": True, "usage": None}


def responses_head(response_id: str = "resp_1") -> list[bytes]:
    """What the Responses API sends at once, before any output."""
    return [
        named("response.created", {"sequence_number": 0,
                                   "response": response_obj(response_id, "in_progress")}),
        named("response.in_progress", {"sequence_number": 1,
                                       "response": response_obj(response_id, "in_progress")}),
        named("response.output_item.added", {"sequence_number": 2, "output_index": 0, "item": {
            "id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress",
            "content": []}}),
        named("response.content_part.added", {
            "sequence_number": 3, "item_id": "msg_1", "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []}}),
    ]


def output_delta(text: str) -> bytes:
    return named("response.output_text.delta", {
        "sequence_number": 4, "item_id": "msg_1", "output_index": 0, "content_index": 0,
        "delta": text, "logprobs": []})


def responses_end(response_id: str, text: str) -> list[bytes]:
    return [named("response.completed", {"sequence_number": 9,
                                         "response": response_obj(response_id, "completed",
                                                                  text)})]


def responses_script(texts: Sequence[str], *, response_id: str = "resp_1", ttft: float = 0.0,
                     end: bool = True) -> Script:
    """The early-headers trap when `ttft` is long: created/in_progress at once."""
    steps: list[Step] = [Head(), *(Send(b) for b in responses_head(response_id))]
    if ttft:
        steps.append(Sleep(ttft))
    steps += [Send(output_delta(t)) for t in texts]
    if end:
        steps += [Send(b) for b in responses_end(response_id, "".join(texts))]
    return Script(headers=SSE_HEADERS, steps=steps)
