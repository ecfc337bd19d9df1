"""Incremental Server-Sent Events codec over bytes (pure: no I/O, no asyncio).

Work in bytes, not str: line ends are ASCII, so a chunk split in the middle of a UTF-8
character is reassembled for free, and the relay can pass `data` through without decoding.
"""

from __future__ import annotations


class SSEEvent:
    """One dispatched event. `data` is the joined `data:` lines (b"\\n" between them)."""

    __slots__ = ("data", "event")

    def __init__(self, data: bytes, event: bytes | None = None) -> None:
        self.data = data
        self.event = event

    def __repr__(self) -> str:
        return f"SSEEvent(data={self.data!r}, event={self.event!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SSEEvent) and self.data == other.data and self.event == other.event
        )

    __hash__ = None  # type: ignore[assignment]


class SSEBatch:
    """What one upstream read completed: its events, and its bytes when they can pass as is.

    `raw` is set when the read was exactly whole single-line `data:` events in the canonical
    framing (`data: X\n\n`, LF only, no comment or other field) and began at an event
    boundary: those bytes are what the gateway would send anyway, so after commit the relay
    forwards them untouched without building an event per line. `named` is set when the read
    was exactly whole named events in the canonical framing (`event: NAME\ndata: X\n\n`,
    `named_events`) read at an event boundary: a translation that writes such a read from its
    bytes (`StreamTranslator.feed_named`) never builds its events. In both cases `events`
    is decoded only if someone asks (the race does, before commit). Otherwise both are None
    and `events` is the decoder's view."""

    __slots__ = ("_events", "named", "raw")

    def __init__(self, events: list[SSEEvent] | None, raw: bytes | None = None,
                 named: bytes | None = None) -> None:
        self._events = events
        self.raw = raw
        self.named = named

    @property
    def events(self) -> list[SSEEvent]:
        events = self._events
        if events is None:
            events = self._events = self.decoded()
            # the events hold a named read's bytes now: a read kept for a continuation is
            # not held twice (its count is theirs)
            self.named = None
        return events

    def decoded(self) -> list[SSEEvent]:
        """`events` without keeping them on the batch (a caller that needs them once, such
        as a continuation's look at what was relayed, leaves a plain read as its bytes)."""
        if self._events is not None:
            return self._events
        raw, named = self.raw, self.named
        if raw:
            return [SSEEvent(part[6:]) for part in raw[:-2].split(b"\n\n")]
        if named:
            events = _cut_named(named)
            return _lines_of(named) if events is None else events
        return []

    def count(self) -> int:
        """How many events the read holds, without decoding it: one a `\n\n` in the
        canonical framings (`raw`, `named`), by one scan in C. A `named` read one event of
        which holds two `data:` lines and another none is counted one too many until it is
        decoded: whoever writes such a read from its bytes checks each event first (as
        `MessagesToChat.feed_named` does), and the other paths decode it."""
        if self._events is not None:
            return len(self._events)
        raw = self.raw if self.raw is not None else self.named
        return raw.count(b"\n\n") if raw else 0

    def __repr__(self) -> str:
        return f"SSEBatch(events={self._events!r}, raw={self.raw!r}, named={self.named!r})"


def is_plain_events(chunk: bytes) -> bool:
    """Whether `chunk` is exactly N >= 1 events `data: X\n\n` with X free of CR and LF.

    Four C-level scans and no allocation: it must start with `data: `, end with a blank line,
    hold no CR, and its LFs must be exactly the two of each event: one `\n\ndata: ` between
    events, so 2 * (separators + 1) LFs in all. Any other line (a comment, `event:`, `id:`, a
    multi-line `data`, an extra blank line) adds an LF that no separator accounts for."""
    if not chunk.startswith(b"data: ") or not chunk.endswith(b"\n\n") or 13 in chunk:
        return False
    return chunk.count(b"\n") == 2 * (chunk.count(b"\n\ndata: ") + 1)


def named_events(chunk: bytes) -> list[SSEEvent] | None:
    """The events of `chunk` when it is exactly N >= 1 events `event: NAME\ndata: X\n\n` (each
    one line of each field, LF only, no comment), as the decoder would make them; else None.

    After `is_named_events`' scans, one part could still hold two `data:` lines and another
    none, or a name be empty (the line loop's way: the event is unnamed), so each part's
    `data:` line is found after its name. The per-event work is one `find` and two slices,
    where the decoder ran its line loop three times an event."""
    return _cut_named(chunk) if is_named_events(chunk) else None


def _cut_named(chunk: bytes) -> list[SSEEvent] | None:
    """`named_events` of a chunk `is_named_events` holds (told once, at the read)."""
    parts = chunk[:-2].split(b"\n\n")
    events = []
    for part in parts:
        at = part.find(b"\ndata: ")
        if at <= 7:
            return None
        events.append(SSEEvent(part[at + 7:], part[7:at]))
    return events


def is_named_events(chunk: bytes) -> bool:
    """Whether `chunk` is whole events in the named framing by a few scans in C: its lines
    are only `event: ` lines, `data: ` lines and blank lines, it ends with a blank line and
    holds at least one `data: ` line (so it completes an event, and leaves a decoder at an
    event boundary), though one event may hold two `data:` lines and another none
    (`named_events` tells those apart).

    Why it holds: the chunk's LFs number 3 N where N is its `\ndata: ` count, N - 1 of them
    open a following `event: ` line after a blank line, and it opens with `event: ` and ends
    with a blank line, so every LF is one of those: no other line (a comment, an `id:`, an
    extra blank line) fits in."""
    if not chunk.startswith(b"event: ") or not chunk.endswith(b"\n\n") or 13 in chunk:
        return False
    count = chunk.count(b"\ndata: ")
    return bool(count) and chunk.count(b"\n") == 3 * count \
        and chunk.count(b"\n\nevent: ") == count - 1


def _lines_of(chunk: bytes) -> list[SSEEvent]:
    """What a decoder at an event boundary makes of `chunk` line by line (a named read that
    `named_events` does not cut: the line loop leaves the same state after it)."""
    decoder = SSEDecoder(max(1, len(chunk)))
    decoder._first_line = False
    return decoder.feed(chunk)


class SSEProtocolError(ValueError):
    """The upstream byte stream cannot be a sane SSE stream (today: a line over `max_line`)."""


_BOM = b"\xef\xbb\xbf"


class SSEDecoder:
    """Incremental SSE decoder over bytes, following the WHATWG event-stream parsing rules.

    Feed it the response body chunk by chunk, split anywhere (mid UTF-8 character, between the
    CR and LF of a CRLF); it returns the events completed by each chunk. Upstream `id:` and
    `retry:` fields are parsed and dropped because the gateway never forwards them; a
    non-standard `error: text` field (some upstreams send it) becomes an event of type
    b"error" carrying `text`. Comments are dropped but counted in `self.comments`.

    Why the shape of the code: this runs once per upstream chunk on the hot path, so lines are
    cut with `bytes.splitlines` (C speed; for bytes it splits on exactly LF, CRLF and CR)
    rather than a per-byte loop, and a chunk that completes no line is just stored in a list
    (no re-joining of a growing buffer, so a long line in tiny chunks costs linear time).
    Measured with timeit (best of 5) on CPython 3.11.7, a shared 2-core AMD EPYC VM: one
    181-byte `data: {chunk json}\\n\\n` chunk decodes to its event in 1.3-2.5 microseconds (LF
    or CRLF alike; the spread is machine noise); split in two, both feeds take ~1.7 us.

    A line longer than `max_line` bytes raises `SSEProtocolError`, checked as bytes arrive,
    so a broken upstream sending a giant line without a newline cannot grow memory forever.
    After that error the decoder is spent: discard it with its stream.
    """

    __slots__ = (
        "_cr_pending",
        "_data",
        "_event",
        "_first_line",
        "_max_line",
        "_parts",
        "_parts_len",
        "comments",
    )

    def __init__(self, max_line: int = 1 << 20) -> None:
        if max_line < 1:
            raise ValueError("max_line must be positive")
        self._max_line = max_line
        #: bytes of the current, not yet terminated line (kept as pieces: see class doc)
        self._parts: list[bytes] = []
        self._parts_len = 0
        #: the last chunk ended with CR: an LF opening the next chunk is the same line end
        self._cr_pending = False
        #: no line completed yet, so a leading BOM must still be stripped
        self._first_line = True
        #: `data` field values of the event being built (None entries never occur)
        self._data: list[bytes] = []
        self._event: bytes | None = None
        #: comment lines seen so far (for tests and stats; upstream keep-alives are comments)
        self.comments = 0

    def feed_batch(self, chunk: bytes) -> SSEBatch | None:
        """Decode one chunk into a batch (None when it completes no event).

        A chunk of plain events (`is_plain_events`) read at an event boundary is not decoded
        at all: the decoder's state after it would be the state before it (nothing pending),
        so it is handed on as its bytes, with its events decoded only on demand."""
        if self.at_boundary() and is_plain_events(chunk):
            return SSEBatch(None, chunk)
        # a named server's usual read (Messages, the Responses API): whole events told by
        # a few C scans, not line by line, and decoded only when asked for; a first read
        # opening with `event: ` has no BOM to strip
        if chunk.startswith(b"event: ") and len(chunk) <= self._max_line and not (
                self._parts or self._data or self._cr_pending or self._event is not None) \
                and is_named_events(chunk):
            self._first_line = False
            return SSEBatch(None, named=chunk)
        events = self.feed(chunk)
        return SSEBatch(events) if events else None

    def at_boundary(self) -> bool:
        """Nothing is pending: no partial line, no data lines of an unfinished event, no CR
        whose LF may follow, no event type set, and a BOM no longer expected."""
        return not (self._parts or self._data or self._cr_pending or self._event is not None
                    or self._first_line)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Decode one chunk; return the events it completed (often none or one)."""
        if not chunk:
            return []
        if self._cr_pending:
            self._cr_pending = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
                if not chunk:
                    return []
        # `int in bytes` is a plain memchr; `b"\r" in bytes` raises and clears a TypeError
        # inside CPython 3.11 before its substring search (see `encode_event`).
        if 10 not in chunk and 13 not in chunk:
            # No line end: just remember the bytes, bounded by max_line.
            self._parts.append(chunk)
            self._parts_len += len(chunk)
            if self._parts_len > self._max_line:
                self._fail()
            return []
        if self._parts:
            self._parts.append(chunk)
            text = b"".join(self._parts)
            self._parts.clear()
            self._parts_len = 0
        else:
            text = chunk
        # bytes.splitlines cuts on exactly LF, CRLF and CR: the SSE line ends.
        lines = text.splitlines()
        last = text[-1]
        if last == 13:
            # A trailing CR ends its line now; remember it so a following LF is not a 2nd end.
            self._cr_pending = True
        elif last != 10:
            rest = lines.pop()
            self._parts.append(rest)
            self._parts_len = len(rest)
        if len(text) > self._max_line and (
            self._parts_len > self._max_line or any(len(line) > self._max_line for line in lines)
        ):
            self._fail()
        if self._first_line:
            self._first_line = False
            if lines[0].startswith(_BOM):
                lines[0] = lines[0][3:]
        return self._process(lines)

    def close(self) -> list[SSEEvent]:
        """End of stream. Always returns [].

        Per the SSE rules, an event not terminated by a blank line (and any unterminated last
        line) is discarded at end of stream, so closing never yields an event; the list return
        only mirrors `feed` so callers can treat both alike.
        """
        self._parts.clear()
        self._parts_len = 0
        self._data.clear()
        self._event = None
        self._cr_pending = False
        return []

    def _fail(self) -> None:
        self.close()
        raise SSEProtocolError(f"SSE line longer than {self._max_line} bytes")

    def _process(self, lines: list[bytes]) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        data = self._data
        for line in lines:
            if line.startswith(b"data: "):  # by far the most common line: skip the general path
                data.append(line[6:])
                continue
            if not line:
                # Blank line: dispatch, unless no data field was seen.
                if data:
                    joined = data[0] if len(data) == 1 else b"\n".join(data)
                    events.append(SSEEvent(joined, self._event or None))
                    data.clear()
                self._event = None
                continue
            if line[0] == 0x3A:  # ':'
                self.comments += 1
                continue
            colon = line.find(b":")
            if colon < 0:
                name, value = line, b""
            else:
                name = line[:colon]
                value = line[colon + 1 :]
                if value[:1] == b" ":
                    value = value[1:]
            if name == b"data":
                data.append(value)
            elif name == b"event":
                self._event = value
            elif name == b"error":
                self._event = b"error"
                data.append(value)
            # `id`, `retry` and unknown fields: parsed above, deliberately dropped.
        return events


def encode_event(data: bytes, event: bytes | None = None) -> bytes:
    """Encode one event: `event: x` (if any), one `data:` line per line of `data`, blank line.

    `data` must not contain CR (a decoder would read it as a line end, so the event would not
    round-trip); `event` must hold no line end at all. Both raise ValueError.
    """
    # `13 in data`, not `b"\r" in data`: for a bytes needle CPython 3.11's `in` raises and
    # clears a formatted TypeError (it tries the needle as an integer first), about 2,500
    # instructions each; an int is a plain memchr, and `bytes.find` skips the integer try
    if 13 in data:
        raise ValueError("SSE data must not contain CR")
    if 10 in data:
        body = b"".join([b"data: " + line + b"\n" for line in data.split(b"\n")]) + b"\n"
    else:
        body = b"data: " + data + b"\n\n"
    if event is None:
        return body
    if 10 in event or 13 in event:
        raise ValueError("SSE event type must not contain CR or LF")
    return b"event: " + event + b"\n" + body


def encode_comment(text: str) -> bytes:
    """Encode a comment (`: text` and a blank line), e.g. the gateway's keep-alives.

    A CR or LF in `text` would end the comment early and smuggle a field in: ValueError.
    """
    if "\n" in text or "\r" in text:
        raise ValueError("SSE comment must not contain CR or LF")
    return b": " + text.encode("utf-8") + b"\n\n"
