"""The chat and legacy completions wire rules: first token, `[DONE]`, error shapes (pure).

The hedge race commits to an attempt on its first *token*, not its first byte: upstreams send
role-only chunks, keep-alive comments and empty deltas long before the model has produced
anything, and committing on those would defeat hedging. This runs on
every event before commit, so it is plain dict/list probing with no validation library, and it
is defensive: upstream JSON of any shape yields a `Kind`, never an exception.
"""

from __future__ import annotations

import json

from gateway.errors import GatewayError, error_body
from gateway.wire.base import (
    Encoder,
    Kind,
    RelayOutcome,
    Rewrite,
    StreamEnd,
    WireProtocol,
    json_bytes,
)
from gateway.wire.sse import SSEBatch, SSEEvent, encode_event
from gateway.wire.usage import read_usage

#: delta fields whose non-empty string value is model output
_DELTA_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "refusal")


def is_done(data: bytes) -> bool:
    """True for the `[DONE]` sentinel (surrounding whitespace allowed)."""
    # bytes.strip returns the object itself when there is nothing to strip: cheap.
    return data.strip() == b"[DONE]"


def classify(event: SSEEvent) -> Kind:
    """Classify one decoded SSE event: DONE, ERROR (an `event: error`), else by its JSON."""
    data = event.data
    if is_done(data):
        return Kind.DONE
    if event.event == b"error":
        return Kind.ERROR
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        # JSONDecodeError and UnicodeDecodeError are ValueErrors; absurd nesting recurses.
        return Kind.OTHER
    if not isinstance(obj, dict):
        return Kind.OTHER
    return classify_payload(obj)


def chat_answered(events: list[SSEEvent]) -> bool:
    """Whether a stream that reached `[DONE]` without a token is a complete answer: some chunk
    gave a choice its `finish_reason` (an empty answer, `stop` or `length`). A bare `[DONE]`
    is not one. Read once, at the end of a token-less stream."""
    for event in events:
        if event.data.find(b'"finish_reason"') < 0:
            continue
        try:
            obj = json.loads(event.data)
        except (ValueError, RecursionError):
            continue
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if isinstance(choices, list) and any(
            isinstance(c, dict) and _nonempty_str(c.get("finish_reason")) for c in choices
        ):
            return True
    return False


def classify_payload(obj: object) -> Kind:
    """Classify a parsed chunk. ERROR beats TOKEN: a chunk reporting an error is a failure."""
    if not isinstance(obj, dict):
        return Kind.OTHER
    if obj.get("error") is not None:
        return Kind.ERROR
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return Kind.OTHER
    token = False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") == "error":
            return Kind.ERROR
        if not token and _choice_has_output(choice):
            token = True
    return Kind.TOKEN if token else Kind.OTHER


def _nonempty_str(value: object) -> bool:
    return isinstance(value, str) and value != ""


def _call_has_output(call: object) -> bool:
    """A function(-call) object with a non-empty name or arguments fragment."""
    return isinstance(call, dict) and (
        _nonempty_str(call.get("name")) or _nonempty_str(call.get("arguments"))
    )


def _choice_has_output(choice: dict[object, object]) -> bool:
    if _nonempty_str(choice.get("text")):  # legacy completions
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    for key in _DELTA_TEXT_KEYS:
        if _nonempty_str(delta.get(key)):
            return True
    audio = delta.get("audio")  # audio output: its data or transcript, output though not text
    if isinstance(audio, dict) and (
        _nonempty_str(audio.get("data")) or _nonempty_str(audio.get("transcript"))
    ):
        return True
    tool_calls = delta.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if isinstance(call, dict) and _call_has_output(call.get("function")):
                return True
    return _call_has_output(delta.get("function_call"))


# --- error shapes ---------------------------------------------------------------------------


def openai_error_event(message: str, code: str, request_id: str) -> bytes:
    """A final in-stream error in OpenAI chat shape; the SDKs raise it as an APIError."""
    payload = error_body(message, type="upstream_error", code=code, request_id=request_id)
    return b"data: " + json_bytes(payload) + b"\n\n"


def openai_error_body(exc: GatewayError, message: str) -> dict[str, object]:
    return error_body(message, type=exc.shown_type, code=exc.shown_code, param=exc.param)


# --- the client's stream after commit: passed through until `[DONE]` ----------------------

DONE = b"data: [DONE]\n\n"


def _error_kind(event: SSEEvent) -> int:
    """0: not an error; 1: an error event in OpenAI shape; 2: an error in another shape.

    Called only when the cheap byte test in the relay says the event may be an error."""
    try:
        payload = json.loads(event.data)
    except (ValueError, RecursionError):  # not JSON, or hostile nesting: not an error event
        payload = None
    shaped = isinstance(payload, dict) and isinstance(payload.get("error"), dict)
    if shaped:
        return 1
    if event.event == b"error" or (isinstance(payload, dict) and payload.get("error")):
        return 2
    return 0


# Byte tests on the per-event path are `int in bytes` (a memchr) or `bytes.find`, never
# `b"..." in bytes`: CPython 3.11's `in` first tries the needle as an integer, and for bytes
# raises and clears a formatted TypeError every time (about 2,500 instructions: 13 % of a
# streamed request's, measured with `python -m gateway.bench.instructions`).


def _encode(event: SSEEvent) -> bytes:
    data = event.data
    if event.event is None and 10 not in data and 13 not in data:
        return b"data: " + data + b"\n\n"
    return encode_event(data, event.event)


def _encode_batch(batch: SSEBatch, request_id: str, outcome: RelayOutcome) -> bytes:
    """The client's bytes for one upstream read; sets `outcome.end` when the stream is over.

    Plain bytes without `[DONE]`, an error marker or a usage object are the answer as they
    are; everything else (a plain read that holds the end of the stream or the usage the
    gateway may have to strip) takes the event path."""
    raw = batch.raw
    if raw is not None and raw.find(b"[DONE]") < 0 and raw.find(b'"error"') < 0 and (
        raw.find(b'"usage"') < 0 or raw.count(b'"usage"') == raw.count(b'"usage":null')
    ):
        return raw
    return _encode_events(batch.events, request_id, outcome)


def _encode_events(batch: list[SSEEvent], request_id: str, outcome: RelayOutcome) -> bytes:
    parts: list[bytes] = []
    for event in batch:
        data = event.data
        if data == b"[DONE]":
            outcome.end = StreamEnd.DONE
            parts.append(DONE)
            break
        # OpenAI repeats `"usage":null` in every chunk once usage is asked for: two byte
        # tests, no call, for those
        if data.find(b'"usage"') >= 0 and data.find(b'"usage":null') < 0 \
                and (found := read_usage(data)) is not None:
            usage, usage_only = found
            outcome.usage = usage.merge(outcome.usage)
            if usage_only and outcome.strip_usage:
                continue
        if (event.event is not None or data.find(b'"error"') >= 0) and (
                kind := _error_kind(event)):
            # relayed as is when the SDKs can read it; otherwise our own error event, so
            # the client raises an API error instead of failing to parse the upstream's
            outcome.end = StreamEnd.UPSTREAM_ERROR
            parts.append(
                _encode(event)
                if kind == 1
                else openai_error_event("upstream reported an error", "upstream_error",
                                        request_id)
            )
            break
        if 10 in data or 13 in data:
            parts.append(encode_event(data, None))
        else:
            parts.append(b"data: " + data + b"\n\n")
    return b"".join(parts)


#: chat's relay encoder: a plain read passes as it arrived, the rest is re-framed per event
CHAT_ENCODER = Encoder(_encode_events, _encode_batch)


def chat_encoder(_protocol: WireProtocol, _rewrite: Rewrite | None = None) -> Encoder:
    """Chat's `WireProtocol.encoder` (a chat request rewrites no event)."""
    return CHAT_ENCODER


CHAT = WireProtocol("chat", classify, classify_payload, frozenset(), openai_error_event,
                    openai_error_body, chat_answered, encoder=chat_encoder, errors="openai")
