"""First-token predicate: one case per rule of docs/hedging.md, plus malformed input."""

from __future__ import annotations

import json

import pytest

from gateway.wire.base import Kind
from gateway.wire.chat import classify, classify_payload, is_done
from gateway.wire.sse import SSEDecoder, SSEEvent


def chunk(delta: object = None, **choice: object) -> bytes:
    """A chat.completion.chunk with one choice."""
    body: dict[str, object] = {"index": 0, **choice}
    if delta is not None:
        body["delta"] = delta
    return json.dumps({"object": "chat.completion.chunk", "choices": [body]}).encode()


def fn(**kw: object) -> dict[str, object]:
    return {"index": 0, "type": "function", "function": kw}


CASES = [
    # --- not tokens
    pytest.param(chunk({"role": "assistant", "content": ""}), Kind.OTHER, id="role-empty-content"),
    pytest.param(chunk({"role": "assistant", "content": None}), Kind.OTHER, id="role-null-content"),
    pytest.param(chunk({"role": "assistant"}), Kind.OTHER, id="role-only"),
    pytest.param(chunk({}, finish_reason="stop"), Kind.OTHER, id="finish-only"),
    pytest.param(chunk({"content": None}, finish_reason="length"), Kind.OTHER, id="finish-null"),
    pytest.param(
        b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}',
        Kind.OTHER,
        id="usage-only-empty-choices",
    ),
    pytest.param(chunk({"tool_calls": [fn(name="", arguments="")]}), Kind.OTHER, id="tool-empty"),
    pytest.param(chunk({"tool_calls": [{"index": 0, "id": "c1"}]}), Kind.OTHER, id="tool-id-only"),
    pytest.param(chunk({"audio": {"id": "au", "data": "", "transcript": ""}}), Kind.OTHER,
                 id="audio-empty"),
    pytest.param(chunk({"audio": "UklGR"}), Kind.OTHER, id="audio-not-object"),
    pytest.param(chunk({"function_call": {"name": ""}}), Kind.OTHER, id="function-call-empty"),
    pytest.param(b'{"choices":[{"text":""}]}', Kind.OTHER, id="legacy-empty-text"),
    # --- tokens
    pytest.param(chunk({"role": "assistant", "content": "Hi"}), Kind.TOKEN, id="role-and-content"),
    pytest.param(chunk({"content": "Hello"}), Kind.TOKEN, id="content"),
    pytest.param(chunk({"content": " "}), Kind.TOKEN, id="whitespace-content"),
    pytest.param(chunk({"content": "\n"}), Kind.TOKEN, id="newline-content"),
    pytest.param(chunk({"reasoning_content": "hmm"}), Kind.TOKEN, id="reasoning-content"),
    pytest.param(chunk({"reasoning": "think"}), Kind.TOKEN, id="reasoning"),
    pytest.param(chunk({"refusal": "I can't"}), Kind.TOKEN, id="refusal"),
    pytest.param(chunk({"audio": {"id": "au", "data": "UklGR"}}), Kind.TOKEN, id="audio-data"),
    pytest.param(chunk({"audio": {"transcript": "Hi"}}), Kind.TOKEN, id="audio-transcript"),
    pytest.param(chunk({"tool_calls": [fn(name="get_weather")]}), Kind.TOKEN, id="tool-name"),
    pytest.param(chunk({"tool_calls": [fn(arguments='{"ci')]}), Kind.TOKEN, id="tool-arguments"),
    pytest.param(
        chunk({"tool_calls": [fn(name=""), fn(arguments="{")]}), Kind.TOKEN, id="second-tool-call"
    ),
    pytest.param(chunk({"function_call": {"name": "f"}}), Kind.TOKEN, id="function-call-name"),
    pytest.param(chunk({"function_call": {"arguments": "{"}}), Kind.TOKEN, id="function-call-args"),
    pytest.param(b'{"choices":[{"text":"Once"}]}', Kind.TOKEN, id="legacy-text"),
    pytest.param(
        b'{"choices":[{"delta":{"role":"assistant"}},{"delta":{"content":"x"}}]}',
        Kind.TOKEN,
        id="token-in-second-choice",
    ),
    # --- errors
    pytest.param(b'{"error":{"message":"overloaded","code":529}}', Kind.ERROR, id="top-error"),
    pytest.param(b'{"error":"boom"}', Kind.ERROR, id="top-error-string"),
    pytest.param(chunk({}, finish_reason="error"), Kind.ERROR, id="finish-reason-error"),
    pytest.param(
        chunk({"content": "partial"}, finish_reason="error"), Kind.ERROR, id="error-beats-token"
    ),
    pytest.param(
        b'{"error":{"message":"x"},"choices":[{"delta":{"content":"y"}}]}',
        Kind.ERROR,
        id="top-error-beats-token",
    ),
    pytest.param(
        b'{"choices":[{"delta":{"content":"y"}},{"delta":{},"finish_reason":"error"}]}',
        Kind.ERROR,
        id="error-in-later-choice-beats-token",
    ),
    pytest.param(b'{"error":null,"choices":[{"text":"ok"}]}', Kind.TOKEN, id="null-error-ignored"),
    # --- done
    pytest.param(b"[DONE]", Kind.DONE, id="done"),
    pytest.param(b" [DONE] \n", Kind.DONE, id="done-whitespace"),
    # --- malformed / wrong types: never a token, never an exception
    pytest.param(b"{not json", Kind.OTHER, id="malformed-json"),
    pytest.param(b"", Kind.OTHER, id="empty-data"),
    pytest.param(b"\xff\xfe", Kind.OTHER, id="invalid-utf8"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, Kind.OTHER, id="absurd-nesting"),
    pytest.param(b'"content"', Kind.OTHER, id="json-string"),
    pytest.param(b"[1, 2]", Kind.OTHER, id="json-array"),
    pytest.param(b"null", Kind.OTHER, id="json-null"),
    pytest.param(b'{"choices":{"0":{"text":"x"}}}', Kind.OTHER, id="choices-not-list"),
    pytest.param(b'{"choices":["x", 1, null]}', Kind.OTHER, id="choice-not-object"),
    pytest.param(b'{"choices":[{"delta":"hi"}]}', Kind.OTHER, id="delta-not-object"),
    pytest.param(b'{"choices":[{"delta":{"content":5}}]}', Kind.OTHER, id="content-number"),
    pytest.param(b'{"choices":[{"delta":{"content":["a"]}}]}', Kind.OTHER, id="content-list"),
    pytest.param(b'{"choices":[{"text":7}]}', Kind.OTHER, id="text-number"),
    pytest.param(
        b'{"choices":[{"delta":{"tool_calls":{"function":{"name":"f"}}}}]}',
        Kind.OTHER,
        id="tool-calls-not-list",
    ),
    pytest.param(
        b'{"choices":[{"delta":{"tool_calls":["f", null, {"function":"f"}]}}]}',
        Kind.OTHER,
        id="tool-call-wrong-types",
    ),
    pytest.param(
        b'{"choices":[{"delta":{"tool_calls":[{"function":{"name":1,"arguments":{}}}]}}]}',
        Kind.OTHER,
        id="tool-call-field-types",
    ),
    pytest.param(
        b'{"choices":[{"delta":{"function_call":"f"}}]}', Kind.OTHER, id="function-call-string"
    ),
]


@pytest.mark.parametrize(("data", "kind"), CASES)
def test_classify(data: bytes, kind: Kind) -> None:
    assert classify(SSEEvent(data)) is kind


def test_event_error_type_is_error_whatever_the_data() -> None:
    assert classify(SSEEvent(b'{"choices":[{"delta":{"content":"x"}}]}', b"error")) is Kind.ERROR
    assert classify(SSEEvent(b"not json", b"error")) is Kind.ERROR


def test_error_sse_field_decodes_to_an_error_event() -> None:
    (event,) = SSEDecoder().feed(b"error: upstream overloaded\n\n")
    assert classify(event) is Kind.ERROR


def test_other_event_types_are_classified_by_data() -> None:
    assert classify(SSEEvent(b'{"choices":[{"text":"x"}]}', b"message")) is Kind.TOKEN


def test_comments_produce_no_event_to_classify() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b": ping\n\n: OPENROUTER PROCESSING\n\n") == []
    assert decoder.comments == 2


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(None, id="none"),
        pytest.param([], id="list"),
        pytest.param("x", id="str"),
        pytest.param({}, id="empty-object"),
        pytest.param({1: 2, "choices": None}, id="non-str-key"),
    ],
)
def test_classify_payload_wrong_top_level_types(obj: object) -> None:
    assert classify_payload(obj) is Kind.OTHER


@pytest.mark.parametrize(
    ("data", "done"),
    [
        pytest.param(b"[DONE]", True, id="plain"),
        pytest.param(b"  [DONE]\n", True, id="padded"),
        pytest.param(b"[done]", False, id="lowercase"),
        pytest.param(b'"[DONE]"', False, id="quoted"),
        pytest.param(b"", False, id="empty"),
    ],
)
def test_is_done(data: bytes, done: bool) -> None:
    assert is_done(data) is done


def test_kind_is_int_enum_with_stable_members() -> None:
    assert [k.name for k in Kind] == ["OTHER", "TOKEN", "ERROR", "DONE"]
