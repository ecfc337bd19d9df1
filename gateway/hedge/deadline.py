"""A request's time-to-first-token objective and what it changes about its hedge. Pure.

No I/O, no asyncio: times are seconds handed in as numbers.

Why: the hedge delay is the pool's answer for every request alike, the TTFT that only the
budget's share of requests exceed. A request that must have its first token within an
objective (a key's `ttft_objective`, or an `x-slo-ttft-ms` header, as in-cluster schedulers
send) cannot wait that long when its primary's learnt tail at its size is past the objective:
by the time the normal hedge goes out, the copy can no longer answer in time. So such a
request sends its hedge at the latest moment that still meets the objective: the objective
minus what the second backend typically takes (`deadline_delay`). A request whose primary
would meet it changes nothing, and a deadline never makes a hedge later than the normal one.

Who pays: the extra attempts an objective causes are paid from its key's own share
(`KeyShare`, a token bucket per key beside the pool's budget, filled by that key's requests
only), so one tenant's tight objectives cannot spend the hedges another tenant's requests
earned.
"""

from __future__ import annotations

import math

#: the header a client or an in-cluster scheduler names its TTFT objective with, milliseconds
OBJECTIVE_HEADER = "x-slo-ttft-ms"
#: a key's share holds at most this many deadline hedges (and starts full): enough for a short
#: burst of slow primaries, bounded so a quiet key cannot save up a flood
SHARE_BURST = 10.0
#: slack when comparing the float level with 1 (ten deposits of 0.1 must make one token)
_EPSILON = 1e-9


def header_objective(raw: str | None) -> float | None:
    """The objective an `x-slo-ttft-ms` value names, in seconds; None when absent or not a
    positive finite number of milliseconds. A malformed value is ignored rather than refused:
    the header is usually set by infrastructure between the client and the gateway, and a bad
    hint must not fail a request that would be answered fine without it."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value / 1000.0 if value > 0 and math.isfinite(value) else None


def objective(key: float | None, header: float | None) -> float | None:
    """The request's objective: the tighter of its key's and its header's. A header can only
    tighten the key's objective, never loosen it."""
    if key is None:
        return header
    if header is None:
        return key
    return min(key, header)


def request_objective(key: float | None, raw: str | None) -> float | None:
    """The request's objective from its key's (`key`, seconds) and its raw `x-slo-ttft-ms`
    header (`header_objective`, then `objective`): one call for the route's read of it."""
    return objective(key, header_objective(raw))


def deadline_delay(*, normal: float, objective: float, primary_tail: float | None,
                   second_ttft: float | None) -> float | None:
    """When (seconds after the primary's start) the hedge of a request with `objective` goes,
    or None: nothing changes (the normal delay applies).

    `primary_tail`: the primary's learnt TTFT tail at the request's size (None: nothing
    learnt, no prediction, nothing changes); `second_ttft`: the typical TTFT of the backend the
    hedge would go to (None: unknown, so the hedge goes at once, the best chance left).

    When the primary's tail meets the objective, None. Else the hedge goes as late as still
    meets it, `objective - second_ttft` (at once when that is past), but never later than
    `normal`: at or after the normal delay, None (the normal hedge is as early)."""
    if primary_tail is None or primary_tail <= objective:
        return None
    at = 0.0 if second_ttft is None else max(0.0, objective - second_ttft)
    return at if at < normal else None


class KeyShare:
    """One key's share of the hedge budget: a token bucket beside the pool's, for the hedges
    its deadlines send early. Each of the key's requests deposits its ratio (the key's own
    `hedging.ratio`, else the pool's), capped at SHARE_BURST; each deadline hedge spends one.
    Starts full. A fixed handful of numbers per key, whatever its traffic."""

    __slots__ = ("level",)

    def __init__(self) -> None:
        self.level = SHARE_BURST

    def deposit(self, ratio: float) -> None:
        """One request of the key arrived."""
        self.level = min(SHARE_BURST, self.level + ratio)

    def can_pay(self) -> bool:
        """Whether one deadline hedge can be paid now."""
        return self.level >= 1.0 - _EPSILON

    def spend(self) -> None:
        """A deadline hedge was sent (after `can_pay`)."""
        self.level = max(0.0, self.level - 1.0)
