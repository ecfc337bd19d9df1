"""The hedge delay: how long a request waits for a first token before a hedge.

Pure: no I/O, no asyncio; time comes in as `now` (monotonic seconds).

One `HedgeDelay` per (pool, backend) learns that backend's time-to-first-token (TTFT) and
turns it into a threshold: `clamp(q-quantile of the recent TTFTs, min, max)`. Waiting for the
q-quantile means that only about `1 - q` of requests (the slow tail) ever get a hedge, which is
what keeps duplicates cheap; the clamp stops a very fast backend from hedging almost at once
and a very slow one from never hedging at all.

Which quantile (`delay.quantile`): a number pins it. `auto` (the default) derives it from
the pool's hedge budget: `q = 1 - 0.8 x ratio`, so the delay targets the hedge rate the budget
pays for (8 % of requests at the default ratio 0.1) and leaves a fifth of the budget to failure
replacements. A fixed q95 breaks once more than 5 % of requests straggle: the quantile then
lands inside the slow mode and every hedge starts after the straggler would have answered.
Tying q to the budget spends what the operator already agreed to pay, and no more. With few
stragglers most of those hedges would be wasted, so auto also moves q later while the pool's
hedges mostly lose (`HedgeDelay.steer`), never earlier than the budget's quantile.

The threshold is a cached number, recomputed only by `refresh(now)`: never on the request path. The
shell calls `refresh` periodically (`gateway.app` runs one task for every
pool); `delay()`, `median()` and `adaptive()` only read what the last refresh left.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.hedge.latency import RecentSketch, WindowedSketch
from gateway.settings import DelaySettings

#: the smallest remaining deadline worth starting an attempt for, seconds
MIN_USEFUL_FLOOR = 0.010
#: `quantile: auto` keeps this share of the hedge budget for failure replacements
FAILOVER_SHARE = 0.2
#: the auto quantile stays within these bounds, whatever the budget ratio: below the median a
#: hedge would be the rule rather than the exception; above 0.995 the window holds too few
#: samples past the threshold to place it
AUTO_QUANTILE_RANGE = (0.5, 0.995)
#: auto's feedback on the pool's recent hedge win rate: below LOW, most hedges go to requests
#: the primary still wins (the tail is thin: few stragglers), so the delay moves later; above
#: HIGH, hedges pay off and it moves back towards the budget's quantile, one step per refresh
#: that saw new hedge outcomes. LOW is above the efficacy guard's default (0.15), so that a
#: thin tail makes the delay later rather than tripping the guard.
AUTO_WIN_LOW = 0.35
AUTO_WIN_HIGH = 0.55
#: the factor applied to the hedged share (1 - q) per step
AUTO_STEP = 0.85
#: the fallback for a quiet window keeps at least this many of the newest samples: a tail
#: quantile of only `min_samples` (20) values would be little more than their maximum
RECENT_SAMPLES = 100
#: the TTFT by which an attempt has almost surely answered (`HedgeDelay.tail`): what the
#: cold-hedge rule compares a copy's prefill with
TAIL_QUANTILE = 0.99


def min_useful(median: float | None) -> float:
    """The least remaining time that makes a new attempt worth starting.

    An attempt that cannot reach even the target backend's typical (median) TTFT before the
    deadline would only burn budget; with no data, 10 ms.
    """
    if median is None:
        return MIN_USEFUL_FLOOR
    return max(median, MIN_USEFUL_FLOOR)


def auto_quantile(ratio: float) -> float:
    """The quantile `delay.quantile: auto` puts in force for a budget `ratio`.

    The hedge rate a q-quantile delay produces is `1 - q` of requests; the budget pays for
    `ratio` extra attempts per request, a fifth of which is kept for failovers.
    """
    low, high = AUTO_QUANTILE_RANGE
    return min(max(1.0 - (1.0 - FAILOVER_SHARE) * ratio, low), high)


class HedgeDelay:
    """The hedge threshold for one backend of one pool, learned from its TTFTs.

    Censored observations: an attempt cancelled before its first token (it lost the race, or
    the client left) never tells us its TTFT, only that it was *at least* its elapsed time.
    Such a lower bound is recorded only when it reaches the threshold in force; below it, it
    is dropped (counted in `censored_dropped`). Why that rule:

    - the delay is the point with `1 - q` of the samples above it, so what it needs is the
      right *count* of samples above the threshold. A primary hedged at the threshold and then
      cancelled has a TTFT above it; its lower bound (threshold plus the hedge's TTFT) is above
      it too, so the count is kept even though the value is too low;
    - a lower bound under the threshold (a losing hedge cancelled after 10 ms, a client that
      left after 5 ms) says nothing about the count above it, yet adds a sample below it:
      recorded, it would pull the quantile and the median down and hedges would fire ever
      earlier;
    - dropping every censored sample would be worse still: the slow tail that hedging cuts
      off would vanish from the window, the quantile would fall, more requests would be hedged
      and cancelled, and so on towards hedging almost every request.

    With this rule the threshold's fixed point is the true q-quantile of the backend's TTFT:
    when more than `1 - q` of the samples sit above the threshold, the next refresh moves it
    up, and when fewer do, down. The values above the threshold are biased low, so after a
    rise in slowness the threshold climbs over a few refreshes rather than at once, and it
    settles where the hedge rate is `1 - q` instead of creeping on. That is what `auto`
    relies on: its `1 - q` is the hedge rate the budget pays for.

    Quiet backends: `min_samples` are needed before the quantile counts. When the time window
    holds fewer (a pool with a few requests a minute), the quantile comes from the newest
    values however old they are (`RecentSketch`, at least RECENT_SAMPLES of them once that
    many came), so a quiet pool leaves `initial` after its first `min_samples` requests and
    keeps what it learned while idle.

    In `fixed` mode the delay is always `settings.value`, but observations are still recorded:
    the median feeds `min_useful` and stats show the TTFT quantiles either way.
    """

    __slots__ = (
        "_adaptive",
        "_added",
        "_base_tail",
        "_budget_ratio",
        "_epoch",
        "_learnt",
        "_median",
        "_recent",
        "_sketch",
        "_steered_at",
        "_tail",
        "_threshold",
        "censored_count",
        "censored_dropped",
        "observations",
        "quantile",
        "settings",
    )

    def __init__(self, settings: DelaySettings, *, budget_ratio: float = 0.1) -> None:
        self.settings = settings
        self._budget_ratio = budget_ratio
        #: the quantile in force: the configured one, or under auto, between
        #: `auto_quantile(budget_ratio)` and the top of AUTO_QUANTILE_RANGE (see `steer`)
        self.quantile = (
            auto_quantile(budget_ratio) if settings.quantile == "auto" else settings.quantile
        )
        #: auto: the largest share of requests the delay may target (1 - the budget's quantile)
        self._base_tail = 1.0 - self.quantile
        self._steered_at = 0
        self._sketch = WindowedSketch(settings.window)
        self._recent = RecentSketch(max(settings.min_samples, RECENT_SAMPLES))
        self._threshold = settings.value if settings.mode == "fixed" else settings.initial
        self._adaptive = False
        self._learnt = False
        self._median: float | None = None
        self._tail: float | None = None
        #: observations added since the last refresh, and the window slice it ran in
        self._added = 0
        self._epoch: int | None = None
        #: observations recorded since start, censored ones included
        self.observations = 0
        #: recorded observations that were lower bounds (attempt cancelled before a token)
        self.censored_count = 0
        #: lower bounds under the threshold in force, not recorded (see the class docstring)
        self.censored_dropped = 0

    def adopt(self, settings: DelaySettings, *, budget_ratio: float, now: float) -> HedgeDelay:
        """This backend's delay under reloaded settings: itself when nothing changed, else a
        delay with the new settings over the same samples (what was learnt survives), already
        refreshed so the reload never falls back to `initial`. A changed `window` starts a
        fresh sketch: the ring's slices are sized by the window. The auto quantile's steering
        carries over while the rule and the budget's ratio stay the same."""
        same_rule = (settings.quantile == self.settings.quantile
                     and budget_ratio == self._budget_ratio)
        if settings == self.settings and same_rule:
            return self
        fresh = HedgeDelay(settings, budget_ratio=budget_ratio)
        if settings.window == self.settings.window:
            fresh._sketch = self._sketch
            fresh._recent = self._recent
            fresh.observations = self.observations
            fresh.censored_count = self.censored_count
            fresh.censored_dropped = self.censored_dropped
        if same_rule:
            fresh.quantile, fresh._steered_at = self.quantile, self._steered_at
        fresh.refresh(now)
        return fresh

    def observe(self, ttft: float, now: float, *, censored: bool = False) -> None:
        """Record one attempt's TTFT, measured from that attempt's own start (seconds).

        `censored=True`: the attempt was cancelled before its first token and `ttft` is its
        elapsed time then, a lower bound, kept only if it reaches the threshold in force.
        Cheap: two sketch inserts, no quantile.
        """
        if censored:
            if ttft < self._threshold:
                self.censored_dropped += 1
                return
            self.censored_count += 1
        self._sketch.add(ttft, now)
        self._recent.add(ttft)
        self.observations += 1
        self._added += 1

    def steer(self, win_rate: float | None, recorded: int) -> None:
        """`quantile: auto` only: move the quantile on the pool's recent hedge win rate.

        `win_rate` is the budget's (the efficacy guard's window), `recorded` its count of hedge
        outcomes so far: nothing moves unless new outcomes arrived since the last step, so a
        pool that stopped hedging does not drift. Why steer at all: the budget's quantile is
        the earliest delay the budget pays for, and early is right when stragglers fill the
        hedged share (most hedges win). When they do not (a thin tail: 1 % stragglers and a q92
        delay hedge seven requests in eight for nothing), the hedges are waste, and a win rate
        that low would also trip the efficacy guard, which then stops the hedges that did
        help. Moving the delay later raises the win rate; the hedge rate never exceeds the
        budget's share.
        """
        if self.settings.quantile != "auto" or win_rate is None or recorded == self._steered_at:
            return
        self._steered_at = recorded
        tail = 1.0 - self.quantile
        if win_rate < AUTO_WIN_LOW:
            tail = max(tail * AUTO_STEP, 1.0 - AUTO_QUANTILE_RANGE[1])
        elif win_rate > AUTO_WIN_HIGH:
            tail = min(tail / AUTO_STEP, self._base_tail)
        else:
            return
        if tail != 1.0 - self.quantile:
            self.quantile = 1.0 - tail
            self._epoch = None  # recompute at the next refresh

    def refresh(self, now: float) -> None:
        """Recompute the threshold and median (a merge of the window's sketches).

        Called off the request path by the shell's periodic refresher; a no-op when nothing
        was added and the window did not move since the last call.
        """
        epoch = self._sketch.epoch(now)
        if self._added == 0 and epoch == self._epoch:
            return
        self._added, self._epoch = 0, epoch
        settings = self.settings
        high: float | None = None
        qs = (self.quantile, 0.5, TAIL_QUANTILE)
        if self._sketch.count(now) >= settings.min_samples:
            high, self._median, self._tail = self._sketch.quantiles(qs, now)
        elif self._recent.count >= settings.min_samples:
            high, self._median, self._tail = self._recent.quantiles(qs)
        else:
            self._median = self._sketch.quantiles((0.5,), now)[0]
            if self._median is None:
                self._median = self._recent.quantiles((0.5,))[0]
            self._tail = None
        self._learnt = high is not None
        if settings.mode == "fixed":
            self._threshold = settings.value
            self._adaptive = False
        elif high is None:
            self._threshold = settings.initial
            self._adaptive = False
        else:
            self._threshold = min(max(high, settings.min), settings.max)
            self._adaptive = True

    def delay(self, now: float) -> float:
        """The hedge delay in force, in seconds, as of the last refresh.

        `now` is accepted so that callers need not know when that was; nothing is computed.
        """
        return self._threshold

    def adaptive(self, now: float) -> bool:
        """True when the delay comes from the quantile; False while `initial` applies or in
        `fixed` mode (as of the last refresh)."""
        return self._adaptive

    def learnt(self, now: float) -> bool:
        """True when the last refresh had `min_samples` observations, in either mode: the
        quantiles (`tail`) come from data."""
        return self._learnt

    def tail(self, now: float) -> float | None:
        """The recent TAIL_QUANTILE (q99) as of the last refresh; None until `learnt`."""
        return self._tail

    def median(self, now: float) -> float | None:
        """The recent median TTFT as of the last refresh (for `min_useful` and the balancer);
        None before any data."""
        return self._median

    def samples(self, now: float) -> int:
        """How many observations the time window holds now (censored ones included)."""
        return self._sketch.count(now)

    def quantiles(self, qs: Sequence[float], now: float) -> list[float | None]:
        """Recent TTFT quantiles of this backend, for stats (one merge, not cached)."""
        return self._sketch.quantiles(qs, now)
