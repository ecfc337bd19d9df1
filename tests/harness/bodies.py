"""Body builders: OpenAI-shaped SSE events and JSON bodies, and the scripts made of them.

Why here: every integration test needs the same wire shapes (role chunk, tokens, finish,
usage, `[DONE]`, error JSON), and building them in one place keeps them identical to what the
official SDK expects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.api.inference import InferenceRoute
from tests.harness.scripts import Framing, Hang, Head, Reset, Script, Send, Step

DONE = b"data: [DONE]\n\n"
CHUNK_ID = "chatcmpl-harness"
MODEL = "upstream-model"
CREATED = 1_700_000_000
SSE_HEADERS: Mapping[str, str] = {"content-type": "text/event-stream", "cache-control": "no-cache"}


def sse(obj: object) -> bytes:
    """One SSE event whose data is `obj` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def comment(text: str = "ping") -> bytes:
    """An SSE comment block (keep-alives such as `: ping`); never a token."""
    return b": " + text.encode() + b"\n\n"


def chunk_obj(
    delta: Mapping[str, Any] | None,
    *,
    finish_reason: str | None = None,
    usage: Mapping[str, int] | None = None,
    model: str = MODEL,
) -> dict[str, Any]:
    """A chat.completion.chunk dict (for tests that need a custom shape); `delta=None` gives
    `choices: []` (the usage-only shape)."""
    choices: list[dict[str, Any]] = []
    if delta is not None:
        choices.append(
            {"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish_reason}
        )
    obj: dict[str, Any] = {
        "id": CHUNK_ID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        obj["usage"] = dict(usage)
    return obj


def role_chunk(role: str = "assistant") -> bytes:
    """The role-only first chunk OpenAI sends (empty content: not a token)."""
    return sse(chunk_obj({"role": role, "content": "", "refusal": None}))


def token_chunk(text: str) -> bytes:
    return sse(chunk_obj({"content": text}))


def finish_chunk(reason: str = "stop") -> bytes:
    return sse(chunk_obj({}, finish_reason=reason))


def usage_chunk(prompt_tokens: int = 5, completion_tokens: int = 2) -> bytes:
    total = prompt_tokens + completion_tokens
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
    }
    return sse(chunk_obj(None, usage=usage))


def text_chunk(text: str, finish_reason: str | None = None) -> bytes:
    """A legacy /v1/completions stream event."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    obj = {
        "id": "cmpl-harness",
        "object": "text_completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [choice],
    }
    return sse(obj)


def chat_completion_obj(content: str = "Hello world", *, model: str = MODEL) -> dict[str, Any]:
    """A non-streaming chat.completion body."""
    return {
        "id": CHUNK_ID,
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def error_obj(
    message: str, *, type: str = "server_error", code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def stream_script(
    tokens: Sequence[str],
    ttft: float = 0.0,
    gap: float = 0.0,
    pre: Sequence[bytes] | None = None,
    *,
    finish: str | None = "stop",
    usage: bool = False,
    done: bool = True,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
    close: bool = True,
    framing: Framing = "chunked",
) -> Script:
    """A chat stream: head and `pre` (default: the role chunk) at once, the first token after
    `ttft`, each later token `gap` after the previous, then finish, optional usage, `[DONE]`."""
    steps: list[Step] = [Head()]
    steps += [Send(b) for b in (pre if pre is not None else [role_chunk()])]
    steps += [Send(token_chunk(t), ttft if i == 0 else gap) for i, t in enumerate(tokens)]
    if finish is not None:
        steps.append(Send(finish_chunk(finish)))
    if usage:
        steps.append(Send(usage_chunk()))
    if done:
        steps.append(Send(DONE))
    all_headers = {**SSE_HEADERS, **(headers or {})}
    return Script(status=status, headers=all_headers, steps=steps, close=close, framing=framing)


def json_script(
    obj: object,
    status: int = 200,
    *,
    headers: Mapping[str, str] | None = None,
    delay: float = 0.0,
    close: bool = True,
) -> Script:
    """A non-streaming JSON response with Content-Length, written `delay` seconds after the
    request arrived."""
    all_headers = {"content-type": "application/json", **(headers or {})}
    steps: list[Step] = [Head(delay), Send(json.dumps(obj).encode())]
    return Script(status=status, headers=all_headers, steps=steps, close=close, framing="length")


def error_script(
    status: int,
    message: str = "upstream error",
    *,
    headers: Mapping[str, str] | None = None,
    close: bool = True,
) -> Script:
    """An OpenAI-shaped error response (add `{"retry-after": "1"}` for a 429)."""
    return json_script(error_obj(message), status, headers=headers, close=close)


def hang_script() -> Script:
    """Accept the request and never send a byte."""
    return Script(steps=[Hang(), Head()])


def reset_script() -> Script:
    """Reset the connection before any byte of the response."""
    return Script(steps=[Reset(), Head()])


#: the smallest prompt of each field a route takes it in (`InferenceRoute.prompt`)
PROMPTS: Mapping[str, Any] = {"messages": [{"role": "user", "content": "hi"}],
                              "prompt": "hi", "input": "hi"}


def smallest_body(route: InferenceRoute, model: str, stream: bool | None = None
                  ) -> dict[str, Any] | None:
    """The smallest valid request body for `route` (None: the route takes no body), asking
    `model`; `stream` is set only on a route that streams, and only when given. One builder,
    so the tests generated from the route table send the same requests."""
    if route.stored:
        return None
    body: dict[str, Any] = {"model": model}
    if route.prompt is not None:
        body[route.prompt] = PROMPTS[route.prompt]
    if route.endpoint == "responses":
        body["input"] = "hi"
    if route.errors == "anthropic":
        body["max_tokens"] = 8
    if stream is not None and route.streams:
        body["stream"] = stream
    return body
