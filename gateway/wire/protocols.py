"""The Responses API and Anthropic Messages wire rules: first token, end, error shapes (pure).

SPEC §15. The race stays protocol-agnostic ("the runner returned a prefix ending in a token");
what a token, an end and an error look like on each route is described here once, as a small
`WireProtocol` chosen per request. Like `gateway.wire.chat` (the chat rules), the predicates
run on every event before commit, so they are plain dict probing, defensive against any JSON
shape, and never raise.

Both protocols name their events (`event: response.output_text.delta`, `event: message_stop`)
and repeat the name as the payload's `type`; the predicates read the payload's `type` and fall
back to the SSE event name, so a compatible server that sends only one of the two still works.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.errors import GatewayError, error_body
from gateway.wire.chat import Kind, classify, classify_payload
from gateway.wire.sse import SSEEvent, encode_event

# --- the Responses API ------------------------------------------------------------------------

#: delta events whose non-empty `delta` string is model output
RESPONSES_DELTAS = frozenset({
    "response.output_text.delta",
    "response.refusal.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.function_call_arguments.delta",
    "response.custom_tool_call_input.delta",
})
#: the events that end a Responses stream (there is no `[DONE]`)
RESPONSES_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})

# --- the Anthropic Messages API -----------------------------------------------------------------

#: `content_block_delta` delta types and the field that carries their output
MESSAGES_DELTAS: Mapping[str, str] = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "input_json_delta": "partial_json",
}
#: content blocks that are a tool call: their start carries the tool's name, the first output
MESSAGES_TOOL_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
MESSAGES_END = "message_stop"


def _payload(event: SSEEvent) -> tuple[str, dict[str, object] | None]:
    """The event's type (payload `type`, else its SSE name) and its JSON object, if any."""
    name = event.event.decode("latin-1") if event.event is not None else ""
    try:
        obj = json.loads(event.data)
    except (ValueError, RecursionError):
        return name, None
    if not isinstance(obj, dict):
        return name, None
    kind = obj.get("type")
    return (kind if isinstance(kind, str) and kind else name), obj


def _nonempty(value: object) -> bool:
    return isinstance(value, str) and value != ""


def classify_responses(event: SSEEvent) -> Kind:
    """One Responses stream event: TOKEN, ERROR (`error`, `response.failed`), DONE (the
    other end events), else OTHER (`response.created`, `in_progress`, a message item added,
    `content_part.added`, empty deltas, anything malformed)."""
    kind, obj = _payload(event)
    if kind == "error" or kind == "response.failed":
        return Kind.ERROR
    if kind in RESPONSES_ENDS:
        return Kind.DONE
    if obj is None:
        return Kind.OTHER
    if kind in RESPONSES_DELTAS:
        return Kind.TOKEN if _nonempty(obj.get("delta")) else Kind.OTHER
    if kind == "response.output_item.added":
        item = obj.get("item")
        if isinstance(item, dict) and _is_tool_call(item):
            return Kind.TOKEN
    return Kind.OTHER


def _is_tool_call(item: dict[str, object]) -> bool:
    """An output item that is a function or tool call and already carries the tool's name."""
    kind = item.get("type")
    return isinstance(kind, str) and kind.endswith("_call") and _nonempty(item.get("name"))


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


def classify_messages(event: SSEEvent) -> Kind:
    """One Messages stream event: TOKEN (a non-empty text/thinking/input_json delta, a tool
    block start), ERROR (`error`), DONE (`message_stop`), else OTHER (`message_start`, `ping`,
    an empty text block start, `signature_delta`, `message_delta`, malformed)."""
    kind, obj = _payload(event)
    if kind == "error":
        return Kind.ERROR
    if kind == MESSAGES_END:
        return Kind.DONE
    if obj is None:
        return Kind.OTHER
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict):
            field = MESSAGES_DELTAS.get(str(delta.get("type")))
            if field is not None and _nonempty(delta.get(field)):
                return Kind.TOKEN
        return Kind.OTHER
    if kind == "content_block_start":
        block = obj.get("content_block")
        if isinstance(block, dict):
            if block.get("type") in MESSAGES_TOOL_BLOCKS and _nonempty(block.get("name")):
                return Kind.TOKEN
            if _nonempty(block.get("text")) or _nonempty(block.get("thinking")):
                return Kind.TOKEN
    return Kind.OTHER


def classify_messages_body(obj: object) -> Kind:
    """A whole Messages body: ERROR for `{"type": "error"}`, else TOKEN."""
    if not isinstance(obj, dict):
        return Kind.OTHER
    return Kind.ERROR if obj.get("type") == "error" else Kind.TOKEN


def classify_any_body(obj: object) -> Kind:
    """A body relayed as it is (count_tokens, a stored response): any JSON object answers."""
    return Kind.TOKEN if isinstance(obj, dict) else Kind.OTHER


# --- error shapes -------------------------------------------------------------------------------


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def openai_error_event(message: str, code: str, request_id: str) -> bytes:
    """A final in-stream error in OpenAI chat shape; the SDKs raise it as an APIError."""
    payload = error_body(message, type="upstream_error", code=code, request_id=request_id)
    return b"data: " + _json(payload) + b"\n\n"


def responses_error_event(message: str, code: str, request_id: str) -> bytes:
    """A final `event: error` in the Responses shape (`ResponseErrorEvent` in the SDK)."""
    payload = {"type": "error", "code": code, "param": None, "sequence_number": 0,
               "message": f"{message} (request id {request_id})"}
    return encode_event(_json(payload), b"error")


def messages_error_event(message: str, code: str, request_id: str) -> bytes:
    """A final `event: error` in Anthropic's shape; its SDK raises it as an APIStatusError.
    Anthropic's stream errors carry a type, not a code: ours are all `api_error` apart from
    the deadline (`timeout_error`) and a shutdown (`overloaded_error`)."""
    kind = {"stream_timeout": "timeout_error", "gateway_shutdown": "overloaded_error"}.get(
        code, "api_error")
    payload = {"type": "error",
               "error": {"type": kind, "message": f"{message} ({code}, request id {request_id})"}}
    return encode_event(_json(payload), b"error")


#: Anthropic's error type for each status the gateway answers with
_ANTHROPIC_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
    503: "overloaded_error", 529: "overloaded_error", 504: "timeout_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    """`{"type": "error", "error": {"type", "message"}}` for a status (SPEC §15)."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def openai_error_body(exc: GatewayError, message: str) -> dict[str, object]:
    return error_body(message, type=exc.type, code=exc.code, param=exc.param)


# --- the description a request carries ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WireProtocol:
    """How one route's streams and errors look; chosen once per request."""

    name: str
    #: one stream event before commit -> TOKEN / ERROR / DONE / OTHER
    classify: Callable[[SSEEvent], Kind]
    #: a whole non-streaming body (parsed JSON) -> TOKEN / ERROR
    classify_body: Callable[[object], Kind]
    #: event types after which the stream is complete; empty: the chat `[DONE]` rule
    ends: frozenset[bytes]
    #: (message, code, request id) -> the final error event of a cut or failed stream
    error_event: Callable[[str, str, str], bytes]
    #: (error, message) -> the JSON body of an HTTP error on this route
    error_body: Callable[[GatewayError, str], dict[str, object]]


def _anthropic_body(exc: GatewayError, message: str) -> dict[str, object]:
    return anthropic_error_body(exc.status, message)


CHAT = WireProtocol("chat", classify, classify_payload, frozenset(), openai_error_event,
                    openai_error_body)
RESPONSES = WireProtocol(
    "responses", classify_responses, classify_responses_body,
    frozenset(name.encode() for name in RESPONSES_ENDS), responses_error_event,
    openai_error_body)
MESSAGES = WireProtocol("messages", classify_messages, classify_messages_body,
                        frozenset({MESSAGES_END.encode()}), messages_error_event,
                        _anthropic_body)
#: single-backend calls whose body is relayed whatever it says (count_tokens, GET a response)
RESPONSES_ITEM = WireProtocol("responses_item", classify_responses, classify_any_body,
                              RESPONSES.ends, responses_error_event, openai_error_body)
COUNT_TOKENS = WireProtocol("count_tokens", classify_messages, classify_any_body,
                            MESSAGES.ends, messages_error_event, _anthropic_body)

#: which provider serves which route (SPEC §15); `sim` simulates every one
PROVIDER_ROUTES: Mapping[str, frozenset[str]] = {
    "openai": frozenset({"chat/completions", "completions", "embeddings", "responses",
                         "responses/item"}),
    "anthropic": frozenset({"messages", "messages/count_tokens"}),
    "sim": frozenset({"chat/completions", "completions", "embeddings", "responses",
                      "responses/item", "messages", "messages/count_tokens"}),
}


def serves(provider: str, endpoint: str) -> bool:
    return endpoint in PROVIDER_ROUTES.get(provider, frozenset())


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
        if isinstance(response, dict) and _nonempty(response.get("id")):
            return str(response["id"])
    return None


def protocol_for_path(path: str) -> WireProtocol:
    """The protocol whose error shape answers a request to `path`, even one no route matched
    (a 404 under /v1/messages is still read by an Anthropic SDK)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return MESSAGES
    return CHAT
