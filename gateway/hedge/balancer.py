"""Backend selection and health for one pool. Pure.

No I/O, no asyncio; time comes in as `now` (monotonic seconds) and randomness from an injected
`random.Random`, so tests are deterministic.

Selection is power of two choices: sample two usable backends (weighted by `weight`) and take
the better one. Two random candidates are enough to avoid piling onto one backend (the classic
result: the maximum load drops exponentially compared with one random choice), without the
herding that "always the least loaded" causes when every request sees the same stale numbers.
"Better" is the lower expected wait, `(in-flight attempts + 1) * recent TTFT`: load alone
ignores that one backend may be twice as fast, TTFT alone would send everything to the fastest
backend until it slows down.

Health: a backend is ejected after `eject_after` consecutive failures, for a cool-down that
doubles with each repeated ejection (capped at `max_cooldown`). After the cool-down it gets
exactly one probe attempt; while that probe runs it takes nothing else. A success anywhere
resets the failure and ejection counts; a failed probe ejects again, for longer. The caller
decides what counts as a failure of the *backend* (a 400 from a bad request does not).
`Retry-After` pauses a backend, independently of ejection, for at most `max_pause`: it is
the upstream's advice, and one answer must not take a backend out for minutes.

Panic routing (Envoy's panic threshold): when the backends that are neither paused nor
ejected hold less than `panic_below` of the pool's weight, health stops being trusted. Paused
and ejected backends become candidates again, behind the healthy ones, the one whose pause or
cool-down ends soonest first. Without it, a few pushbacks (or a one-backend pool's single one)
refuse every request without an upstream attempt, although most would succeed. Panic never
overrides `max_concurrency`: a full backend stays full.

Quota headroom (`gateway.hedge.headroom`): a backend whose rate-limit headers show less than
`min_headroom` of a quota left is `low` until the reset. Every choice (primary, hedge,
failover) leaves low candidates out while another candidate of that choice has room, and
reports each one it left out (`skipped`, counted per backend as `headroom_skips`); when every
candidate is low, the choice is made as if none were. So a low backend is never refused
outright: it is neither paused nor ejected, its weight still counts for panic routing, and a
pool whose every backend is near its quota serves as it would without the headers. Room
comes before "another group" for a hedge: a backend about to refuse is a worse hedge than one
in the primary's zone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence

from gateway.hedge.headroom import Headroom
from gateway.settings import BackendSettings, HealthSettings
from gateway.wire.ratelimit import read_quotas

#: a TTFT used in the load * TTFT product is at least this, so load still counts when a
#: backend reports (near) zero TTFT
_TTFT_FLOOR = 1e-6


class _Backend:
    """Mutable health and load state of one backend."""

    __slots__ = (
        "ejected_until",
        "ejections",
        "failures",
        "group",
        "headroom",
        "inflight",
        "max_concurrency",
        "name",
        "paused_until",
        "probe",
        "probing",
        "weight",
    )

    def __init__(self, settings: BackendSettings) -> None:
        self.name = settings.name
        self.group = settings.group
        self.weight = max(0.0, settings.weight)
        self.max_concurrency = settings.max_concurrency
        self.inflight = 0
        #: consecutive failures since the last success
        self.failures = 0
        #: ejections since the last success (drives the cool-down length)
        self.ejections = 0
        #: None: not ejected; otherwise the end of the cool-down
        self.ejected_until: float | None = None
        #: the single post-cool-down probe attempt is running; and the number of the latest
        #: probe (each one's own, so that only its end frees the slot: `on_finish`)
        self.probing = False
        self.probe = 0
        self.paused_until: float | None = None
        #: its quota as its answers last told it
        self.headroom = Headroom()


class Balancer:
    """Picks backends for attempts and tracks their health (one per pool)."""

    __slots__ = ("_backends", "_health", "_rng")

    def __init__(
        self,
        backends: Sequence[BackendSettings],
        health: HealthSettings,
        rng: random.Random,
    ) -> None:
        self._backends = {b.name: _Backend(b) for b in backends}
        if len(self._backends) != len(backends):
            raise ValueError("backend names in a pool must be unique")
        self._health = health
        self._rng = rng

    def adopt(self, backends: Sequence[BackendSettings], health: HealthSettings) -> Balancer:
        """A balancer for a reloaded pool: backends that keep their name keep their state
        object (health, pauses, attempts in flight), with the new weight, group and
        `max_concurrency`; new ones start fresh. Shared objects, not copies: attempts of
        requests that started before the reload end on this balancer and must still count."""
        fresh = Balancer(backends, health, self._rng)
        for name, state in fresh._backends.items():
            kept = self._backends.get(name)
            if kept is not None:
                kept.group, kept.weight = state.group, state.weight
                kept.max_concurrency = state.max_concurrency
                fresh._backends[name] = kept
        return fresh

    # -- queries --------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Every backend of the pool, in configuration order."""
        return list(self._backends)

    def group(self, name: str) -> str:
        """The backend's `group` label (zone, provider); "" when none is configured."""
        return self._backends[name].group

    def inflight(self, name: str) -> int:
        """Attempts currently running on the backend (between on_start and on_finish)."""
        return self._backends[name].inflight

    @staticmethod
    def _healthy(b: _Backend, now: float) -> bool:
        """Neither paused nor ejected (a backend whose cool-down is over and whose probe is not
        taken yet counts: it may take the probe)."""
        if b.paused_until is not None and now < b.paused_until:
            return False
        return b.ejected_until is None or (now >= b.ejected_until and not b.probing)

    @staticmethod
    def _has_room(b: _Backend) -> bool:
        return b.max_concurrency is None or b.inflight < b.max_concurrency

    def _usable(self, b: _Backend, now: float) -> bool:
        return self._healthy(b, now) and self._has_room(b)

    def panic(self, now: float, *, outside: Collection[str] = ()) -> bool:
        """Whether selection is in panic mode: the healthy backends hold less than
        `panic_below` of the pool's weight (of its backend count when every weight is 0).

        `outside`: backends the request may not use at all (their provider does not serve its
        route): they are not weighed, so in a pool that mixes providers the route's own
        backends decide, and a route whose every backend is paused is still tried."""
        backends = [b for b in self._backends.values() if b.name not in outside]
        total = sum(b.weight for b in backends)
        if total > 0:
            healthy = sum(b.weight for b in backends if self._healthy(b, now))
        else:
            total = float(len(backends))
            healthy = float(sum(1 for b in backends if self._healthy(b, now)))
        return healthy < self._health.panic_below * total

    def _ready_at(self, b: _Backend, now: float) -> float:
        """When the backend's pause and cool-down are both over (`now` if they are)."""
        return max(now, b.paused_until or now, b.ejected_until or now)

    def usable(self, now: float) -> list[str]:
        """Backends that may take a new attempt now, in configuration order: not ejected (or
        cool-down over and its probe not yet taken), not paused, under max_concurrency."""
        return [b.name for b in self._backends.values() if self._usable(b, now)]

    def seconds_left(self, name: str, now: float) -> float | None:
        """Seconds until the backend's pause or cool-down ends (0.0 when an ejected backend
        only waits for its probe), or until it stops being low; None when it is ok. For
        stats, like `state`."""
        b = self._backends[name]
        if b.ejected_until is None and (b.paused_until is None or now >= b.paused_until):
            low_until = self._low_until(b, now)
            return None if low_until is None else low_until - now
        return self._ready_at(b, now) - now

    def state(self, name: str, now: float) -> tuple[str, str | None]:
        """("ok" | "ejected" | "paused" | "low", reason) for stats. Ejection wins over a
        pause, a pause over low headroom. The time left is `seconds_left`'s."""
        b = self._backends[name]
        if b.ejected_until is not None:
            if now < b.ejected_until:
                return ("ejected", f"{b.failures} consecutive failures")
            if b.probing:
                return ("ejected", "probe in flight")
            return ("ejected", "cool-down over, awaiting probe")
        if b.paused_until is not None and now < b.paused_until:
            return ("paused", "retry-after")
        lowest = b.headroom.lowest(now)
        if lowest is not None and self._low_until(b, now) is not None:
            return ("low", f"{lowest.share:.1%} of its {lowest.resource} quota left")
        return ("ok", None)

    # -- quota headroom -------------------------------------------------------------------

    def observe_quota(self, name: str, headers: Mapping[str, str], now: float,
                      wall: float) -> None:
        """Take in the rate-limit headers of one of the backend's answers (any status) at
        `now`; `wall` is the Unix time, for resets given as a time of day. A backend a reload
        removed is ignored."""
        b = self._backends.get(name)
        if b is None:
            return
        quotas = read_quotas(headers, wall=wall)
        if quotas:
            b.headroom.observe(quotas, now, unknown_reset=self._health.default_pause,
                               longest=self._health.max_pause)

    def _low_until(self, b: _Backend, now: float) -> float | None:
        return b.headroom.low_until(now, self._health.min_headroom)

    def headroom(self, name: str, now: float) -> tuple[float, str] | None:
        """The backend's least headroom (share left, resource) as its latest answer said,
        None when unknown or past its reset. For stats."""
        lowest = self._backends[name].headroom.lowest(now)
        return None if lowest is None else (lowest.share, lowest.resource)

    def prefer_room(self, names: Sequence[str], now: float) -> tuple[list[str], list[str]]:
        """(the candidates to choose from, the low ones left out): `names` less the low ones
        while one of them has room, else all of `names` and nothing left out."""
        kept, skipped = self._with_room([self._backends[n] for n in names], now)
        return [b.name for b in kept], [b.name for b in skipped]

    def _with_room(self, candidates: list[_Backend], now: float
                   ) -> tuple[list[_Backend], list[_Backend]]:
        roomy = [b for b in candidates if self._low_until(b, now) is None]
        if not roomy or len(roomy) == len(candidates):
            return candidates, []
        return roomy, [b for b in candidates if self._low_until(b, now) is not None]

    # -- selection ------------------------------------------------------------------------

    def pick(
        self,
        now: float,
        *,
        exclude: Collection[str] = (),
        avoid_groups: Collection[str] = (),
        ttft: Callable[[str], float | None],
        outside: Collection[str] = (),
        skipped: list[str] | None = None,
    ) -> str | None:
        """Choose a backend for a new attempt, or None when no usable one is left.

        In panic mode (see `panic`), when no healthy candidate is left, the paused or ejected
        candidate below its `max_concurrency` whose pause or cool-down ends soonest is chosen.
        `exclude`: backends that must not be chosen (those already running an attempt of this
        request). `avoid_groups`: groups to stay out of if any usable candidate lies outside
        them (hedge to another zone or provider). `ttft(name)`: that backend's recent TTFT in
        seconds, None when unknown. An unknown TTFT counts as the better one of the pair
        (explore it), so the comparison then rests on load alone. `outside`: backends the
        request may not use at all (see `panic`); never chosen either. `skipped`: the low
        candidates this choice left out are appended to it (module docstring).
        Does not count the attempt: call `on_start` when it actually starts.
        """
        open_ = [
            b for b in self._backends.values()
            if b.name not in exclude and b.name not in outside and self._has_room(b)
        ]
        healthy, low = self._with_room([b for b in open_ if self._healthy(b, now)], now)
        candidates = self._prefer_elsewhere(healthy, avoid_groups)
        if candidates:
            if skipped is not None:
                skipped.extend(b.name for b in low)
            if len(candidates) == 1:
                return candidates[0].name
            first = self._sample(candidates)
            second = self._sample([b for b in candidates if b is not first])
            return self._better(first, second, ttft).name
        if not open_ or not self.panic(now, outside=outside):
            return None
        roomy, low = self._with_room(open_, now)
        if skipped is not None:
            skipped.extend(b.name for b in low)
        rest = self._prefer_elsewhere(roomy, avoid_groups)
        return min(rest, key=lambda b: (self._ready_at(b, now), b.inflight)).name

    @staticmethod
    def _prefer_elsewhere(
        candidates: list[_Backend], avoid_groups: Collection[str]
    ) -> list[_Backend]:
        """The candidates outside `avoid_groups`, or all of them when none is."""
        if avoid_groups:
            elsewhere = [b for b in candidates if b.group not in avoid_groups]
            if elsewhere:
                return elsewhere
        return candidates

    def _sample(self, candidates: list[_Backend]) -> _Backend:
        if len(candidates) == 1:  # the second of a pair: no draw to make
            return candidates[0]
        weights = [b.weight for b in candidates]
        if sum(weights) <= 0:
            return self._rng.choice(candidates)
        return self._rng.choices(candidates, weights=weights)[0]

    @staticmethod
    def _better(first: _Backend, second: _Backend, ttft: Callable[[str], float | None]) -> _Backend:
        """The candidate with the lower (in-flight + 1) * TTFT; ties go to `first`.

        Ties going to the first sample keeps the choice proportional to the weights when the
        candidates look alike (the common case at low load).
        """
        t1, t2 = ttft(first.name), ttft(second.name)
        known1 = t1 if t1 is not None else (t2 if t2 is not None else 1.0)
        known2 = t2 if t2 is not None else known1
        cost1 = (first.inflight + 1) * max(known1, _TTFT_FLOOR)
        cost2 = (second.inflight + 1) * max(known2, _TTFT_FLOOR)
        if cost2 < cost1 or (cost2 == cost1 and t2 is None and t1 is not None):
            return second
        return first

    # -- events ---------------------------------------------------------------------------

    def on_start(self, name: str) -> int:
        """An attempt starts on the backend. Returns the probe's number when it is the probe
        of an ejected backend (then no other attempt goes there until it ends, outside panic
        mode), else 0; the caller hands it back to `on_finish` for that attempt."""
        b = self._backends[name]
        b.inflight += 1
        if b.ejected_until is not None and not b.probing:
            b.probing = True
            b.probe += 1
            return b.probe
        return 0

    def on_finish(self, name: str, *, probe: int = 0) -> None:
        """An attempt on the backend ended, whatever the outcome (also after cancellation).

        Only the running probe's own end frees the probe slot (`probe`: what `on_start`
        returned for this attempt): an older attempt ending meanwhile, an older probe among
        them (one that won and streams on, while its backend was ejected again and probed
        anew), must not let a second probe in. A probe that ends without a verdict (cancelled
        as a loser) frees the slot, so the next attempt becomes the probe.
        """
        b = self._backends[name]
        if b.inflight > 0:
            b.inflight -= 1
        if probe and probe == b.probe:
            b.probing = False

    def on_success(self, name: str, now: float) -> None:
        """The backend served an attempt: it is healthy; forget failures and ejections."""
        b = self._backends[name]
        b.failures = 0
        b.ejections = 0
        b.ejected_until = None
        b.probing = False

    def on_failure(self, name: str, now: float) -> None:
        """A backend-level failure (connect error, 5xx, ...; the caller decides what counts).

        Failures of attempts that were already running when the backend got ejected, arriving
        during the cool-down, change nothing: the backend is already out. A failure after the
        cool-down (the probe's) ejects again with a doubled cool-down.
        """
        b = self._backends[name]
        b.failures += 1
        if b.ejected_until is not None:
            if now >= b.ejected_until:
                self._eject(b, now)  # the probe slot stays taken until the probe itself ends
            return
        if b.failures >= self._health.eject_after:
            self._eject(b, now)

    def _eject(self, b: _Backend, now: float) -> None:
        b.ejections += 1
        # the exponent is capped so a backend that stays down for days cannot overflow it
        cooldown = self._health.cooldown * 2.0 ** min(b.ejections - 1, 62)
        b.ejected_until = now + min(cooldown, self._health.max_cooldown)

    def capped_pause(self, seconds: float) -> float:
        """A Retry-After's pause as the gateway applies it: at most `max_pause`, never < 0."""
        return min(max(0.0, seconds), self._health.max_pause)

    def pause(self, name: str, seconds: float, now: float) -> None:
        """Keep the backend out of selection (outside panic mode) for `seconds` from `now`, at
        most `max_pause` (from a Retry-After). A shorter pause never cuts a longer one short."""
        b = self._backends[name]
        until = now + self.capped_pause(seconds)
        if b.paused_until is None or until > b.paused_until:
            b.paused_until = until
