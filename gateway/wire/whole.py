"""A streamed answer written as the API's whole (non-streaming) answer. Pure.

Why: a non-streaming request can only be continued on another backend when its answer is
read upstream as a stream (the relay continues streams, not bodies). Such a request is sent
upstream with the API's own stream flag (and usage asked for), relayed as any stream is
(breaks and stalls continued, the continuation's events spliced in), and the relayed events
are assembled here into the one body the client asked for: one id, the text of every piece,
one finish reason, the usage the stream reported (a continued answer's, as the splice counts
it). The Responses API's stream ends with the whole response object (`response.completed`,
or `response.incomplete` at the output limit), which is the body a non-streaming request is
answered with; of a continued answer it is the one the splice rewrote (the relayed response
and item ids, the whole text, the usage counted once).

`whole_answer` returns None when the events are not one complete answer (an error event, no
end event, a shape it does not know): the caller answers with an error, never a cut body.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.wire.sse import SSEEvent

#: the routes (upstream endpoints) whose non-streaming requests may be read as streams
WHOLE_ENDPOINTS = frozenset({"chat/completions", "messages", "responses"})


def streamed_body(endpoint: str, body: dict[str, Any] | Any) -> dict[str, Any] | None:
    """The body a non-streaming request to `endpoint` is sent upstream as a stream, or None
    when it is not to be: another route (legacy completions, embeddings), or an answer that
    could hold what the assembler does not rebuild (several choices, log probabilities).
    Chat also asks for usage (the whole answer carries it); the other two APIs' streams
    always report it."""
    if endpoint not in WHOLE_ENDPOINTS:
        return None
    if endpoint == "chat/completions":
        if body.get("n") not in (None, 1) or body.get("logprobs") or \
                body.get("top_logprobs") is not None:
            return None
        return {**body, "stream": True, "stream_options": {"include_usage": True}}
    return {**body, "stream": True}


def whole_answer(api: str, events: list[SSEEvent]) -> dict[str, Any] | None:
    """The whole answer of `api` (`chat`, `messages` or `responses`) built from its relayed
    stream."""
    try:
        if api == "chat":
            return _chat(events)
        if api == "messages":
            return _messages(events)
        if api == "responses":
            return _responses(events)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None  # a shape this code does not know: not an answer to send
    return None


def _chat(events: list[SSEEvent]) -> dict[str, Any] | None:
    head: dict[str, Any] | None = None
    extra: dict[str, Any] = {}
    role = "assistant"
    content: list[str] = []
    refusal: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    arguments: dict[int, list[str]] = {}
    finish: str | None = None
    usage: Any = None
    done = False
    for event in events:
        if event.data == b"[DONE]":
            done = True
            continue
        obj = json.loads(event.data)
        if not isinstance(obj, dict) or "error" in obj:
            return None
        if head is None:
            head = {"id": obj["id"], "object": "chat.completion",
                    "created": obj.get("created"), "model": obj.get("model")}
        for key in ("system_fingerprint", "service_tier"):
            if obj.get(key) is not None:
                extra[key] = obj[key]
        if isinstance(obj.get("usage"), dict):
            usage = obj["usage"]
        for choice in obj.get("choices") or ():
            if choice.get("index", 0) != 0:
                return None  # several choices: not rebuilt here
            delta = choice.get("delta") or {}
            role = delta.get("role") or role
            if delta.get("content"):
                content.append(delta["content"])
            if delta.get("refusal"):
                refusal.append(delta["refusal"])
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or ():
                index = call.get("index", 0)
                whole = calls.setdefault(index, {"id": None, "type": "function",
                                                 "function": {"name": None}})
                if call.get("id"):
                    whole["id"] = call["id"]
                function = call.get("function") or {}
                if function.get("name"):
                    whole["function"]["name"] = function["name"]
                arguments.setdefault(index, []).append(function.get("arguments") or "")
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    if head is None or finish is None or not done:
        return None
    message: dict[str, Any] = {"role": role, "content": "".join(content) if content else None,
                               "refusal": "".join(refusal) if refusal else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        for index, call in calls.items():
            call["function"]["arguments"] = "".join(arguments.get(index, ()))
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    head["choices"] = [{"index": 0, "message": message, "logprobs": None,
                        "finish_reason": finish}]
    if usage is not None:
        head["usage"] = usage
    head.update(extra)
    return head


def _messages(events: list[SSEEvent]) -> dict[str, Any] | None:
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    texts: dict[int, list[str]] = {}
    done = False
    for event in events:
        obj = json.loads(event.data)
        kind = obj.get("type")
        if kind == "error":
            return None
        if kind == "message_start":
            message = dict(obj["message"])
            message["usage"] = dict(message.get("usage") or {})
        elif kind == "content_block_start":
            blocks[obj["index"]] = dict(obj["content_block"])
            texts[obj["index"]] = []
        elif kind == "content_block_delta":
            delta = obj["delta"]
            piece = delta.get("text", delta.get("partial_json", delta.get("thinking")))
            if isinstance(piece, str):
                texts[obj["index"]].append(piece)
            if "signature" in delta:
                blocks[obj["index"]]["signature"] = delta["signature"]
        elif kind == "message_delta" and message is not None:
            message.update(obj.get("delta") or {})
            message["usage"].update(obj.get("usage") or {})
        elif kind == "message_stop":
            done = True
    if message is None or not done:
        return None
    content = []
    for index in sorted(blocks):
        block, joined = blocks[index], "".join(texts[index])
        if block.get("type") == "text":
            block["text"] = block.get("text", "") + joined
        elif block.get("type") == "thinking":
            block["thinking"] = block.get("thinking", "") + joined
        elif block.get("type") in ("tool_use", "server_tool_use") and joined:
            block["input"] = json.loads(joined)
        content.append(block)
    message["content"] = content
    return message


#: the Responses API's events that end an answer with the whole response object in them
_RESPONSES_FINAL = frozenset({"response.completed", "response.incomplete"})


def _responses(events: list[SSEEvent]) -> dict[str, Any] | None:
    """The response object of the stream's end event, or None when the stream reported an
    error (`error`, `response.failed`) or has no such end: never a response in progress."""
    for event in events:
        obj = json.loads(event.data)
        kind = obj.get("type")
        if kind in ("error", "response.failed"):
            return None
        if kind in _RESPONSES_FINAL:
            response = obj["response"]
            return response if isinstance(response, dict) \
                and response.get("object", "response") == "response" else None
    return None


#: the most bytes a whole answer read as a stream may take (the bound a non-streaming body
#: has upstream): past it the answer is refused, never held
MAX_WHOLE_BYTES = 64 * 1024 * 1024
