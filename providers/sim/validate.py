"""The simulator's request checks: the 400s the real APIs answer, with their messages. Pure.

A gateway must relay an upstream's refusal of a request as final (the request would fail on
every backend, and a client retry would fail again), which only a simulator that refuses what
the real APIs refuse can show. The checks are the common ones, not a full schema: a missing
or mistyped `model`, `messages` (`input`, `prompt`), an empty message list, an unknown role,
output limits below the API's minimum (Messages requires `max_tokens`; the Responses API takes
no `max_output_tokens` under 16), `n` above 1 (one answer per request is all this simulator
makes), a tool result with no call before it, malformed tools and a `tool_choice` that names no
offered tool. The wording follows each API: OpenAI's `Missing required parameter: 'messages'.`
with its `param` and `code`, Anthropic's `max_tokens: Field required` (a validation path).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import error_body
from gateway.wire.messages import anthropic_error_body
from providers.sim.prompt import Api, api_of

#: the largest `dimensions` an embeddings request may ask for
MAX_DIMENSIONS = 3072
#: the Responses API's smallest `max_output_tokens`
MIN_OUTPUT_TOKENS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
RESPONSES_ROLES = ("user", "assistant", "system", "developer")
#: the routes whose bodies are checked (stored-response operations take none)
CHECKED = frozenset({"chat/completions", "completions", "embeddings", "responses",
                     "messages", "messages/count_tokens"})


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request is refused: the message, and for OpenAI's shape its `param` and `code`."""

    message: str
    param: str | None = None
    code: str | None = None


def check_request(endpoint: str, body: Mapping[str, Any]) -> Rejection | None:
    """The first thing the real API would refuse in `body`, or None."""
    if endpoint not in CHECKED:
        return None
    api = api_of(endpoint)
    checks = _anthropic(body, count=endpoint == "messages/count_tokens") if api == "messages" \
        else _openai(body, api)
    return next(checks, None)


# --- OpenAI's wording -------------------------------------------------------------------------

_ARTICLES = {bool: "a boolean", int: "an integer", float: "a decimal", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}


def _got(value: object) -> str:
    return _ARTICLES.get(type(value), "an object")


def _missing(param: str) -> Rejection:
    return Rejection(f"Missing required parameter: '{param}'.", param,
                     "missing_required_parameter")


def _type(param: str, expected: str, value: object) -> Rejection:
    return Rejection(f"Invalid type for '{param}': expected {expected}, but got {_got(value)} "
                     "instead.", param, "invalid_type")


def _value(param: str, value: object, supported: tuple[str, ...]) -> Rejection:
    listed = ", ".join(f"'{s}'" for s in supported[:-1]) + f", and '{supported[-1]}'"
    return Rejection(f"Invalid value: '{value}'. Supported values are: {listed}.", param,
                     "invalid_value")


def _integer(body: Mapping[str, Any], param: str, minimum: int,
             maximum: int | None = None) -> Iterator[Rejection]:
    value = body.get(param)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        yield _type(param, "an integer", value)
    elif value < minimum:
        yield Rejection(f"Invalid '{param}': integer below minimum value. Expected a value >= "
                        f"{minimum}, but got {value} instead.", param, "integer_below_min_value")
    elif maximum is not None and value > maximum:
        yield Rejection(f"Invalid '{param}': integer above maximum value. Expected a value <= "
                        f"{maximum}, but got {value} instead.", param, "integer_above_max_value")


def _openai(body: Mapping[str, Any], api: Api) -> Iterator[Rejection]:
    model = body.get("model")
    if model is None or model == "":
        yield Rejection("you must provide a model parameter")
    elif not isinstance(model, str):
        yield _type("model", "a string", model)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        yield _type("stream", "a boolean", stream)
    if body.get("stream_options") is not None and stream is not True and api != "embeddings":
        yield Rejection("The 'stream_options' parameter is only allowed when 'stream' is "
                        "enabled.", "stream_options", None)
    if api == "chat":
        yield from _chat_messages(body)
        yield from _integer(body, "max_completion_tokens", 1)
    elif api == "completions" and "prompt" not in body:
        yield _missing("prompt")
    elif api == "embeddings":
        yield from _embeddings(body)
    elif api == "responses":
        yield from _responses_input(body)
        yield from _integer(body, "max_output_tokens", MIN_OUTPUT_TOKENS)
    if api in ("chat", "completions"):
        yield from _integer(body, "max_tokens", 1)
        yield from _integer(body, "n", 1)
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            yield Rejection(f"Unsupported value: 'n' does not support {n} with this model. Only "
                            "the default (1) value is supported.", "n", "unsupported_value")
    if api in ("chat", "responses"):
        yield from _openai_tools(body, api)


def _chat_messages(body: Mapping[str, Any]) -> Iterator[Rejection]:
    messages = body.get("messages")
    if messages is None:
        yield _missing("messages")
        return
    if not isinstance(messages, list):
        yield _type("messages", "an array", messages)
        return
    if not messages:
        yield Rejection("Invalid 'messages': empty array. Expected an array with minimum length "
                        "1, but got an empty array instead.", "messages", "empty_array")
    calls_open = False  # an assistant message with tool_calls came before
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, Mapping):
            yield _type(at, "an object", message)
            return
        role = message.get("role")
        if role is None:
            yield _missing(f"{at}.role")
        elif role not in CHAT_ROLES:
            yield _value(f"{at}.role", role, CHAT_ROLES)
        content = message.get("content")
        if content is None and role not in ("assistant", "tool", "function"):
            yield _missing(f"{at}.content")
        elif content is not None and not isinstance(content, (str, list)):
            yield _type(f"{at}.content", "one of a string or array of objects", content)
        if role == "tool":
            if not calls_open:
                yield Rejection("Invalid parameter: messages with role 'tool' must be a "
                                "response to a preceeding message with 'tool_calls'.",
                                f"{at}.role", None)
            if not isinstance(message.get("tool_call_id"), str):
                yield _missing(f"{at}.tool_call_id")
        elif role is not None:
            calls_open = role == "assistant" and bool(message.get("tool_calls"))


def _embeddings(body: Mapping[str, Any]) -> Iterator[Rejection]:
    given = body.get("input")
    if given is None:
        yield _missing("input")
    elif given in ("", []) or (isinstance(given, list) and "" in given):
        yield Rejection("'$.input' is invalid: an empty input has no embedding.", "input", None)
    elif not isinstance(given, (str, list)):
        yield _type("input", "one of a string or array", given)
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        yield _value("encoding_format", encoding, ("float", "base64"))
    yield from _integer(body, "dimensions", 1, MAX_DIMENSIONS)


def _responses_input(body: Mapping[str, Any]) -> Iterator[Rejection]:
    given = body.get("input")
    if given is None or isinstance(given, str):
        return
    if not isinstance(given, list):
        yield _type("input", "one of a string or array of input items", given)
        return
    for i, item in enumerate(given):
        at = f"input[{i}]"
        if not isinstance(item, Mapping):
            yield _type(at, "an object", item)
            return
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role is None:
                yield _missing(f"{at}.role")
            elif role not in RESPONSES_ROLES:
                yield _value(f"{at}.role", role, RESPONSES_ROLES)
            if "content" not in item:
                yield _missing(f"{at}.content")
        elif kind in ("function_call_output", "function_call"):
            if not isinstance(item.get("call_id"), str):
                yield _missing(f"{at}.call_id")
            needed = "output" if kind == "function_call_output" else "name"
            if needed not in item:
                yield _missing(f"{at}.{needed}")


def _openai_tools(body: Mapping[str, Any], api: Api) -> Iterator[Rejection]:
    tools = body.get("tools")
    names: list[str] = []
    if tools is not None and not isinstance(tools, list):
        yield _type("tools", "an array", tools)
        return
    for i, tool in enumerate(tools or ()):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            yield _type(at, "an object", tool)
            return
        if "type" not in tool:
            yield _missing(f"{at}.type")
            return
        if tool["type"] != "function":
            continue  # built-in and custom tools: not this simulator's to call
        where = tool.get("function") if api == "chat" else tool
        prefix = f"{at}.function" if api == "chat" else at
        if not isinstance(where, Mapping):
            yield _missing(prefix)
            return
        name = where.get("name")
        if not isinstance(name, str) or not name:
            yield _missing(f"{prefix}.name") if name is None else \
                _type(f"{prefix}.name", "a string", name)
            return
        names.append(name)
        parameters = where.get("parameters")
        if parameters is not None and (not isinstance(parameters, Mapping)
                                       or parameters.get("type") != "object"):
            kind = parameters.get("type") if isinstance(parameters, Mapping) else None
            yield Rejection(f"Invalid schema for function '{name}': schema must be a JSON Schema "
                            f"of 'type: \"object\"', got 'type: \"{kind}\"'.",
                            f"{prefix}.parameters", "invalid_function_parameters")
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not tools:
        yield Rejection("Invalid value for 'tool_choice': 'tool_choice' is only allowed when "
                        "'tools' are specified.", "tool_choice", None)
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            yield _value("tool_choice", choice, ("none", "auto", "required"))
    elif isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) and api == "chat" \
            else choice.get("name")
        if name not in names:
            yield Rejection(f"Invalid value for 'tool_choice': function '{name}' is not one of "
                            "the tools offered in 'tools'.", "tool_choice", "invalid_value")


# --- Anthropic's wording ------------------------------------------------------------------------


def _anthropic(body: Mapping[str, Any], *, count: bool) -> Iterator[Rejection]:
    model = body.get("model")
    if model is None:
        yield Rejection("model: Field required")
    elif not isinstance(model, str):
        yield Rejection("model: Input should be a valid string")
    if not count:
        limit = body.get("max_tokens")
        if limit is None:
            yield Rejection("max_tokens: Field required")
        elif isinstance(limit, bool) or not isinstance(limit, int):
            yield Rejection("max_tokens: Input should be a valid integer")
        elif limit < 1:
            yield Rejection("max_tokens: Input should be greater than or equal to 1")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            yield Rejection("stream: Input should be a valid boolean")
    yield from _anthropic_messages(body.get("messages"))
    yield from _anthropic_tools(body)


def _anthropic_messages(messages: object) -> Iterator[Rejection]:
    if messages is None:
        yield Rejection("messages: Field required")
        return
    if not isinstance(messages, list):
        yield Rejection("messages: Input should be a valid list")
        return
    if not messages:
        yield Rejection("messages: at least one message is required")
    uses: set[str] = set()  # the tool_use ids of the previous assistant turn
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            yield Rejection(f"messages.{i}: Input should be a valid dictionary")
            return
        role = message.get("role")
        if role is None:
            yield Rejection(f"messages.{i}.role: Field required")
        elif role not in ("user", "assistant"):
            yield Rejection(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = message.get("content")
        if content is None:
            yield Rejection(f"messages.{i}.content: Field required")
        elif not isinstance(content, (str, list)):
            yield Rejection(f"messages.{i}.content: Input should be a valid list")
        blocks = [b for b in content if isinstance(b, Mapping)] \
            if isinstance(content, list) else []
        for j, block in enumerate(blocks):
            if block.get("type") == "tool_result" and block.get("tool_use_id") not in uses:
                yield Rejection(
                    f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                    f"`tool_result` blocks: {block.get('tool_use_id')}. Each `tool_result` "
                    "block must have a corresponding `tool_use` block in the previous message.")
        uses = {str(b.get("id")) for b in blocks if b.get("type") == "tool_use"} \
            if role == "assistant" else set()


def _anthropic_tools(body: Mapping[str, Any]) -> Iterator[Rejection]:
    tools = body.get("tools")
    names: list[str] = []
    if tools is not None and not isinstance(tools, list):
        yield Rejection("tools: Input should be a valid list")
        return
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping):
            yield Rejection(f"tools.{i}: Input should be a valid dictionary")
            return
        if not isinstance(tool.get("name"), str):
            yield Rejection(f"tools.{i}.name: Field required")
            return
        names.append(tool["name"])
        if tool.get("type", "custom") != "custom":
            continue  # a server tool (web search, code execution): no schema of ours
        schema = tool.get("input_schema")
        if schema is None:
            yield Rejection(f"tools.{i}.custom.input_schema: Field required")
        elif not isinstance(schema, Mapping) or schema.get("type") != "object":
            yield Rejection(f"tools.{i}.custom.input_schema.type: Input should be 'object'")
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            yield Rejection("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
        elif kind == "tool" and choice.get("name") not in names:
            yield Rejection(f"tool_choice: tool '{choice.get('name')}' not found in 'tools'")
    elif choice is not None:
        yield Rejection("tool_choice: Input should be a valid dictionary")


# --- the answer -------------------------------------------------------------------------------


def error_answer(endpoint: str, status: int, rejection: Rejection) -> dict[str, object]:
    """An error body in the route's shape: Anthropic's on the Messages routes, OpenAI's on
    every other (its `type` from the status: `rate_limit_error` for a 429,
    `invalid_request_error` for another 4xx, `server_error` above)."""
    if api_of(endpoint) == "messages":
        return anthropic_error_body(status, rejection.message)
    if status == 429:
        kind = "rate_limit_error"
    elif 400 <= status < 500:
        kind = "invalid_request_error"
    else:
        kind = "server_error"
    return error_body(rejection.message, type=kind, code=rejection.code, param=rejection.param)
