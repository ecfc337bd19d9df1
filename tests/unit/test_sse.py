"""SSE decoder/encoder: every split point, every line-end style, limits and round trips."""

from __future__ import annotations

import random

import pytest

from gateway.wire.sse import (
    SSEBatch,
    SSEDecoder,
    SSEEvent,
    SSEProtocolError,
    encode_comment,
    encode_event,
    is_plain_events,
    named_events,
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


# --- batches: the read's own bytes when they are plain events (the relay's pass-through) ---


def decode_batches(chunks: list[bytes]) -> tuple[list[SSEEvent], list[bytes | None]]:
    """Every chunk through `feed_batch` after a first plain read (the decoder always decodes
    its first read, for the BOM): the events, and each batch's `raw`."""
    decoder = SSEDecoder()
    assert decoder.feed_batch(b"data: warm\n\n") is not None
    events: list[SSEEvent] = []
    raws: list[bytes | None] = []
    for chunk in chunks:
        batch = decoder.feed_batch(chunk)
        if batch is not None:
            events += batch.events
            raws.append(batch.raw)
    return events, raws


@pytest.mark.parametrize("name", IDS)
def test_batches_decode_every_case_at_every_split_like_feed(name: str) -> None:
    raw, expected = CASES[name]
    if raw.startswith(b"\xef\xbb\xbf"):  # a BOM only counts at the very start
        return
    for cut in range(len(raw) + 1):
        events, _ = decode_batches([raw[:cut], raw[cut:]])
        assert events == expected, cut


def test_a_read_of_plain_events_passes_as_its_own_bytes() -> None:
    chunk = b'data: {"a":1}\n\ndata: {"b":2}\n\n'
    events, raws = decode_batches([chunk])
    assert raws == [chunk] and raws[0] is chunk  # the very object: no copy
    assert events == [E(b'{"a":1}'), E(b'{"b":2}')]


@pytest.mark.parametrize(
    "chunks",
    [
        [b"data: a\r\n\r\n"],  # CRLF: re-framed with LF
        [b": ping\n\ndata: a\n\n"],  # a comment: dropped
        [b"data: a\n\n: ping\n\n"],
        [b"event: x\ndata: a\n\n"],  # another field
        [b"id: 7\ndata: a\n\n"],
        [b"data: a\ndata: b\n\n"],  # multi-line data
        [b"data: a\n\n\ndata: b\n\n"],  # an extra blank line
        [b"data:a\n\n"],  # no space after the colon
        [b"data: a\n"],  # an unfinished event
    ],
    ids=["crlf", "comment-first", "comment-last", "event-field", "id-field", "multi-line",
         "extra-blank", "no-space", "unfinished"],
)
def test_anything_but_plain_events_is_decoded_not_passed(chunks: list[bytes]) -> None:
    _, raws = decode_batches(chunks)
    assert all(raw is None for raw in raws)


def test_a_split_event_is_decoded_and_the_next_plain_read_passes_again() -> None:
    events, raws = decode_batches([b"data: a", b"b\n\n", b"data: c\n\n"])
    assert events == [E(b"ab"), E(b"c")]
    assert raws == [None, b"data: c\n\n"]  # after the split, the decoder is at a boundary


def test_a_read_after_a_pending_cr_goes_through_the_decoder() -> None:
    """A read ending in CR leaves the decoder waiting for a possible LF: the next read is
    decoded (its leading LF is the same line end), and plain reads pass again after it."""
    events, raws = decode_batches([b"data: a\n\r", b"\ndata: b\n\n", b"data: c\n\n"])
    assert events == [E(b"a"), E(b"b"), E(b"c")]
    assert raws == [None, None, b"data: c\n\n"]


def test_plain_events_predicate() -> None:
    assert is_plain_events(b"data: x\n\n")
    assert is_plain_events(b"data: x\n\ndata: \n\n")
    assert not is_plain_events(b"")
    assert not is_plain_events(b"data: x\n\ndata: y\n")
    assert not is_plain_events(b"data: x\ndata: y\n\n")
    assert not is_plain_events(b"data: x\r\n\r\n")
    assert not is_plain_events(b"\ndata: x\n\n")


def test_decoded_events_of_a_plain_read_are_not_kept_on_it() -> None:
    """A kept plain read decoded for a continuation's look stays its bytes alone."""
    batch = SSEBatch(None, b"data: a\n\ndata: b\n\n")
    assert [e.data for e in batch.decoded()] == [b"a", b"b"]
    assert repr(batch).startswith("SSEBatch(events=None,")
    assert [e.data for e in batch.events] == [b"a", b"b"]  # (which `events` does keep)
    assert batch.decoded() is batch.events


# --- whole named events: a Messages server's usual read, cut without the line loop ----------

#: the pieces a fuzzed read is built of: the named framing and everything that may break it
_PIECES = (b"event: ", b"data: ", b"\n", b"\n\n", b"\r", b":", b"x", b"content_block_delta",
           b'{"a":1}', b" ", b"event:", b"data:", b"id: 1", b"\xef\xbb\xbf")


def _named(name: bytes, data: bytes) -> bytes:
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


@pytest.mark.parametrize("seed", range(40))
def test_a_read_of_named_events_is_cut_as_the_decoder_reads_it(seed: int) -> None:
    """`feed_batch` on a fresh decoder and after a whole read gives the events `feed` gives,
    for reads of named events in the usual framing and for reads that break it anywhere
    (another field, a comment, a second data line, CR, an extra blank line, no space)."""
    rng = random.Random(seed)
    for _ in range(200):
        if rng.random() < 0.5:
            chunk = b"".join(_named(rng.choice([b"ping", b"content_block_delta", b"a b"]),
                                    rng.choice([b"{}", b'{"t":"x y"}', b"", b" lead"]))
                             for _ in range(rng.randint(1, 5)))
            if rng.random() < 0.5:  # one piece somewhere in it
                at = rng.randrange(len(chunk) + 1)
                chunk = chunk[:at] + rng.choice(_PIECES) + chunk[at:]
        else:
            chunk = b"event: " + b"".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 12)))
        for warm in (None, b"data: warm\n\n", b"event: w\ndata: warm\n\n"):
            fast, slow = SSEDecoder(), SSEDecoder()
            if warm is not None:
                assert fast.feed_batch(warm) is not None
                slow.feed(warm)
            batch = fast.feed_batch(chunk)
            expected = slow.feed(chunk)
            assert (batch.events if batch is not None else []) == expected, chunk
            # the decoder's state after it is the same: the next read decodes alike
            follow = b"data: next\n\n"
            after = fast.feed_batch(follow)
            assert (after.events if after is not None else []) == slow.feed(follow), chunk
            assert fast.comments == slow.comments


def test_a_first_read_of_named_events_is_cut_without_the_line_loop() -> None:
    """The decoder's first read (no BOM: it opens with `event: `) of whole named events is
    cut by `named_events`, and the read after it too; each event its name and its data."""
    chunk = _named(b"message_start", b'{"type":"message_start"}') + _named(b"ping", b"{}")
    assert named_events(chunk) == [E(b'{"type":"message_start"}', b"message_start"),
                                   E(b"{}", b"ping")]
    decoder = SSEDecoder()
    batch = decoder.feed_batch(chunk)
    assert batch is not None and batch.events == named_events(chunk)
    assert decoder.at_boundary()
    for broken in (chunk + b"data: x\n\n", b": c\n" + chunk, chunk.replace(b"\n\n", b"\n\n\n", 1),
                   chunk.replace(b"data: ", b"data:", 1), b"event: \ndata: x\n\n",
                   chunk.replace(b"\n", b"\r\n")):
        assert named_events(broken) is None, broken


def test_a_named_read_is_decoded_only_when_asked() -> None:
    """A read of whole named events stays its bytes (`named`) until someone asks for its
    events, and is counted by its blank lines meanwhile; one the named cut cannot take (an
    event of two `data:` lines beside one of none) decodes as the line loop reads it."""
    chunk = _named(b"content_block_delta", b'{"t":"a"}') + _named(b"ping", b"{}")
    decoder = SSEDecoder()
    batch = decoder.feed_batch(chunk)
    assert batch is not None and batch.named == chunk and batch.raw is None
    assert batch.count() == 2 and repr(batch).startswith("SSEBatch(events=None,")
    assert batch.events == named_events(chunk) and batch.count() == 2
    assert batch.named is None  # decoded, the read is its events alone
    assert decoder.at_boundary()
    odd = b"event: a\ndata: x\ndata: y\n\nevent: b\n\n"
    batch = decoder.feed_batch(odd)
    assert batch is not None and batch.named == odd and named_events(odd) is None
    assert batch.count() == 2  # (undecoded, one a blank line: see `SSEBatch.count`)
    assert batch.events == [E(b"x\ny", b"a")] == SSEDecoder().feed(odd)
    assert batch.count() == 1 and decoder.at_boundary()
    follow = decoder.feed_batch(b"data: next\n\n")
    assert follow is not None and follow.events == [E(b"next")]
