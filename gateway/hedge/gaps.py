"""How long a backend's streams go without a token, and the stall delay that follows (pure).

After commit a stream is late when no token has come for longer than its backend's streams
usually go: the stall delay. Measuring every gap between tokens would be work per event on
the hot path; the relay instead keeps, per stream, its longest gap (one subtraction and one
comparison per upstream read) and hands it here once, when the stream ends normally, so the
sketch gets one value per stream. A stream in which a stall was declared is left out: its
longest gap is the stall itself, and counting it would teach the backend that stalls are
normal.

The delay is a high quantile (`QUANTILE`) of those longest gaps, times `MARGIN`, clamped to
`hedging.stall.min` .. `max`; with fewer than `MIN_SAMPLES` streams in the window it is
`min`; it is computed once per slice of the window (50 s), not per stream. Memory is one
windowed sketch per backend (bounded bins), whatever the traffic; the
clock is a parameter.
"""

from __future__ import annotations

from gateway.hedge.latency import WindowedSketch

#: the quantile of per-stream longest gaps the delay follows
QUANTILE = 0.95
#: how much longer than that a gap must be to be a stall
MARGIN = 2.0
#: streams in the window before the quantile is trusted
MIN_SAMPLES = 20
#: how far back streams count, seconds
WINDOW = 300.0


class GapSketch:
    """One backend's recent streams' longest gaps between tokens."""

    __slots__ = ("_cached", "_sketch")

    def __init__(self, window: float = WINDOW) -> None:
        self._sketch = WindowedSketch(window)
        #: (time slice, low, high, delay): the delay is read once per stream, and a merge
        #: of the window's sketches per read would cost more than the stream's relay; it is
        #: recomputed when the clock enters a new slice of the window (or the clamps change)
        self._cached: tuple[int, float, float, float] | None = None

    def observe(self, longest_gap: float, now: float) -> None:
        """A stream of this backend ended normally; its longest gap was `longest_gap`."""
        self._sketch.add(longest_gap, now)

    def delay(self, low: float, high: float, now: float) -> float:
        """The stall delay at `now`, clamped to `low`..`high` (`low` until enough streams);
        the same for the whole of a time slice of the window (see `_cached`)."""
        epoch = self._sketch.epoch(now)
        cached = self._cached
        if cached is not None and cached[:3] == (epoch, low, high):
            return cached[3]
        if self._sketch.count(now) < MIN_SAMPLES:
            value = low
        else:
            q = self._sketch.quantile(QUANTILE, now)
            value = low if q is None else min(high, max(low, q * MARGIN))
        self._cached = (epoch, low, high, value)
        return value
