"""Requests between Chat Completions and Anthropic Messages, both ways (pure).

One call per request and per attempt that goes to a backend of the other API, never per event.
Each field is carried, dropped (it only tunes: `DROPPED_*`, listed in docs/translation.md) or
refused with `Untranslatable` (a 400 naming it) when it would change the answer and the other
API has no place for it. A top-level field neither carried nor dropped (`top_k` to Chat,
`min_p`, `repetition_penalty`, `guided_json`: a server's own extensions) is refused too:
dropped, it would silently change the answer the client asked for. A value equal to the
field's default changes nothing and is dropped (`n: 1`, `logprobs: false`,
`presence_penalty: 0`), so clients that send defaults everywhere still pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from gateway.errors import Unreadable, Untranslatable

T = TypeVar("T")

#: Messages requires `max_tokens`; a Chat request that sets none gets this many
DEFAULT_MAX_TOKENS = 4096
#: the tool a Chat `response_format` (JSON output) becomes on a Messages backend: forced, its
#: arguments are the JSON answer, and the answer's translation turns them back into text
JSON_TOOL = "json_answer"
#: Chat fields dropped on the way to Messages: they tune delivery or bookkeeping, not the
#: answer (docs/translation.md lists them; a test holds the two equal)
DROPPED_CHAT = frozenset({
    "service_tier", "store", "metadata", "seed", "prediction", "safety_identifier",
    "prompt_cache_key", "verbosity",
})
#: Messages fields dropped on the way to Chat (of `metadata`, `user_id` becomes `user`)
DROPPED_MESSAGES = frozenset({
    "service_tier", "context_management", "cache_control", "output_config", "inference_geo",
})
#: Chat fields the translation to Messages reads (carried, or refused by their value)
CARRIED_CHAT = frozenset({
    "model", "messages", "max_completion_tokens", "max_tokens", "temperature", "top_p",
    "top_k", "stop", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "reasoning_effort", "user", "stream", "stream_options",
})
#: Messages fields the translation to Chat reads (carried, or refused by their value)
CARRIED_MESSAGES = frozenset({
    "model", "messages", "system", "max_tokens", "temperature", "top_p", "stop_sequences",
    "tools", "tool_choice", "thinking", "output_format", "metadata", "stream", "top_k",
    "container", "mcp_servers",
})
#: a Chat field at its default (or absent) changes nothing; any other value changes the answer
_CHAT_DEFAULTS: Mapping[str, Any] = {
    "n": 1, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0,
    "frequency_penalty": 0, "logit_bias": {}, "modalities": ["text"], "audio": None,
    "web_search_options": None, "functions": None, "function_call": None,
}
#: reasoning effort -> a thinking budget, and back by the nearest budget at or above
EFFORT_BUDGETS: Mapping[str, int] = {"minimal": 1024, "low": 2048, "medium": 8192, "high": 24576}


#: what reading a value of an unexpected shape raises (`5["role"]`, `None.get`, `len(3)`)
UNREADABLE = (TypeError, AttributeError, ValueError, LookupError)


def each_item(items: Iterable[Any], name: str, convert: Callable[[Any, str], T]) -> list[T]:
    """`convert(item, "name[i]")` of each item, in order; an item whose shape the conversion
    cannot read is refused naming it (`Unreadable`), not raised as the conversion's error
    (the body check looks no deeper than the items being objects; one `try` per list)."""
    out: list[T] = []
    field = name
    try:
        for i, item in enumerate(items):
            field = f"{name}[{i}]"
            out.append(convert(item, field))
    except UNREADABLE as exc:
        raise Unreadable(field, exc) from None
    return out


def refuse_unknown(body: Mapping[str, Any], known: frozenset[str], api: str) -> None:
    """`Untranslatable` naming the first top-level field of `body` outside `known` (the
    fields a translation carries, refuses by value or drops). Such a field is another
    server's extension or newer than this gateway: dropping it would change the answer
    unseen, so the request stays with backends of its own API or is refused."""
    for name in body:
        if name not in known:
            raise Untranslatable(name, f"{api} has no such field")


def _image_url_to_block(url: str, field: str) -> dict[str, Any]:
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        media, _, encoding = head[5:].partition(";")
        if encoding != "base64" or not media:
            raise Untranslatable(field, "only base64 data URLs and http(s) URLs are images")
        return {"type": "image", "source": {"type": "base64", "media_type": media,
                                            "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _block_to_image_url(block: Mapping[str, Any], field: str) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif isinstance(source, dict) and source.get("type") == "url":
        url = str(source.get("url"))
    else:
        raise Untranslatable(f"{field}.source", "only base64 and URL images have a Chat form")
    return {"type": "image_url", "image_url": {"url": url}}


# --- Chat Completions -> Messages ---------------------------------------------------------


def _chat_parts(content: Any, field: str) -> list[dict[str, Any]]:
    """A Chat message's content (a string or parts) as Messages content blocks."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "refusal"):
            blocks.append({"type": "text", "text": part.get(kind if kind == "refusal" else "text")})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            blocks.append(_image_url_to_block(str(url), f"{field}[{j}].image_url"))
        else:
            raise Untranslatable(f"{field}[{j}].type", f"content of type {kind!r} has no "
                                 "Messages form")
    return blocks


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content or () if isinstance(p, dict))


def _arguments(raw: Any, field: str) -> Any:
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw else {}
    except ValueError:
        raise Untranslatable(field, "tool call arguments are not JSON") from None
    if not isinstance(value, dict):
        raise Untranslatable(field, "tool call arguments are not a JSON object")
    return value


def _chat_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Chat's messages -> (Messages' system blocks, its messages). System and developer
    messages go to `system` in order; consecutive turns of one role are joined, so a run of
    tool results is one user turn (parallel calls answered together)."""
    system: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    field = "messages"
    try:
        for i, message in enumerate(messages):
            field = f"messages[{i}]"
            role = message.get("role") if isinstance(message, dict) else None
            if role in ("system", "developer"):
                system += _chat_parts(message.get("content"), f"{field}.content")
                continue
            if role == "user":
                blocks = _chat_parts(message.get("content"), f"{field}.content")
            elif role == "assistant":
                blocks = _chat_parts(message.get("content"), f"{field}.content")
                for k, call in enumerate(message.get("tool_calls") or ()):
                    function = call.get("function") or {}
                    blocks.append({"type": "tool_use", "id": call.get("id"),
                                   "name": function.get("name"),
                                   "input": _arguments(function.get("arguments"),
                                                       f"{field}.tool_calls[{k}].function.arguments")})
            elif role == "tool":
                role = "user"
                blocks = [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                           "content": _chat_parts(message.get("content"), f"{field}.content")}]
            else:
                raise Untranslatable(f"{field}.role", f"role {role!r} has no Messages form")
            if out and out[-1]["role"] == role:
                out[-1]["content"] += blocks
            else:
                out.append({"role": role, "content": blocks})
    except UNREADABLE as exc:  # a message of a shape no Messages form reads: named
        raise Unreadable(field, exc) from None
    return system, out


def _chat_tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    if choice is None and parallel is not False:
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        result: dict[str, Any] = {"type": "tool", "name": name}
    else:
        result = {"type": {"none": "none", "required": "any"}.get(str(choice), "auto")}
    if parallel is False and result["type"] != "none":
        result["disable_parallel_tool_use"] = True
    return result


_KNOWN_CHAT = CARRIED_CHAT | DROPPED_CHAT | frozenset(_CHAT_DEFAULTS)
_KNOWN_MESSAGES = CARRIED_MESSAGES | DROPPED_MESSAGES


def _refuse_changing(body: Mapping[str, Any]) -> None:
    refuse_unknown(body, _KNOWN_CHAT, "Messages")
    for name, default in _CHAT_DEFAULTS.items():
        value = body.get(name)
        if value is not None and value != default:
            raise Untranslatable(name, "Messages has no such field")
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and temperature > 1:
        raise Untranslatable("temperature", "Messages takes a temperature of at most 1")


def chat_to_messages(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Chat Completions request body as a Messages request body."""
    _refuse_changing(body)
    system, messages = _chat_messages(list(body.get("messages") or ()))
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if system:
        out["system"] = system
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    out["max_tokens"] = limit if isinstance(limit, int) else DEFAULT_MAX_TOKENS
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    stop = body.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    tools = each_item(body.get("tools") or (), "tools", _chat_tool)
    choice = _chat_tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
    fmt = body.get("response_format")
    fmt = fmt if isinstance(fmt, dict) else {}
    kind = fmt.get("type")
    if kind in ("json_object", "json_schema"):
        if tools:
            raise Untranslatable("response_format", "JSON output to Messages is a forced tool, "
                                 "which cannot be forced beside the request's own tools")
        schema = (fmt.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        tools = [{"name": JSON_TOOL, "description": "Answer with this JSON.",
                  "input_schema": schema or {"type": "object"}}]
        choice = {"type": "tool", "name": JSON_TOOL}
    elif kind not in (None, "text"):
        raise Untranslatable("response_format.type", f"{kind!r} has no Messages form")
    if tools:
        out["tools"] = tools
    if choice is not None and (tools or choice["type"] == "none"):
        out["tool_choice"] = choice
    effort = body.get("reasoning_effort")
    if isinstance(effort, str) and effort in EFFORT_BUDGETS:  # (a list is unhashable)
        if out.get("tool_choice", {}).get("type") in ("any", "tool"):
            # Messages thinks only where the model may choose not to call a tool
            raise Untranslatable("reasoning_effort", "thinking on Messages takes no forced "
                                 "tool (a required or named tool_choice, or JSON output)")
        budget = EFFORT_BUDGETS[effort]
        out["thinking"] = {"type": "enabled", "budget_tokens": budget}
        out["max_tokens"] = max(out["max_tokens"], budget + 1)
    elif effort not in (None, "none"):
        raise Untranslatable("reasoning_effort", f"{effort!r} has no thinking budget")
    if isinstance(body.get("user"), str):
        out["metadata"] = {"user_id": body["user"]}
    if body.get("stream") is True:
        out["stream"] = True
    return out


def _chat_tool(tool: Any, field: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise Untranslatable(f"{field}.type", "only function tools have a Messages form")
    function = tool.get("function") or {}
    out = {"name": function.get("name"),
           "input_schema": function.get("parameters") or {"type": "object", "properties": {}}}
    if function.get("description"):
        out["description"] = function["description"]
    return out


# --- Messages -> Chat Completions ---------------------------------------------------------


def _message_blocks(content: Any) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content or ())


def _tool_result_content(content: Any, field: str) -> str:
    blocks = _message_blocks(content)
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise Untranslatable(f"{field}[{j}].type", "a Chat tool result holds text only")
    return _text_of(blocks)


def _messages_turn(message: Mapping[str, Any], field: str) -> list[dict[str, Any]]:
    """One Messages turn as Chat messages: tool results become `tool` messages, in order,
    before the turn's other content."""
    role = message.get("role")
    if role == "system":  # a mid-conversation system turn (a Claude Code beta)
        return [{"role": "system", "content": _text_of(_message_blocks(message.get("content")))}]
    if role not in ("user", "assistant"):
        raise Untranslatable(f"{field}.role", f"role {role!r} has no Chat form")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_message_blocks(message.get("content"))):
        where = f"{field}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            parts.append(_block_to_image_url(block, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"),
                "arguments": json.dumps(block.get("input") or {}, separators=(",", ":"),
                                        ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": _tool_result_content(block.get("content"),
                                                        f"{where}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # a past turn's thinking: each API keeps its own, Chat takes none back
        else:
            raise Untranslatable(f"{where}.type", f"a {kind!r} block has no Chat form")
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": _joined(parts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    elif parts:
        out.append({"role": "user", "content": _joined(parts)})
    return out


def _joined(parts: list[dict[str, Any]]) -> Any:
    """Text-only parts as one string (what every Chat server reads), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts) if parts else None
    return parts


def _messages_tool(tool: Any, field: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise Untranslatable(f"{field}.type", f"the server tool {kind!r} has no Chat form")
    function: dict[str, Any] = {"name": tool.get("name"),
                                "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def messages_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Messages request body as a Chat Completions request body."""
    refuse_unknown(body, _KNOWN_MESSAGES, "Chat Completions")
    for name in ("top_k", "container", "mcp_servers"):
        if body.get(name) is not None:
            raise Untranslatable(name, "Chat Completions has no such field")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text_of(_message_blocks(system))})
    for turn in each_item(body.get("messages") or (), "messages", _messages_turn):
        messages += turn
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("max_tokens") is not None:
        out["max_tokens"] = body["max_tokens"]
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("stop_sequences"):
        out["stop"] = list(body["stop_sequences"])
    tools = each_item(body.get("tools") or (), "tools", _messages_tool)
    if tools:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and tools:  # (Chat takes no `tool_choice` without tools)
        kind = choice.get("type")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            out["tool_choice"] = {"any": "required"}.get(str(kind), kind)
        if choice.get("disable_parallel_tool_use") is True and tools:
            out["parallel_tool_calls"] = False
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        out["reasoning_effort"] = next(
            (e for e, b in EFFORT_BUDGETS.items() if isinstance(budget, int) and budget <= b),
            "high")
    fmt = body.get("output_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.get("schema") or {}, "strict": True}}
    user = (body.get("metadata") or {}).get("user_id")
    if isinstance(user, str):
        out["user"] = user[:256]
    if body.get("stream") is True:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out
