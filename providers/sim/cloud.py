"""What the Bedrock and Vertex simulators share: a scripted `Reply` per request, the record of
each call, and the Messages events of an answer.

Why scripted rather than the random `SimProfile`: these simulators exist to show that the
gateway speaks each cloud's wire correctly (signatures, tokens, framing, error shapes) and that
the race and the relay work across providers. Tests state what each request gets (`Reply`,
from a `Responder` that sees the call) and order steps by causality: `Reply.hold` is awaited
before the first text, so a test can keep one backend silent until the other one's answer
reached the client, instead of sleeping.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request


@dataclass(frozen=True)
class Reply:
    """What one request gets."""

    texts: Sequence[str] = ("Hello", " from the cloud")
    #: awaited after the stream's head (message_start, the block start, a ping) and before the
    #: first text, or before a non-streaming answer: a test's latch
    hold: Callable[[], Awaitable[None]] | None = None
    #: not 200: an HTTP error in the cloud's shape, of `error_type` (Bedrock's
    #: `ThrottlingException`, Google's `RESOURCE_EXHAUSTED`)
    status: int = 200
    error_type: str | None = None
    #: the error answer's message (the cloud's own words, which the gateway relays for a 400)
    error_message: str = "simulated failure"
    #: a failure inside a 200 stream after this many texts (0: before the first): Bedrock
    #: sends an exception frame of `stream_exception`, Vertex an `event: error`
    fail_after: int | None = None
    stream_exception: str = "modelStreamErrorException"


@dataclass
class CallRecord:
    """One request as the simulator saw it."""

    path: str
    headers: Mapping[str, str]
    body: Any
    stream: bool
    arrived: float = field(default_factory=time.monotonic)
    #: the model id from the path
    model: str = ""
    #: the credential the request carried (Bedrock: the access key id; Vertex: the token)
    credential: str = ""
    #: the stream's last event went out
    completed: bool = False
    #: the client hung up before the end (a cancelled hedge)
    closed_early: bool = False
    #: texts written before the end or the hang-up
    texts_sent: int = 0


Responder = Callable[[CallRecord], Reply]


def default_responder(call: CallRecord) -> Reply:
    return Reply()


def message_start(model: str, message_id: str) -> dict[str, Any]:
    return {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 1}}}


def stream_head(model: str, message_id: str) -> list[dict[str, Any]]:
    """What the APIs send at once, before any output (no token among them)."""
    return [message_start(model, message_id),
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}},
            {"type": "ping"}]


def text_delta(text: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}}


def stream_tail(outputs: int) -> list[dict[str, Any]]:
    return [{"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": {"output_tokens": outputs}},
            {"type": "message_stop"}]


def message_body(reply: Reply, model: str, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": "".join(reply.texts)}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": len(reply.texts)}}


class Failure:
    """Marks the point of an in-stream failure in `play`'s output."""


FAILURE = Failure()


async def play(reply: Reply, call: CallRecord, model: str,
               message_id: str) -> AsyncGenerator[dict[str, Any] | Failure, None]:
    """The stream's events in order, `FAILURE` where the reply fails. Records how it ended:
    a cancellation (Starlette's, when the client hangs up) marks the call `closed_early`."""
    ended = False
    try:
        for event in stream_head(model, message_id):
            yield event
        if reply.hold is not None:
            await reply.hold()
        for index, text in enumerate(reply.texts):
            if reply.fail_after is not None and index == reply.fail_after:
                ended = True
                yield FAILURE
                return
            yield text_delta(text)
            call.texts_sent += 1
            await asyncio.sleep(0)
        if reply.fail_after is not None and reply.fail_after >= len(reply.texts):
            ended = True
            yield FAILURE
            return
        for event in stream_tail(len(reply.texts)):
            yield event
        call.completed = ended = True
    finally:
        if not ended:
            call.closed_early = True


async def read_call(request: Request, *, stream: bool, model: str) -> tuple[CallRecord, bytes]:
    """The request's record and its raw body (a signature covers the bytes as sent)."""
    raw = await request.body()
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = None
    headers = {k.lower(): v for k, v in request.headers.items()}
    return CallRecord(path=request.url.path, headers=headers, body=body, stream=stream,
                      model=model), raw
