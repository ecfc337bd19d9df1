"""Responses API requests answered by Chat Completions: the request, the whole answer and the
stream event by event (pure).

Only a request that holds its whole conversation is translated: `store: false`, no
`previous_response_id`, no `conversation`, not in background. Stored state lives on the
backend that made it, so a request that needs or makes it stays with backends that speak the
Responses API (`Untranslatable` naming the field sends it there, or is the answer when the
pool has none). A Messages backend is reached through Chat (`gateway.wire.translate.routes`
chains this with `chat_messages`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.errors import Unreadable, Untranslatable
from gateway.wire.base import json_bytes
from gateway.wire.responses import responses_error
from gateway.wire.sse import SSEEvent
from gateway.wire.translate.chat_messages import UNREADABLE, each_item, refuse_unknown
from gateway.wire.usage import Usage, usage_of

#: Responses fields dropped on the way to Chat: bookkeeping and delivery, not the answer
#: (docs/translation.md lists them; a test holds the two equal)
DROPPED_RESPONSES = frozenset({
    "metadata", "include", "truncation", "service_tier", "safety_identifier",
    "prompt_cache_key", "max_tool_calls", "stream_options", "user", "client_metadata",
})
#: Responses fields the translation to Chat reads (carried, or refused by their value)
CARRIED_RESPONSES = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
    "parallel_tool_calls", "tools", "tool_choice", "text", "reasoning", "stream", "store",
    "previous_response_id", "conversation", "prompt", "background", "top_logprobs",
})
_KNOWN_RESPONSES = CARRIED_RESPONSES | DROPPED_RESPONSES
#: fields that name stored state: a request that carries one stays on Responses backends
_STATEFUL = ("previous_response_id", "conversation", "prompt")


def _parts(content: Any, field: str) -> Any:
    """A Responses message's content as Chat's: a string, or text and image parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content or ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") not in (None, "auto"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise Untranslatable(f"{field}[{j}].type", f"content of type {kind!r} has no "
                                 "Chat Completions form")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _output_text(output: Any, field: str) -> str:
    """A tool's output as a Chat tool message's text: a string, or text parts; a part of
    another kind (an image, a file) has no place in a Chat tool message and is refused, never
    dropped."""
    if isinstance(output, str):
        return output
    texts: list[str] = []
    for j, part in enumerate(output or ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise Untranslatable(f"{field}[{j}].type", f"a tool output part of type {kind!r} "
                                 "has no Chat Completions form")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _input_messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    field = "input"
    try:
        for i, item in enumerate(items or ()):
            field = f"input[{i}]"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise Untranslatable(f"{field}.role", f"role {role!r} has no Chat form")
                out.append({"role": role, "content": _parts(item.get("content"),
                                                             f"{field}.content")})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": _output_text(item.get("output"), f"{field}.output")})
            elif kind == "reasoning":
                continue  # a past turn's reasoning: Chat takes none back
            else:
                raise Untranslatable(f"{field}.type", f"an input item {kind!r} has no Chat form")
    except UNREADABLE as exc:  # an item of a shape no Chat form reads: named
        raise Unreadable(field, exc) from None
    return out


def _tool(tool: Any, field: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise Untranslatable(f"{field}.type", f"the tool {kind!r} has no Chat form")
    function: dict[str, Any] = {"name": tool.get("name"),
                                "parameters": tool.get("parameters") or {"type": "object"}}
    for name in ("description", "strict"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    return {"type": "function", "function": function}


def responses_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request body as a Chat Completions request body."""
    refuse_unknown(body, _KNOWN_RESPONSES, "Chat Completions")
    if body.get("store") is not False:
        raise Untranslatable("store", "a stored response stays with backends that speak the "
                             "Responses API (send `store: false` and the whole input)")
    for name in _STATEFUL:
        if body.get(name) is not None:
            raise Untranslatable(name, "stored state stays with backends that speak the "
                                 "Responses API")
    if body.get("background") is True:
        raise Untranslatable("background", "Chat Completions has no background mode")
    if body.get("top_logprobs"):
        raise Untranslatable("top_logprobs", "Messages and Chat translations carry no logprobs")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += _input_messages(body.get("input"))
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(name) is not None:
            out[name] = body[name]
    tools = each_item(body.get("tools") or (), "tools", _tool)
    if tools:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        out["tool_choice"] = choice
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise Untranslatable("tool_choice.type", f"{choice.get('type')!r} has no Chat form")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    fmt = (body.get("text") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        out["reasoning_effort"] = effort
    if body.get("stream") is True:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


# --- answers ----------------------------------------------------------------------------------


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """Chat usage as the Responses API's."""
    if not isinstance(usage, dict):
        return None
    prompt, output = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


#: Chat `finish_reason` -> the Responses status and `incomplete_details.reason`
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_object(response_id: str, model: Any, created: int, output: list[Any],
                    finish: str | None, usage: Any, *, done: bool = True) -> dict[str, Any]:
    """The response object the SDKs read, in progress or finished."""
    reason = _INCOMPLETE.get(str(finish)) if done else None
    return {
        "id": response_id, "object": "response", "created_at": created,
        "status": "in_progress" if not done else "incomplete" if reason else "completed",
        "background": False, "error": None,
        "incomplete_details": {"reason": reason} if reason else None,
        "instructions": None, "max_output_tokens": None, "model": model, "output": output,
        "parallel_tool_calls": True, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": None,
        "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
        "top_p": None, "truncation": "disabled",
        "usage": responses_usage(usage) if done else None, "user": None, "metadata": {},
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status != "in_progress" else []}


def _call_item(call_id: Any, name: Any, arguments: str, status: str) -> dict[str, Any]:
    return {"id": f"fc_{call_id}", "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning",
            "summary": [{"type": "summary_text", "text": text}] if text else []}


def chat_answer_to_responses(body: Mapping[str, Any], created: int) -> dict[str, Any]:
    """A whole Chat completion as a Responses answer (`created`: now, in seconds)."""
    choices = body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    base = str(body.get("id"))
    output: list[Any] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(_reasoning_item(f"rs_{base}", reasoning))
    text = message.get("content") or message.get("refusal")
    if isinstance(text, str) and text:
        output.append(_message_item(f"msg_{base}", text, "completed"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        output.append(_call_item(call.get("id"), function.get("name"),
                                 str(function.get("arguments") or ""), "completed"))
    return response_object(f"resp_{base}", body.get("model"), created, output,
                           choice.get("finish_reason"), body.get("usage"))


def chat_error_to_responses(body: Any) -> dict[str, Any]:
    """An OpenAI error chunk as the Responses API's `error` event payload."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {"message": str(error or "upstream error")}
    return responses_error(str(error.get("code") or error.get("type") or "server_error"),
                           str(error.get("message", "upstream error")), error.get("param"))


class ChatToResponses:
    """A Chat stream (a Chat backend) written as a Responses stream (a Responses client).

    Items open as the output's kind changes (reasoning, the message, each tool call) and are
    done when the next opens; `response.completed` (or `.incomplete`) with the whole response
    object is written at `[DONE]`, after the usage chunk. Each event names its item and
    output index; the finished items are kept for the final response object (bounded by the
    answer, which the client receives anyway)."""

    __slots__ = ("_chat_usage", "created", "ended", "failed", "finish", "id", "include_usage",
                 "model", "open", "output", "seq", "started", "texts", "tools", "usage")

    def __init__(self, created: int) -> None:
        self.created = created
        self.id = ""
        self.model: Any = None
        self.seq = -1
        self.started = False
        #: the open item's output index (None: none open)
        self.open: int | None = None
        #: the output items so far, and the text each has accumulated
        self.output: list[dict[str, Any]] = []
        self.texts: list[str] = []
        #: Chat tool call index -> its output index
        self.tools: dict[int, int] = {}
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.ended = self.failed = False
        #: the Responses API always reports usage: a Chat client's wish does not apply
        self.include_usage = True
        self._chat_usage: Any = None

    def _event(self, kind: str, /, **payload: Any) -> bytes:
        self.seq += 1
        return (b"event: " + kind.encode() + b"\ndata: "
                + json_bytes({"type": kind, "sequence_number": self.seq, **payload}) + b"\n\n")

    def _response(self, done: bool) -> dict[str, Any]:
        return response_object(self.id, self.model, self.created,
                               self.output if done else [], self.finish, self._chat_usage,
                               done=done)

    def _close(self) -> bytes:
        index = self.open
        if index is None:
            return b""
        self.open = None
        item, text = self.output[index], self.texts[index]
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            item.update(_message_item(item["id"], text, "completed"))
            part = item["content"][0]
            out = self._event("response.output_text.done", **at, content_index=0, text=text,
                              logprobs=[])
            out += self._event("response.content_part.done", **at, content_index=0, part=part)
        elif item["type"] == "function_call":
            item.update(status="completed", arguments=text)
            out = self._event("response.function_call_arguments.done", **at,
                              name=item["name"], arguments=text)
        else:
            item.update(_reasoning_item(item["id"], text))
            out = self._event("response.reasoning_summary_text.done", **at, summary_index=0,
                              text=text)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _add(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.open = len(self.output)
        self.output.append(item)
        self.texts.append("")
        return out + self._event("response.output_item.added", output_index=self.open,
                                 item=item)

    def _text(self, kind: str, delta: str) -> bytes:
        out = b""
        current = self.output[self.open] if self.open is not None else None
        if current is None or current["type"] != kind:
            index = len(self.output)
            if kind == "message":
                out = self._add(_message_item(f"msg_{self.id}_{index}", "", "in_progress"))
                out += self._event("response.content_part.added", item_id=self.output[-1]["id"],
                                   output_index=index, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []})
            else:
                out = self._add(_reasoning_item(f"rs_{self.id}_{index}", ""))
        assert self.open is not None
        self.texts[self.open] += delta
        at = {"item_id": self.output[self.open]["id"], "output_index": self.open}
        if kind == "message":
            return out + self._event("response.output_text.delta", **at, content_index=0,
                                     delta=delta, logprobs=[])
        return out + self._event("response.reasoning_summary_text.delta", **at,
                                 summary_index=0, delta=delta)

    def _tool(self, call: dict[str, Any]) -> bytes:
        out = b""
        function = call.get("function") or {}
        index = self.tools.get(call.get("index", 0))
        if index is None:
            out = self._add(_call_item(call.get("id"), function.get("name"), "", "in_progress"))
            index = self.tools[call.get("index", 0)] = len(self.output) - 1
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            self.texts[index] += arguments
            out += self._event("response.function_call_arguments.delta",
                               item_id=self.output[index]["id"], output_index=index,
                               delta=arguments)
        return out

    def feed_all(self, events: list[SSEEvent]) -> bytes:
        """The Responses bytes for a read's chunks, `feed` for each."""
        return b"".join([self.feed(event) for event in events])

    def feed_named(self, chunk: bytes) -> bytes | None:
        """None: a Chat backend's reads are not in the named framing."""
        return None

    def feed(self, event: SSEEvent) -> bytes:
        """The Responses bytes for one Chat chunk."""
        if self.ended:
            return b""
        if event.data.strip() == b"[DONE]":
            self.ended = True
            end = "response.incomplete" if self.finish in _INCOMPLETE else "response.completed"
            out = b"" if self.started else self._begin({})
            return out + self._close() + self._event(end, response=self._response(True))
        try:
            obj = json.loads(event.data)
        except (ValueError, RecursionError):
            return b""
        if not isinstance(obj, dict):
            return b""
        if obj.get("error") is not None or event.event == b"error":
            self.ended = self.failed = True
            return self._event("error", **{k: v for k, v in chat_error_to_responses(obj).items()
                                           if k not in ("type", "sequence_number")})
        out = b"" if self.started else self._begin(obj)
        if isinstance(obj.get("usage"), dict):
            self._chat_usage = obj["usage"]
            self.usage = usage_of(obj)
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out += self._text("reasoning", reasoning)
            for name in ("content", "refusal"):
                text = delta.get(name)
                if isinstance(text, str) and text:
                    out += self._text("message", text)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._tool(call)
            if choice.get("finish_reason"):
                self.finish = str(choice["finish_reason"])
                out += self._close()
        return out

    def _begin(self, obj: dict[str, Any]) -> bytes:
        self.started = True
        self.id = f"resp_{obj.get('id', '')}"
        self.model = obj.get("model")
        response = self._response(False)
        return (self._event("response.created", response=response)
                + self._event("response.in_progress", response=response))
