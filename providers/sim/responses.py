"""The simulator's Responses API: streams and bodies, as OpenAI sends them.

The stream is the real one's, event for event, each with its `sequence_number` from 0:
`response.created` and `response.in_progress` at once (the early-headers trap: a gateway that
committed on them would lose every hedge); then, for text, the message item and its part
(`output_item.added`, `content_part.added`), the `output_text.delta`s from the TTFT on and
`output_text.done`, `content_part.done`, `output_item.done`; for a tool call, from the TTFT on,
the `function_call` item (`output_item.added`, which names the function: the first token),
its `function_call_arguments.delta`s, `.done` and `output_item.done`. The end is
`response.completed`, or `response.incomplete` (status `incomplete`, `incomplete_details.reason`
`max_output_tokens`) when the request's `max_output_tokens` cut the answer. Usage counts input
tokens (of which cached) and output tokens.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator
from typing import Any

from providers.sim.wire import (
    MARKER,
    Event,
    SimPlan,
    Sleep,
    around_markers,
    before_token,
    json_string,
    named_event,
)

#: the two delta events a stream splices per token
_TEXT_DELTA = "response.output_text.delta"
_ARGUMENTS_DELTA = "response.function_call_arguments.delta"


def delta_template(name: str, payload: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    """A delta event's data (`name`, its fields but the piece and the sequence number) cut
    around its sequence number and its piece: `named_event`'s bytes encoded once, so a
    token's event is a few concatenations (as the chat stream's token chunk is)."""
    _, data = named_event(name, {"sequence_number": MARKER, **payload, "delta": MARKER,
                                 **({"logprobs": []} if name == _TEXT_DELTA else {})})
    head, middle, tail = around_markers(data, 2)
    return head, middle, tail


def _usage(plan: SimPlan) -> dict[str, Any]:
    output = len(plan.tokens)
    return {"input_tokens": plan.prompt_tokens,
            "input_tokens_details": {"cached_tokens": plan.cached_tokens or 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": plan.prompt_tokens + output}


def _item(plan: SimPlan, response_id: str, *, done: bool) -> dict[str, Any]:
    """The answer's output item, in progress (nothing yet) or done (all of it)."""
    status = "in_progress" if not done else "incomplete" if plan.truncated else "completed"
    call = plan.tool_call
    if call is not None:
        return {"id": f"fc_{call.key}", "type": "function_call", "status": status,
                "arguments": plan.content if done else "", "call_id": f"call_{call.key}",
                "name": call.name}
    content = [_part(plan.content)] if done else []
    return {"id": f"msg_{response_id}", "type": "message", "status": status,
            "content": content, "role": "assistant"}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def response_object(plan: SimPlan, model: str, response_id: str, *, created: int,
                    done: bool) -> dict[str, Any]:
    """The response object: in progress (no output, no usage) or finished."""
    echo = plan.echo or {}
    status = "in_progress" if not done else "incomplete" if plan.truncated else "completed"
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if done and plan.truncated
        else None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"), "model": model,
        "output": [_item(plan, response_id, done=True)] if done else [],
        "parallel_tool_calls": True,
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "store": echo.get("store", True),
        "temperature": echo.get("temperature", 1.0),
        "text": {"format": {"type": "text"}}, "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools", []), "top_p": echo.get("top_p", 1.0),
        "truncation": "disabled", "usage": _usage(plan) if done else None, "user": None,
        "metadata": echo.get("metadata", {}),
    }


async def responses_stream(
    plan: SimPlan, *, model: str, response_id: str, sleep: Sleep, created: int
) -> AsyncGenerator[Event, None]:
    """The whole stream, with the plan's delays and faults: a hang stops after the scaffolding
    sent at once, a mid-stream fault is an `error` event in place of a piece."""
    seq = -1

    def ev(event: str, /, **payload: Any) -> Event:
        nonlocal seq
        seq += 1
        return named_event(event, {"sequence_number": seq, **payload})

    def whole(name: str, *, done: bool) -> Event:
        return ev(name, response=response_object(plan, model, response_id, created=created,
                                                 done=done))

    call = plan.tool_call
    item = _item(plan, response_id, done=False)
    item_id = item["id"]
    at = {"item_id": item_id, "output_index": 0}
    if call is None:
        name, fields = _TEXT_DELTA, {**at, "content_index": 0}
    else:
        name, fields = _ARGUMENTS_DELTA, at
    head, middle, tail = delta_template(name, fields)
    encoded = name.encode()

    def token(piece: str) -> Event:
        """`ev(name, **fields, delta=piece[, logprobs=[]])`, spliced."""
        nonlocal seq
        seq += 1
        return encoded, head + str(seq).encode() + middle + json_string(piece) + tail

    yield whole("response.created", done=False)
    yield whole("response.in_progress", done=False)
    if call is None:
        yield ev("response.output_item.added", output_index=0, item=item)
        yield ev("response.content_part.added", **at, content_index=0, part=_part(""))
    if plan.hang:
        await sleep(math.inf)
        return
    delay = plan.ttft
    for i, piece in enumerate(plan.tokens):
        await sleep(delay)
        if i:
            await before_token(plan, i, sleep)
        if i == plan.midstream_error_after:
            yield ev("error", code="server_error", message="simulated failure", param=None)
            return
        if i == 0 and call is not None:
            yield ev("response.output_item.added", output_index=0, item=item)
        yield token(piece)
        delay = plan.inter_token
    if plan.midstream_error_after is not None or not plan.tokens:
        await sleep(delay)
    if plan.midstream_error_after is not None:
        yield ev("error", code="server_error", message="simulated failure", param=None)
        return
    text = plan.content
    if call is None:
        yield ev("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
        yield ev("response.content_part.done", **at, content_index=0, part=_part(text))
    else:
        if not plan.tokens:  # nothing was streamed, so the item was never added
            yield ev("response.output_item.added", output_index=0, item=item)
        yield ev("response.function_call_arguments.done", **at, name=call.name, arguments=text)
    yield ev("response.output_item.done", output_index=0,
             item=_item(plan, response_id, done=True))
    yield whole("response.incomplete" if plan.truncated else "response.completed", done=True)


def responses_body(plan: SimPlan, model: str, response_id: str, created: int) -> dict[str, Any]:
    return response_object(plan, model, response_id, created=created, done=True)


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
    return {**response_object(SimPlan(), model, response_id, created=created, done=True),
            "status": status, "output": [], "usage": None}
