"""What `serve --workers N` decides, without processes: each worker's share of the budget, and
whether a dead worker may be replaced now. Pure: no I/O, time as a parameter.

The shell that forks, watches and signals the workers is `gateway.server.supervisor`.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from dataclasses import replace

from gateway.settings import Settings
from gateway.settings.tenants import TenantLimits

#: a worker that dies is replaced at once, but at most this many times per `RESTART_WINDOW`
#: across the server: a worker that cannot stay up (a crash at start, a bad host) must not
#: become a fork loop. Past it the supervisor stops the server and says why.
MAX_RESTARTS = 5
RESTART_WINDOW = 60.0


def with_response_id_secret(settings: Settings) -> Settings:
    """The settings with a response id secret: the configured one, else a new one for this
    server's lifetime. The supervisor calls this once before it forks, so every worker (and
    every replacement worker) signs and reads the same response ids; a second replica has its
    own unless `server.response_id_secret` gives them one."""
    if settings.server.response_id_secret is not None:
        return settings
    server = replace(settings.server, response_id_secret=secrets.token_urlsafe(32))
    return replace(settings, server=server)


def worker_settings(settings: Settings, workers: int) -> Settings:
    """The settings one of `workers` processes runs with: every pool's budget bucket holds
    `ceil(burst / workers)` (and `ceil(burst_input_tokens / workers)` input tokens), deposits
    and reserve unchanged.

    Why: each worker keeps its own bucket (no shared memory on the request path), so the host's
    extra attempts are bounded by the sum of the buckets plus the deposits: at most
    `ratio x requests + workers x ceil(burst / workers) + workers x min_per_second x seconds`,
    i.e. the configured burst (plus less than one token per worker from rounding up, which
    keeps every worker able to hedge at all) rather than `workers x burst`."""
    if workers <= 1:
        return settings
    pools = tuple(
        replace(pool, hedging=replace(pool.hedging, budget=replace(
            pool.hedging.budget,
            burst=float(math.ceil(pool.hedging.budget.burst / workers)),
            burst_input_tokens=math.ceil(pool.hedging.budget.burst_input_tokens / workers))))
        for pool in settings.pools
    )
    return replace(settings, pools=pools, keys=tuple(
        replace(key, limits=worker_limits(key.limits, workers)) for key in settings.keys))


def worker_limits(limits: TenantLimits, workers: int) -> TenantLimits:
    """One worker's part of a client key's limits: the per-minute limits whole, since the
    workers lease slices of each from the store they share (`gateway.tenants.lease`), so a
    client whose connections all land on one worker still has the whole limit; the count in
    flight, which no lease holds, split: `ceil(in_flight / workers)` each, so the server runs
    at most the configured count plus less than one per worker from rounding up
    (docs/tenants.md)."""
    if limits.in_flight is None:
        return limits
    return replace(limits, in_flight=math.ceil(limits.in_flight / workers))


class RestartLimiter:
    """At most `limit` replacements within any `window` seconds."""

    __slots__ = ("_limit", "_times", "_window")

    def __init__(self, limit: int = MAX_RESTARTS, window: float = RESTART_WINDOW) -> None:
        self._limit = limit
        self._window = window
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """May a dead worker be replaced at `now`? If so, the replacement is counted."""
        while self._times and now - self._times[0] >= self._window:
            self._times.popleft()
        if len(self._times) >= self._limit:
            return False
        self._times.append(now)
        return True
