"""The simulator's Responses API and Anthropic Messages streams and bodies.

Same plans as the chat simulator (`providers.sim.wire`): the TTFT, the tokens, the faults. What
differs is the wire, and in particular the early-headers trap both real APIs set: the status,
the headers and the scaffolding events go out at once (`message_start` and `ping`;
`response.created` and `response.in_progress`), and the first text only after the TTFT. A
gateway that committed on the first byte or the first event would lose every hedge.

Each stream item is `(event name, data)`: both protocols name their events.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from providers.sim.wire import SimPlan, Sleep, wire_json

Event = tuple[bytes, bytes]


def _event(name: str, payload: Mapping[str, Any]) -> Event:
    return name.encode(), wire_json({"type": name, **payload})


# --- the Responses API ------------------------------------------------------------------------


def response_object(plan: SimPlan, model: str, response_id: str, *, status: str,
                    created: int, text: str | None = None) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if text is not None:
        output.append({
            "id": f"msg_{response_id}", "type": "message", "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        })
    usage: dict[str, Any] | None = None
    if status == "completed":
        usage = {"input_tokens": plan.prompt_tokens, "output_tokens": len(plan.tokens),
                 "total_tokens": plan.prompt_tokens + len(plan.tokens)}
        if plan.cached_tokens is not None:  # as OpenAI reports its prompt cache
            usage["input_tokens_details"] = {"cached_tokens": plan.cached_tokens}
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "status": status, "output": output, "usage": usage, "error": None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


async def responses_stream(
    plan: SimPlan, *, model: str, response_id: str, sleep: Sleep, created: int
) -> AsyncGenerator[Event, None]:
    """created, in_progress, the message item and its part at once; the text deltas from the
    TTFT on; then the done events and `response.completed`. Faults as in chat: a hang stops
    after the scaffolding, a mid-stream error is an `error` event."""
    seq = 0

    def ev(name: str, **payload: Any) -> Event:
        nonlocal seq
        seq += 1
        return _event(name, {**payload, "sequence_number": seq})

    item_id = f"msg_{response_id}"
    yield ev("response.created",
             response=response_object(plan, model, response_id, status="in_progress",
                                      created=created))
    yield ev("response.in_progress",
             response=response_object(plan, model, response_id, status="in_progress",
                                      created=created))
    yield ev("response.output_item.added", output_index=0,
             item={"id": item_id, "type": "message", "role": "assistant",
                   "status": "in_progress", "content": []})
    yield ev("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
             part={"type": "output_text", "text": "", "annotations": []})
    if plan.hang:
        await sleep(math.inf)
        return
    delay = plan.ttft
    for i, piece in enumerate(plan.tokens):
        await sleep(delay)
        if i == plan.midstream_error_after:
            yield ev("error", code="server_error", message="simulated failure", param=None)
            return
        yield ev("response.output_text.delta", item_id=item_id, output_index=0,
                 content_index=0, delta=piece, logprobs=[])
        delay = plan.inter_token
    if plan.midstream_error_after is not None or not plan.tokens:
        await sleep(delay)
    if plan.midstream_error_after is not None:
        yield ev("error", code="server_error", message="simulated failure", param=None)
        return
    text = plan.content
    yield ev("response.output_text.done", item_id=item_id, output_index=0, content_index=0,
             text=text, logprobs=[])
    yield ev("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
             part={"type": "output_text", "text": text, "annotations": []})
    yield ev("response.completed",
             response=response_object(plan, model, response_id, status="completed",
                                      created=created, text=text))


def responses_item_body(method: str, path: str, model: str, created: int) -> dict[str, Any]:
    """What the simulator answers for a stored response it pretends to hold."""
    parts = path.split("/")  # responses/{id}[/cancel|/input_items]
    response_id = parts[1] if len(parts) > 1 else ""
    if len(parts) > 2 and parts[2] == "input_items":
        return {"object": "list", "data": [], "first_id": None, "last_id": None,
                "has_more": False}
    if method == "DELETE":
        return {"id": response_id, "object": "response.deleted", "deleted": True}
    status = "cancelled" if len(parts) > 2 and parts[2] == "cancel" else "completed"
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "status": status, "output": [], "usage": None, "error": None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


# --- Anthropic Messages ---------------------------------------------------------------------------


def _message(plan: SimPlan, model: str, message_id: str, content: list[dict[str, Any]],
             *, stop: str | None, output_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {"input_tokens": plan.prompt_tokens, "output_tokens": output_tokens}
    if plan.cached_tokens is not None:  # as Anthropic reports its cache: beside input_tokens
        usage.update(input_tokens=max(0, plan.prompt_tokens - plan.cached_tokens),
                     cache_read_input_tokens=plan.cached_tokens, cache_creation_input_tokens=0)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": None, "usage": usage}


async def messages_stream(
    plan: SimPlan, *, model: str, message_id: str, sleep: Sleep
) -> AsyncGenerator[Event, None]:
    """`message_start`, an empty text block start and a `ping` at once (the trap); the text
    deltas from the TTFT on; then block stop, `message_delta` and `message_stop`."""
    yield _event("message_start",
                 {"message": _message(plan, model, message_id, [], stop=None, output_tokens=1)})
    yield _event("content_block_start",
                 {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield _event("ping", {})
    if plan.hang:
        await sleep(math.inf)
        return
    error = {"error": {"type": "overloaded_error", "message": "simulated failure"}}
    delay = plan.ttft
    for i, piece in enumerate(plan.tokens):
        await sleep(delay)
        if i == plan.midstream_error_after:
            yield _event("error", error)
            return
        yield _event("content_block_delta",
                     {"index": 0, "delta": {"type": "text_delta", "text": piece}})
        delay = plan.inter_token
    if plan.midstream_error_after is not None or not plan.tokens:
        await sleep(delay)
    if plan.midstream_error_after is not None:
        yield _event("error", error)
        return
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                   "usage": {"output_tokens": len(plan.tokens)}})
    yield _event("message_stop", {})


def messages_body(plan: SimPlan, model: str, message_id: str) -> dict[str, Any]:
    content = [{"type": "text", "text": plan.content}]
    return _message(plan, model, message_id, content, stop="end_turn",
                    output_tokens=len(plan.tokens))


def count_tokens_body(plan: SimPlan) -> dict[str, Any]:
    return {"input_tokens": plan.prompt_tokens}


# --- dispatch -----------------------------------------------------------------------------------

#: the routes this module simulates (chat, completions and embeddings are `wire`'s)
ROUTES = frozenset({"responses", "responses/item", "messages", "messages/count_tokens"})


def protocol_stream(plan: SimPlan, endpoint: str, *, model: str, request_id: str,
                    sleep: Sleep, created: int) -> AsyncGenerator[Event, None]:
    if endpoint == "messages":
        return messages_stream(plan, model=model, message_id=f"msg_sim_{request_id}",
                               sleep=sleep)
    return responses_stream(plan, model=model, response_id=f"resp_sim_{request_id}",
                            sleep=sleep, created=created)


def protocol_body(plan: SimPlan, endpoint: str, *, method: str, path: str | None, model: str,
                  request_id: str, created: int) -> dict[str, Any]:
    if endpoint == "messages":
        return messages_body(plan, model, f"msg_sim_{request_id}")
    if endpoint == "messages/count_tokens":
        return count_tokens_body(plan)
    if endpoint == "responses/item":
        return responses_item_body(method, path or "", model, created)
    return response_object(plan, model, f"resp_sim_{request_id}", status="completed",
                           created=created, text=plan.content)


def response_time(plan: SimPlan, endpoint: str) -> float:
    """A non-streaming answer's delay: item reads and token counts answer at once."""
    if endpoint in ("responses/item", "messages/count_tokens"):
        return 0.0
    return plan.response_time("chat/completions")
