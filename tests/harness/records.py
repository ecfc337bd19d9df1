"""Recording: what a `ScriptedUpstream` saw of one request and what became of its response.

Why a separate record: tests assert order and causality (which event was written when, when
the client hung up) from these plain objects, never from the upstream's internals.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tests.harness.scripts import Script

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEEventCounter:
    """Counts SSE events completed in a byte stream that arrives in arbitrary pieces.

    An event is a block of lines ended by a blank line with at least one field that is not a
    comment; comment-only blocks (`: ping`) are not events. LF, CRLF and CR line ends, split
    anywhere, are handled. Pure: the upstream feeds it what it wrote."""

    def __init__(self) -> None:
        self.total = 0
        self._line_len = 0
        self._comment = False
        self._has_field = False
        self._pending_cr = False

    def feed(self, data: bytes) -> int:
        """Consume `data`; return how many events it completed."""
        done = 0
        pos = 1 if self._pending_cr and data[:1] == b"\n" else 0
        self._pending_cr = False
        while True:
            m = _LINE_END.search(data, pos)
            if m is None:
                self._take(data[pos:])
                break
            self._take(data[pos : m.start()])
            done += self._end_line()
            pos = m.end()
            if pos == len(data) and m.group() == b"\r":
                self._pending_cr = True
        self.total += done
        return done

    def _take(self, segment: bytes) -> None:
        if segment:
            if self._line_len == 0 and segment[:1] == b":":
                self._comment = True
            self._line_len += len(segment)

    def _end_line(self) -> int:
        if self._line_len == 0:
            ended = 1 if self._has_field else 0
            self._has_field = False
            return ended
        if not self._comment:
            self._has_field = True
        self._line_len = 0
        self._comment = False
        return 0


Outcome = Literal["complete", "client_closed", "reset", "closed", "server_stopped"]


@dataclass(eq=False)
class RecordedRequest:
    """One request as the upstream saw it, and what became of its response.

    Times are `time.monotonic()`. Fields are updated in the loop thread under the upstream's
    lock; read them from the test thread after one of the upstream's `wait_*` helpers."""

    index: int
    conn_id: int
    method: str
    path: str
    query: str
    headers: dict[str, str]
    #: the body parsed as JSON, or the raw bytes when it is not JSON
    body: Any
    raw_body: bytes
    received_at: float
    script: Script | None = None
    #: when the status line and headers were written (None: never)
    head_at: float | None = None
    #: when the CLIENT closed or reset the connection that carried this request, during the
    #: response or later while the connection sat idle; None if the server closed first
    closed_at: float | None = None
    #: when the upstream was done with this request, for whatever reason (`outcome`)
    finished_at: float | None = None
    outcome: Outcome | None = None
    #: every byte written on the socket for this response (head, framing, body)
    bytes_written: int = 0
    #: SSE events (not comments) fully written to the socket, and when each one was
    events_written: int = 0
    event_times: list[float] = field(default_factory=list)


Responder = Callable[[RecordedRequest], Script]
