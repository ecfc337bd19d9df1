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
