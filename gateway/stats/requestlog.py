"""One structured log line per request to an inference route, refused ones included.

Logger `hedge_gateway.requests`, level INFO, message = one JSON object, also attached to the
record as `record.hedge_request` (a dict) for handlers that format structured data themselves.
Written once per request when it has fully ended (same moment as `Stats.record`), never per
event. A request refused before it reached a pool's race (a bad body, a wrong key, an unknown
model or route, a foreign origin) never reaches the stats, but it gets its line all the same
(`refusal_record`): without it, an operator looking for why a client fails would find nothing.

Every line, refused or not, starts with the same fields: `id`, `route` (the route table's
path, `/v1/responses/{response_id}`; null for a path no route matched, then `path` holds it),
`method`, `model` (as the client sent it: bounded, escaped, `[redacted]` if it holds or looks
like a key, null when the body was not read or had none: `gateway.stats.loggable`), `status`
(the HTTP status answered; 499 when the client left first), `reason` (`ok`, or a short machine
word: `unknown_model`, `invalid_json`, `body_too_large`, `unsupported_media_type`,
`unauthorized`, `overloaded`, `draining`, `upstream_failed`, ...: `GatewayError.log_reason`)
and `outcome` (`refused` for a request refused before any pool's race; else `ok` or the
error class the stats count it under). A refused request's line ends with `peer`, the
client's address as its connection shows it (a proxy in front: the proxy's).

What it holds besides: ids, pool, endpoint, each attempt's backend/kind/start/TTFT/outcome/reason,
the winner, the suppressed hedge reasons, the error class and stream end, timings. What it
never holds: prompt or completion content, request or upstream bodies, headers, keys, URLs.
Attempt reasons are the gateway's own short descriptions (`status 503`, `connect error`), the
same text the client's 502 carries; `failure` is the failed attempt's code (`unavailable`,
`connect_error`), the class the stats count it under.

The line of a request that reached a pool goes on with: `pool`, `endpoint`, `stream`,
`error` (error code or null), `relay_end` (how a stream ended: `done`, `truncated`, ...),
`winner` (backend or null), `winner_kind`, `hedges` / `failovers` (extra attempts started),
`suppressed` (reasons, in order), `ttft_ms` (client-observed, null without a token),
`total_ms`, `usage` ({`input`, `output`} tokens of the winner, or null),
`hedge_input_tokens` (input tokens paid again by extra attempts), `cost_usd` (what the
request cost at its backends' prices, its losing attempts and continuations included; null
when none of them is priced: docs/tenants.md),
`continuations` (null when the stream had none: else, by backend, `started`, `won`,
`breaks_continued`, `breaks_ended`, `stalls`, `refused` by reason, and `input_tokens`
resent),
`attempts`: [{`backend`, `kind`, `start_ms` (from the request's start),
`ttft_ms` (from the attempt's start; for a cancelled attempt its elapsed time then),
`outcome`, `failure`, `reason`, `close_ms`, `late_events`}], and for a request of a named
client key (`keys:`), `key`: its name. A request with a TTFT objective adds `objective_ms`,
`objective_met` (null when the client left first) and `deadline_hedges` (hedges sent early
for it; one its key's share could not pay is in `suppressed` as `key_budget`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from gateway.hedge.attempt import AttemptRecord, ContinuationCounts
from gateway.stats.loggable import loggable_path
from gateway.stats.record import hedge_input_tokens, request_class
from gateway.stats.summary import RequestSummary
from gateway.tenants.spend import DECIMALS

LOGGER_NAME = "hedge_gateway.requests"
#: the `outcome` of a request refused before it reached a pool's race
REFUSED = "refused"


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


def _continuations(counts: ContinuationCounts | None) -> dict[str, Any] | None:
    """A request's continuations after commit, when it had any (None: none, or none
    possible): to which backends, which won, why not, and what broke or stalled."""
    if not counts:
        return None
    return {"started": dict(counts.started), "won": dict(counts.won),
            "refused": dict(counts.refused), "breaks_continued": dict(counts.breaks_continued),
            "breaks_ended": dict(counts.breaks_ended), "stalls": dict(counts.stalls),
            "input_tokens": counts.input_tokens}


def request_record(summary: RequestSummary, error_classes: frozenset[str]) -> dict[str, Any]:
    """The log line's content as a dict (also what tests inspect)."""
    winner = summary.winner
    kinds = [a.kind for a in summary.attempts]
    ended = summary.ended if summary.ended is not None else summary.started
    outcome = request_class(summary, error_classes)
    record = {
        "id": summary.request_id,
        "route": summary.route,
        "method": summary.method,
        "model": summary.model,
        "status": summary.status,
        "reason": summary.reason or outcome,
        "outcome": outcome,
        "pool": summary.pool,
        "endpoint": summary.endpoint,
        "stream": summary.stream,
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
        "continuations": _continuations(summary.continuations),
        "cost_usd": None if summary.cost is None else round(summary.cost, DECIMALS),
        "attempts": [_attempt(a, summary.started) for a in summary.attempts],
    }
    if summary.key is not None:  # a named client key: its name, never the key
        record["key"] = summary.key
    if summary.objective is not None:
        record["objective_ms"] = _ms(summary.objective)
        record["objective_met"] = summary.objective_met
        record["deadline_hedges"] = summary.deadline_hedges
    return record


def refusal_record(request_id: str | None, method: str, route: str | None, path: str,
                   model: str | None, status: int | None, reason: str,
                   peer: str | None = None) -> dict[str, Any]:
    """The line of a request refused before any pool's race. `model` is already loggable;
    `path` is logged only when no route matched it (a route's own path is `route`); `peer`,
    the client's address as the connection shows it, when known: who is guessing keys or
    sending bad requests (behind a proxy, the proxy's address)."""
    record: dict[str, Any] = {
        "id": request_id,
        "route": route,
        "method": method,
        "model": model,
        "status": status,
        "reason": reason,
        "outcome": REFUSED,
    }
    if route is None:
        record["path"] = loggable_path(path)
    if peer is not None:
        record["peer"] = peer
    return record


def log_request(summary: RequestSummary, error_classes: frozenset[str]) -> None:
    """Write the request's line to `hedge_gateway.requests` at INFO (skipped cheaply when
    that level is off)."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.isEnabledFor(logging.INFO):
        _write(logger, request_record(summary, error_classes))


def log_refusal(request_id: str | None, method: str, route: str | None, path: str,
                model: str | None, status: int | None, reason: str,
                peer: str | None = None) -> None:
    """Write a refused request's line (`refusal_record`) to `hedge_gateway.requests`."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.isEnabledFor(logging.INFO):
        _write(logger, refusal_record(request_id, method, route, path, model, status, reason,
                                      peer))


def _write(logger: logging.Logger, record: dict[str, Any]) -> None:
    logger.info(json.dumps(record, separators=(",", ":")), extra={"hedge_request": record})
