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
  connected, or that an upstream refused with an error status, was not charged by it.

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
    found: list[Charge] = []
    for attempt in summary.attempts:
        if attempt is winner:
            if usage is not None:
                found.append(Charge(attempt.backend, usage.input, usage.cached or 0,
                                    usage.output))
            else:
                found.append(Charge(attempt.backend, sent, 0, summary.relayed or 0))
            continue
        if attempt.outcome == "failed" and attempt.failure not in CHARGED_FAILURES:
            continue
        cached = 0
        if size is not None and size.tokens > 0:
            cached = sent - round(sent * min(1.0, size.uncached(attempt.backend) / size.tokens))
        found.append(Charge(attempt.backend, sent, cached, attempt.output_sent or 0))
    return found


def summary_cost(summary: RequestSummary,
                 prices: Mapping[str, PriceSettings]) -> float | None:
    """What `summary`'s request cost in US dollars, its losers included; None when no
    backend it was charged on has a price (or no price is configured at all), and for a read
    of stored state, which generates nothing (`RequestSummary.metered`)."""
    if not prices or not summary.metered:
        return None
    return request_cost(charges(summary), prices)
