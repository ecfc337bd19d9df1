"""The last races, for the dashboard's timeline (SPEC §17). Pure.

`Stats.record` hands every ended request that started at least one attempt to `RecentRaces`;
`GET /hedge/races` serves them. One entry per request, newest last, at most `capacity` (50):
`id`, `pool`, `endpoint`, `t` (seconds since the gateway started, at the request's arrival),
`outcome` (`ok` or the error class), `ttft_ms` (client-observed), `total_ms`, `winner` (index
of the winning attempt or null), and `attempts`: [{`backend`, `kind`, `start_ms` (from the
request's arrival), `end_ms` (its first token, or when it was cancelled, failed or abandoned),
`outcome`, `reason`}]. So a person sees a hedge overtake a straggler. No prompt, body or key.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.attempt import AttemptRecord
    from gateway.stats.record import RequestSummary

CAPACITY = 50


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def attempt_end(attempt: AttemptRecord, request_end: float) -> float:
    """When an attempt's bar ends: its first token or cancellation (`ttft`), else when its
    runner stopped (a failure), else the request's end."""
    if attempt.ttft is not None:
        return attempt.started + attempt.ttft
    if attempt.ended is not None:
        return attempt.ended
    return request_end


class RecentRaces:
    """A bounded list of the last races."""

    def __init__(self, started: float, capacity: int = CAPACITY) -> None:
        self._started = started
        self._races: deque[dict[str, Any]] = deque(maxlen=capacity)

    def add(self, summary: RequestSummary, outcome: str) -> None:
        if not summary.attempts:
            return
        start = summary.started
        end = summary.ended if summary.ended is not None else start
        winner = summary.winner
        self._races.append({
            "id": summary.request_id,
            "pool": summary.pool,
            "endpoint": summary.endpoint,
            "t": round(start - self._started, 3),
            "outcome": outcome,
            "ttft_ms": _ms(summary.client_ttft),
            "total_ms": _ms(end - start),
            "winner": None if winner is None else winner.index,
            "attempts": [
                {
                    "backend": a.backend,
                    "kind": a.kind,
                    "start_ms": _ms(a.started - start),
                    "end_ms": _ms(max(a.started, attempt_end(a, end)) - start),
                    "outcome": a.outcome,
                    "reason": a.reason,
                }
                for a in summary.attempts
            ],
        })

    def view(self) -> dict[str, Any]:
        return {"capacity": self._races.maxlen, "races": list(self._races)}
