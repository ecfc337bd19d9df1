"""The simulator's chat completions and legacy completions: streams and bodies, as OpenAI
sends them.

Chat streams: a role-only chunk at once (the status and headers come with it: a gateway that
committed on the first byte would lose every hedge), then the output from the TTFT on (text as
`delta.content`; a tool call as one chunk carrying `delta.tool_calls[0]` with its index, id and
function name, then its arguments in pieces), a finish-only chunk (`stop`, `length` when the
request's output limit cut the answer, `tool_calls`), a usage-only chunk (`choices: []`) when
the request asked for it (`stream_options.include_usage`; every chunk then carries
`"usage":null`, as OpenAI's do), and `[DONE]`. Legacy completions have no role chunk and carry
`choices[].text`. A hang sleeps forever after the role chunk; a mid-stream fault sends an error
in the OpenAI shape instead of a token.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from gateway.wire.sse import encode_event
from providers.base import Endpoint
from providers.sim.embeddings import embeddings_body
from providers.sim.wire import DONE, MIDSTREAM_ERROR, SimPlan, Sleep, before_token, wire_json

_MARKER = "\x00"
_MARKER_JSON = json.dumps(_MARKER).encode()


def finish_reason(plan: SimPlan) -> str:
    if plan.truncated:
        return "length"
    return "tool_calls" if plan.tool_call is not None else "stop"


def usage(plan: SimPlan, completion_tokens: int, *, details: bool) -> dict[str, Any]:
    """OpenAI's usage object; `details` (chat) adds the cached and reasoning token counts."""
    out: dict[str, Any] = {
        "prompt_tokens": plan.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": plan.prompt_tokens + completion_tokens,
    }
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": plan.cached_tokens or 0}
        out["completion_tokens_details"] = {"reasoning_tokens": 0}
    elif plan.cached_tokens is not None:  # as OpenAI reports its prompt cache
        out["prompt_tokens_details"] = {"cached_tokens": plan.cached_tokens}
    return out


def _call_id(plan: SimPlan) -> str:
    assert plan.tool_call is not None
    return f"call_{plan.tool_call.key}"


async def sim_payloads(
    plan: SimPlan,
    *,
    endpoint: Endpoint,
    model: str,
    request_id: str,
    sleep: Sleep,
    created: int | None = None,
) -> AsyncGenerator[bytes, None]:
    """The `data` of each event of a streaming response, in order, with the plan's delays:
    the first output after `ttft`, then one piece per `inter_token`."""
    chat = endpoint != "completions"
    head: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-sim-{request_id}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
    }
    tail: dict[str, Any] = {"usage": None} if plan.usage and chat else {}
    call = plan.tool_call if chat else None

    def chunk(delta: dict[str, Any] | None, piece: str | None, finish: str | None) -> bytes:
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "logprobs": None,
                                      "finish_reason": finish}
        else:
            text = "" if piece is None else piece
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return wire_json({**head, "choices": [choice], **tail})

    def delta_of(piece: str) -> dict[str, Any]:
        if call is None:
            return {"content": piece}
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}

    # A token chunk is the same JSON but for its text: encode it once around a marker and
    # splice each token's JSON string in (byte for byte `chunk(delta_of(piece), piece, None)`,
    # a fraction of its cost, which a zero-delay stream pays 50 times per request). rpartition:
    # the marker is the last string in the chunk, and the model name echoed before it may hold
    # anything.
    prefix, _, suffix = chunk(delta_of(_MARKER), _MARKER, None).rpartition(_MARKER_JSON)

    def token(piece: str) -> bytes:
        return prefix + json.dumps(piece).encode() + suffix

    if chat:
        role = {"role": "assistant", "content": None if call is not None else ""}
        yield chunk(role, None, None)
    if plan.hang:
        await sleep(math.inf)
        return
    delay = plan.ttft
    for i, piece in enumerate(plan.tokens):
        await sleep(delay)
        if i:
            await before_token(plan, i, sleep)
        if i == plan.midstream_error_after:
            yield wire_json(MIDSTREAM_ERROR)
            return
        if i == 0 and call is not None:  # the call's head: its index, id and name
            yield chunk({"tool_calls": [{"index": 0, "id": _call_id(plan), "type": "function",
                                         "function": {"name": call.name, "arguments": ""}}]},
                        None, None)
        yield token(piece)
        delay = plan.inter_token
    if plan.midstream_error_after is not None:  # at or past the last token
        await sleep(delay)
        yield wire_json(MIDSTREAM_ERROR)
        return
    if not plan.tokens:
        await sleep(delay)
    yield chunk(None, None, finish_reason(plan))
    if plan.usage:
        yield wire_json({**head, "choices": [], "usage": usage(plan, len(plan.tokens),
                                                               details=chat)})
    yield DONE


async def sim_events(
    plan: SimPlan,
    *,
    endpoint: Endpoint,
    model: str,
    request_id: str,
    sleep: Sleep,
    created: int | None = None,
) -> AsyncGenerator[bytes, None]:
    """`sim_payloads` encoded as SSE wire bytes (`data: ...\\n\\n`), one item per event."""
    payloads = sim_payloads(
        plan, endpoint=endpoint, model=model, request_id=request_id, sleep=sleep, created=created
    )
    async with aclosing(payloads):
        async for data in payloads:
            yield encode_event(data)


def chat_message(plan: SimPlan) -> dict[str, Any]:
    """The whole answer as a chat `message`: text, or the tool call with its arguments."""
    if plan.tool_call is None:
        return {"role": "assistant", "content": plan.content, "refusal": None}
    call = {"id": _call_id(plan), "type": "function",
            "function": {"name": plan.tool_call.name, "arguments": plan.content}}
    return {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}


def sim_response(
    plan: SimPlan, endpoint: Endpoint, model: str, request_id: str, created: int | None = None
) -> dict[str, Any]:
    """The complete non-streaming body for `plan`, with the same content as the stream."""
    stamp = int(time.time()) if created is None else created
    if endpoint == "embeddings":
        return embeddings_body(plan, model)
    choice: dict[str, Any]
    if endpoint == "completions":
        obj, ident = "text_completion", f"cmpl-sim-{request_id}"
        choice = {"index": 0, "text": plan.content, "logprobs": None,
                  "finish_reason": finish_reason(plan)}
    else:
        obj, ident = "chat.completion", f"chatcmpl-sim-{request_id}"
        choice = {"index": 0, "message": chat_message(plan), "logprobs": None,
                  "finish_reason": finish_reason(plan)}
    return {
        "id": ident,
        "object": obj,
        "created": stamp,
        "model": model,
        "choices": [choice],
        "usage": usage(plan, len(plan.tokens), details=endpoint != "completions"),
    }
