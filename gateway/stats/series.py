"""The dashboard's time series: one point per pool per second, the last 10 minutes. Pure.

`GET /hedge/series` serves it (`gateway.dashboard`); a sampler task hands `Series.sample` a
`Reading` once a second, off the request path: requests never touch the series. A point reads
what the stats and the live pools already hold, so it costs a few sketch reads per second,
whatever the traffic.

Per pool, each point (`seq`: 1 + `t` rounded to a whole second, so the same
second has the same `seq` in every worker; `t`: the seconds since the start, exactly):
- rates over the interval since the previous point, per second: `requests`, `hedges_started`,
  `hedges_won`, `failovers`, `suppressed.<reason>`, `translated.<client->backend>` (requests
  answered by a backend of another API), `tokens_input`, `tokens_output`,
  `hedge_input_tokens` (from the lifetime counters' growth; 0 in a series' first point, which
  is taken as the process starts, before it serves);
- the recent-window quantiles at that moment (the same window as `/hedge/stats`' `window`):
  `client_ttft_ms.p50/p99`, `loser_close_ms_p99`, and per backend `ttft_ms.p50/p99`;
- gauges: `budget_tokens`, `inflight`, per backend `state` and `inflight`.

Bounded: at most `capacity` points per pool (a deque drops the oldest), and only the pools the
reading holds now: after a configuration reload a new pool starts its own series and a removed
one's is dropped.

**The whole server**. Without workers a reading is this process's stats and pools
(`own_reading`). Under `serve --workers N` every worker samples the whole server's
(`whole_reading`): the workers' exports merged as for `/hedge/stats`, so quantiles come from the
merged sketches and gauges are combined. Points fall on the same ticks in every worker (`seq`
and `t` count from the supervisor's start), so any worker answers the same series, give or take
a sample; a worker that replaced a dead one holds only the points since it started.

Rates are the growth of each process's own lifetime counters since the previous point, summed
over the processes: the growth of the server's summed counters, minus the ways a difference of
sums goes wrong when the set of processes changes.
- The first point is the baseline: every process in it counts from its numbers then (a
  replacement worker's peers: their past lands in no point of its series).
- A process seen for the first time later counts from zero (a replacement, or a sibling that
  published after this one's first point): nothing of it was counted yet. Unless it started
  more than `FRESH` seconds before the first point: then it was missed (its numbers stale), and
  it counts from its current numbers. One that comes back after a gap adds its growth since.
- A process that disappears (died, or its numbers are older than 2 s) stops adding. The
  supervisor folding a dead worker's lifetime into the retired numbers (which keep
  `/hedge/stats` from going down) is no activity: the retired numbers take no part here. What
  a worker did after the last point before it died (under a second) is not in the series.
- Growth is clamped at zero per process and counter: no rate goes negative.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.hedge.budget import SuppressReason
from gateway.stats.merge import merge, rebuild
from gateway.wire.translate.routes import TRANSLATION_NAMES

if TYPE_CHECKING:
    from gateway.hedge.latency import WindowedSketch
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
#: every counter a rate is made of
RATE_KEYS = (*RATES.values(), *(f"suppressed.{r.value}" for r in SuppressReason),
             *(f"translated.{name}" for name in TRANSLATION_NAMES))
#: a process first seen after the first point counts from zero if it started at most this
#: long before that point: the workers forked together start within it, however late one of
#: them first publishes
FRESH = 30.0
#: a known pid whose start moved by more than this is another process (the pid was reused)
SAME_START = 1.0
#: how many processes (the most recently seen) are remembered between their readings
REMEMBERED = 64


@dataclass(frozen=True, slots=True)
class Process:
    """One process's part of a reading: when it started, and per pool the lifetime counters
    the rates are made of (`RATE_KEYS`)."""

    started: float
    counts: Mapping[str, Mapping[str, int]]


@dataclass(frozen=True, slots=True)
class Reading:
    """What one point is read from."""

    #: the counts and sketches: this process's, or the whole server's rebuilt from the merge
    stats: Stats
    #: the moment to read the recent windows of `stats` at (on its own clock)
    at: float
    #: per pool, the live state as `view.live_view` gives it (or as combined over the workers)
    live: Mapping[str, Mapping[str, Any]]
    #: the processes whose counters make the rates, by pid
    processes: Mapping[int, Process]


def rate_counts(lifetime: Mapping[str, Any]) -> dict[str, int]:
    return {key: int(lifetime.get(key, 0)) for key in RATE_KEYS}


def own_reading(stats: Stats, live: Mapping[str, Mapping[str, Any]], now: float,
                pid: int) -> Reading:
    """This process's reading at `now` (`live`: its `view.live_view`)."""
    counts = {name: rate_counts(ps.counts.lifetime) for name, ps in stats.pools.items()}
    return Reading(stats, now, live, {pid: Process(stats.started, counts)})


def whole_reading(exports: Sequence[Mapping[str, Any]], now: float) -> Reading:
    """The whole server's reading at `now` from the exports `StatsSource` reads (this
    worker's, its peers' fresh ones, the retired numbers). ValueError if they do not merge."""
    stats, live, at = rebuild(merge(exports))
    processes: dict[int, Process] = {}
    for item in exports:
        workers = item["workers"]
        pid = workers[0].get("pid") if len(workers) == 1 else None
        if not isinstance(pid, int):  # the retired numbers: no process, no activity
            continue
        started = now - float(workers[0].get("age_s", 0.0)) - float(item["uptime_s"])
        counts = {name: rate_counts(pool["lifetime"]) for name, pool in item["pools"].items()}
        processes[pid] = Process(started, counts)
    return Reading(stats, at, live, processes)


def _quantiles_ms(sketch: WindowedSketch, now: float) -> dict[str, float | None]:
    p50, p99 = sketch.quantiles((0.5, 0.99), now)
    return {
        "p50": None if p50 is None else round(p50 * 1000, 2),
        "p99": None if p99 is None else round(p99 * 1000, 2),
    }


class Series:
    """Per-pool rings of per-second points (fields in the module docstring)."""

    def __init__(self, origin: float, *, capacity: int = CAPACITY,
                 interval: float = INTERVAL) -> None:
        """`origin`: when the server started (`seq` and `t` count from it)."""
        self.origin = origin
        self.capacity = capacity
        self.interval = interval
        #: the `seq` of the last point (0: none yet)
        self.seq = 0
        self._points: dict[str, deque[dict[str, Any]]] = {}
        #: each process's counters at the previous point, least recently seen first
        self._seen: dict[int, Process] = {}
        #: when the first and the last point were taken
        self._first_at: float | None = None
        self._last_at: float | None = None

    def _seq(self, now: float) -> int:
        return round((now - self.origin) / self.interval) + 1

    def next_at(self) -> float:
        """When the next point is due: on the next whole second since the server started."""
        return self.origin + self.seq * self.interval

    def sample(self, reading: Reading, now: float) -> None:
        """Add one point per pool of `reading` for the moment `now`. At most one per tick: a
        reading within the tick of the last point is left out (the next point covers it)."""
        seq = self._seq(now)
        if seq <= self.seq:
            return
        first = self._first_at is None
        if self._first_at is None:
            self._first_at = now
        growth = self._grow(reading.processes, self._first_at, first=first)
        elapsed = 0.0 if self._last_at is None else now - self._last_at
        self._last_at = now
        self.seq = seq
        stats, at = reading.stats, reading.at
        for gone in set(self._points) - set(stats.pools):
            del self._points[gone]
        for name, ps in stats.pools.items():
            grown = growth.get(name, Counter())
            point: dict[str, Any] = {"seq": seq, "t": round(now - self.origin, 3)}
            for field, key in RATES.items():
                point[field] = _rate(grown[key], elapsed)
            point["suppressed"] = {
                r.value: _rate(grown[f"suppressed.{r.value}"], elapsed) for r in SuppressReason
            }
            point["translated"] = {
                name: _rate(grown[f"translated.{name}"], elapsed) for name in TRANSLATION_NAMES
            }
            point["client_ttft_ms"] = _quantiles_ms(ps.client_ttft.recent, at)
            (close_p99,) = ps.close.recent.quantiles((0.99,), at)
            point["loser_close_ms_p99"] = None if close_p99 is None else round(close_p99 * 1000, 3)
            live = reading.live.get(name)
            if live is not None:
                point["budget_tokens"] = live["budget"]["tokens"]
                point["inflight"] = live["inflight_requests"]
            states = {} if live is None else live["backends"]
            backends: dict[str, Any] = {}
            for backend, bs in ps.backends.items():
                entry: dict[str, Any] = {"ttft_ms": _quantiles_ms(bs.ttft.recent, at)}
                state = states.get(backend)
                if state is not None:
                    entry["state"] = state["state"]
                    entry["inflight"] = state["inflight"]
                backends[backend] = entry
            point["backends"] = backends
            points = self._points.get(name)
            if points is None:
                points = self._points[name] = deque(maxlen=self.capacity)
            points.append(point)

    def _grow(self, processes: Mapping[int, Process], first_at: float, *,
              first: bool) -> dict[str, Counter[str]]:
        """Per pool, the counters' growth since the previous point, summed over the processes
        (the rules in the module docstring); `first`: this is the first point (at `first_at`),
        which only sets where each process starts."""
        growth: dict[str, Counter[str]] = {}
        for pid, process in processes.items():
            known = self._seen.pop(pid, None)
            if known is None or process.started > known.started + SAME_START:
                fresh = not first and process.started >= first_at - FRESH
                known = Process(process.started, {}) if fresh else process
            for pool, counts in process.counts.items():
                before = known.counts.get(pool, {})
                into = growth.setdefault(pool, Counter())
                for key, n in counts.items():
                    delta = n - before.get(key, 0)
                    if delta > 0:
                        into[key] += delta
            self._seen[pid] = process
        while len(self._seen) > REMEMBERED:
            del self._seen[next(iter(self._seen))]
        return growth

    def view(self, since: int = 0) -> dict[str, Any]:
        """The points newer than `since` (a `seq`; 0: all kept), oldest first, per pool."""
        return {
            "interval_s": self.interval,
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
