"""The simulator's request checks: what the real APIs refuse, in each API's words (OpenAI's
message, `param` and `code`; Anthropic's validation path), and nothing they accept. Pure."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.wire.chat import CHAT
from gateway.wire.messages import MESSAGES
from providers.sim.validate import Rejection, check_request, error_answer

HI = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                       "arguments": "{}"}}]}

REFUSED: list[tuple[str, dict[str, Any], Rejection]] = [
    ("chat/completions", {"messages": HI}, Rejection("you must provide a model parameter")),
    ("chat/completions", {"model": "m"},
     Rejection("Missing required parameter: 'messages'.", "messages",
               "missing_required_parameter")),
    ("chat/completions", {"model": "m", "messages": []},
     Rejection("Invalid 'messages': empty array. Expected an array with minimum length 1, but "
               "got an empty array instead.", "messages", "empty_array")),
    ("chat/completions", {"model": "m", "messages": "hi"},
     Rejection("Invalid type for 'messages': expected an array, but got a string instead.",
               "messages", "invalid_type")),
    ("chat/completions", {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
     Rejection("Invalid value: 'robot'. Supported values are: 'system', 'developer', 'user', "
               "'assistant', 'tool', and 'function'.", "messages[0].role", "invalid_value")),
    ("chat/completions", {"model": "m", "messages": [{"role": "user"}]},
     Rejection("Missing required parameter: 'messages[0].content'.", "messages[0].content",
               "missing_required_parameter")),
    ("chat/completions", {"model": "m", "messages": HI, "max_tokens": 0},
     Rejection("Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but "
               "got 0 instead.", "max_tokens", "integer_below_min_value")),
    ("chat/completions", {"model": "m", "messages": HI, "max_completion_tokens": "8"},
     Rejection("Invalid type for 'max_completion_tokens': expected an integer, but got a "
               "string instead.", "max_completion_tokens", "invalid_type")),
    ("chat/completions", {"model": "m", "messages": HI, "n": 2},
     Rejection("Unsupported value: 'n' does not support 2 with this model. Only the default "
               "(1) value is supported.", "n", "unsupported_value")),
    ("chat/completions", {"model": "m", "messages": HI, "stream": "yes"},
     Rejection("Invalid type for 'stream': expected a boolean, but got a string instead.",
               "stream", "invalid_type")),
    ("chat/completions", {"model": "m", "messages": [*HI, {"role": "tool", "content": "x",
                                                           "tool_call_id": "c"}]},
     Rejection("Invalid parameter: messages with role 'tool' must be a response to a "
               "preceeding message with 'tool_calls'.", "messages[1].role")),
    ("chat/completions", {"model": "m", "messages": [*HI, CALLED, {"role": "tool",
                                                                   "content": "x"}]},
     Rejection("Missing required parameter: 'messages[2].tool_call_id'.",
               "messages[2].tool_call_id", "missing_required_parameter")),
    ("chat/completions", {"model": "m", "messages": HI, "tools": [{"type": "function"}]},
     Rejection("Missing required parameter: 'tools[0].function'.", "tools[0].function",
               "missing_required_parameter")),
    ("chat/completions", {"model": "m", "messages": HI, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     Rejection("Invalid schema for function 'f': schema must be a JSON Schema of 'type: "
               "\"object\"', got 'type: \"string\"'.", "tools[0].function.parameters",
               "invalid_function_parameters")),
    ("chat/completions", {"model": "m", "messages": HI, "tool_choice": "required"},
     Rejection("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
               "are specified.", "tool_choice")),
    ("chat/completions", {"model": "m", "messages": HI, "tools": [FN],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}},
     Rejection("Invalid value for 'tool_choice': function 'g' is not one of the tools offered "
               "in 'tools'.", "tool_choice", "invalid_value")),
    ("completions", {"model": "m"}, Rejection("Missing required parameter: 'prompt'.",
                                              "prompt", "missing_required_parameter")),
    ("embeddings", {"model": "m", "input": ""},
     Rejection("'$.input' is invalid: an empty input has no embedding.", "input")),
    ("embeddings", {"model": "m", "input": "x", "encoding_format": "hex"},
     Rejection("Invalid value: 'hex'. Supported values are: 'float', and 'base64'.",
               "encoding_format", "invalid_value")),
    ("embeddings", {"model": "m", "input": "x", "dimensions": 5000},
     Rejection("Invalid 'dimensions': integer above maximum value. Expected a value <= 3072, "
               "but got 5000 instead.", "dimensions", "integer_above_max_value")),
    ("responses", {"input": "hi"}, Rejection("you must provide a model parameter")),
    ("responses", {"model": "m", "input": "hi", "max_output_tokens": 8},
     Rejection("Invalid 'max_output_tokens': integer below minimum value. Expected a value >= "
               "16, but got 8 instead.", "max_output_tokens", "integer_below_min_value")),
    ("responses", {"model": "m", "input": [{"role": "robot", "content": "x"}]},
     Rejection("Invalid value: 'robot'. Supported values are: 'user', 'assistant', 'system', "
               "and 'developer'.", "input[0].role", "invalid_value")),
    ("responses", {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
     Rejection("Missing required parameter: 'input[0].call_id'.", "input[0].call_id",
               "missing_required_parameter")),
    ("responses", {"model": "m", "input": "hi", "tools": [{"type": "function"}]},
     Rejection("Missing required parameter: 'tools[0].name'.", "tools[0].name",
               "missing_required_parameter")),
    ("messages", {"max_tokens": 8, "messages": HI}, Rejection("model: Field required")),
    ("messages", {"model": "m", "messages": HI}, Rejection("max_tokens: Field required")),
    ("messages", {"model": "m", "max_tokens": 0, "messages": HI},
     Rejection("max_tokens: Input should be greater than or equal to 1")),
    ("messages", {"model": "m", "max_tokens": "8", "messages": HI},
     Rejection("max_tokens: Input should be a valid integer")),
    ("messages", {"model": "m", "max_tokens": 8}, Rejection("messages: Field required")),
    ("messages", {"model": "m", "max_tokens": 8, "messages": []},
     Rejection("messages: at least one message is required")),
    ("messages", {"model": "m", "max_tokens": 8, "messages": {"role": "user"}},
     Rejection("messages: Input should be a valid list")),
    ("messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "system",
                                                                "content": "x"}]},
     Rejection("messages.0.role: Input should be 'user' or 'assistant'")),
    ("messages", {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]},
     Rejection("messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: "
               "t1. Each `tool_result` block must have a corresponding `tool_use` block in the "
               "previous message.")),
    ("messages", {"model": "m", "max_tokens": 8, "messages": HI, "tools": [{"name": "f"}]},
     Rejection("tools.0.custom.input_schema: Field required")),
    ("messages", {"model": "m", "max_tokens": 8, "messages": HI,
                  "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                  "tool_choice": {"type": "tool", "name": "g"}},
     Rejection("tool_choice: tool 'g' not found in 'tools'")),
    ("messages/count_tokens", {"model": "m"}, Rejection("messages: Field required")),
]


@pytest.mark.parametrize(("endpoint", "body", "expected"), REFUSED,
                         ids=[f"{e} {r.message[:40]}" for e, _, r in REFUSED])
def test_what_the_real_apis_refuse(endpoint: str, body: dict[str, Any],
                                   expected: Rejection) -> None:
    assert check_request(endpoint, body) == expected


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("chat/completions", {"model": "m", "messages": HI, "stream": True,
                          "stream_options": {"include_usage": True}, "max_tokens": 5}),
    ("chat/completions", {"model": "m", "messages": [*HI, CALLED, {
        "role": "tool", "tool_call_id": "c", "content": "x"}], "tools": [FN],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "n": 1}),
    ("chat/completions", {"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]}, *HI],
        "tools": [FN, {"type": "custom", "custom": {"name": "grammar"}}]}),
    ("completions", {"model": "m", "prompt": ["a", "b"], "max_tokens": 2}),
    ("embeddings", {"model": "m", "input": ["a", "b"], "encoding_format": "base64",
                    "dimensions": 3}),
    ("embeddings", {"model": "m", "input": [1, 2, 3]}),
    ("responses", {"model": "m", "input": "hi", "store": False, "max_output_tokens": 16}),
    ("responses", {"model": "m", "previous_response_id": "resp_1"}),
    ("responses", {"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "x"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
                  {"type": "web_search"}], "tool_choice": {"type": "function", "name": "f"}}),
    ("messages", {"model": "m", "max_tokens": 8, "messages": HI, "stream": True,
                  "system": "be brief"}),
    ("messages", {"model": "m", "max_tokens": 8, "messages": [
        *HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "x"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}},
                  {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "auto"}}),
    ("messages/count_tokens", {"model": "m", "messages": HI}),
    # a thread's next turn: the server holds the turn whose call this result answers
    ("messages", {"model": "m", "max_tokens": 8, "thread": {
        "type": "continue", "previous_message_id": "msg_1"}, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "x"}]}]}),
    ("responses/item", {}),
]


@pytest.mark.parametrize(("endpoint", "body"), ACCEPTED)
def test_what_they_accept_passes(endpoint: str, body: dict[str, Any]) -> None:
    assert check_request(endpoint, body) is None


def test_the_answer_takes_the_route_s_shape() -> None:
    """OpenAI's error object on its routes, Anthropic's on the Messages routes: the gateway's
    own readers of each shape take them as errors."""
    refused = Rejection("Missing required parameter: 'messages'.", "messages",
                        "missing_required_parameter")
    openai = error_answer("chat/completions", 400, refused)
    assert openai == {"error": {"message": refused.message, "type": "invalid_request_error",
                                "param": "messages", "code": "missing_required_parameter"}}
    assert CHAT.classify_body(openai).name == "ERROR"
    anthropic = error_answer("messages", 400, Rejection("max_tokens: Field required"))
    assert anthropic == {"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": "max_tokens: Field required"}}
    assert MESSAGES.classify_body(anthropic).name == "ERROR"
    assert error_answer("messages", 529, Rejection("x"))["error"] == {
        "type": "overloaded_error", "message": "x"}
    limited = error_answer("responses", 429, Rejection("x"))["error"]
    assert isinstance(limited, dict) and limited["type"] == "rate_limit_error"
