"""Whole answers, usage, stop reasons and errors between Chat Completions and Messages (pure).

Read once per non-streaming answer, and by the streams' state machines
(`gateway.wire.translate.chat_messages_stream`) for the pieces a stream shares with a whole
answer (usage, stop reasons, errors). Each mapping is a table, so that the round trip
(a Chat answer to Messages and back) is the same answer wherever both APIs have the field.

Usage: Chat's `prompt_tokens` counts every input token and says how many of them were read
from the cache (`prompt_tokens_details.cached_tokens`); Messages' `input_tokens` counts only
those after the last cache breakpoint, beside `cache_read_input_tokens` and
`cache_creation_input_tokens`. Chat has no field for cache writes: they are counted as input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.errors import error_body
from gateway.wire.translate.chat_messages import JSON_TOOL

#: Messages `stop_reason` -> Chat `finish_reason`
FINISH_OF_STOP: Mapping[str, str] = {
    "end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
    "tool_use": "tool_calls", "refusal": "content_filter", "pause_turn": "stop",
    "model_context_window_exceeded": "length",
}
#: Chat `finish_reason` -> Messages `stop_reason`
STOP_OF_FINISH: Mapping[str, str] = {
    "stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
    "function_call": "tool_use", "content_filter": "refusal",
}
#: Chat's error `type` for each Anthropic error type (the status stays the upstream's)
CHAT_ERROR_OF: Mapping[str, str] = {
    "invalid_request_error": "invalid_request_error", "authentication_error":
    "authentication_error", "permission_error": "permission_error", "not_found_error":
    "not_found_error", "request_too_large": "invalid_request_error", "rate_limit_error":
    "rate_limit_error", "api_error": "server_error", "overloaded_error": "server_error",
    "timeout_error": "timeout_error",
}
#: Anthropic's error type for an OpenAI error `type` (`code` read first: `rate_limit_exceeded`)
MESSAGES_ERROR_OF: Mapping[str, str] = {
    "invalid_request_error": "invalid_request_error", "authentication_error":
    "authentication_error", "permission_error": "permission_error", "not_found_error":
    "not_found_error", "rate_limit_error": "rate_limit_error", "rate_limit_exceeded":
    "rate_limit_error", "insufficient_quota": "rate_limit_error", "server_error": "api_error",
    "timeout_error": "timeout_error", "overloaded": "overloaded_error",
}


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """Messages usage (`message_start`'s, a `message_delta`'s, a whole answer's) as Chat's."""
    if not isinstance(usage, dict):
        return None
    read = _count(usage.get("cache_read_input_tokens"))
    prompt = _count(usage.get("input_tokens")) + read + _count(
        usage.get("cache_creation_input_tokens"))
    output = _count(usage.get("output_tokens"))
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": output,
                           "total_tokens": prompt + output}
    if "cache_read_input_tokens" in usage:
        out["prompt_tokens_details"] = {"cached_tokens": read}
    return out


def messages_usage(usage: Any) -> dict[str, Any]:
    """Chat usage as Messages': the cached part of the prompt moved beside `input_tokens`."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    out: dict[str, Any] = {"input_tokens": _count(usage.get("prompt_tokens")) - (cached or 0),
                           "output_tokens": _count(usage.get("completion_tokens"))}
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return out


def finish_of(stop: Any, *, json_only: bool) -> str:
    """Chat's `finish_reason` for a Messages `stop_reason`. `json_only`: the answer's only
    tool call was the forced JSON tool of a translated `response_format`, which the client
    receives as text, so `tool_use` there is a plain `stop` (no call is returned to make)."""
    if json_only and stop == "tool_use":
        return "stop"
    return FINISH_OF_STOP.get(str(stop), "stop")


def _arguments_text(value: Any) -> str:
    return json.dumps(value if value is not None else {}, separators=(",", ":"),
                      ensure_ascii=False)


def messages_answer_to_chat(body: Mapping[str, Any], created: int) -> dict[str, Any]:
    """A whole Messages answer as a Chat completion (`created`: now, in seconds; Messages has
    no such field). The forced JSON tool of a translated `response_format` becomes text."""
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    json_only = False
    for block in body.get("content") or ():
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "tool_use" and block.get("name") == JSON_TOOL:
            text.append(_arguments_text(block.get("input")))
            json_only = True
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": _arguments_text(block.get("input"))}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    finish = finish_of(body.get("stop_reason"), json_only=json_only and not calls)
    out: dict[str, Any] = {
        "id": body.get("id"), "object": "chat.completion", "created": created,
        "model": body.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
                     "logprobs": None}]}
    usage = chat_usage(body.get("usage"))
    if usage is not None:
        out["usage"] = usage
    return out


def chat_answer_to_messages(body: Mapping[str, Any]) -> dict[str, Any]:
    """A whole Chat completion (its first choice: a Messages client never asks for more) as a
    Messages answer."""
    choices = body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content") or message.get("refusal")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:  # cut short (max tokens): kept whole as the one string it is
            arguments = {"_arguments": function.get("arguments")}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": arguments})
    finish = choice.get("finish_reason")
    return {"id": body.get("id"), "type": "message", "role": "assistant",
            "model": body.get("model"), "content": content,
            "stop_reason": STOP_OF_FINISH.get(str(finish), "end_turn"), "stop_sequence": None,
            "usage": messages_usage(body.get("usage"))}


def messages_error_to_chat(body: Any) -> dict[str, Any]:
    """An Anthropic error body (or an in-stream `error` event's payload) in OpenAI's shape.
    The HTTP status, and with it the retry advice, is the upstream's and is not changed here."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    kind = str(error.get("type", "api_error"))
    return error_body(str(error.get("message", "upstream error")),
                      type=CHAT_ERROR_OF.get(kind, "server_error"), code=kind)


def chat_error_to_messages(body: Any) -> dict[str, Any]:
    """An OpenAI error body (or an in-stream error chunk) in Anthropic's shape; its `code` and
    `param`, which Anthropic's shape has no field for, are named in the message."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {"message": str(error or "upstream error")}
    code, kind = error.get("code"), error.get("type")
    mapped = MESSAGES_ERROR_OF.get(str(code)) or MESSAGES_ERROR_OF.get(str(kind), "api_error")
    named = ", ".join(f"{n} {v}" for n, v in (("param", error.get("param")), ("code", code)) if v)
    message = str(error.get("message", "upstream error"))
    return {"type": "error", "error": {"type": mapped,
                                       "message": f"{message} [{named}]" if named else message}}
