"""The dashboard's time series: one point per pool per second, the last 10 minutes. Pure.

`GET /hedge/series` serves it (`gateway.dashboard`); a sampler task calls `sample(now)` once a
second, off the request path: requests never touch the series. A point reads what `Stats` and
the live pools already hold, so it costs a few sketch reads per second, whatever the traffic.

Per pool, each point (`seq` counts points, `t` is seconds since the gateway started):
- rates over the interval since the previous point, per second: `requests`, `hedges_started`,
  `hedges_won`, `failovers`, `suppressed.<reason>`, `tokens_input`, `tokens_output`,
  `hedge_input_tokens` (from the lifetime counters' growth);
- the recent-window quantiles at that moment (the same window as `/hedge/stats`' `window`):
  `client_ttft_ms.p50/p99`, `loser_close_ms_p99`, and per backend `ttft_ms.p50/p99`;
- gauges: `budget_tokens`, `inflight`, per backend `state` and `inflight`.

Bounded: at most `capacity` points per pool (a deque drops the oldest), and only the pools the
stats hold now: after a configuration reload a new pool starts its own series and a removed
one's is dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.budget import SuppressReason

if TYPE_CHECKING:
    from gateway.latency import WindowedSketch
    from gateway.pool import PoolRuntime
    from gateway.stats.record import Stats

#: seconds between points, and how many points are kept (10 minutes)
INTERVAL = 1.0
CAPACITY = 600
#: lifetime counters turned into per-second rates: point field -> counter key
RATES = {
    "requests": "requests",
    "hedges_started": "hedges",
    "hedges_won": "hedges_won",
    "failovers": "failovers",
    "tokens_input": "tokens.input",
    "tokens_output": "tokens.output",
    "hedge_input_tokens": "tokens.hedge_input",
}


def _quantiles_ms(sketch: WindowedSketch, now: float) -> dict[str, float | None]:
    p50, p99 = sketch.quantiles((0.5, 0.99), now)
    return {
        "p50": None if p50 is None else round(p50 * 1000, 2),
        "p99": None if p99 is None else round(p99 * 1000, 2),
    }


class Series:
    """Per-pool rings of per-second points (fields in the module docstring)."""

    def __init__(
        self, stats: Stats, pools: Mapping[str, PoolRuntime], *, capacity: int = CAPACITY
    ) -> None:
        self._stats = stats
        self._pools = pools
        self.capacity = capacity
        self.seq = 0
        self._points: dict[str, deque[dict[str, Any]]] = {}
        #: the counters and time of the previous point, per pool, for the rates
        self._last: dict[str, tuple[float, dict[str, int]]] = {}

    def sample(self, now: float) -> None:
        """Add one point per pool for the moment `now`."""
        self.seq += 1
        for gone in set(self._points) - set(self._stats.pools):
            del self._points[gone]
            self._last.pop(gone, None)
        for name, ps in self._stats.pools.items():
            counts = ps.counts.lifetime
            current = {key: counts[key] for key in RATES.values()}
            current.update(
                {f"suppressed.{r.value}": counts[f"suppressed.{r.value}"] for r in SuppressReason}
            )
            previous_at, previous = self._last.get(name, (now, current))
            self._last[name] = (now, current)
            elapsed = now - previous_at
            point: dict[str, Any] = {
                "seq": self.seq,
                "t": round(now - self._stats.started, 3),
            }
            for field, key in RATES.items():
                point[field] = _rate(current[key] - previous[key], elapsed)
            point["suppressed"] = {
                r.value: _rate(
                    current[f"suppressed.{r.value}"] - previous[f"suppressed.{r.value}"], elapsed
                )
                for r in SuppressReason
            }
            point["client_ttft_ms"] = _quantiles_ms(ps.client_ttft.recent, now)
            (close_p99,) = ps.close.recent.quantiles((0.99,), now)
            point["loser_close_ms_p99"] = None if close_p99 is None else round(close_p99 * 1000, 3)
            runtime = self._pools.get(name)
            if runtime is not None:
                point["budget_tokens"] = round(runtime.budget.tokens(now), 3)
                point["inflight"] = runtime.inflight_requests
            backends: dict[str, Any] = {}
            for backend, bs in ps.backends.items():
                entry: dict[str, Any] = {"ttft_ms": _quantiles_ms(bs.ttft.recent, now)}
                if runtime is not None:
                    entry["state"] = runtime.balancer.state(backend, now)[0]
                    entry["inflight"] = runtime.balancer.inflight(backend)
                backends[backend] = entry
            point["backends"] = backends
            points = self._points.get(name)
            if points is None:
                points = self._points[name] = deque(maxlen=self.capacity)
            points.append(point)

    def view(self, since: int = 0) -> dict[str, Any]:
        """The points newer than `since` (a `seq`; 0: all kept), oldest first, per pool."""
        return {
            "interval_s": INTERVAL,
            "capacity": self.capacity,
            "seq": self.seq,
            "pools": {
                name: [p for p in points if p["seq"] > since]
                for name, points in self._points.items()
            },
        }


def _rate(delta: int, elapsed: float) -> float:
    """A per-second rate; the first point (no interval yet) and a clock step count as 0."""
    if elapsed <= 0:
        return 0.0
    return round(max(0, delta) / elapsed, 3)
