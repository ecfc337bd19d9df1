"""A simulated request quota and the rate-limit headers that state it.

Why: the gateway's quota headroom (`gateway.hedge.headroom`) acts on the rate-limit headers of
real APIs; a simulator that sends them lets the tests, the demo and the bench show it without
a real quota to burn. A backend with `rate_limit_requests: N` allows N requests per
`rate_limit_window` (a fixed window that starts with the first request); every answer states
what is left, in the shape of the route it answers: OpenAI's `x-ratelimit-*-requests` (reset as
a duration) on OpenAI's routes, Anthropic's `anthropic-ratelimit-requests-*` (reset as an RFC
3339 time) on the Messages routes. Past the quota a request gets a 429 with `Retry-After` until
the window ends, as the real APIs answer. No quota configured: no headers, nothing refused.

Kept apart from the plans and the wire content (`providers.sim.wire`, `protocols`): it only
adds headers and a refusal, around whatever those produce. The clock is a parameter.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from gateway.errors import UpstreamStatusError

#: the routes whose answers carry Anthropic's header names
ANTHROPIC_ROUTES = frozenset({"messages", "messages/count_tokens"})


@dataclass(slots=True)
class SimQuota:
    """`limit` requests per `window` seconds; mutable, one per simulated backend."""

    limit: int
    window: float
    #: when the current window started (None: no request yet)
    started: float | None = None
    used: int = 0

    def take(self, now: float) -> bool:
        """Count one request at `now`; False when the window's quota is already spent (the
        request is refused, and counts for nothing)."""
        if self.started is None or now >= self.started + self.window:
            self.started, self.used = now, 0
        if self.used >= self.limit:
            return False
        self.used += 1
        return True

    def reset_in(self, now: float) -> float:
        """Seconds until the window ends (the whole window before the first request)."""
        if self.started is None:
            return self.window
        return max(0.0, self.started + self.window - now)

    def headers(self, endpoint: str, now: float, wall: float | None = None) -> dict[str, str]:
        """The rate-limit headers of an answer at `now` on `endpoint`'s route; `wall` (Unix
        time, default the real one) dates an Anthropic reset."""
        remaining = str(max(0, self.limit - self.used))
        reset = self.reset_in(now)
        if endpoint in ANTHROPIC_ROUTES:
            at = (time.time() if wall is None else wall) + reset
            return {"anthropic-ratelimit-requests-limit": str(self.limit),
                    "anthropic-ratelimit-requests-remaining": remaining,
                    "anthropic-ratelimit-requests-reset": _rfc3339(at)}
        return {"x-ratelimit-limit-requests": str(self.limit),
                "x-ratelimit-remaining-requests": remaining,
                "x-ratelimit-reset-requests": f"{reset:.3f}s"}

    def retry_after(self, now: float) -> float:
        """What a refusal's Retry-After says: whole seconds until the window ends, at least 1."""
        return max(1.0, float(math.ceil(self.reset_in(now))))


def refusal(quota: SimQuota, endpoint: str, now: float) -> UpstreamStatusError:
    """The in-process simulator's answer past its quota: a 429 with Retry-After and the
    rate-limit headers that say the quota is spent."""
    error = UpstreamStatusError.of(429, retry_after=quota.retry_after(now))
    error.quota = quota.headers(endpoint, now)
    return error


def _rfc3339(unix: float) -> str:
    """`2025-01-01T00:00:30.250Z`: how Anthropic dates a reset."""
    whole = math.floor(unix)
    millis = min(999, round((unix - whole) * 1000))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"
