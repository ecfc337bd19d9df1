"""Counters and sketches behind `/hedge/stats` and `/metrics` (SPEC §9, §10).

Fed once per logical request with a `RequestSummary` when the request has fully ended (winner
closed, losers reaped), so nothing here runs per event.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.budget import SuppressReason

if TYPE_CHECKING:
    from gateway.race import AttemptRecord, RaceResult


@dataclass(slots=True)
class RequestSummary:
    """Everything the stats and the request log need about one logical request."""

    request_id: str
    pool: str
    endpoint: str
    stream: bool
    started: float
    attempts: Sequence[AttemptRecord] = ()
    suppressed: Sequence[SuppressReason] = ()
    winner: AttemptRecord | None = None
    committed_at: float | None = None
    ended: float | None = None
    error: str | None = None
    relay_end: str | None = None

    def attach(
        self,
        attempts: Sequence[AttemptRecord],
        suppressed: Sequence[SuppressReason],
        result: RaceResult | None,
    ) -> None:
        self.attempts = attempts
        self.suppressed = suppressed
        if result is not None:
            self.winner = result.winner
            self.committed_at = result.committed_at

    @property
    def client_ttft(self) -> float | None:
        return None if self.committed_at is None else self.committed_at - self.started


@dataclass(slots=True)
class Stats:
    """Process-lifetime record of what the gateway did."""

    summaries: int = 0
    by_pool: dict[str, int] = field(default_factory=dict)

    def record(self, summary: RequestSummary) -> None:
        self.summaries += 1
        self.by_pool[summary.pool] = self.by_pool.get(summary.pool, 0) + 1
