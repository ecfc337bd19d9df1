"""The hedge delay per size class of a request's uncached input, for one backend. Pure.

Why per class: a backend's time to first token grows with the input it must prefill, so one
quantile over every request is the wrong delay for nearly all of them. On a pool serving 200-
and 30,000-token turns the q92 of the mixture lands inside the long turns' normal prefill:
short requests wait far longer than their own tail before a hedge, and long ones are hedged
while they are merely prefilling, by copies that must prefill the same input again. Learnt per
class (`gateway.hedge.prefill.size_class`, log2 buckets of estimated uncached tokens), each
delay is the same rule as before (`HedgeDelay`: the budget's quantile, censoring, steering) over
requests that take alike.

A class needs `min_samples` observations of its own, and per backend and class that is slow
to come (a pool of three backends sees a 30,000-token class a fifth as often as the pool does).
Until then it borrows, in this order:
1. from the nearest learnt class at most `BORROW_GAP` classes away (both, averaged, when two
   are equally near), shifted by the backend's fitted prefill rate times the difference in
   tokens: a class twice as long needs about `rate x tokens` more, with the same spread;
2. from all of the backend's requests at once: each observation is also recorded with its
   prefill taken off (`ttft - rate x tokens`, the backend's time without prefill), and the
   class reads that sketch's value plus its own prefill (`rate x tokens`);
3. with no prefill rate fitted yet, from nothing: the backend's one delay over all requests
   applies, as it did before classes (a neighbour's value cannot be moved to another size
   without a rate, and unmoved it would be wrong by the prefill of the difference). Except
   for a size above every size the backend has answered: a delay learnt on shorter requests
   is too early for it by their difference in prefill, unknown without a rate, so it waits
   `delay.max` (the most the configuration allows) until the backend has seen such a size or
   fitted a rate. At a pool's start that is what keeps the first long prompts from being
   copied at `initial`, long before they could have answered.

The rate (`PrefillFit`) is redrawn at every refresh from the medians of the classes with at
least FIT_MIN_SAMPLES observations, so its memory is the classes' own sketches. Everything
here reads what the last `refresh(now)` left, like `HedgeDelay`: per request nothing is
computed beyond picking a class and a shift.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.hedge.delay import HedgeDelay
from gateway.hedge.prefill import PrefillFit, size_class
from gateway.settings import DelaySettings

#: a class's median counts towards the prefill fit from this many observations on
FIT_MIN_SAMPLES = 5
#: a learnt class lends to classes at most this many doublings away
BORROW_GAP = 2
#: weight of each new observation in a class's running mean of tokens
TOKENS_ALPHA = 0.05


class ClassDelays:
    """One backend's delays per size class, beside (never instead of) its one delay over all
    requests (`overall`, the object the stats and the non-classed paths read)."""

    __slots__ = ("_budget_ratio", "_classes", "_tokens", "fit", "overall", "settings",
                 "unprefilled")

    def __init__(self, overall: HedgeDelay, *, budget_ratio: float = 0.1) -> None:
        self.overall = overall
        self.settings: DelaySettings = overall.settings
        self._budget_ratio = budget_ratio
        #: class -> its delay (created at its first observation: at most MAX - MIN + 1)
        self._classes: dict[int, HedgeDelay] = {}
        #: class -> running mean of the tokens observed in it
        self._tokens: dict[int, float] = {}
        #: every observation with its fitted prefill taken off (recorded once a rate is known)
        self.unprefilled = HedgeDelay(self.settings, budget_ratio=budget_ratio)
        #: the backend's prefill line, as of the last refresh (None: under two classes known)
        self.fit: PrefillFit | None = None

    def adopt(self, overall: HedgeDelay, *, budget_ratio: float, now: float) -> ClassDelays:
        """This backend's classes under reloaded delay settings, beside its adopted `overall`:
        what each class learnt carries over (`HedgeDelay.adopt`)."""
        fresh = ClassDelays(overall, budget_ratio=budget_ratio)
        settings = overall.settings
        fresh._classes = {c: d.adopt(settings, budget_ratio=budget_ratio, now=now)
                          for c, d in self._classes.items()}
        fresh._tokens = dict(self._tokens)
        fresh.unprefilled = self.unprefilled.adopt(settings, budget_ratio=budget_ratio, now=now)
        fresh.fit = self.fit
        return fresh

    def observe(self, tokens: int, ttft: float, now: float, *, censored: bool = False) -> None:
        """One attempt's TTFT for a request of `tokens` uncached tokens (estimated), into its
        class (the caller feeds `overall` itself). Censored values follow the class's own
        threshold (`HedgeDelay.observe`) and leave the class's mean of tokens alone."""
        c = size_class(tokens)
        delay = self._classes.get(c)
        if delay is None:
            delay = self._classes[c] = HedgeDelay(self.settings, budget_ratio=self._budget_ratio)
        delay.observe(ttft, now, censored=censored)
        if self.fit is not None:
            self.unprefilled.observe(max(0.0, ttft - self.fit.rate * tokens), now,
                                     censored=censored)
        if not censored:
            mean = self._tokens.get(c)
            self._tokens[c] = float(tokens) if mean is None else \
                mean + TOKENS_ALPHA * (tokens - mean)

    def refresh(self, now: float, win_rate: float | None = None, recorded: int = 0) -> None:
        """Refresh every class (steered like `overall` under `quantile: auto`), then redraw
        the prefill fit through the medians of the classes with enough data."""
        points: list[tuple[float, float, float]] = []
        for c, delay in self._classes.items():
            delay.steer(win_rate, recorded)
            delay.refresh(now)
            median, samples = delay.median(now), delay.samples(now)
            if median is not None and samples >= FIT_MIN_SAMPLES:
                points.append((self._tokens.get(c, float(2**c)), median, float(samples)))
        self.unprefilled.steer(win_rate, recorded)
        self.unprefilled.refresh(now)
        self.fit = PrefillFit.of(points)

    # -- reads --------------------------------------------------------------------------------

    def delay(self, tokens: int, now: float) -> float:
        """The hedge delay for a request of `tokens` uncached tokens whose primary is here."""
        if self.settings.mode == "fixed":
            return self.overall.delay(now)
        value = self._read(tokens, now, lambda d: d.delay(now))
        if value is None:
            return self.settings.max if self._beyond(tokens) else self.overall.delay(now)
        return min(max(value, self.settings.min), self.settings.max)

    def _beyond(self, tokens: int) -> bool:
        """The size is above every size this backend has answered (and it has answered some)."""
        seen = self._tokens
        return bool(seen) and size_class(tokens) > max(seen)

    def median(self, tokens: int, now: float) -> float | None:
        """The typical TTFT here at this size (the balancer's and `min_useful`'s input)."""
        value = self._read(tokens, now, lambda d: d.median(now))
        return self.overall.median(now) if value is None else value

    def tail(self, tokens: int, now: float) -> float | None:
        """The TTFT by which a request of this size has almost surely answered here (q99);
        None while nothing was learnt."""
        value = self._read(tokens, now, lambda d: d.tail(now))
        return self.overall.tail(now) if value is None else value

    def cold_prefill(self, tokens: int) -> float | None:
        """How long prefilling `tokens` uncached tokens takes here (the fitted rate); None
        while no rate is fitted."""
        return None if self.fit is None else self.fit.rate * max(0, tokens)

    def learnt(self, now: float) -> dict[int, HedgeDelay]:
        """The classes with `min_samples` behind them, by class (for stats)."""
        return {c: d for c, d in sorted(self._classes.items()) if d.learnt(now)}

    def _read(self, tokens: int, now: float,
              value: Callable[[HedgeDelay], float | None]) -> float | None:
        """`value` of the request's own class when it has learnt, else borrowed (the module
        docstring's order); None when there is nothing to borrow from."""
        c = size_class(tokens)
        own = self._classes.get(c)
        if own is not None and own.learnt(now):
            return value(own)
        if self.fit is None:
            return None
        rate = self.fit.rate
        for gap in range(1, BORROW_GAP + 1):
            found: list[float] = []
            for near in (c - gap, c + gap):
                delay = self._classes.get(near)
                seen = None if delay is None or not delay.learnt(now) else value(delay)
                if seen is not None:
                    mean = self._tokens.get(near, float(2**near))
                    found.append(max(0.0, seen + rate * (tokens - mean)))
            if found:
                return sum(found) / len(found)
        if self.unprefilled.learnt(now):
            base = value(self.unprefilled)
            if base is not None:
                return base + rate * max(0, tokens)
        return None
