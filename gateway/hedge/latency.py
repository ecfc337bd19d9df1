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
from collections.abc import Mapping, Sequence
from typing import Any

from ddsketch import LogCollapsingLowestDenseDDSketch
from ddsketch.ddsketch import BaseDDSketch
from ddsketch.mapping import LogarithmicMapping
from ddsketch.store import CollapsingLowestDenseStore

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


def state_of(sketch: BaseDDSketch, relative_accuracy: float) -> dict[str, Any]:
    """A sketch in its mergeable, JSON-able form: the relative accuracy, the zero bucket and
    the non-empty bins as `[key, count]` pairs. Two states of the same accuracy merge exactly
    (bins add up), which is what lets separate processes report as one.

    ddsketch 3.x has no public accessor for its bins short of protobuf, so this reads the
    positive store's dense array; values are floored above zero (`FLOOR`), so the negative
    store is always empty."""
    store = sketch._store
    return {
        "accuracy": relative_accuracy,
        "zero": float(sketch._zero_count),
        "bins": [[store.offset + i, c] for i, c in enumerate(store.bins) if c],
    }


def merge_states(states: Sequence[Mapping[str, Any]],
                 relative_accuracy: float = 0.01) -> dict[str, Any]:
    """The state of the union of the values of `states` (bins added up, exact).

    ValueError if a state is malformed or of another accuracy (those cannot merge)."""
    zero = 0.0
    bins: dict[int, float] = {}
    for state in states:
        if state.get("accuracy") != relative_accuracy:
            raise ValueError(f"sketch accuracy {state.get('accuracy')!r} is not "
                             f"{relative_accuracy!r}")
        zero += _weight(state.get("zero", 0.0), allow_zero=True)
        for pair in state.get("bins", ()):
            key, count = pair
            if not isinstance(key, int) or isinstance(key, bool):
                raise ValueError(f"sketch bin key {key!r} is not an integer")
            bins[key] = bins.get(key, 0.0) + _weight(count)
    return {"accuracy": relative_accuracy, "zero": zero,
            "bins": [[key, bins[key]] for key in sorted(bins)]}


def _weight(value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"sketch count {value!r} is not a positive number")
    return float(value)


def sketch_of(state: Mapping[str, Any]) -> BaseDDSketch:
    """A sketch holding the values a state describes (for `merge` into a live one or for
    quantiles). ValueError if the state is malformed."""
    accuracy = state.get("accuracy")
    if not isinstance(accuracy, float) or not 0.0 < accuracy < 1.0:
        raise ValueError(f"sketch accuracy {accuracy!r} is not within (0, 1)")
    clean = merge_states([state], accuracy)
    store = CollapsingLowestDenseStore(_BIN_LIMIT)
    for key, count in clean["bins"]:
        store.add(key, count)
    return BaseDDSketch(
        mapping=LogarithmicMapping(accuracy),
        store=store,
        negative_store=CollapsingLowestDenseStore(_BIN_LIMIT),
        zero_count=clean["zero"],
    )


def quantiles_of(state: Mapping[str, Any], qs: Sequence[float]) -> list[float | None]:
    """Quantiles (seconds) of the values a state describes; None each when it is empty."""
    return _read(sketch_of(state), qs)


def _read(sketch: BaseDDSketch, qs: Sequence[float]) -> list[float | None]:
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

    def _slot(self, now: float) -> int | None:
        """The slot for values observed at `now`, recycled if it held an older slice; None
        when `now` is older than the slot's slice (older than the whole window as seen from
        the newest data: such a value could never be read, so it is dropped)."""
        sid = self._slice(now)
        slot = sid % self._slices
        held = self._ids[slot]
        if held is None or held < sid:
            self._sketches[slot] = _new_sketch(self._accuracy)
            self._ids[slot] = sid
        elif held > sid:
            return None
        return slot

    def add(self, value: float, now: float) -> None:
        """Record one latency (seconds, >= 0) observed at time `now`."""
        value = _clean(value)
        slot = self._slot(now)
        if slot is None:
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

    def state(self, now: float) -> dict[str, Any]:
        """The window's values at `now` in mergeable form (see `state_of`)."""
        return state_of(self._merge(now), self._accuracy)

    def absorb(self, state: Mapping[str, Any], now: float) -> None:
        """Add the values of a mergeable state as if they had been observed at `now`."""
        other = sketch_of(state)
        slot = self._slot(now)
        if slot is None or other.count == 0:
            return
        self._sketches[slot].merge(other)
        self._merged = None

    def count(self, now: float) -> int:
        """How many values the window holds at `now` (no merge: sums slice counts)."""
        return int(sum(self._sketches[slot].count for slot in self._live(self._slice(now))))


class LifetimeSketch:
    """Quantiles over every value added since the process started (for /hedge/stats)."""

    __slots__ = ("_accuracy", "_sketch")

    def __init__(self, relative_accuracy: float = 0.01) -> None:
        self._accuracy = relative_accuracy
        self._sketch = _new_sketch(relative_accuracy)

    def add(self, value: float) -> None:
        """Record one latency in seconds (>= 0)."""
        self._sketch.add(_clean(value))

    def quantile(self, q: float) -> float | None:
        return _read(self._sketch, (q,))[0]

    def state(self) -> dict[str, Any]:
        """Every value so far in mergeable form (see `state_of`)."""
        return state_of(self._sketch, self._accuracy)

    def absorb(self, state: Mapping[str, Any]) -> None:
        """Add the values of a mergeable state."""
        other = sketch_of(state)
        if other.count:
            self._sketch.merge(other)

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
