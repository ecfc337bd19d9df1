"""One request's size, as the race's delays and the cold rule see it. Pure.

The race reads each backend's delay as `delays[name].delay(now)`, `.median(now)` and
`.observe(...)`; `SizedDelays` gives it that same face, answered by the backend's delay for
this request's size class (`gateway.hedge.classes`), so the race knows nothing of sizes. The
size of a request *at a backend* is the input that backend has not cached, which the gateway
can only estimate:

- its whole input (`bytes / 4`) anywhere its conversation has not been;
- at the conversation's home (the first backend of its key's order, where every turn goes
  unless that backend is overloaded or down), only what grew since the conversation's last
  turn (`ConversationMemory`): the rest is in the home's prefix cache.

Why the home and nothing finer: the affinity order is what the gateway acts on, the same in
every worker and after a restart, and it puts a conversation's turns on its home. Which backend
actually answered each earlier turn (a spill, a hedge that won) would say more, but that is a
per-conversation record of backends and outcomes kept in each worker apart; the order says
enough to tell a warm hedge target from a cold one in the case that matters (a spilled primary
whose hedge goes back home).

`ColdRule` is the rule the race asks before a hedge: a target other than the home must prefill
the whole input, and when that prefill alone outlasts what the primary very likely still needs
(`gateway.hedge.prefill.cold_hedge`), the hedge is not sent (counted `cold`). The placement asks
a rule of the same kind before it spills a primary off a loaded home (`ColdRule.spill`): a
conversation whose input would take longer to prefill elsewhere than the wait it could dodge
at home stays home, loaded or not. Bounded load keeps a hot set of conversations from piling
onto one backend; it should not send a 120,000-token history to be prefilled cold (seconds)
to dodge a queue that costs less, nor cache a long first turn where its next turns will not
go.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway.hedge.classes import ClassDelays
from gateway.hedge.prefill import cold_hedge

#: before anything is learnt, a spill of this many input tokens or more is taken as cold: at
#: the prefill rates of the servers we front (a GPU server's thousands of tokens a second, a
#: CPU's hundreds) it costs a second or more, more than bounded load's imbalance is likely to
UNLEARNT_HOLD_TOKENS = 16_384


class DelayReader(Protocol):
    """What the race reads of a backend's delay: `HedgeDelay` itself, or a `ClassView`."""

    def delay(self, now: float) -> float: ...

    def median(self, now: float) -> float | None: ...

    def tail(self, now: float) -> float | None: ...

    def observe(self, ttft: float, now: float, *, censored: bool = False) -> None: ...


@dataclass(frozen=True, slots=True)
class RequestSize:
    """A request's estimated input: all of it, and what its home has not seen."""

    #: estimated input tokens of the whole request
    tokens: int
    #: of those, what the conversation's home backend has not seen (`tokens` when unknown)
    new: int
    #: the first backend of the conversation key's order (None: the request has no key)
    home: str | None = None

    def uncached(self, backend: str) -> int:
        """The input `backend` most likely has to prefill for this request."""
        return self.new if backend == self.home else self.tokens


class ClassView:
    """One backend's delay at one request's size, in the shape the race reads delays.

    `by_size=False` reads the backend's one delay over all requests but still feeds the
    classes, so the cold rule can learn while per-class delays are off.

    `home`: the request's view at its conversation's warm home, when this backend is not it
    (a primary that spilled off a loaded or paused home, a failover). Such a request is hedged
    no later than the home's own delay at the home's size: the hedge goes home first, where
    only the new part needs prefilling, and there it beats a primary that prefills the whole
    history cold (a spilled 120,000-token turn takes seconds more than its home would). That
    holds only while the hedge would go home: the race asks the placement when the hedge is
    due (`Placement.early_hedge`), and one that would go elsewhere waits for `own`."""

    __slots__ = ("by_size", "classes", "home", "tokens")

    def __init__(self, classes: ClassDelays, tokens: int, *, by_size: bool = True,
                 home: ClassView | None = None) -> None:
        self.classes = classes
        self.tokens = tokens
        self.by_size = by_size
        self.home = home

    def delay(self, now: float) -> float:
        own = self.own(now)
        return own if self.home is None or not self.by_size else min(own, self.home.delay(now))

    def own(self, now: float) -> float:
        """This backend's own delay at this size, the home's left out."""
        if not self.by_size:
            return self.classes.overall.delay(now)
        return self.classes.delay(self.tokens, now)

    def median(self, now: float) -> float | None:
        if not self.by_size:
            return self.classes.overall.median(now)
        return self.classes.median(self.tokens, now)

    def tail(self, now: float) -> float | None:
        """The TTFT by which a request of this size has almost surely answered here (q99);
        None while nothing was learnt (a deadline's prediction of the primary)."""
        if not self.by_size:
            return self.classes.overall.tail(now)
        return self.classes.tail(self.tokens, now)

    def observe(self, ttft: float, now: float, *, censored: bool = False) -> None:
        """Into the backend's delay over all requests and into this size's class."""
        self.classes.overall.observe(ttft, now, censored=censored)
        self.classes.observe(self.tokens, ttft, now, censored=censored)


class SizedDelays(Mapping[str, ClassView]):
    """Backend -> its delay at this request's size (a view built per request, lazily)."""

    __slots__ = ("_by_size", "_classes", "_size", "_views")

    def __init__(self, classes: Mapping[str, ClassDelays], size: RequestSize, *,
                 by_size: bool = True) -> None:
        self._classes = classes
        self._size = size
        self._by_size = by_size
        self._views: dict[str, ClassView] = {}

    def __getitem__(self, name: str) -> ClassView:
        view = self._views.get(name)
        if view is None:
            size = self._size
            home = None
            if size.home is not None and name != size.home and size.home in self._classes \
                    and size.new < size.tokens:
                home = self[size.home]
            view = self._views[name] = ClassView(self._classes[name], size.uncached(name),
                                                 by_size=self._by_size, home=home)
        return view

    @property
    def home(self) -> str | None:
        """The request's conversation home (None: no key)."""
        return self._size.home

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)


class ColdRule:
    """Whether a hedge to a target would be cold for this request (see the module
    docstring). Without a fitted prefill rate at the target, or a learnt tail at the
    primary, nothing is known to be cold and the hedge goes ahead as before."""

    __slots__ = ("_classes", "size")

    def __init__(self, classes: Mapping[str, ClassDelays], size: RequestSize) -> None:
        self._classes = classes
        self.size = size

    def cold(self, target: str, primary: str, elapsed: float, now: float) -> bool:
        size = self.size
        if target == size.home and size.new < size.tokens:
            return False  # its home holds the conversation's history: not cold
        target_classes, primary_classes = self._classes.get(target), self._classes.get(primary)
        if target_classes is None or primary_classes is None:
            return False
        prefill = target_classes.cold_prefill(size.uncached(target))
        tail = primary_classes.tail(size.uncached(primary), now)
        if prefill is None or tail is None:
            return False
        return cold_hedge(elapsed=elapsed, primary_tail=tail, cold_prefill=prefill)

    def spill(self, target: str, now: float) -> bool:
        """Whether placing the primary on `target` instead of its home would be cold: the
        whole input prefilled where the conversation's turns do not go costs more than the
        wait it could dodge at the home. A spill pays that prefill once, now (a later turn:
        the history, again) or on the next turn (a first turn: the home never saw it); the
        wait it dodges is at most the home's spread at this size (its q99 over its median,
        queueing and stragglers included). While no rate is fitted at `target` or the home
        has not learnt this size (a pool just started), an input of
        `UNLEARNT_HOLD_TOKENS` or more is held and a shorter one spills. False without a
        key."""
        size = self.size
        home = size.home
        if home is None or target == home:
            return False
        target_classes, home_classes = self._classes.get(target), self._classes.get(home)
        prefill = None if target_classes is None else target_classes.cold_prefill(size.tokens)
        tail = median = None
        if home_classes is not None:
            tail, median = home_classes.tail(size.new, now), home_classes.median(size.new, now)
        if prefill is None or tail is None or median is None:
            return size.tokens >= UNLEARNT_HOLD_TOKENS
        return prefill > tail - median
