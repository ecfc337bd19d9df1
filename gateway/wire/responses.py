"""The Responses API wire rules: first token, end events, error shapes, response ids (pure).

The stream has no `[DONE]`: it ends at `response.completed`, `response.incomplete` or
`response.failed`. Events are named (`event: response.output_text.delta`) and repeat the name
as the payload's `type`; the predicates read the payload's `type` and fall back to the SSE
event name, so a compatible server that sends only one of the two still works.
"""

from __future__ import annotations

import json

from gateway.wire.base import (
    Kind,
    WireProtocol,
    classify_any_body,
    json_bytes,
    nonempty,
    typed_payload,
)
from gateway.wire.chat import openai_error_body
from gateway.wire.named import named_relay_encoder
from gateway.wire.sse import SSEEvent, encode_event

#: delta events whose non-empty `delta` string is model output (text, or not: code for the
#: code interpreter, a tool's arguments, audio)
RESPONSES_DELTAS = frozenset({
    "response.output_text.delta",
    "response.refusal.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.function_call_arguments.delta",
    "response.custom_tool_call_input.delta",
    "response.mcp_call_arguments.delta",
    "response.code_interpreter_call_code.delta",
    "response.audio.delta",
    "response.audio.transcript.delta",
})
#: a partial image of an image generation call: output, in `partial_image_b64`
RESPONSES_PARTIAL_IMAGE = "response.image_generation_call.partial_image"
#: output items that are scaffolding until their content arrives (text, reasoning), and the
#: server's own tool listing; every other item added (a tool call of any kind) is output
RESPONSES_SCAFFOLD_ITEMS = frozenset({"message", "reasoning", "mcp_list_tools"})
#: tool items whose output is their name: a token only once the name is there
RESPONSES_NAMED_ITEMS = frozenset({"function_call", "custom_tool_call"})
#: the events that end a Responses stream (there is no `[DONE]`)
RESPONSES_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def classify_responses(event: SSEEvent) -> Kind:
    """One Responses stream event: TOKEN (a non-empty output delta, a partial image, a tool
    item added), ERROR (`error`, `response.failed`), DONE (the other end events), else OTHER
    (`response.created`, `in_progress`, a message or reasoning item added,
    `content_part.added`, empty deltas, anything malformed)."""
    kind, obj = typed_payload(event)
    if kind == "error" or kind == "response.failed":
        return Kind.ERROR
    if kind in RESPONSES_ENDS:
        return Kind.DONE
    if obj is None:
        return Kind.OTHER
    if kind in RESPONSES_DELTAS:
        return Kind.TOKEN if nonempty(obj.get("delta")) else Kind.OTHER
    if kind == "response.output_item.added":
        item = obj.get("item")
        if isinstance(item, dict) and _is_output_item(item):
            return Kind.TOKEN
    elif kind == RESPONSES_PARTIAL_IMAGE and nonempty(obj.get("partial_image_b64")):
        return Kind.TOKEN
    return Kind.OTHER


def _is_output_item(item: dict[str, object]) -> bool:
    """An output item that is output by itself: a tool call of any kind (computer, image
    generation, code interpreter, web or file search, MCP, shell, ...), a function or custom
    tool call once it carries its name; not a message or reasoning item, which wait for their
    text."""
    kind = item.get("type")
    if not nonempty(kind) or kind in RESPONSES_SCAFFOLD_ITEMS:
        return False
    return kind not in RESPONSES_NAMED_ITEMS or nonempty(item.get("name"))


def classify_responses_body(obj: object) -> Kind:
    """A whole (non-streaming) Responses body: ERROR when it failed, else TOKEN (it is the
    answer). An `incomplete` response is an answer too (it hit max_output_tokens)."""
    if not isinstance(obj, dict):
        return Kind.OTHER
    if obj.get("status") == "failed" or obj.get("type") == "error":
        return Kind.ERROR
    if obj.get("object") != "response" and isinstance(obj.get("error"), dict):
        return Kind.ERROR  # an error body in OpenAI shape that came with a 200
    return Kind.TOKEN


def responses_error(code: str, message: str, param: object = None) -> dict[str, object]:
    """The payload of the Responses API's flat `error` event (`ResponseErrorEvent` in the
    SDK): ours, and an upstream's translated from another API."""
    return {"type": "error", "code": code, "param": param, "sequence_number": 0,
            "message": message}


def responses_error_event(message: str, code: str, request_id: str) -> bytes:
    """A final `event: error` in the Responses shape (`ResponseErrorEvent` in the SDK)."""
    payload = responses_error(code, f"{message} (request id {request_id})")
    return encode_event(json_bytes(payload), b"error")


RESPONSES = WireProtocol(
    "responses", classify_responses, classify_responses_body,
    frozenset(name.encode() for name in RESPONSES_ENDS), responses_error_event,
    openai_error_body, encoder=named_relay_encoder, errors="openai")
#: single-backend calls whose body is relayed whatever it says (GET a stored response)
RESPONSES_ITEM = WireProtocol("responses_item", classify_responses, classify_any_body,
                              RESPONSES.ends, responses_error_event, openai_error_body,
                              encoder=named_relay_encoder, errors="openai")


def response_id_of(events: list[SSEEvent], *, stream: bool) -> str | None:
    """The id of the response an upstream made: from `response.created` (or any event that
    carries the response object) before the first token, or from a whole body. Read once per
    request at commit, never per relayed event."""
    for event in events:
        try:
            obj = json.loads(event.data)
        except (ValueError, RecursionError):
            continue
        if not isinstance(obj, dict):
            continue
        response = obj.get("response") if stream else obj
        if isinstance(response, dict) and nonempty(response.get("id")):
            return str(response["id"])
    return None
