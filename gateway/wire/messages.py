"""The Anthropic Messages wire rules: first token, the end event, error shapes (pure).

The stream ends at `message_stop`; events are named and repeat the name as the payload's
`type` (read first, the SSE name as a fallback). Errors on this route use Anthropic's shape
`{"type": "error", "error": {"type", "message"}}` with its error types.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gateway.errors import GatewayError, UpstreamClientError
from gateway.wire.base import (
    Kind,
    WireProtocol,
    classify_any_body,
    json_bytes,
    nonempty,
    typed_payload,
)
from gateway.wire.named import named_relay_encoder
from gateway.wire.sse import SSEEvent, encode_event

#: `content_block_delta` delta types and the field that carries their output
MESSAGES_DELTAS: Mapping[str, str] = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "input_json_delta": "partial_json",
}
#: content blocks that are a tool call: their start carries the tool's name, the first output
MESSAGES_TOOL_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
MESSAGES_END = "message_stop"


#: a block index as JSON writes an integer (no leading zero: the parse refuses `00`)
INDEX = rb'(?:0|[1-9]\d{0,5})'
#: the usual delta as servers write it, its text a JSON string without escapes or control
#: characters (what the parse accepts of such a string, once its bytes are UTF-8):
#: told by its bytes
_usual_delta = re.compile(
    rb'\{"type":"content_block_delta","index":' + INDEX + rb',"delta":\{"type":"(?:text_delta",'
    rb'"text"|input_json_delta","partial_json"|thinking_delta","thinking"):"([^"\\\x00-\x1f]*)"'
    rb'\}\}').fullmatch
#: the keep-alive and a text block's empty start, as servers write them: no output
_PING = b'{"type":"ping"}'
_empty_text_start = re.compile(rb'\{"type":"content_block_start","index":' + INDEX +
                               rb',"content_block":\{"type":"text","text":""\}\}').fullmatch


def classify_messages(event: SSEEvent) -> Kind:
    """One Messages stream event: TOKEN (a non-empty text/thinking/input_json delta, a tool
    or redacted thinking block start), ERROR (`error`), DONE (`message_stop`), else OTHER
    (`message_start`, `ping`, an empty text block start, `signature_delta`, `message_delta`,
    malformed). The usual delta, the keep-alive and an empty text start are told by their
    bytes (what the parse would make of them: the payload's type decides), the rest parsed."""
    data = event.data
    if (usual := _usual_delta(data)) is not None:
        # read as the parse reads it (`json.loads` decodes bytes as UTF-8, lone surrogates
        # passed); ASCII, the usual case, is told without decoding
        text = usual.group(1)
        if text.isascii():
            return Kind.TOKEN if text else Kind.OTHER
        try:
            text.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            pass  # not UTF-8: the parse below refuses it too
        else:
            return Kind.TOKEN
    if data == _PING or _empty_text_start(data) is not None:
        return Kind.OTHER
    kind, obj = typed_payload(event)
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
            if field is not None and nonempty(delta.get(field)):
                return Kind.TOKEN
        return Kind.OTHER
    if kind == "content_block_start":
        block = obj.get("content_block")
        if isinstance(block, dict):
            if block.get("type") in MESSAGES_TOOL_BLOCKS and nonempty(block.get("name")):
                return Kind.TOKEN
            if nonempty(block.get("text")) or nonempty(block.get("thinking")):
                return Kind.TOKEN
            if block.get("type") == "redacted_thinking" and nonempty(block.get("data")):
                return Kind.TOKEN  # thinking the API encrypted: output, though not text
    return Kind.OTHER


def classify_messages_body(obj: object) -> Kind:
    """A whole Messages body: ERROR for `{"type": "error"}`, else TOKEN."""
    if not isinstance(obj, dict):
        return Kind.OTHER
    return Kind.ERROR if obj.get("type") == "error" else Kind.TOKEN


def messages_error_event(message: str, code: str, request_id: str) -> bytes:
    """A final `event: error` in Anthropic's shape; its SDK raises it as an APIStatusError.
    Anthropic's stream errors carry a type, not a code: ours are all `api_error` apart from
    the deadline (`timeout_error`) and a shutdown (`overloaded_error`)."""
    kind = {"stream_timeout": "timeout_error", "gateway_shutdown": "overloaded_error"}.get(
        code, "api_error")
    payload = {"type": "error",
               "error": {"type": kind, "message": f"{message} ({code}, request id {request_id})"}}
    return encode_event(json_bytes(payload), b"error")


#: Anthropic's error type for each status the gateway answers with
_ANTHROPIC_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "request_too_large", 415: "invalid_request_error", 422: "invalid_request_error",
    429: "rate_limit_error", 431: "invalid_request_error", 503: "overloaded_error",
    529: "overloaded_error", 504: "timeout_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    """`{"type": "error", "error": {"type", "message"}}` for a status."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


#: the error types Anthropic's shape has (an upstream's relayed type is kept when one)
ANTHROPIC_TYPES = frozenset(_ANTHROPIC_TYPES.values()) | {"api_error"}


def _anthropic_body(exc: GatewayError, message: str) -> dict[str, object]:
    """Anthropic's shape: a type and a message. An upstream's relayed explanation keeps its
    type when Anthropic's shape has it, and its `param` and `code`, which the shape has no
    field for, are named at the end of the message."""
    explanation = exc.explanation if isinstance(exc, UpstreamClientError) else None
    if explanation is None:
        return anthropic_error_body(exc.status, message)
    named = ", ".join(f"{name} {value}" for name, value in
                      (("param", explanation.param), ("code", explanation.code)) if value)
    kind = explanation.type if explanation.type in ANTHROPIC_TYPES else None
    return {"type": "error", "error": {
        "type": kind or _ANTHROPIC_TYPES.get(exc.status, "api_error"),
        "message": f"{message} [{named}]" if named else message}}


MESSAGES = WireProtocol("messages", classify_messages, classify_messages_body,
                        frozenset({MESSAGES_END.encode()}), messages_error_event,
                        _anthropic_body, encoder=named_relay_encoder, errors="anthropic")
#: a single-backend call whose body is relayed whatever it says
COUNT_TOKENS = WireProtocol("count_tokens", classify_messages, classify_any_body,
                            MESSAGES.ends, messages_error_event, _anthropic_body,
                            encoder=named_relay_encoder, errors="anthropic")
