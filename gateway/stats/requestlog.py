"""One structured log line per logical request.

Logger `hedge_gateway.requests`, level INFO, message = one JSON object, also attached to the
record as `record.hedge_request` (a dict) for handlers that format structured data themselves.
Written once per request when it has fully ended (same moment as `Stats.record`), never per
event.

What it holds: ids, pool, endpoint, each attempt's backend/kind/start/TTFT/outcome/reason,
the winner, the suppressed hedge reasons, the error class and stream end, timings. What it
never holds: prompt or completion content, request or upstream bodies, headers, keys, URLs.
Attempt reasons are the gateway's own short descriptions (`status 503`, `connect error`), the
same text the client's 502 carries; `failure` is the failed attempt's code (`unavailable`,
`connect_error`), the class the stats count it under.

Fields: `id`, `pool`, `endpoint`, `stream`, `outcome` (`ok` or the error class),
`error` (error code or null), `relay_end` (how a stream ended: `done`, `truncated`, ...),
`winner` (backend or null), `winner_kind`, `hedges` / `failovers` (extra attempts started),
`suppressed` (reasons, in order), `ttft_ms` (client-observed, null without a token),
`total_ms`, `usage` ({`input`, `output`} tokens of the winner, or null),
`hedge_input_tokens` (input tokens paid again by extra attempts),
`attempts`: [{`backend`, `kind`, `start_ms` (from the request's start),
`ttft_ms` (from the attempt's start; for a cancelled attempt its elapsed time then),
`outcome`, `failure`, `reason`, `close_ms`, `late_events`}].
"""

from __future__ import annotations

import json
import logging
from typing import Any

from gateway.hedge.attempt import AttemptRecord
from gateway.stats.record import hedge_input_tokens, request_class
from gateway.stats.summary import RequestSummary

LOGGER_NAME = "hedge_gateway.requests"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _attempt(a: AttemptRecord, start: float) -> dict[str, Any]:
    return {
        "backend": a.backend,
        "kind": a.kind,
        "start_ms": _ms(a.started - start),
        "ttft_ms": _ms(a.ttft),
        "outcome": a.outcome,
        "failure": a.failure,
        "reason": a.reason,
        "close_ms": _ms(a.close_s),
        "late_events": a.late_events,
    }


def request_record(summary: RequestSummary, error_classes: frozenset[str]) -> dict[str, Any]:
    """The log line's content as a dict (also what tests inspect)."""
    winner = summary.winner
    kinds = [a.kind for a in summary.attempts]
    ended = summary.ended if summary.ended is not None else summary.started
    return {
        "id": summary.request_id,
        "pool": summary.pool,
        "endpoint": summary.endpoint,
        "stream": summary.stream,
        "outcome": request_class(summary, error_classes),
        "error": summary.error,
        "relay_end": summary.relay_end,
        "winner": None if winner is None else winner.backend,
        "winner_kind": None if winner is None else winner.kind,
        "hedges": kinds.count("hedge"),
        "failovers": kinds.count("failover"),
        "suppressed": [str(reason) for reason in summary.suppressed],
        "ttft_ms": _ms(summary.client_ttft),
        "total_ms": _ms(ended - summary.started),
        "usage": None if summary.usage is None else {
            "input": summary.usage.input, "output": summary.usage.output},
        "hedge_input_tokens": hedge_input_tokens(summary),
        "attempts": [_attempt(a, summary.started) for a in summary.attempts],
    }


def log_request(summary: RequestSummary, error_classes: frozenset[str]) -> None:
    """Write the request's line to `hedge_gateway.requests` at INFO (skipped cheaply when
    that level is off)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.isEnabledFor(logging.INFO):
        return
    record = request_record(summary, error_classes)
    logger.info(
        json.dumps(record, separators=(",", ":")),
        extra={"hedge_request": record},
    )
