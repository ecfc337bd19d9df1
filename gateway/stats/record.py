"""Counters and sketches behind `/hedge/stats` and `/metrics`. Pure.

Fed once per logical request with a `RequestSummary` when the request has fully ended (winner
closed, losers reaped), so nothing here runs per event. No I/O, no asyncio: the time of a
record is the summary's own `ended`, and the views (`gateway.stats.view`) take `now`.

Every number exists twice: over the process lifetime and over the recent window (`window_s`,
default 60 s). Counts in the window come from a ring of count buckets (one per window/6
seconds, recycled lazily like the latency sketches); quantiles from `WindowedSketch`. A
window view therefore covers between 5/6 and all of `window_s`, never anything older.

Only configured pools and backends are ever keys (the layout comes from the configuration,
at construction and at each reload through `Stats.adopt`), and
error classes are folded into a fixed set, so nothing a client sends becomes a key here or a
label in `/metrics`. No prompt, body, key or URL is stored.

The JSON document built from these numbers (`GET /hedge/stats`, its fields) is
`gateway.stats.view`'s job; `gateway.stats.prometheus` reads the same objects for `/metrics`.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gateway.errors import GatewayError, failure_codes
from gateway.hedge.attempt import CANCELLED_BEFORE_TOKEN
from gateway.hedge.budget import SuppressReason
from gateway.hedge.latency import LifetimeSketch, WindowedSketch
from gateway.stats.races import RecentRaces
from gateway.stats.summary import RequestSummary
from gateway.tenants.spend import MICRO
from gateway.wire.base import ERROR_ENDS, StreamEnd
from providers.base import ENDPOINTS

#: the values a `route` label takes: the API paths below /v1/
ROUTES: tuple[str, ...] = ENDPOINTS

if TYPE_CHECKING:
    from gateway.hedge.attempt import AttemptRecord, ContinuationCounts
    from gateway.hedge.pool import PoolRuntime

WINDOW = 60.0
SLICES = 6
#: Prometheus histogram bounds (seconds) for TTFTs and for loser close times
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                5.0, 10.0, 30.0)
CLOSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
#: the counter of each named key's spend (micro-dollars, `gateway.tenants.spend.MICRO`),
#: beside the pool's `spend.micro_usd`
KEY_SPEND = "spend.key."
#: ends of a relayed stream that are not errors
CLEAN_ENDS = (None, StreamEnd.DONE)


# -- classification --------------------------------------------------------------------------


def _error_classes() -> frozenset[str]:
    """Every code and class name of the error tree, plus the proxy's own labels."""
    names = {"client_disconnected"}
    pending: list[type[GatewayError]] = [GatewayError]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        if cls.code:
            names.add(cls.code)
        pending.extend(cls.__subclasses__())
    names.update(f"stream_{end}" for end in ERROR_ENDS)
    return frozenset(names)


def route_label(endpoint: str) -> str:
    """The request's route as a label: one of `ROUTES` (a fixed set), else `other`."""
    return endpoint if endpoint in ROUTES else "other"


def request_class(summary: RequestSummary, known: frozenset[str]) -> str:
    """`ok`, or the class of what went wrong: the error code (`upstream_failed`,
    `first_token_timeout`, `client_disconnected`, ...), `stream_<end>` for a relay that
    ended otherwise than with `[DONE]`, `no_response` when neither says; a class outside the
    known set is `other` (so a label can never grow without bound)."""
    if summary.error is not None:
        cls = summary.error
    elif summary.relay_end not in CLEAN_ENDS:
        cls = f"stream_{summary.relay_end}"
    elif summary.winner is None:
        return "no_response"
    else:
        return "ok"
    return cls if cls in known else "other"


def failure_class(attempt: AttemptRecord, known: frozenset[str]) -> str:
    """A failed attempt's class: its error's code (`unavailable`, `connect_error`, ...);
    a code outside the known set is `other`, a failure without one `unknown`."""
    code = attempt.failure
    if code is None:
        return "unknown"
    return code if code in known else "other"


# -- building blocks -------------------------------------------------------------------------


class CounterRing:
    """Counts over roughly the last `window` seconds: a ring of per-slice `Counter`s."""

    __slots__ = ("_counters", "_ids", "_slices", "_width")

    def __init__(self, window: float, slices: int = SLICES) -> None:
        self._slices = slices
        self._width = window / slices
        self._counters: list[Counter[str]] = [Counter() for _ in range(slices)]
        self._ids: list[int | None] = [None] * slices

    def add(self, counts: Mapping[str, int], now: float) -> None:
        sid = math.floor(now / self._width)
        slot = sid % self._slices
        held = self._ids[slot]
        if held is not None and held > sid:
            return  # older than the whole window as seen from the newest data
        if held != sid:
            self._counters[slot] = Counter()
            self._ids[slot] = sid
        self._counters[slot].update(counts)

    def total(self, now: float) -> Counter[str]:
        current = math.floor(now / self._width)
        out: Counter[str] = Counter()
        for sid, counter in zip(self._ids, self._counters, strict=True):
            if sid is not None and current - self._slices < sid <= current:
                out.update(counter)
        return out


class Tally:
    """A lifetime `Counter` and its windowed twin, fed the same counts."""

    __slots__ = ("lifetime", "recent")

    def __init__(self, window: float) -> None:
        self.lifetime: Counter[str] = Counter()
        self.recent = CounterRing(window)

    def add(self, counts: Mapping[str, int], now: float) -> None:
        self.lifetime.update(counts)
        self.recent.add(counts, now)

    def view(self, scope: str, now: float) -> Counter[str]:
        return self.lifetime if scope == "lifetime" else self.recent.total(now)


class BucketHistogram:
    """Cumulative-bucket counts for a Prometheus histogram (lifetime; seconds)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, count of values <= le)], ending with "+Inf", as Prometheus wants them."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


class Latency:
    """One latency series: lifetime and windowed quantiles, and a Prometheus histogram."""

    __slots__ = ("histogram", "lifetime", "recent")

    def __init__(self, window: float, bounds: Sequence[float]) -> None:
        self.lifetime = LifetimeSketch()
        self.recent = WindowedSketch(window, SLICES)
        self.histogram = BucketHistogram(bounds)

    def add(self, seconds: float, now: float) -> None:
        self.lifetime.add(seconds)
        self.recent.add(seconds, now)
        self.histogram.add(seconds)

    def view_ms(self, scope: str, qs: Sequence[float], now: float) -> dict[str, Any]:
        """{"p50": ms, ..., "count": n}; quantiles null without data."""
        if scope == "lifetime":
            values, count = self.lifetime.quantiles(qs), self.lifetime.count
        else:
            values, count = self.recent.quantiles(qs, now), self.recent.count(now)
        out: dict[str, Any] = {
            f"p{round(q * 100)}": None if v is None else round(v * 1000, 3)
            for q, v in zip(qs, values, strict=True)
        }
        out["count"] = count
        return out


class BackendStats:
    __slots__ = ("counts", "ttft")

    def __init__(self, window: float) -> None:
        self.counts = Tally(window)
        self.ttft = Latency(window, TTFT_BUCKETS)


class PoolStats:
    __slots__ = ("backends", "client_ttft", "close", "counts", "saved")

    def __init__(self, backends: Iterable[str], window: float) -> None:
        self.counts = Tally(window)
        self.client_ttft = Latency(window, TTFT_BUCKETS)
        self.saved = Latency(window, TTFT_BUCKETS)
        self.close = Latency(window, CLOSE_BUCKETS)
        self.backends = {name: BackendStats(window) for name in backends}


# -- the stats -------------------------------------------------------------------------------


class Stats:
    """What the gateway did, per configured pool and backend, lifetime and recent window."""

    def __init__(
        self, layout: Mapping[str, Sequence[str]], *, now: float, window: float = WINDOW
    ) -> None:
        """`layout`: pool name -> its backend names, from the configuration."""
        self.window = window
        self.started = now
        self.pools = {name: PoolStats(backends, window) for name, backends in layout.items()}
        self.error_classes = _error_classes()
        self.failure_codes = failure_codes()
        #: summaries for a pool not in the layout (a bug elsewhere; never a new key)
        self.unrecorded = 0
        #: exceptions of ours on the request path, each answered with a 500 in the route's
        #: shape (those of an admitted request are its error class `internal_error` too)
        self.internal_errors = 0
        #: the last races, for the dashboard's timeline
        self.races = RecentRaces(now)
        #: per named key (`keys:`), lifetime: `objectives_met`, `objectives_missed`,
        #: `deadline_hedges` (sent early for an objective), `deadline_refused` (its share could
        #: not pay). Bounded by the keys configured or made (names, never the keys); a key
        #: with no objective and no deadline hedge adds nothing
        self.keys: dict[str, Counter[str]] = {}

    @classmethod
    def for_pools(cls, pools: Mapping[str, PoolRuntime], *, now: float,
                  window: float = WINDOW) -> Stats:
        layout = {name: [b.name for b in p.settings.backends] for name, p in pools.items()}
        return cls(layout, now=now, window=window)

    def adopt(self, layout: Mapping[str, Sequence[str]]) -> None:
        """Take a reloaded configuration's layout (pool name -> backend names): pools and
        backends that keep their name keep their counters and sketches, new ones start at
        zero, removed ones disappear (a request of a removed pool that ends later is counted
        in `unrecorded`, like any summary outside the layout)."""
        pools: dict[str, PoolStats] = {}
        for name, backends in layout.items():
            ps = self.pools.get(name) or PoolStats((), self.window)
            ps.backends = {b: ps.backends.get(b) or BackendStats(self.window) for b in backends}
            pools[name] = ps
        self.pools = pools

    def record(self, summary: RequestSummary) -> None:
        """Account for one logical request that has fully ended."""
        pool = self.pools.get(summary.pool)
        if pool is None:
            self.unrecorded += 1
            return
        now = summary.ended if summary.ended is not None else summary.started
        winner = summary.winner
        pc: Counter[str] = Counter(requests=1, attempts=len(summary.attempts))
        pc[f"attempts={len(summary.attempts)}"] += 1
        outcome = request_class(summary, self.error_classes)
        pc[f"outcome.{outcome}"] += 1
        pc["panic"] += summary.panic
        if summary.affinity is not None:
            pc[f"affinity.{summary.affinity}"] += 1
        pc["empty_answers"] += winner is not None and winner.empty
        if summary.translated is not None:
            pc[f"translated.{summary.translated}"] += 1
        pc["headroom_skips"] += len(summary.headroom_skips)
        for name, skips in Counter(summary.headroom_skips).items():
            skipped = pool.backends.get(name)
            if skipped is not None:
                skipped.counts.add(Counter(headroom_skips=skips), now)
        if summary.continuations:
            self._record_continuations(pool, summary.continuations, pc, now)
        self.races.add(summary, outcome)
        pc[f"route.{route_label(summary.endpoint)}"] += 1
        for reason in summary.suppressed:
            pc[f"suppressed.{SuppressReason(reason).value}"] += 1
        if summary.key is not None and summary.objective is not None:
            self._record_key(summary.key, summary)
        for attempt in summary.attempts:
            self._record_attempt(pool, attempt, attempt is winner, pc, now, summary.metered)
        client_ttft = summary.client_ttft
        if client_ttft is not None and summary.metered:
            pool.client_ttft.add(client_ttft, now)
        saved = latency_saved(summary)
        if saved is not None:
            pool.saved.add(saved, now)
        usage = summary.usage
        if usage is not None and winner is not None:
            tokens = Counter({"tokens.input": usage.input, "tokens.output": usage.output})
            if usage.cached is not None:  # the upstream reports its cache: a hit rate's input
                tokens.update({"tokens.cached": usage.cached,
                               "tokens.input_cache_reported": usage.input})
            if usage.cache_write is not None:
                tokens["tokens.cache_write"] += usage.cache_write
            pc.update(tokens)
            pc["tokens.hedge_input"] += hedge_input_tokens(summary)
            pc["tokens.hedge_input_miss"] += hedge_input_miss_tokens(summary)
            backend = pool.backends.get(winner.backend)
            if backend is not None:
                backend.counts.add(tokens, now)
        if summary.cost is not None:  # counted in micro-dollars: the counters are integers
            micro = round(summary.cost * MICRO)
            pc["spend.micro_usd"] += micro
            if summary.key is not None:  # a named key: names are bounded by the keys
                pc[f"{KEY_SPEND}{summary.key}"] += micro
        pool.counts.add(pc, now)

    def _record_continuations(self, pool: PoolStats, counts: ContinuationCounts,
                              pc: Counter[str], now: float) -> None:
        """What a request's continuations did: per pool, and per backend (a continuation's
        start and win on the backend it went to; a break or a stall on the one that had it)."""
        per_backend: dict[str, Counter[str]] = {}
        for key, counter in (("continuations.started", counts.started),
                             ("continuations.won", counts.won),
                             ("breaks.continued", counts.breaks_continued),
                             ("breaks.ended", counts.breaks_ended),
                             ("stalls", counts.stalls)):
            for backend, n in counter.items():
                pc[key] += n
                per_backend.setdefault(backend, Counter())[key] += n
        for reason, n in counts.refused.items():
            pc[f"continuations.refused.{reason}"] += n
        pc["continuations.input_tokens"] += counts.input_tokens
        for backend, bc in per_backend.items():
            stats = pool.backends.get(backend)
            if stats is not None:
                stats.counts.add(bc, now)

    def _record_key(self, key: str, summary: RequestSummary) -> None:
        """A named key's request with an objective: met or missed, and its deadline
        hedges, sent or refused by the key's share."""
        counts = self.keys.get(key)
        if counts is None:
            counts = self.keys[key] = Counter()
        met = summary.objective_met
        if met is not None:
            counts["objectives_met" if met else "objectives_missed"] += 1
        counts["deadline_hedges"] += summary.deadline_hedges
        counts["deadline_refused"] += summary.suppressed.count(SuppressReason.KEY_BUDGET)

    def _record_attempt(
        self, pool: PoolStats, attempt: AttemptRecord, won: bool, pc: Counter[str], now: float,
        metered: bool = True,
    ) -> None:
        outcome = attempt.outcome or "unknown"
        censored = attempt.reason == CANCELLED_BEFORE_TOKEN
        if attempt.kind != "primary":
            pc[f"{attempt.kind}s"] += 1
            pc[f"{attempt.kind}s_won"] += won
        if outcome == "lost":
            pc["losers"] += 1
            pc["losers_before_token"] += censored
            pc["late_events"] += attempt.late_events
            if attempt.close_s is not None:
                pool.close.add(attempt.close_s, now)
        elif outcome == "cancelled":
            pc["cancelled"] += 1
        backend = pool.backends.get(attempt.backend)
        if backend is None:
            return
        bc: Counter[str] = Counter(attempts=1)
        bc[f"kind.{attempt.kind}"] += 1
        bc[f"outcome.{outcome}"] += 1
        bc[f"kind.{attempt.kind}.{outcome}"] += 1
        if attempt.kind == "hedge":
            bc["hedges_won"] += won
        if outcome == "failed":
            bc[f"failure.{failure_class(attempt, self.failure_codes)}"] += 1
        if attempt.ttft is not None and metered:
            if censored:
                bc["ttft_censored"] += 1
            else:
                backend.ttft.add(attempt.ttft, now)
        backend.counts.add(bc, now)


#: failures that mean the request never reached the backend, so it paid no prefill there
UNREACHED = frozenset({"connect_error", "connect_timeout"})


def hedge_input_tokens(summary: RequestSummary) -> int:
    """The hedge cost of one request: its input tokens once for each extra attempt that reached
    a backend (every attempt but one that got past connecting paid the prefill again)."""
    if summary.usage is None:
        return 0
    reached = sum(1 for a in summary.attempts if a.failure not in UNREACHED)
    return summary.usage.input * max(0, reached - 1)


def hedge_input_miss_tokens(summary: RequestSummary) -> int:
    """Of the hedge cost (`hedge_input_tokens`), the input tokens that were cache misses where
    they were sent. The extra copies are the attempts that reached a backend after the first
    one that did. A copy that won has its upstream's own count (input less cached, when the
    usage reports a cache); a losing copy reported nothing (it was cut off before its usage),
    so its share is the gateway's estimate (`RequestSize.uncached`: the whole input away
    from the conversation's home, what grew since its last turn at home); with no estimate
    at all, the whole input counts as a miss."""
    usage = summary.usage
    if usage is None:
        return 0
    reached = [a for a in summary.attempts if a.failure not in UNREACHED]
    size, winner, missed = summary.size, summary.winner, 0
    for attempt in reached[1:]:
        if attempt is winner and usage.cached is not None:
            missed += max(0, usage.input - usage.cached)
        elif size is None or size.tokens <= 0:
            missed += usage.input
        else:
            missed += round(usage.input * min(1.0, size.uncached(attempt.backend) / size.tokens))
    return missed


def latency_saved(summary: RequestSummary) -> float | None:
    """When a hedge won while the primary was still running: the primary's time without a
    token at commit (a lower bound of what hedging saved); else None."""
    winner, attempts = summary.winner, summary.attempts
    if winner is None or winner.kind != "hedge" or summary.committed_at is None or not attempts:
        return None
    primary = attempts[0]
    if primary.kind != "primary" or primary.outcome != "lost" or primary.empty:
        return None  # (a primary that had answered, empty, was not slow: nothing was saved)
    return max(0.0, summary.committed_at - primary.started)
