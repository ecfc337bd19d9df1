"""The simulator's Anthropic Messages API: streams and bodies, as Anthropic sends them.

Text: `message_start` (with the input usage), an empty text `content_block_start` and a `ping`
at once (the early-headers trap), the `text_delta`s from the TTFT on, then `content_block_stop`,
`message_delta` (`stop_reason` `end_turn`, or `max_tokens` when the request's `max_tokens` cut
the answer; the output usage) and `message_stop`. A tool call: `message_start` and `ping` at
once; from the TTFT on a `tool_use` block (its start names the tool: the first token), an empty
`input_json_delta` and the arguments in `input_json_delta` pieces, its stop, and `stop_reason`
`tool_use`. Usage as Anthropic counts it: `input_tokens` are the ones not read from the cache,
`cache_read_input_tokens` the cached ones.
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

_DELTA = b"content_block_delta"


def delta_template(kind: str) -> tuple[bytes, bytes]:
    """A `kind` delta's (`text_delta`, `input_json_delta`) data of block 0 before and after its
    piece's JSON string: `named_event("content_block_delta", ...)`'s bytes encoded once, so a
    token's event is two concatenations (as the chat stream's token chunk is: the simulator's
    two wires cost the same per token, or a bench comparing them measures the simulator)."""
    field = "text" if kind == "text_delta" else "partial_json"
    _, data = named_event("content_block_delta",
                          {"index": 0, "delta": {"type": kind, field: MARKER}})
    before, after = around_markers(data, 1)
    return before, after


#: the two deltas' templates, encoded once for every stream
_TEXT_DELTA = delta_template("text_delta")
_JSON_DELTA = delta_template("input_json_delta")


def stop_reason(plan: SimPlan) -> str:
    if plan.truncated:
        return "max_tokens"
    return "tool_use" if plan.tool_call is not None else "end_turn"


def _usage(plan: SimPlan, output_tokens: int) -> dict[str, Any]:
    cached = plan.cached_tokens or 0
    return {"input_tokens": plan.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def _message(plan: SimPlan, model: str, message_id: str, content: list[dict[str, Any]],
             *, stop: str | None, output_tokens: int) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": _usage(plan, output_tokens)}


def _tool_use(plan: SimPlan, *, done: bool) -> dict[str, Any]:
    call = plan.tool_call
    assert call is not None
    value = call.input_of(len(plan.tokens)) if done else {}
    return {"type": "tool_use", "id": f"toolu_{call.key}", "name": call.name, "input": value}


async def messages_stream(
    plan: SimPlan, *, model: str, message_id: str, sleep: Sleep
) -> AsyncGenerator[Event, None]:
    """The whole stream, with the plan's delays and faults: a hang stops after the scaffolding
    sent at once, a mid-stream fault is an `error` event (`overloaded_error`)."""
    call = plan.tool_call
    yield named_event("message_start", {
        "message": _message(plan, model, message_id, [], stop=None, output_tokens=1)})
    if call is None:
        yield named_event("content_block_start",
                          {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield named_event("ping", {})
    if plan.hang:
        await sleep(math.inf)
        return
    error = {"error": {"type": "overloaded_error", "message": "simulated failure"}}
    before, after = _TEXT_DELTA if call is None else _JSON_DELTA
    delay = plan.ttft
    for i, piece in enumerate(plan.tokens):
        await sleep(delay)
        if i:
            await before_token(plan, i, sleep)
        if i == plan.midstream_error_after:
            yield named_event("error", error)
            return
        if i == 0 and call is not None:
            yield named_event("content_block_start",
                              {"index": 0, "content_block": _tool_use(plan, done=False)})
            yield _DELTA, before + b'""' + after
        yield _DELTA, before + json_string(piece) + after
        delay = plan.inter_token
    if plan.midstream_error_after is not None or not plan.tokens:
        await sleep(delay)
    if plan.midstream_error_after is not None:
        yield named_event("error", error)
        return
    if call is not None and not plan.tokens:  # nothing was streamed: the block never opened
        yield named_event("content_block_start",
                          {"index": 0, "content_block": _tool_use(plan, done=False)})
    yield named_event("content_block_stop", {"index": 0})
    yield named_event("message_delta", {
        "delta": {"stop_reason": stop_reason(plan), "stop_sequence": None},
        "usage": {"output_tokens": len(plan.tokens)}})
    yield named_event("message_stop", {})


def messages_body(plan: SimPlan, model: str, message_id: str) -> dict[str, Any]:
    content = [{"type": "text", "text": plan.content}] if plan.tool_call is None \
        else [_tool_use(plan, done=True)]
    return _message(plan, model, message_id, content, stop=stop_reason(plan),
                    output_tokens=len(plan.tokens))


def count_tokens_body(plan: SimPlan) -> dict[str, Any]:
    return {"input_tokens": plan.prompt_tokens}
