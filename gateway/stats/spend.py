"""Who in a request was charged what: its attempts as `Charge`s, and the request's cost.

Every attempt that reached its backend was sent the whole input, so each is charged:

- the winner: its upstream's usage (input, cached input, output); without a usage report (a
  client that left a stream before it, a backend that reports none in a stream), the
  gateway's estimate of its input (`RequestSize.tokens`) and, for a stream, one output token
  per event relayed to the client (`RequestSummary.relayed`);
- a loser (an attempt the race cancelled, one whose token came second, a complete answer that
  lost): the input, taken from the winner's count when there is one (the same body was sent)
  else the estimate, of which the part its backend most likely had cached (the conversation's
  home: what did not grow since its last turn) is priced as cached input; and its output until
  it was closed (`AttemptRecord.output_sent`: none for one closed before its first token);
- a failed attempt only when its upstream had taken the request (a read timeout, a broken or
  malformed stream, an in-band error, a stream without a token): an attempt that never
  connected, or that an upstream refused with an error status, was not charged by it;
- a continuation after commit (`ContinuationLeg`): the input (the request's, as above, plus
  the tokens relayed before it started, which it resent) and its output. A stream the relay
  took over is charged what the client read from it: the winner and each continuation taken
  after it, the tokens relayed until the next one took over; the last one, its upstream's
  count (the answer's usage less the tokens relayed before it). The client's usage is the
  answer's, counted once. One that lost its stall race, its output until it was closed; a
  failed one, as a failed attempt.

Runs once per request at its end (and for a non-streamed answer once more, for its header):
a few arithmetic steps per attempt, nothing per event.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.settings.model import PriceSettings
from gateway.stats.summary import RequestSummary
from gateway.tenants.spend import Charge, request_cost

#: failures after the upstream took the request: it had the input, so it charged for it
CHARGED_FAILURES = frozenset({"read_timeout", "protocol_error", "connection_reset",
                              "error_event", "no_token"})


def charges(summary: RequestSummary) -> list[Charge]:
    """The tokens each attempt of `summary` was charged (see the module docstring)."""
    usage, size, winner = summary.usage, summary.size, summary.winner
    sent = usage.input if usage is not None else (size.tokens if size is not None else 0)
    legs = () if summary.continuations is None else summary.continuations.legs
    taken = [leg for leg in legs if leg.taken]
    found: list[Charge] = []
    for attempt in summary.attempts:
        if attempt is winner:
            if taken:  # continued: its share is the tokens relayed before the first one
                found.append(Charge(attempt.backend, sent,
                                    _cached(sent, summary, attempt.backend), taken[0].relayed))
            elif usage is not None:
                found.append(Charge(attempt.backend, usage.input, usage.cached or 0,
                                    usage.output))
            else:
                found.append(Charge(attempt.backend, sent, 0, summary.relayed or 0))
            continue
        if attempt.outcome == "failed" and attempt.failure not in CHARGED_FAILURES:
            continue
        found.append(Charge(attempt.backend, sent, _cached(sent, summary, attempt.backend),
                            attempt.output_sent or 0))
    for leg in legs:
        record, resent = leg.record, sent + leg.relayed
        if leg.taken:
            at = taken.index(leg)
            if at + 1 < len(taken):
                output = taken[at + 1].relayed - leg.relayed
                found.append(Charge(record.backend, resent,
                                    _cached(sent, summary, record.backend), output))
            elif usage is not None:  # the last: its upstream's count, the relayed moved back
                found.append(Charge(record.backend, resent, usage.cached or 0,
                                    max(0, usage.output - leg.relayed)))
            else:
                found.append(Charge(record.backend, resent, 0, 0))
        elif record.outcome != "failed" or record.failure in CHARGED_FAILURES:
            found.append(Charge(record.backend, resent,
                                _cached(sent, summary, record.backend), leg.output))
    return found


def _cached(sent: int, summary: RequestSummary, backend: str) -> int:
    """Of `sent` input tokens, the part `backend` most likely had cached: what did not grow
    since the conversation's last turn there (`RequestSize.uncached`)."""
    size = summary.size
    if size is None or size.tokens <= 0:
        return 0
    return sent - round(sent * min(1.0, size.uncached(backend) / size.tokens))


def summary_cost(summary: RequestSummary,
                 prices: Mapping[str, PriceSettings]) -> float | None:
    """What `summary`'s request cost in US dollars, its losers and continuations included;
    None when no backend it was charged on has a price (or no price is configured at all),
    and for a read of stored state, which generates nothing (`RequestSummary.metered`)."""
    if not prices or not summary.metered:
        return None
    return request_cost(charges(summary), prices)
