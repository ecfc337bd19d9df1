"""SSE decoder/encoder: every split point, every line-end style, limits and round trips."""

from __future__ import annotations

import random

import pytest

from gateway.sse import (
    SSEDecoder,
    SSEEvent,
    SSEProtocolError,
    encode_comment,
    encode_event,
)

E = SSEEvent

# (input, expected events); each input is also re-run with every split point below.
CASES: dict[str, tuple[bytes, list[SSEEvent]]] = {
    "lf": (b"data: a\n\ndata: b\n\n", [E(b"a"), E(b"b")]),
    "crlf": (b"data: a\r\n\r\ndata: b\r\n\r\n", [E(b"a"), E(b"b")]),
    "cr": (b"data: a\r\rdata: b\r\r", [E(b"a"), E(b"b")]),
    "mixed-line-ends": (b"data: a\r\ndata: b\rdata: c\n\r\n", [E(b"a\nb\nc")]),
    "comments": (
        b": ping\n: OPENROUTER PROCESSING\r\n\ndata: x\n:mid\n\n:\n\n",
        [E(b"x")],
    ),
    "multi-line-data": (b"data: l1\ndata: l2\ndata: l3\n\n", [E(b"l1\nl2\nl3")]),
    "data-without-space": (b"data:a\ndata:  two\n\n", [E(b"a\n two")]),
    "empty-data-field": (b"data:\n\ndata\n\n", [E(b""), E(b"")]),
    "event-field": (
        b"event: delta\ndata: {}\n\ndata: plain\n\n",
        [E(b"{}", b"delta"), E(b"plain")],
    ),
    "id-retry-ignored": (b"id: 7\nretry: 1000\ndata: a\nid\n\n", [E(b"a")]),
    "unknown-field-ignored": (b"foo: bar\ndata: a\nDATA: b\n\n", [E(b"a")]),
    "error-field": (b"error: boom\n\n", [E(b"boom", b"error")]),
    "bom": (b"\xef\xbb\xbfdata: a\n\n", [E(b"a")]),
    "bom-then-comment": (b"\xef\xbb\xbf: hi\ndata: a\n\n", [E(b"a")]),
    "bom-only-first-line": (b"data: a\n\n\xef\xbb\xbfdata: b\n\n", [E(b"a")]),
    "utf8-multibyte": (
        'data: {"c":"héllo 日本 🎉"}\r\n\r\n'.encode(),
        [E('{"c":"héllo 日本 🎉"}'.encode())],
    ),
    # str.splitlines would cut at these; SSE (and bytes.splitlines) must not.
    "other-separators-are-not-line-ends": (
        "data: a\x0bb\x0cc\x1cd\x1ee\u2028f\x85g\n\n".encode(),
        [E("a\x0bb\x0cc\x1cd\x1ee\u2028f\x85g".encode())],
    ),
    "event-without-data-not-dispatched": (b"event: x\n\ndata: y\n\n", [E(b"y")]),
    "unterminated-event-discarded": (b"data: a\n\ndata: b\n", [E(b"a")]),
    "unterminated-line-discarded": (b"data: a\n\ndata: b", [E(b"a")]),
    "openai-stream": (
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
        b": keep-alive\n\n"
        b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
        b"data: [DONE]\n\n",
        [
            E(b'{"choices":[{"delta":{"role":"assistant","content":""}}]}'),
            E(b'{"choices":[{"delta":{"content":"Hi"}}]}'),
            E(b"[DONE]"),
        ],
    ),
}
IDS = list(CASES)


def decode(chunks: list[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    events.extend(decoder.close())
    return events


@pytest.mark.parametrize("name", IDS)
def test_one_shot(name: str) -> None:
    raw, expected = CASES[name]
    assert decode([raw]) == expected


@pytest.mark.parametrize("name", IDS)
def test_every_two_chunk_split(name: str) -> None:
    raw, expected = CASES[name]
    for cut in range(len(raw) + 1):
        assert decode([raw[:cut], raw[cut:]]) == expected, f"split at {cut}"


@pytest.mark.parametrize("name", IDS)
def test_every_three_chunk_split(name: str) -> None:
    raw, expected = CASES[name]
    n = len(raw)
    for i in range(n + 1):
        for j in range(i, n + 1):
            assert decode([raw[:i], raw[i:j], raw[j:]]) == expected, f"split at {i},{j}"


@pytest.mark.parametrize("name", IDS)
def test_byte_by_byte(name: str) -> None:
    raw, expected = CASES[name]
    assert decode([raw[k : k + 1] for k in range(len(raw))]) == expected


def test_all_cases_concatenated_random_chunks() -> None:
    # Each case ends at an event boundary or is unterminated; join only the clean ones.
    clean = [n for n in IDS if not n.startswith(("unterminated", "bom"))]
    raw = b"".join(CASES[n][0] for n in clean)
    expected = [e for n in clean for e in CASES[n][1]]
    rng = random.Random(1234)
    for _ in range(200):
        chunks, pos = [], 0
        while pos < len(raw):
            step = rng.randint(1, 40)
            chunks.append(raw[pos : pos + step])
            pos += step
        assert decode(chunks) == expected


def test_cr_then_lf_across_chunks_is_one_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []  # the LF completes the CRLF: not a blank line
    assert decoder.feed(b"") == []
    assert decoder.feed(b"\r") == [E(b"a")]


def test_empty_chunk_keeps_pending_cr() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"") == []
    assert decoder.feed(b"\ndata: b\n\n") == [E(b"a\nb")]


def test_cr_cr_is_two_line_ends() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\r") == [E(b"a")]


def test_blank_lines_without_data_dispatch_nothing() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"\n\n\r\n\r\r\n") == []
    assert decoder.feed(b"event: x\nid: 3\n\n") == []
    # the event type was reset by the blank line
    assert decoder.feed(b"data: a\n\n") == [E(b"a")]


def test_comments_produce_no_event_and_are_counted() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b": ping\n\n: OPENROUTER PROCESSING\n\n") == []
    assert decoder.comments == 2
    assert decoder.feed(b":x\r\n") == []
    assert decoder.comments == 3


def test_close_discards_unterminated_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\ndata: b\n") == []
    assert decoder.close() == []
    assert decoder.close() == []  # idempotent


def test_bom_split_across_chunks() -> None:
    assert decode([b"\xef", b"\xbb", b"\xbfdata: a\n\n"]) == [E(b"a")]


def test_line_at_max_line_is_accepted() -> None:
    decoder = SSEDecoder(max_line=10)
    assert decoder.feed(b"data: 1234\n\n") == [E(b"1234")]  # "data: 1234" is 10 bytes


def test_line_over_max_line_in_one_chunk_raises() -> None:
    decoder = SSEDecoder(max_line=10)
    with pytest.raises(SSEProtocolError):
        decoder.feed(b"data: 12345\n\n")


def test_line_over_max_line_before_a_short_line_raises() -> None:
    decoder = SSEDecoder(max_line=10)
    with pytest.raises(SSEProtocolError):
        decoder.feed(b"data: 1\n: " + b"x" * 20 + b"\ndata: 2\n")


def test_long_line_without_newline_in_many_chunks_raises_before_newline() -> None:
    decoder = SSEDecoder(max_line=1000)
    decoder.feed(b"data: ")
    with pytest.raises(SSEProtocolError):
        for _ in range(1000):
            decoder.feed(b"x" * 7)  # no newline ever arrives


def test_long_unterminated_tail_after_a_line_raises() -> None:
    decoder = SSEDecoder(max_line=10)
    with pytest.raises(SSEProtocolError):
        decoder.feed(b"data: a\n" + b"y" * 11)


def test_max_line_counts_line_split_across_chunks() -> None:
    decoder = SSEDecoder(max_line=10)
    decoder.feed(b"data: 1234")
    with pytest.raises(SSEProtocolError):
        decoder.feed(b"5\n")


def test_max_line_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SSEDecoder(max_line=0)


def test_protocol_error_is_value_error() -> None:
    assert issubclass(SSEProtocolError, ValueError)


# --- encoder -----------------------------------------------------------------------------


def test_encode_event_shape() -> None:
    assert encode_event(b"x") == b"data: x\n\n"
    assert encode_event(b"a\nb", b"error") == b"event: error\ndata: a\ndata: b\n\n"


def test_encode_comment_shape() -> None:
    assert encode_comment("keep-alive") == b": keep-alive\n\n"


@pytest.mark.parametrize(
    ("data", "event"),
    [
        pytest.param(b"{}", None, id="json"),
        pytest.param(b"", None, id="empty"),
        pytest.param(b" leading space", None, id="leading-space"),
        pytest.param(b"l1\nl2\n\nl4", None, id="multi-line"),
        pytest.param(b"trailing\n", None, id="trailing-newline"),
        pytest.param(b"[DONE]", None, id="done"),
        pytest.param('{"c":"日本 🎉"}'.encode(), b"delta", id="utf8-with-event"),
        pytest.param(b'{"error":{}}', b"error", id="error-event"),
    ],
)
def test_encode_decode_round_trip(data: bytes, event: bytes | None) -> None:
    raw = encode_event(data, event)
    assert decode([raw]) == [E(data, event)]
    assert decode([raw[k : k + 1] for k in range(len(raw))]) == [E(data, event)]


def test_comment_round_trip_yields_no_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(encode_comment("ping")) == []
    assert decoder.comments == 1


@pytest.mark.parametrize("text", ["a\nb", "a\rb", "a\r\n"])
def test_encode_comment_rejects_line_ends(text: str) -> None:
    with pytest.raises(ValueError):
        encode_comment(text)


def test_encode_event_rejects_cr_in_data_and_line_ends_in_type() -> None:
    with pytest.raises(ValueError):
        encode_event(b"a\rb")
    with pytest.raises(ValueError):
        encode_event(b"a", b"x\ny")
