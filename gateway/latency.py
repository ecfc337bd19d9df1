"""Latency quantiles over a sliding time window and over the process lifetime (pure).

This is the only module that imports `ddsketch`: everything else asks for quantiles in
seconds and never sees a sketch, so the library can be swapped or pinned in one place.

Why DDSketch: quantiles with a *relative* error bound (1 % by default) whatever the range,
in bounded memory, and sketches merge exactly. Merging is what makes a sliding window cheap:
keep a ring of sub-sketches, one per time slice, drop a whole slice when it ages out, and merge
the live ones on read. Reads happen when a hedge threshold is refreshed or stats are asked
for, not per request, so the merge cost (a few hundred bins) stays off the hot path.

Two quirks of ddsketch 3.x are handled here rather than by callers:
- a value at (or near) zero lands in a separate zero bucket, and a quantile that falls in it
  comes back as the *int* `0`; values below a microscopic floor that cannot be told apart by
  the log mapping (around 1e-308) stretch the dense store over tens of thousands of bins.
  Every value is therefore raised to `FLOOR` (1 microsecond) before it is added: no latency
  the gateway measures is meaningfully shorter, the store stays a few hundred bins wide,
  and quantiles are always floats.
- NaN or infinite values would corrupt the mapping; they are rejected with ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ddsketch import LogCollapsingLowestDenseDDSketch

#: every recorded value is at least this many seconds (see the module docstring)
FLOOR = 1e-6
#: hard cap on bins per sketch; with FLOOR the data never gets near it, but a bounded store
#: keeps memory bounded whatever happens (collapsing hurts only the lowest quantiles)
_BIN_LIMIT = 2048


def _new_sketch(relative_accuracy: float) -> LogCollapsingLowestDenseDDSketch:
    return LogCollapsingLowestDenseDDSketch(relative_accuracy, bin_limit=_BIN_LIMIT)


def _clean(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"latency must be a finite number of seconds, got {value!r}")
    return value if value > FLOOR else FLOOR


def _read(sketch: LogCollapsingLowestDenseDDSketch, qs: Sequence[float]) -> list[float | None]:
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be within [0, 1], got {q!r}")
    if sketch.count == 0:
        return [None for _ in qs]
    out: list[float | None] = []
    for q in qs:
        value = sketch.get_quantile_value(q)
        out.append(None if value is None else float(value))
    return out


class WindowedSketch:
    """Quantiles of the values added during roughly the last `window` seconds.

    A ring of `slices` sub-sketches, each covering `window / slices` seconds of the clock
    (slice number `floor(now / width)`). A read merges the slices whose number is within the
    last `slices` of the current one, so it sees between `window - width` and `window` seconds
    of history: nothing older than `window` ever counts, and nothing younger than
    `window - width` is ever dropped. A slot is recycled lazily when a value for a newer slice
    lands on it; reads just skip stale slots, so an idle sketch needs no timer to expire.

    The merged sketch is cached until the next `add` or until the clock enters a new slice,
    so several reads at the same moment (delay refresh, stats) cost one merge.
    """

    __slots__ = (
        "_accuracy",
        "_ids",
        "_merged",
        "_merged_at",
        "_sketches",
        "_slices",
        "_width",
        "window",
    )

    def __init__(self, window: float, slices: int = 6, relative_accuracy: float = 0.01) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window!r}")
        if slices < 1:
            raise ValueError(f"slices must be at least 1, got {slices!r}")
        self.window = window
        self._slices = slices
        self._width = window / slices
        self._accuracy = relative_accuracy
        self._sketches = [_new_sketch(relative_accuracy) for _ in range(slices)]
        #: the slice number each slot currently holds (None: never used)
        self._ids: list[int | None] = [None] * slices
        self._merged: LogCollapsingLowestDenseDDSketch | None = None
        self._merged_at: int | None = None

    def _slice(self, now: float) -> int:
        return math.floor(now / self._width)

    def epoch(self, now: float) -> int:
        """The number of the time slice `now` falls in: while it and the values stay the same,
        every read gives the same answer (a reader can skip recomputing)."""
        return self._slice(now)

    def _live(self, current: int) -> list[int]:
        """Slots holding a slice within the window that ends at slice `current`."""
        oldest = current - self._slices + 1
        return [
            slot
            for slot, sid in enumerate(self._ids)
            if sid is not None and oldest <= sid <= current
        ]

    def add(self, value: float, now: float) -> None:
        """Record one latency (seconds, >= 0) observed at time `now`."""
        value = _clean(value)
        sid = self._slice(now)
        slot = sid % self._slices
        held = self._ids[slot]
        if held is None or held < sid:
            self._sketches[slot] = _new_sketch(self._accuracy)
            self._ids[slot] = sid
        elif held > sid:
            # A value stamped older than this slot's slice is older than the whole window as
            # seen from the newest data: it could never be read, so it is dropped.
            return
        self._sketches[slot].add(value)
        self._merged = None

    def _merge(self, now: float) -> LogCollapsingLowestDenseDDSketch:
        current = self._slice(now)
        if self._merged is not None and self._merged_at == current:
            return self._merged
        merged = _new_sketch(self._accuracy)
        for slot in self._live(current):
            merged.merge(self._sketches[slot])
        self._merged = merged
        self._merged_at = current
        return merged

    def quantile(self, q: float, now: float) -> float | None:
        """The q-quantile (0..1) in seconds of the values in the window; None when empty."""
        return _read(self._merge(now), (q,))[0]

    def quantiles(self, qs: Sequence[float], now: float) -> list[float | None]:
        """Several quantiles from one merge; each None when the window is empty."""
        return _read(self._merge(now), qs)

    def count(self, now: float) -> int:
        """How many values the window holds at `now` (no merge: sums slice counts)."""
        return int(sum(self._sketches[slot].count for slot in self._live(self._slice(now))))


class LifetimeSketch:
    """Quantiles over every value added since the process started (for /hedge/stats)."""

    __slots__ = ("_sketch",)

    def __init__(self, relative_accuracy: float = 0.01) -> None:
        self._sketch = _new_sketch(relative_accuracy)

    def add(self, value: float) -> None:
        """Record one latency in seconds (>= 0)."""
        self._sketch.add(_clean(value))

    def quantile(self, q: float) -> float | None:
        return _read(self._sketch, (q,))[0]

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        return _read(self._sketch, qs)

    @property
    def count(self) -> int:
        """How many values were added (a property, unlike `WindowedSketch.count(now)`)."""
        return int(self._sketch.count)


class RecentSketch:
    """Quantiles of roughly the last `capacity` values, however long ago they came (pure).

    The time window of `WindowedSketch` forgets a quiet backend: with fewer values per window
    than a reader needs, it never has enough. This is the fallback that widens the window until
    it holds enough: a ring of `slices` sub-sketches filled by *count*, `per_slice` values each.
    A read merges them all, so it sees between `capacity` and `capacity + per_slice` of the
    newest values once that many were ever added. Memory is bounded by the slice count.
    """

    __slots__ = ("_accuracy", "_current", "_merged", "_per_slice", "_sketches")

    def __init__(self, capacity: int, slices: int = 4, relative_accuracy: float = 0.01) -> None:
        if capacity < 1 or slices < 2:
            raise ValueError(f"need capacity >= 1 and slices >= 2, got {capacity}, {slices}")
        self._per_slice = -(-capacity // (slices - 1))  # ceil: slices-1 full ones hold capacity
        self._accuracy = relative_accuracy
        self._sketches = [_new_sketch(relative_accuracy) for _ in range(slices)]
        self._current = 0
        self._merged: LogCollapsingLowestDenseDDSketch | None = None

    def add(self, value: float) -> None:
        """Record one latency in seconds (>= 0); the oldest slice is recycled when full."""
        value = _clean(value)
        if self._sketches[self._current].count >= self._per_slice:
            self._current = (self._current + 1) % len(self._sketches)
            self._sketches[self._current] = _new_sketch(self._accuracy)
        self._sketches[self._current].add(value)
        self._merged = None

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        """Several quantiles from one merge (cached until the next add)."""
        if self._merged is None:
            merged = _new_sketch(self._accuracy)
            for sketch in self._sketches:
                merged.merge(sketch)
            self._merged = merged
        return _read(self._merged, qs)

    @property
    def count(self) -> int:
        """How many values the ring holds (at most capacity + one slice)."""
        return int(sum(sketch.count for sketch in self._sketches))
