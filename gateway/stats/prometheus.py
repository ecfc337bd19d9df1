"""`GET /metrics`: Prometheus text built from `Stats` and the pools at scrape time.

Why a custom collector rather than metric objects updated per request: `Stats` already counts
everything once per request, so the request path does no extra work for Prometheus, and the
gauges (budget tokens, in-flight, hedge delay, backend state) are read live when scraped.

Each app owns its own `CollectorRegistry` (never the global one): tests build many apps in
one process, and two gateways must not share series.

Bounded labels: `pool` and `backend` come from the configuration only (the collector walks
the configured pools, never request data); `outcome`, `kind`, `reason`, `state` are fixed
enumerations; `code` is an attempt failure code (one per `UpstreamError` class); a request
outcome is `ok` or one of the error classes `Stats` folds into a fixed set. Nothing a client
sends can create a series.

Metrics (all prefixed `hedge_gateway_`; counters end in `_total`):

| metric | type | labels | meaning |
|---|---|---|---|
| `requests_total` | counter | pool, outcome | logical requests; `ok` or the error class |
| `route_requests_total` | counter | pool, route | logical requests per route (fixed set) |
| `translated_requests_total` | counter | pool, translation | translated: `chat->messages`... |
| `attempts_total` | counter | pool, backend, kind, outcome | upstream attempts |
| `hedges_started_total` | counter | pool | delay-triggered hedges started |
| `hedges_won_total` | counter | pool | hedges whose stream won |
| `hedges_suppressed_total` | counter | pool, reason | hedges/failovers not started |
| `failovers_total` | counter | pool | replacement attempts after failures |
| `panic_total` | counter | pool | requests whose backend choice ran in panic mode |
| `affinity_total` | counter | pool, result | how affinity chose the primary: hit, spill, miss |
| `headroom_skips_total` | counter | pool, backend | choices that left it out: low quota headroom |
| `continuations_total` | counter | pool, backend, event | after commit, by event (below) |
| `continuations_refused_total` | counter | pool, reason | continuations not started, by reason |
| `refused_no_backend_total` | counter | pool | requests refused untried: no backend had room |
| `losers_cancelled_total` | counter | pool | attempts cancelled because another won |
| `loser_events_after_commit_total` | counter | pool | events losers read after commit |
| `attempt_ttft_censored_total` | counter | pool, backend | attempts cancelled before a token |
| `attempt_failures_total` | counter | pool, backend, code | failed attempts by failure code |
| `tokens_total` | counter | pool, backend, type | `input`, `output`, `cached`, `cache_write` |
| `hedge_input_tokens_total` | counter | pool | input tokens paid again by extra attempts |
| `hedge_input_miss_tokens_total` | counter | pool | of those, cache misses where they were sent |
| `spend_usd_total` | counter | pool | what requests cost at their prices, losers included |
| `key_spend_usd_total` | counter | pool, key | of that, each named client key's |
| `internal_errors_total` | counter | | exceptions of ours on the request path (answered 500) |
| `key_objectives_total` | counter | key, result | a key's objectives `met`, `missed` |
| `key_deadline_hedges_total` | counter | key, result | early hedges `sent`, `refused` (share) |
| `attempt_ttft_seconds` | histogram | pool, backend | attempt TTFT (attempts with a token) |
| `client_ttft_seconds` | histogram | pool | request arrival to first-token commit |
| `loser_close_seconds` | histogram | pool | cancel to upstream closed, per loser |
| `latency_saved_seconds` | histogram | pool | hedge won: primary's tokenless time at commit |
| `budget_tokens` | gauge | pool | hedge budget tokens available |
| `budget_input_tokens` | gauge | pool | input tokens the budget holds (pools that count them) |
| `prefill_seconds_per_1k_tokens` | gauge | pool, backend | the fitted prefill rate (once fitted) |
| `budget_ineffective` | gauge | pool | 1 while the efficacy guard holds hedges back |
| `inflight_requests` | gauge | pool | logical requests in flight |
| `inflight_attempts` | gauge | pool, backend | attempts in flight |
| `hedge_delay_seconds` | gauge | pool, backend | hedge delay in force |
| `backend_state` | gauge | pool, backend, state | 1 for the current state (ok/ejected/paused/low) |
| `backend_headroom` | gauge | pool, backend | least share of a quota left (when headers told) |

`continuations_total`'s `event`: `started` and `won` count continuations sent to the backend
and those that gave the client its next token; `stall`, `break_continued` and `break_ended`
count the backend's own streams that stalled, broke and were continued elsewhere, or broke
and ended with the in-band error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gateway.errors import NoBackendAvailable
from gateway.hedge.budget import SuppressReason
from gateway.hedge.pool import PoolRuntime
from gateway.stats.record import KEY_SPEND, ROUTES, BucketHistogram, Stats
from gateway.stats.view import live_view
from gateway.tenants.spend import MICRO
from gateway.wire.translate.routes import TRANSLATION_NAMES

#: what a scrape reads: the counts, and each pool's live state as `view.live_view` gives it
Reading = tuple[Stats, Mapping[str, Mapping[str, Any]]]

PREFIX = "hedge_gateway_"
KINDS = ("primary", "hedge", "failover")
#: the `event` label of `continuations_total`, and the counter each reads
CONTINUATION_EVENTS = (("started", "continuations.started"), ("won", "continuations.won"),
                       ("stall", "stalls"), ("break_continued", "breaks.continued"),
                       ("break_ended", "breaks.ended"))
OUTCOMES = ("won", "lost", "failed", "cancelled")
STATES = ("ok", "ejected", "paused", "low")


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _histogram(family: HistogramMetricFamily, labels: list[str], h: BucketHistogram) -> None:
    family.add_metric(labels, h.cumulative(), h.sum)


class GatewayCollector(Collector):
    """Reads the counts and the live pool state on every scrape, through `read`."""

    def __init__(self, read: Callable[[], Reading]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats, live = self._read()
        yield from self._counts(stats)
        yield from self._latencies(stats)
        yield from self._live(stats, live)

    def _counts(self, stats: Stats) -> Iterator[Metric]:
        requests = _counter("requests", "Logical requests by outcome.", ["pool", "outcome"])
        routes = _counter("route_requests", "Logical requests by route.", ["pool", "route"])
        translated = _counter("translated_requests", "Requests answered by a backend of "
                              "another API, by client API -> backend API.",
                              ["pool", "translation"])
        attempts = _counter("attempts", "Upstream attempts by kind and outcome.",
                            ["pool", "backend", "kind", "outcome"])
        started = _counter("hedges_started", "Delay-triggered hedges started.", ["pool"])
        won = _counter("hedges_won", "Hedges whose stream won the race.", ["pool"])
        suppressed = _counter("hedges_suppressed", "Hedges or failovers not started, by reason.",
                              ["pool", "reason"])
        failovers = _counter("failovers", "Replacement attempts after failures.", ["pool"])
        panic = _counter("panic", "Requests whose backend choice ran in panic mode.", ["pool"])
        affinity = _counter("affinity", "Requests by how conversation affinity chose the "
                            "primary (hit, spill, miss).", ["pool", "result"])
        skips = _counter("headroom_skips", "Choices that left a backend out for low quota "
                         "headroom.", ["pool", "backend"])
        refused = _counter("refused_no_backend",
                           "Requests refused untried: no backend could take them.", ["pool"])
        losers = _counter("losers_cancelled", "Attempts cancelled because another won.",
                          ["pool"])
        late = _counter("loser_events_after_commit", "Events losers read after the commit.",
                        ["pool"])
        censored = _counter("attempt_ttft_censored",
                            "Attempts cancelled before their first token.", ["pool", "backend"])
        failures = _counter("attempt_failures", "Failed attempts by failure code.",
                            ["pool", "backend", "code"])
        tokens = _counter("tokens", "Tokens the winning attempts reported, by type.",
                          ["pool", "backend", "type"])
        hedge_cost = _counter("hedge_input_tokens",
                              "Input tokens paid again by extra attempts that reached a backend.",
                              ["pool"])
        hedge_miss = _counter("hedge_input_miss_tokens",
                              "Of the hedge cost, input tokens that were cache misses where sent.",
                              ["pool"])
        spend = _counter("spend_usd", "What requests cost at their backends' prices, losing "
                         "attempts included (USD).", ["pool"])
        key_spend = _counter("key_spend_usd", "Of the spend, each named client key's (USD).",
                             ["pool", "key"])
        for pool, ps in stats.pools.items():
            c = ps.counts.lifetime
            outcomes = {"ok": c["outcome.ok"]}
            outcomes.update(
                {k[8:]: v for k, v in c.items() if k.startswith("outcome.") and v > 0}
            )
            for outcome, value in sorted(outcomes.items()):
                requests.add_metric([pool, outcome], value)
            for route in ROUTES:
                routes.add_metric([pool, route], c[f"route.{route}"])
            for name in TRANSLATION_NAMES:
                translated.add_metric([pool, name], c[f"translated.{name}"])
            started.add_metric([pool], c["hedges"])
            won.add_metric([pool], c["hedges_won"])
            for reason in SuppressReason:
                suppressed.add_metric([pool, reason.value], c[f"suppressed.{reason.value}"])
            failovers.add_metric([pool], c["failovers"])
            panic.add_metric([pool], c["panic"])
            for result in ("hit", "spill", "miss"):
                affinity.add_metric([pool, result], c[f"affinity.{result}"])
            refused.add_metric([pool], c[f"outcome.{NoBackendAvailable.code}"])
            losers.add_metric([pool], c["losers"])
            late.add_metric([pool], c["late_events"])
            hedge_cost.add_metric([pool], c["tokens.hedge_input"])
            hedge_miss.add_metric([pool], c["tokens.hedge_input_miss"])
            spend.add_metric([pool], c["spend.micro_usd"] / MICRO)
            for name, value in sorted(c.items()):
                if name.startswith(KEY_SPEND):
                    key_spend.add_metric([pool, name[len(KEY_SPEND):]], value / MICRO)
            for backend, bs in ps.backends.items():
                bc = bs.counts.lifetime
                for kind in KINDS:
                    for outcome in OUTCOMES:
                        value = bc[f"kind.{kind}.{outcome}"]
                        attempts.add_metric([pool, backend, kind, outcome], value)
                censored.add_metric([pool, backend], bc["ttft_censored"])
                skips.add_metric([pool, backend], bc["headroom_skips"])
                for kind in ("input", "output", "cached", "cache_write"):
                    tokens.add_metric([pool, backend, kind], bc[f"tokens.{kind}"])
                for key, value in sorted(bc.items()):
                    if key.startswith("failure.") and value > 0:
                        failures.add_metric([pool, backend, key[8:]], value)
        continued = _counter("continuations", "After commit, per backend: continuations "
                             "started and won there, streams that stalled, broke and were "
                             "continued, broke and ended with an error.",
                             ["pool", "backend", "event"])
        not_continued = _counter("continuations_refused", "Continuations not started, by "
                                 "reason.", ["pool", "reason"])
        for pool, ps in stats.pools.items():
            c = ps.counts.lifetime
            for key, value in sorted(c.items()):
                if key.startswith("continuations.refused."):
                    not_continued.add_metric([pool, key[22:]], value)
            for backend, bs in ps.backends.items():
                bc = bs.counts.lifetime
                for event, key in CONTINUATION_EVENTS:
                    continued.add_metric([pool, backend, event], bc[key])
        bugs = _counter("internal_errors", "Exceptions of ours on the request path.", [])
        bugs.add_metric([], stats.internal_errors)
        objectives = _counter("key_objectives", "Requests of a named key with a TTFT "
                              "objective, by whether the first token met it.", ["key", "result"])
        deadline = _counter("key_deadline_hedges", "Hedges a TTFT objective sent early "
                            "(sent) or its key's share of the budget refused (refused).",
                            ["key", "result"])
        for key, counts in sorted(stats.keys.items()):
            objectives.add_metric([key, "met"], counts["objectives_met"])
            objectives.add_metric([key, "missed"], counts["objectives_missed"])
            deadline.add_metric([key, "sent"], counts["deadline_hedges"])
            deadline.add_metric([key, "refused"], counts["deadline_refused"])
        yield from (requests, routes, translated, attempts, started, won, suppressed, failovers,
                    panic, affinity, skips, refused, losers, late, censored, failures, tokens,
                    hedge_cost, hedge_miss, spend, key_spend, continued, not_continued, bugs,
                    objectives, deadline)

    def _latencies(self, stats: Stats) -> Iterator[Metric]:
        attempt = HistogramMetricFamily(
            PREFIX + "attempt_ttft_seconds",
            "Attempt time to first token, from the attempt's own start (with a token).",
            labels=["pool", "backend"],
        )
        client = HistogramMetricFamily(
            PREFIX + "client_ttft_seconds",
            "Client-observed time to first token: request arrival to commit.",
            labels=["pool"],
        )
        close = HistogramMetricFamily(
            PREFIX + "loser_close_seconds",
            "Time from cancelling a losing attempt to its upstream being closed.",
            labels=["pool"],
        )
        saved = HistogramMetricFamily(
            PREFIX + "latency_saved_seconds",
            "When a hedge won: how long the primary had run without a token (lower bound).",
            labels=["pool"],
        )
        for pool, ps in stats.pools.items():
            _histogram(client, [pool], ps.client_ttft.histogram)
            _histogram(close, [pool], ps.close.histogram)
            _histogram(saved, [pool], ps.saved.histogram)
            for backend, bs in ps.backends.items():
                _histogram(attempt, [pool, backend], bs.ttft.histogram)
        yield from (attempt, client, close, saved)

    def _live(self, stats: Stats, live: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
        tokens = _gauge("budget_tokens", "Hedge budget tokens available.", ["pool"])
        input_tokens = _gauge("budget_input_tokens", "Input tokens the hedge budget holds.",
                              ["pool"])
        prefill = _gauge("prefill_seconds_per_1k_tokens",
                         "The backend's fitted prefill time per 1,000 uncached input tokens.",
                         ["pool", "backend"])
        guard = _gauge("budget_ineffective", "1 while the efficacy guard limits hedges.",
                       ["pool"])
        inflight = _gauge("inflight_requests", "Logical requests in flight.", ["pool"])
        attempts = _gauge("inflight_attempts", "Attempts in flight.", ["pool", "backend"])
        delay = _gauge("hedge_delay_seconds", "Hedge delay in force.", ["pool", "backend"])
        state = _gauge("backend_state", "1 for the backend's current state.",
                       ["pool", "backend", "state"])
        headroom = _gauge("backend_headroom", "Least share of a quota left, per the backend's "
                          "latest rate-limit headers.", ["pool", "backend"])
        for pool in stats.pools:
            entry = live.get(pool)
            if entry is None:
                continue
            budget = entry["budget"]
            tokens.add_metric([pool], budget["tokens"])
            if budget.get("input_tokens") is not None:
                input_tokens.add_metric([pool], budget["input_tokens"])
            guard.add_metric([pool], 1.0 if budget["ineffective"] else 0.0)
            inflight.add_metric([pool], entry["inflight_requests"])
            for backend in stats.pools[pool].backends:
                b = entry["backends"].get(backend)
                if b is None:
                    continue
                attempts.add_metric([pool, backend], b["inflight"])
                delay.add_metric([pool, backend], b["hedge_delay_ms"] / 1000)
                if b.get("prefill_ms_per_1k") is not None:
                    prefill.add_metric([pool, backend], b["prefill_ms_per_1k"] / 1000)
                for name in STATES:
                    state.add_metric([pool, backend, name], 1.0 if name == b["state"] else 0.0)
                if b.get("headroom") is not None:
                    headroom.add_metric([pool, backend], b["headroom"])
        yield from (tokens, input_tokens, guard, inflight, attempts, delay, prefill, state,
                    headroom)


class Metrics:
    """The app's Prometheus registry and its renderer."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        stats: Stats,
        pools: Mapping[str, PoolRuntime],
        clock: Callable[[], float],
        *,
        read: Callable[[], Reading] | None = None,
    ) -> None:
        """`read` replaces what a scrape reads (the whole server's merged counts and live
        state, under `--workers`); by default, `stats` and `pools` of this process."""

        def local() -> Reading:
            return stats, live_view(pools, clock())

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GatewayCollector(read or local))

    def render_from(self, reading: Reading) -> bytes:
        """The exposition text of a reading taken elsewhere (the whole server's, merged off
        the event loop); the app's registry is not involved."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(GatewayCollector(lambda: reading))
        return generate_latest(registry)

    def render(self) -> bytes:
        """The exposition text (generated under the caller's thread; no I/O)."""
        return generate_latest(self.registry)
