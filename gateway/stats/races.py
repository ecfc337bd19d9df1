"""The last races, for the dashboard's timeline. Pure.

`Stats.record` hands every ended request that started at least one attempt to `RecentRaces`;
`GET /hedge/races` serves them. One entry per request, newest last, at most `capacity` (50):
`id`, `pool`, `endpoint`, `t` (seconds since the gateway started, at the request's arrival),
`outcome` (`ok` or the error class), `ttft_ms` (client-observed), `total_ms`, `winner` (index
of the winning attempt or null), and `attempts`: [{`backend`, `kind`, `start_ms` (from the
request's arrival), `end_ms` (its first token, or when it was cancelled, failed or abandoned),
`outcome`, `reason`}], a continuation's attempt after the race's own (kind `continuation`).
So a person sees a hedge overtake a straggler. No prompt, body or key.

Under `serve --workers N` each worker's last races travel in its mergeable export
(`gateway.stats.merge`) with `at`, the arrival on the host's monotonic clock, in place of `t`,
and the worker (`worker`, `pid`) that served them. `merge_races` keeps the newest `capacity` of
several workers' lists, and `races_view` serves them with `t` from the server's start: the
timeline of the whole server, whichever worker answers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.hedge.attempt import AttemptRecord
    from gateway.stats.summary import RequestSummary

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
    """A bounded list of the last races (kept with `at`; `t` is worked out when served)."""

    def __init__(self, started: float, capacity: int = CAPACITY) -> None:
        self._started = started
        self._races: deque[dict[str, Any]] = deque(maxlen=capacity)

    def add(self, summary: RequestSummary, outcome: str) -> None:
        if not summary.attempts:
            return
        start = summary.started
        end = summary.ended if summary.ended is not None else start
        winner = summary.winner
        attempts = list(summary.attempts)
        if summary.continuations is not None:  # after commit, on the same timeline
            attempts += summary.continuations.records
        self._races.append({
            "id": summary.request_id,
            "pool": summary.pool,
            "endpoint": summary.endpoint,
            "at": start,
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
                for a in attempts
            ],
        })

    def export(self, worker: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The races for a mergeable export, each marked with the process that served it
        (`worker`: its `worker` index and `pid`); `at` to the millisecond, as `t` is shown."""
        mark = {"worker": worker.get("worker"), "pid": worker.get("pid")}
        return [{**race, "at": round(race["at"], 3), **mark} for race in self._races]

    def view(self) -> dict[str, Any]:
        return races_view(self._races, self._started, self._races.maxlen or CAPACITY)


def merge_races(lists: Iterable[Iterable[Any]], capacity: int = CAPACITY) -> list[dict[str, Any]]:
    """The newest `capacity` races of several exports' lists, oldest first (by `at`: the
    monotonic clock of one host, so within one host the order is the order of arrival).
    ValueError if an entry is not a race."""
    races: list[dict[str, Any]] = []
    for entries in lists:
        for race in entries:
            at = race.get("at") if isinstance(race, Mapping) else None
            if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
                raise ValueError("malformed race: no arrival time")
            races.append(dict(race))
    races.sort(key=lambda race: race["at"])
    return races[-capacity:] if capacity > 0 else []


def races_view(races: Iterable[Mapping[str, Any]], started: float,
               capacity: int = CAPACITY) -> dict[str, Any]:
    """The `/hedge/races` document: each race's `at` shown as `t`, seconds since `started`."""
    return {
        "capacity": capacity,
        "races": [{("t" if key == "at" else key):
                   (round(value - started, 3) if key == "at" else value)
                   for key, value in race.items()} for race in races],
    }
