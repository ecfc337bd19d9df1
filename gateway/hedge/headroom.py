"""A backend's quota headroom, as its answers last told it. Pure.

Why: a backend near the end of its quota answers its next requests with 429s. Its rate-limit
headers (`gateway.wire.ratelimit`) say so before it happens, on every answer, so the balancer
can leave it out while another backend has room, rather than spend an attempt, and a hedge's
budget, on learning it from a refusal.

Headroom of one resource (requests, tokens, input or output tokens) is what remains of it over
its limit: the limit the same answer gives, else the last one seen for that resource (an
answer may state only what remains). A backend is *low* while some resource's headroom is
under `min_headroom`, until that resource resets, or until a later answer shows room: the
latest answer that carries rate-limit headers replaces the picture (counts go down and up
between answers; the latest one is the truth). An answer without them changes nothing.

How long a low mark lasts is bounded, as a Retry-After's pause is: the reset as the answer
gives it, `unknown_reset` when it gives none (the pool's `health.default_pause`), and never
more than `longest` (its `max_pause`). Past that, the backend takes requests again and its
next answer says where it stands: a reset hours away (a daily token quota) must not keep a
backend out of a pool for hours on the strength of one answer.

Bounded: at most one entry per (family, resource) pair of `gateway.wire.ratelimit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.wire.ratelimit import Quota


@dataclass(frozen=True, slots=True)
class Reading:
    """One resource of the latest answer: its headroom and until when that reading holds."""

    resource: str
    share: float
    until: float


class Headroom:
    """One backend's headroom: mutable, owned by its balancer state (so a reload keeps it)."""

    __slots__ = ("_limits", "_readings")

    def __init__(self) -> None:
        #: (family, resource) -> the last limit an answer stated
        self._limits: dict[tuple[str, str], float] = {}
        self._readings: tuple[Reading, ...] = ()

    def observe(self, quotas: Sequence[Quota], now: float, *, unknown_reset: float,
                longest: float) -> None:
        """Take in one answer's quotas at `now` (`gateway.wire.ratelimit.read_quotas`)."""
        readings: list[Reading] = []
        for quota in quotas:
            key = (quota.family, quota.resource)
            if quota.limit is not None and quota.limit > 0:
                self._limits[key] = quota.limit
            limit = self._limits.get(key)
            if quota.remaining is None or limit is None:
                continue  # a share needs both; an unknown share is not "low"
            hold = unknown_reset if quota.reset_in is None else quota.reset_in
            readings.append(Reading(quota.resource, min(1.0, quota.remaining / limit),
                                    now + min(max(0.0, hold), longest)))
        if readings:
            self._readings = tuple(readings)

    def _current(self, now: float) -> list[Reading]:
        return [r for r in self._readings if now < r.until]

    def low_until(self, now: float, floor: float) -> float | None:
        """When the backend stops being low (the latest reset of a resource under `floor`),
        or None when it is not low at `now`."""
        ends = [r.until for r in self._current(now) if r.share < floor]
        return max(ends) if ends else None

    def lowest(self, now: float) -> Reading | None:
        """The resource with the least headroom among the readings still current, or None
        (nothing seen yet, or every reading past its reset)."""
        current = self._current(now)
        return min(current, key=lambda r: r.share) if current else None
