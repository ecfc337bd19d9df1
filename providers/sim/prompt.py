"""What a simulated request says, read the way each API reads it: its prompt as segments, the
token count of each, the tools it offers and whether its last input is a tool's result. Pure.

One reading serves the usage numbers and the prefix cache (`providers.sim.cache`), so the
input tokens a response reports and the cached tokens inside them are counted alike, and the
cached part can never exceed the whole. A token is about four bytes of UTF-8 text
(`BYTES_PER_TOKEN`), the gateway's own estimate from a body's size: cheap, deterministic, and
close to what real tokenizers give for English.

A segment is one message (or one tool listing, one system prompt): the unit a backend's prompt
cache stores, so a conversation that grows by whole messages keeps its cached prefix. Parts
that are not text (images, audio) count nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

#: the request shapes: OpenAI chat and legacy completions, embeddings, the Responses API and
#: Anthropic Messages
Api = Literal["chat", "completions", "embeddings", "responses", "messages"]
BYTES_PER_TOKEN = 4
#: the API of each simulated route
_APIS: Mapping[str, Api] = {
    "chat/completions": "chat", "completions": "completions", "embeddings": "embeddings",
    "responses": "responses", "responses/item": "responses", "messages": "messages",
    "messages/count_tokens": "messages",
}


def api_of(endpoint: str) -> Api:
    return _APIS.get(endpoint, "chat")


def count_tokens(text: str) -> int:
    """About four bytes of UTF-8 per token, rounded up: any text at all is one token."""
    return -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


@dataclass(frozen=True, slots=True)
class Segment:
    """One cacheable piece of a prompt: who said it and every text it holds."""

    role: str
    text: str

    @property
    def tokens(self) -> int:
        return count_tokens(self.text)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the request offers: its name and the JSON schema of its arguments."""

    name: str
    schema: Mapping[str, Any]


#: what `tool_choice` asks for: none, the model's choice, any tool, or the named one
Choice = tuple[Literal["none", "auto", "required", "named"], str]
_SIMPLE_CHOICES: Mapping[str, Choice] = {"none": ("none", ""), "required": ("required", "")}


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _texts(value: object) -> Iterator[str]:
    """The text of a content value: a string, or the text-bearing parts of a list (`text`,
    `input_text`, `output_text`, Anthropic `text`, `thinking`, `tool_use` input, nested
    `tool_result` content)."""
    if isinstance(value, str):
        yield value
        return
    if not isinstance(value, list):
        return
    for part in value:
        if isinstance(part, str):
            yield part
        elif isinstance(part, Mapping):
            for key in ("text", "thinking", "refusal"):
                if isinstance(part.get(key), str):
                    yield part[key]
            if part.get("type") == "tool_use":
                yield str(part.get("name", ""))
                yield _json(part.get("input", {}))
            if "content" in part and part.get("type") == "tool_result":
                yield from _texts(part["content"])


def _tool_segment(tools: object) -> list[Segment]:
    """The tool listing counts once, as the prompt's first segment (real APIs put the tools
    before the system prompt, so a changed listing changes the whole cached prefix)."""
    if isinstance(tools, list) and tools:
        return [Segment("tools", _json(tools))]
    return []


def _chat_message(message: Mapping[str, Any]) -> Segment:
    texts = list(_texts(message.get("content")))
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            texts += [str(function.get("name", "")), str(function.get("arguments", ""))]
    return Segment(str(message.get("role", "")), "".join(texts))


def _responses_item(item: object) -> Segment:
    if isinstance(item, str):
        return Segment("user", item)
    if not isinstance(item, Mapping):
        return Segment("", "")
    kind = item.get("type", "message")
    if kind == "function_call":
        return Segment("function_call", f"{item.get('name', '')}{item.get('arguments', '')}")
    if kind == "function_call_output":
        output = item.get("output")
        return Segment("function_call_output", "".join(_texts(output)))
    if kind == "reasoning":
        return Segment("reasoning", "".join(_texts(item.get("summary"))))
    return Segment(str(item.get("role", "")), "".join(_texts(item.get("content"))))


def segments(body: Mapping[str, Any], api: Api) -> list[Segment]:
    """The request's prompt, segment by segment, in the order a backend prefills it."""
    if api == "completions":
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) \
            else []
        return [Segment("prompt", p) for p in prompts if isinstance(p, str)]
    if api == "embeddings":
        return []
    out = _tool_segment(body.get("tools"))
    if api == "chat":
        messages = body.get("messages")
        out += [_chat_message(m) for m in messages if isinstance(m, Mapping)] \
            if isinstance(messages, list) else []
    elif api == "responses":
        if isinstance(body.get("instructions"), str):
            out.append(Segment("instructions", body["instructions"]))
        given = body.get("input")
        items = [given] if isinstance(given, str) else given if isinstance(given, list) else []
        out += [_responses_item(item) for item in items]
    else:
        system = body.get("system")
        if system is not None:
            out.append(Segment("system", "".join(_texts(system))))
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if isinstance(message, Mapping):
                text = "".join(_texts(message.get("content")))
                out.append(Segment(str(message.get("role", "")), text))
    return out


def prompt_tokens(parts: Sequence[Segment]) -> int:
    return sum(part.tokens for part in parts)


def embedding_inputs(value: object) -> tuple[tuple[str, int], ...]:
    """Each embeddings input and its tokens: a string counts like any text, a list of token
    ids counts its ids (as the JSON text, it also seeds the vector)."""
    if isinstance(value, str):
        return ((value, count_tokens(value)),)
    if not isinstance(value, list):
        return ()
    if value and all(isinstance(v, int) for v in value):
        return ((_json(value), len(value)),)  # one input given as token ids
    out: list[tuple[str, int]] = []
    for item in value:
        if isinstance(item, str):
            out.append((item, count_tokens(item)))
        else:
            out.append((_json(item), len(item) if isinstance(item, list) else 1))
    return tuple(out)


# --- tools ------------------------------------------------------------------------------------

_EMPTY_OBJECT: Mapping[str, Any] = {"type": "object", "properties": {}}


def _schema(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else _EMPTY_OBJECT


def offered_tools(body: Mapping[str, Any], api: Api) -> list[Tool]:
    """The functions a request offers, in order: chat `{type: function, function: {name,
    parameters}}`, Responses `{type: function, name, parameters}`, Messages `{name,
    input_schema}` (a server tool such as web search has no schema and is not ours to call)."""
    tools = body.get("tools")
    out: list[Tool] = []
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, Mapping):
            continue
        if api == "chat" and tool.get("type") == "function":
            function = tool.get("function")
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                out.append(Tool(function["name"], _schema(function.get("parameters"))))
        elif api == "responses" and tool.get("type") == "function":
            if isinstance(tool.get("name"), str):
                out.append(Tool(tool["name"], _schema(tool.get("parameters"))))
        elif api == "messages" and "input_schema" in tool and isinstance(tool.get("name"), str):
            out.append(Tool(tool["name"], _schema(tool["input_schema"])))
    return out


def tool_choice(body: Mapping[str, Any], api: Api) -> Choice:
    """`tool_choice` as one of none / auto / required / named. Messages says `auto`, `any`,
    `tool` (with `name`) and `none`; the OpenAI APIs say `none`, `auto`, `required` or name a
    function (chat nests the name in `function`)."""
    value = body.get("tool_choice")
    if isinstance(value, str):
        return _SIMPLE_CHOICES.get(value, ("auto", ""))
    if not isinstance(value, Mapping):
        return ("auto", "")
    kind = value.get("type")
    if api == "messages":
        if kind == "tool" and isinstance(value.get("name"), str):
            return ("named", value["name"])
        return _SIMPLE_CHOICES.get("required" if kind == "any" else str(kind), ("auto", ""))
    function = value.get("function")
    name = function.get("name") if isinstance(function, Mapping) else value.get("name")
    if kind == "function" and isinstance(name, str):
        return ("named", name)
    return ("auto", "")


def ends_with_tool_result(body: Mapping[str, Any], api: Api) -> bool:
    """Whether the request's last input is a tool's result, to be answered in text: a chat
    `tool` (or legacy `function`) message, a Responses `function_call_output` item, a Messages
    user turn holding a `tool_result` block."""
    if api == "responses":
        given = body.get("input")
        last = given[-1] if isinstance(given, list) and given else None
        return isinstance(last, Mapping) and last.get("type") == "function_call_output"
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, Mapping):
        return False
    if api == "chat":
        return last.get("role") in ("tool", "function")
    content = last.get("content")
    return api == "messages" and isinstance(content, list) and any(
        isinstance(block, Mapping) and block.get("type") == "tool_result" for block in content)


#: the request fields that make up its content: what seeds a tool call (never `model`, which
#: the gateway rewrites per backend, nor `stream`, so every copy of a request answers alike)
CONTENT_FIELDS = ("messages", "input", "instructions", "system", "prompt", "tools",
                  "tool_choice")


def content_key(body: Mapping[str, Any]) -> bytes:
    """The request's content as canonical JSON bytes."""
    return _json({key: body[key] for key in CONTENT_FIELDS if key in body}).encode()
