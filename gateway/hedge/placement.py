"""Where one request's attempts go: its options, and the choice of a backend for each attempt.

The race (`gateway.hedge.race`) decides *when* an attempt starts and which one commits; this
decides *where*: the first fitting backend in the conversation key's order when the request
has one (`gateway.hedge.affinity`), else the balancer's choice; never a backend the request may
not use; a backend low on quota headroom only while no other has room; a hedge to another
zone than the attempts running, a failover anywhere but where one is running. It also notes,
for the stats, how the primary was placed (affinity hit, spill), whether a choice ran in
panic mode and which backends were skipped for headroom. No event loop: times are numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from gateway.hedge.affinity import AffinityRoute, Outcome
from gateway.hedge.attempt import AttemptRecord
from gateway.hedge.budget import SuppressReason
from gateway.hedge.deadline import KeyShare
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.sizing import ColdRule, DelayReader, SizedDelays

#: a race never starts more attempts than this, whatever `max_attempts` says
MAX_ATTEMPTS_CAP = 5
#: a loaded home keeps a conversation whose spill would be cold only while its attempts in
#: flight are under this many times its bounded load
HOLD_LOAD_FACTOR = 2


@dataclass(slots=True)
class RaceOptions:
    deadline: float
    #: the latency trackers this request's attempts feed and take their delay from (per
    #: backend; at the request's size class when it has one: `gateway.hedge.sizing`)
    delays: Mapping[str, DelayReader]
    #: delay-triggered hedges allowed for this request (pool switch, opt-outs, safety rules)
    hedging: bool
    #: when hedging was refused for this request, the reason counted once (`disabled`)
    refused_reason: SuppressReason | None = None
    #: backends this request may not use: they do not serve its route, the request is
    #: pinned to the backend that holds its stored state, or (added by `Placement.pick`)
    #: their translation refuses the request
    excluded: frozenset[str] = frozenset()
    #: False: this request's attempt times are not latency samples (a read of stored state)
    learn: bool = True
    #: the request's conversation key and its order over the pool: the primary, hedges and
    #: failovers go to the first fitting backend in it (None: load-based selection)
    affinity: AffinityRoute | None = None
    #: whether a hedge to a backend would prefill cold for nothing (None: no such rule)
    cold: ColdRule | None = None
    #: the request's estimated input tokens: the budget's deposit and each extra attempt's price
    input_tokens: int = 0
    #: the request's time-to-first-token objective, seconds (None: none): a primary whose
    #: learnt tail would miss it is hedged earlier (`gateway.hedge.deadline`)
    objective: float | None = None
    #: the key's share of the hedge budget that pays for those early hedges (None: the
    #: request has no named key, and an objective sends no early hedge)
    share: KeyShare | None = None
    #: the key's own budget ratio, its share's deposit per request (None: the pool's)
    share_ratio: float | None = None
    #: whether an attempt may go to a backend, asked of each backend picked (None: every
    #: one not excluded may): a backend reached by translation is translated for then, and
    #: one whose translation refuses the request is passed over (`gateway.hedge.plan`)
    admits: Callable[[str], bool] | None = None
    #: False: the race deposits nothing in the budget (a continuation's: its request did)
    deposit: bool = True
    #: affinity applies to the request but it has no conversation key: its primary is a
    #: miss (counted as such: `Placement.affinity`)
    affinity_miss: bool = False


@dataclass(slots=True)
class Placement:
    """The backend choices of one request, and what the stats count of them."""

    pool: PoolRuntime
    options: RaceOptions
    #: some backend choice of this request ran in panic mode (counted per pool)
    panic: bool = False
    #: how the primary was chosen by affinity (None: affinity off for this pool)
    affinity: Outcome | None = None
    #: the backends a choice of this request left out for low quota headroom, once per choice
    headroom_skips: list[str] = field(default_factory=list)
    #: the backends of every kind that rejected this request's body (400/413/422): backends
    #: of one kind (one provider: one API's checks) judge a body alike, so no attempt goes
    #: to them
    judged: set[str] = field(default_factory=set)
    #: the primary stayed on its loaded home because a spill would have prefilled cold
    held_home: bool = False

    def primary(self, now: float) -> str | None:
        delays = self.options.delays
        return self.pick(now, first=True, ttft=lambda name: delays[name].median(now))

    def extra(self, now: float, running: Collection[AttemptRecord],
              tried: Collection[AttemptRecord], *, hedge: bool) -> str | None:
        """The backend of a hedge or a failover: one not tried yet, in another zone than the
        attempts running; a failover may go back to a backend tried before (not one running)."""
        in_flight = {r.backend for r in running}
        groups = {self.pool.groups[b] for b in in_flight}

        def ttft(name: str) -> float | None:
            return self.options.delays[name].median(now)

        judged = self.judged
        backend = self.pick(now, first=False,
                            exclude=in_flight | judged | {r.backend for r in tried},
                            avoid_groups=groups, ttft=ttft)
        if backend is None and not hedge:
            backend = self.pick(now, first=False, exclude=in_flight | judged, ttft=ttft)
        return backend

    def early_hedge(self, timed: AttemptRecord, running: Collection[AttemptRecord],
                    tried: Collection[AttemptRecord], now: float) -> float | None:
        """When a hedge due now must wait, else None (it goes now).

        `timed` is the attempt whose delay is in force (the primary, or the latest
        failover). Away from its conversation's warm home it reads the home's shorter delay
        (`ClassView`), because the hedge was to go home, where only the new part needs
        prefilling. That holds only while the hedge would go home: when the choice made now
        would send it elsewhere (the home still loaded, paused, low on headroom, or the
        attempt that failed there), the copy is as cold as `timed` and is sent no earlier
        than `timed`'s own delay at its size, the time returned. The choice is asked as
        `extra` would make it, counting nothing."""
        delays, route = self.options.delays, self.options.affinity
        if route is None or not isinstance(delays, SizedDelays) or delays.home is None:
            return None
        view = delays[timed.backend]
        if view.home is None:
            return None
        due = timed.started + view.own(now)
        if now >= due:
            return None
        in_flight = {r.backend for r in running}
        target = self._in_order(route, now,
                                in_flight | self.judged | {r.backend for r in tried},
                                {self.pool.groups[b] for b in in_flight}, first=False,
                                count=False)
        return None if target == delays.home else due

    def rejected_by(self, backend: str) -> None:
        """`backend` rejected the request's body: leave out every backend of its kind."""
        kinds = _kinds(self.pool)
        self.judged.update(name for name, kind in kinds.items() if kind == kinds[backend])

    def may_judge(self, backend: str) -> bool:
        """`backend` is of a kind that has not rejected the body (it may still serve it)."""
        return backend not in self.judged

    def unjudged_left(self) -> bool:
        """Some backend this request may use is of a kind that has not rejected its body."""
        outside = self.options.excluded
        return any(name not in outside and name not in self.judged
                   for name in self.pool.balancer.names)

    def max_attempts(self) -> int:
        configured = min(self.pool.settings.hedging.max_attempts, MAX_ATTEMPTS_CAP)
        eligible = len(self.pool.settings.backends) - len(self.options.excluded)
        return max(1, min(configured, eligible))

    def cold(self, backend: str, running: Collection[AttemptRecord], now: float) -> bool:
        """The cold rule for a hedge to `backend`, against the oldest attempt running."""
        rule = self.options.cold
        oldest = min(running, key=lambda r: r.started, default=None)
        if rule is None or oldest is None:
            return False
        return rule.cold(backend, oldest.backend, now - oldest.started, now)

    def pick(
        self,
        now: float,
        *,
        first: bool,
        exclude: Collection[str] = (),
        avoid_groups: Collection[str] = (),
        ttft: Callable[[str], float | None],
    ) -> str | None:
        """`Balancer.pick`, noting whether the choice was made in panic mode (for stats), and
        never a backend this request may not use (`RaceOptions.excluded`), nor one that does
        not admit it (`RaceOptions.admits`: then added to the request's `excluded`, as routing
        would have left it out had it translated up front, and the choice made again).

        A refusing backend is excluded, not judged: it is no member of this request's pool, so
        its health must not keep the pool out of panic mode (the backends left may all be
        unhealthy) and it must not count toward `max_attempts`."""
        chosen = self._pick(now, first=first, exclude=exclude, avoid_groups=avoid_groups,
                            ttft=ttft)
        admits = self.options.admits
        while chosen is not None and admits is not None and not admits(chosen):
            self.options.excluded = self.options.excluded | {chosen}
            chosen = self._pick(now, first=first, exclude=exclude, avoid_groups=avoid_groups,
                                ttft=ttft)
        return chosen

    def _pick(self, now: float, *, first: bool, exclude: Collection[str],
              avoid_groups: Collection[str], ttft: Callable[[str], float | None]
              ) -> str | None:
        outside = self.options.excluded
        self.panic = self.panic or self.pool.balancer.panic(now, outside=outside)
        route = self.options.affinity
        if route is not None:
            chosen = self._in_order(route, now, exclude, avoid_groups, first=first)
            if chosen is not None:
                return chosen
        return self.pool.balancer.pick(now, exclude=exclude, avoid_groups=avoid_groups, ttft=ttft,
                                       outside=outside, skipped=self.headroom_skips)

    def _in_order(self, route: AffinityRoute, now: float, exclude: Collection[str],
                  avoid_groups: Collection[str], *, first: bool, count: bool = True
                  ) -> str | None:
        """The first fitting backend in the key's order (`AffinityRoute.choose`); the
        primary's choice is counted as a hit or a spill. A low backend is passed over as an
        unusable one is while another candidate has room: a spill, and a headroom skip
        (`count=False`: a choice only asked about, not made, counts no skip)."""
        balancer, outside = self.pool.balancer, self.options.excluded
        members = [n for n in balancer.names if n not in outside]
        inflight = {n: balancer.inflight(n) for n in members}
        usable, low = balancer.prefer_room(
            [n for n in balancer.usable(now) if n not in exclude and n not in outside], now)
        if count:
            self.headroom_skips += low
        chosen = route.choose(usable, inflight, members=members,
                              exclude={*exclude, *outside}, avoid_groups=avoid_groups,
                              groups=self.pool.groups)
        if first and chosen is not None:
            chosen = self._held_home(route, chosen, usable, inflight, members, now)
        if first:
            self.affinity = "spill" if chosen is None else route.outcome(chosen, members)
        return chosen

    def _held_home(self, route: AffinityRoute, chosen: str, usable: Collection[str],
                   inflight: Mapping[str, int], members: Collection[str], now: float) -> str:
        """The primary's home instead of `chosen` when bounded load alone spilled it (the home
        is usable, and under twice its bound: a pile-up past that spills whatever it costs)
        and the spill would be cold (`ColdRule.spill`): a long history prefilled elsewhere
        costs more than the home's queue is likely to."""
        rule = self.options.cold
        home = None if rule is None else rule.size.home
        if rule is None or home is None or home == chosen or home not in usable:
            return chosen
        if inflight.get(home, 0) >= HOLD_LOAD_FACTOR * route.capacity(home, inflight, members):
            return chosen
        self.held_home = rule.spill(chosen, now)
        return home if self.held_home else chosen


def _kinds(pool: PoolRuntime) -> dict[str, str]:
    """Backend -> its kind: its provider, whose API checks a body (read only on a rejection,
    so no request pays for it otherwise)."""
    return {b.name: b.provider for b in pool.settings.backends}
