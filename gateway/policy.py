"""The hedge delay: how long a request waits for a first token before a hedge (SPEC §5.2).

Pure: no I/O, no asyncio; time comes in as `now` (monotonic seconds).

One `HedgeDelay` per (pool, backend) learns that backend's time-to-first-token (TTFT) and
turns it into a threshold: `clamp(q-quantile of the recent TTFTs, min, max)`. Waiting for the
q-quantile means that only about `1 - q` of requests (the slow tail) ever get a hedge, which is
what keeps duplicates cheap; the clamp stops a very fast backend from hedging almost at once
and a very slow one from never hedging at all.

The threshold is a cached number. `delay()` runs for every request and must be cheap, so the
quantile is recomputed only every `refresh_every` observations, or on a `delay()` call once
`refresh_interval` seconds passed since the last refresh (so that a backend that went quiet
notices its window emptying and falls back to `initial`). Between refreshes the threshold
does not move.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.latency import WindowedSketch
from gateway.settings import DelaySettings

#: the smallest remaining deadline worth starting an attempt for (SPEC §5.3), seconds
MIN_USEFUL_FLOOR = 0.010


def min_useful(median: float | None) -> float:
    """The least remaining time that makes a new attempt worth starting (SPEC §5.3).

    An attempt that cannot reach even the target backend's typical (median) TTFT before the
    deadline would only burn budget; with no data, 10 ms.
    """
    if median is None:
        return MIN_USEFUL_FLOOR
    return max(median, MIN_USEFUL_FLOOR)


class HedgeDelay:
    """The hedge threshold for one backend of one pool, learned from its TTFTs.

    Censored observations: an attempt cancelled before its first token (it lost the race, or
    the client left) never tells us its TTFT, only that the TTFT was *at least* its elapsed
    time. It is added to the sketch at that elapsed time, like any other sample, and counted
    in `censored_count`. Dropping such attempts would remove exactly the slow tail that
    hedging cuts off, pull the quantile down, make hedges fire earlier, which cancels more slow
    attempts, which pulls the quantile further down: a feedback loop towards hedging almost
    every request. Recording the lower bound biases the estimate the safe way (too late
    rather than too early).

    In `fixed` mode the delay is always `settings.value`, but observations are still recorded:
    the median feeds `min_useful` and stats show the TTFT quantiles either way.
    """

    __slots__ = (
        "_adaptive",
        "_median",
        "_refresh_every",
        "_refresh_interval",
        "_refreshed_at",
        "_since_refresh",
        "_sketch",
        "_threshold",
        "censored_count",
        "observations",
        "settings",
    )

    def __init__(
        self,
        settings: DelaySettings,
        *,
        refresh_every: int = 16,
        refresh_interval: float = 1.0,
    ) -> None:
        self.settings = settings
        self._refresh_every = max(1, refresh_every)
        self._refresh_interval = refresh_interval
        self._sketch = WindowedSketch(settings.window)
        self._threshold = settings.value if settings.mode == "fixed" else settings.initial
        self._adaptive = False
        self._median: float | None = None
        self._refreshed_at: float | None = None
        self._since_refresh = 0
        #: every observation since start, censored ones included
        self.observations = 0
        #: observations that were lower bounds (attempt cancelled before its first token)
        self.censored_count = 0

    def adopt(self, settings: DelaySettings) -> HedgeDelay:
        """This backend's delay under reloaded settings: itself when they are unchanged, else
        a delay with the new settings over the same sketch (what was learnt survives). A
        changed `window` starts a fresh sketch: the ring's slices are sized by the window."""
        if settings == self.settings:
            return self
        fresh = HedgeDelay(settings, refresh_every=self._refresh_every,
                           refresh_interval=self._refresh_interval)
        if settings.window == self.settings.window:
            fresh._sketch = self._sketch
            fresh.observations = self.observations
            fresh.censored_count = self.censored_count
        return fresh

    def observe(self, ttft: float, now: float, *, censored: bool = False) -> None:
        """Record one attempt's TTFT, measured from that attempt's own start (seconds).

        `censored=True`: the attempt was cancelled before its first token and `ttft` is its
        elapsed time then, a lower bound (see the class docstring).
        """
        self._sketch.add(ttft, now)
        self.observations += 1
        if censored:
            self.censored_count += 1
        self._since_refresh += 1
        if self._since_refresh >= self._refresh_every:
            self.refresh(now)

    def _maybe_refresh(self, now: float) -> None:
        if self._refreshed_at is None or now - self._refreshed_at > self._refresh_interval:
            self.refresh(now)

    def refresh(self, now: float) -> None:
        """Recompute the threshold and median from the window (normally called internally)."""
        self._refreshed_at = now
        self._since_refresh = 0
        settings = self.settings
        n = self._sketch.count(now)
        if n == 0:
            self._median = None
            high = None
        else:
            high, self._median = self._sketch.quantiles((settings.quantile, 0.5), now)
        if settings.mode == "fixed":
            self._threshold = settings.value
            self._adaptive = False
        elif high is None or n < settings.min_samples:
            self._threshold = settings.initial
            self._adaptive = False
        else:
            self._threshold = min(max(high, settings.min), settings.max)
            self._adaptive = True

    def delay(self, now: float) -> float:
        """The hedge delay in force, in seconds (the cached threshold; cheap)."""
        self._maybe_refresh(now)
        return self._threshold

    def adaptive(self, now: float) -> bool:
        """True when the delay comes from the quantile; False while `initial` applies or in
        `fixed` mode."""
        self._maybe_refresh(now)
        return self._adaptive

    def median(self, now: float) -> float | None:
        """The recent median TTFT as of the last refresh (for `min_useful`); None if no data."""
        self._maybe_refresh(now)
        return self._median

    def samples(self, now: float) -> int:
        """How many observations the window holds now (censored ones included)."""
        return self._sketch.count(now)

    def quantiles(self, qs: Sequence[float], now: float) -> list[float | None]:
        """Recent TTFT quantiles of this backend, for stats (one merge, not cached)."""
        return self._sketch.quantiles(qs, now)
