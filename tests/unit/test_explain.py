"""An upstream's explanation of a rejected request (`gateway.wire.explain`): the shapes it is
read from, and what never survives the scrub (a known secret, a credential's shape, a URL,
an address), whatever field it hides in."""

from __future__ import annotations

import json
import time

import pytest

from gateway.wire.explain import MAX_BODY, MAX_MESSAGE, REDACTED, Explanation, explain, scrub


@pytest.mark.parametrize(("body", "expected"), [
    ({"error": {"message": "Invalid 'n'.", "type": "invalid_request_error", "param": "n",
                "code": "invalid_value"}},
     Explanation("Invalid 'n'.", "invalid_request_error", "n", "invalid_value")),
    ({"type": "error", "error": {"type": "invalid_request_error",
                                 "message": "messages.1.role: Input should be 'user'"}},
     Explanation("messages.1.role: Input should be 'user'", "invalid_request_error")),
    ([{"error": {"code": 400, "message": "bad field", "status": "INVALID_ARGUMENT"}}],
     Explanation("bad field", "INVALID_ARGUMENT")),
    ({"message": "invalid beta flag"}, Explanation("invalid beta flag")),
    ({"Message": "The provided model identifier is invalid."},
     Explanation("The provided model identifier is invalid.")),
], ids=["openai", "anthropic", "google", "aws", "aws-capital"])
def test_each_apis_error_shape_is_read(body: object, expected: Explanation) -> None:
    assert explain(json.dumps(body).encode()) == expected


@pytest.mark.parametrize("body", [
    b"", b"<html>502 Bad Gateway</html>", b'"just a string"', b'{"error": {"message": ""}}',
    b'{"error": {"code": 7}}', json.dumps({"message": "x" * MAX_BODY}).encode(),
])
def test_a_body_without_a_readable_explanation_gives_none(body: bytes) -> None:
    assert explain(body) is None


def test_a_known_secret_goes_wherever_it_stands() -> None:
    secret = "plain-words-key"  # no credential's shape: only knowing it removes it
    shown = explain(json.dumps({"error": {
        "message": f"key {secret} refused (was:{secret})", "code": secret,
        "param": secret, "type": "invalid_request_error"}}).encode(), {secret})
    assert shown == Explanation(f"key {REDACTED} refused (was:{REDACTED})",
                                "invalid_request_error")


@pytest.mark.parametrize(("text", "shown"), [
    ("Incorrect API key provided: sk-proj-abcDEF1234567890abcd.",
     f"Incorrect API key provided: {REDACTED}"),
    ("see https://internal.example/v1/x?key=1 now", f"see {REDACTED} now"),
    ("call 10.1.2.3:9000 or vllm-0.corp.example:8000", f"call {REDACTED} or {REDACTED}"),
    ("could not reach vllm-a:8000 at gpu-node-7.internal or redis.cache.svc.cluster.local",
     f"could not reach {REDACTED} at {REDACTED} or {REDACTED}"),
    ("Authorization: Bearer abc.def", f"Authorization: {REDACTED} {REDACTED}"),
    ("with token=hunter2x and secret: opensesame", f"with token={REDACTED} and secret: {REDACTED}"),
    ("id AKIAIOSFODNN7EXAMPLE", f"id {REDACTED}"),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.c2ln", REDACTED),
    ("tok 9f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8", f"tok {REDACTED}"),
])
def test_credential_and_address_shapes_are_scrubbed(text: str, shown: str) -> None:
    assert scrub(text) == shown


def test_a_short_secret_goes_with_the_port_after_it() -> None:
    """The backend's own host is a secret however short, and is named with its port."""
    assert scrub("upstream vllm-a:8000 refused; vllm-a is busy", {"vllm-a"}) == \
        f"upstream {REDACTED} refused; {REDACTED} is busy"


@pytest.mark.parametrize("text", [
    "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but got "
    "4 instead.",
    "messages.1.role: Input should be 'user' or 'assistant'",
    "prompt is too long: 250000 tokens > 200000 maximum",
    "model claude-sonnet-4-5-20250929 needs an inference profile",
])
def test_an_apis_own_words_stay_readable(text: str) -> None:
    assert scrub(text) == text


def test_the_message_is_bounded_and_has_no_control_characters() -> None:
    shown = scrub("line one\r\n\x1b[31mred\x00 " + "word " * 1000)
    assert len(shown) <= MAX_MESSAGE and shown.endswith("...")
    assert shown.startswith("line one [31mred word")
    assert not any(ord(c) < 32 for c in shown)


def test_fields_that_are_not_short_identifiers_are_dropped() -> None:
    shown = explain(json.dumps({"error": {"message": "m", "type": "a type with spaces",
                                          "param": "x" * 500, "code": 7}}).encode())
    assert shown == Explanation("m")


@pytest.mark.parametrize("word", [
    pytest.param("a", id="letters"), pytest.param("a1+", id="scheme-alphabet"),
    pytest.param("eyJ-", id="jwt-heads"), pytest.param("1.", id="dotted-digits"),
])
def test_scrubbing_takes_time_linear_in_the_body(word: str) -> None:
    """One word as long as the body allows (64 KiB): a URL's scheme searched from each of its
    letters read the rest of the word again from every one, seconds per rejected attempt on
    the event loop. The bound is tens of times the linear figure (see
    `test_telling_a_credential_takes_time_linear_in_the_text`)."""
    size = 4 * 1024
    while size <= MAX_BODY:
        body = json.dumps({"error": {"message": word * (size // len(word))}}).encode()
        start = time.process_time()
        explained = explain(body[:MAX_BODY])
        assert time.process_time() - start < 1.0, size
        assert explained is None or len(explained.message) <= MAX_MESSAGE
        size *= 2


@pytest.mark.parametrize("text", ["see 1http://x.internal/a", "x.y+z://host", "++a://h"])
def test_a_scheme_after_digits_or_signs_is_still_an_address(text: str) -> None:
    assert "://" not in scrub(text)
