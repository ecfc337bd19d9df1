"""The stats core, fed hand-made request summaries; plain numbers as the clock."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.errors import failure_codes
from gateway.hedge.attempt import (
    CANCELLED_AFTER_TOKEN,
    CANCELLED_BEFORE_TOKEN,
    AttemptKind,
    AttemptRecord,
    Outcome,
)
from gateway.hedge.budget import SuppressReason
from gateway.hedge.pool import PoolRuntime
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
)
from gateway.stats import (
    BucketHistogram,
    CounterRing,
    RequestSummary,
    Stats,
    failure_class,
    latency_saved,
)
from gateway.stats.view import snapshot
from gateway.wire.base import StreamEnd

LAYOUT = {"chat": ["a", "b"]}


def attempt(
    index: int,
    backend: str,
    kind: AttemptKind,
    started: float,
    outcome: Outcome,
    *,
    ttft: float | None = None,
    reason: str | None = None,
    close_s: float | None = None,
    late_events: int = 0,
    failure: str | None = None,
) -> AttemptRecord:
    return AttemptRecord(
        index,
        backend,
        kind,
        started,
        kind != "primary",
        outcome,
        ttft,
        reason,
        close_s,
        late_events,
        failure=failure,
    )


def summary(
    started: float,
    attempts: list[AttemptRecord],
    *,
    winner: int | None = 0,
    client_ttft: float | None = None,
    suppressed: tuple[SuppressReason, ...] = (),
    error: str | None = None,
    relay_end: str | None = "done",
    pool: str = "chat",
    ended: float | None = None,
) -> RequestSummary:
    s = RequestSummary("req", pool, "chat/completions", True, started)
    s.attempts = attempts
    s.suppressed = suppressed
    if winner is not None:
        s.winner = attempts[winner]
        s.committed_at = started + (client_ttft if client_ttft is not None else 0.1)
    s.error = error
    s.relay_end = StreamEnd(relay_end) if winner is not None and relay_end else None
    s.ended = ended if ended is not None else started + 1.0
    return s


def plain(t: float, ttft: float = 0.1, backend: str = "a") -> RequestSummary:
    """A request the primary served without help."""
    return summary(t, [attempt(0, backend, "primary", t, "won", ttft=ttft)], client_ttft=ttft)


def hedge_won(t: float, primary_ran: float = 0.5) -> RequestSummary:
    """The primary on `a` was slow; the hedge on `b` won; the primary was cancelled."""
    return summary(
        t,
        [
            attempt(
                0,
                "a",
                "primary",
                t,
                "lost",
                ttft=primary_ran,
                reason=CANCELLED_BEFORE_TOKEN,
                close_s=0.002,
            ),
            attempt(1, "b", "hedge", t + 0.3, "won", ttft=primary_ran - 0.3),
        ],
        winner=1,
        client_ttft=primary_ran,
    )


def hedge_lost(t: float) -> RequestSummary:
    """A hedge on `b` started, but the primary on `a` won first."""
    return summary(
        t,
        [
            attempt(0, "a", "primary", t, "won", ttft=0.35),
            attempt(
                1,
                "b",
                "hedge",
                t + 0.3,
                "lost",
                ttft=0.05,
                reason=CANCELLED_BEFORE_TOKEN,
                close_s=0.004,
            ),
        ],
        client_ttft=0.35,
    )


def pool_runtime(delay: DelaySettings | None = None) -> PoolRuntime:
    settings = PoolSettings(
        "chat",
        (
            BackendSettings("a", "openai", "m", "http://127.0.0.1:1/v1", group="z1"),
            BackendSettings("b", "openai", "m", "http://127.0.0.1:2/v1", group="z2"),
        ),
        hedging=HedgingSettings(delay=delay or DelaySettings()),
    )
    return PoolRuntime.build(settings, {}, global_hedging=True, now=0.0, rng=random.Random(1))


def view(stats: Stats, now: float, scope: str = "lifetime") -> dict[str, Any]:
    out: dict[str, Any] = snapshot(stats, {}, now)["pools"]["chat"][scope]
    return out


def test_counts_and_rates() -> None:
    stats = Stats(LAYOUT, now=0.0)
    for i in range(7):
        stats.record(plain(float(i)))
    stats.record(hedge_won(10.0))
    stats.record(hedge_won(11.0))
    stats.record(hedge_lost(12.0))
    v = view(stats, 20.0)
    assert v["requests"] == 10
    assert v["attempts"] == 13
    assert v["attempts_per_request"] == {"mean": 1.3, "max": 2}
    assert v["hedges"]["started"] == 3
    assert v["hedges"]["issue_rate"] == 0.3
    assert v["hedges"]["won"] == 2
    assert v["hedges"]["win_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert v["failovers"] == 0
    assert v["losers"]["cancelled"] == 3
    assert v["losers"]["cancelled_before_first_token"] == 1.0
    assert v["losers"]["close_ms"]["count"] == 3
    assert v["losers"]["events_received_after_commit"] == 0
    assert v["errors"] == {}
    assert v["ttft_ms"]["count"] == 10


def test_backend_counts_and_censoring() -> None:
    stats = Stats(LAYOUT, now=0.0)
    stats.record(hedge_won(0.0))
    stats.record(hedge_lost(1.0))
    backends = snapshot(stats, {}, 5.0)["pools"]["chat"]["backends"]
    a, b = backends["a"]["lifetime"], backends["b"]["lifetime"]
    assert (a["attempts"], a["primaries"], a["won"], a["lost"]) == (2, 2, 1, 1)
    assert (b["attempts"], b["hedges"], b["won"], b["lost"], b["hedges_won"]) == (2, 2, 1, 1, 1)
    # the cancelled attempts are censored: counted, but kept out of the quantiles
    assert a["ttft_censored"] == 1 and a["ttft_ms"]["count"] == 1
    assert a["ttft_ms"]["p50"] == pytest.approx(350, rel=0.01)
    assert b["ttft_censored"] == 1 and b["ttft_ms"]["count"] == 1
    assert b["ttft_ms"]["p50"] == pytest.approx(200, rel=0.01)


def test_loser_with_token_is_not_censored() -> None:
    """An attempt whose token arrived in the same tick as the winner's had a real TTFT."""
    stats = Stats(LAYOUT, now=0.0)
    stats.record(
        summary(
            0.0,
            [
                attempt(0, "a", "primary", 0.0, "won", ttft=0.3),
                attempt(1, "b", "hedge", 0.1, "lost", ttft=0.2, reason=CANCELLED_AFTER_TOKEN),
            ],
        )
    )
    v = view(stats, 1.0)
    assert v["losers"]["cancelled"] == 1
    assert v["losers"]["cancelled_before_first_token"] == 0.0
    b = snapshot(stats, {}, 1.0)["pools"]["chat"]["backends"]["b"]["lifetime"]
    assert b["ttft_censored"] == 0 and b["ttft_ms"]["count"] == 1


def test_client_ttft_quantiles_within_sketch_accuracy() -> None:
    stats = Stats(LAYOUT, now=0.0)
    values = [i / 1000 for i in range(1, 1001)]  # 1 ms .. 1 s
    random.Random(3).shuffle(values)
    for i, value in enumerate(values):
        stats.record(plain(i * 0.01, ttft=value))
    ttft = view(stats, 10.0)["ttft_ms"]
    for key, expected in (("p50", 500), ("p90", 900), ("p95", 950), ("p99", 990)):
        assert ttft[key] == pytest.approx(expected, rel=0.011)  # 1 % sketch + 1 rank step
    assert ttft["count"] == 1000


def test_window_expires_but_lifetime_keeps() -> None:
    stats = Stats(LAYOUT, now=0.0, window=60.0)
    stats.record(hedge_won(0.0))  # ends at 1.0
    stats.record(plain(30.0))  # ends at 31.0
    assert view(stats, 40.0, "window")["requests"] == 2
    w = view(stats, 65.0, "window")  # the first one's slice (0-10 s) has left the window
    assert w["requests"] == 1
    assert w["hedges"]["started"] == 0
    assert w["hedges"]["win_rate"] is None
    assert w["latency_saved_ms"]["count"] == 0
    assert w["ttft_ms"]["count"] == 1
    empty = view(stats, 200.0, "window")
    assert empty["requests"] == 0
    assert empty["ttft_ms"] == {"p50": None, "p90": None, "p95": None, "p99": None, "count": 0}
    assert empty["attempts_per_request"] == {"mean": None, "max": None}
    lifetime = view(stats, 200.0)
    assert lifetime["requests"] == 2 and lifetime["hedges"]["won"] == 1
    backend = snapshot(stats, {}, 200.0)["pools"]["chat"]["backends"]["b"]
    assert backend["window"]["attempts"] == 0 and backend["lifetime"]["attempts"] == 1


def test_suppressed_by_reason_and_failovers() -> None:
    stats = Stats(LAYOUT, now=0.0)
    stats.record(
        summary(
            0.0,
            [attempt(0, "a", "primary", 0.0, "won", ttft=0.6)],
            suppressed=(SuppressReason.BUDGET, SuppressReason.BUDGET),
        )
    )
    stats.record(
        summary(
            1.0,
            [attempt(0, "a", "primary", 1.0, "won", ttft=0.1)],
            suppressed=(SuppressReason.DISABLED,),
        )
    )
    stats.record(
        summary(
            2.0,
            [
                attempt(0, "a", "primary", 2.0, "failed", reason="status 503",
                        failure="unavailable"),
                attempt(1, "b", "failover", 2.01, "won", ttft=0.1),
            ],
            winner=1,
        )
    )
    v = view(stats, 5.0)
    assert v["hedges"]["suppressed"] == {
        "max_attempts": 0,
        "no_backend": 0,
        "budget": 2,
        "deadline": 0,
        "ineffective": 0,
        "disabled": 1,
        "cold": 0,
        "key_budget": 0,
    }
    assert v["failovers"] == 1 and v["failovers_won"] == 1
    assert v["hedges"]["started"] == 0
    a = snapshot(stats, {}, 5.0)["pools"]["chat"]["backends"]["a"]["lifetime"]
    assert a["failed"] == 1 and a["failures"] == {"unavailable": 1}


def test_errors_by_class_are_bounded() -> None:
    stats = Stats(LAYOUT, now=0.0)
    failed = [attempt(0, "a", "primary", 0.0, "failed", reason="connect error")]
    stats.record(summary(0.0, failed, winner=None, error="upstream_failed"))
    stats.record(
        summary(
            1.0,
            [attempt(0, "a", "primary", 1.0, "cancelled", ttft=0.2, reason=CANCELLED_BEFORE_TOKEN)],
            winner=None,
            error="client_disconnected",
        )
    )
    stats.record(
        summary(2.0, [attempt(0, "a", "primary", 2.0, "won", ttft=0.1)], relay_end="truncated")
    )
    stats.record(
        summary(3.0, [attempt(0, "a", "primary", 3.0, "won", ttft=0.1)], relay_end="stuck_client")
    )
    stats.record(summary(4.0, failed, winner=None, error="anything a client typed"))
    v = view(stats, 10.0)
    assert v["errors"] == {
        "client_disconnected": 1,
        "other": 1,
        "stream_stuck_client": 1,
        "stream_truncated": 1,
        "upstream_failed": 1,
    }
    assert v["cancelled"] == 1
    assert v["losers"]["cancelled"] == 0


@pytest.mark.parametrize("end", ["shutdown", "stuck_client", "client_gone", "too_long",
                                 "failed", "truncated", "upstream_error"])
def test_every_early_stream_end_has_its_own_error_class(end: str) -> None:
    """A stream cut by a graceful shutdown (or ended any other early way) is counted as
    `stream_<end>`, never folded into `other`."""
    stats = Stats(LAYOUT, now=0.0)
    stats.record(summary(0.0, [attempt(0, "a", "primary", 0.0, "won", ttft=0.1)], relay_end=end))
    assert view(stats, 5.0)["errors"] == {f"stream_{end}": 1}


def test_unknown_pool_and_backend_never_become_keys() -> None:
    stats = Stats(LAYOUT, now=0.0)
    stats.record(
        summary(0.0, [attempt(0, "a", "primary", 0.0, "won", ttft=0.1)], pool="gpt-unknown")
    )
    stats.record(plain(1.0, backend="zz"))
    snap = snapshot(stats, {}, 5.0)
    assert list(snap["pools"]) == ["chat"]
    assert list(snap["pools"]["chat"]["backends"]) == ["a", "b"]
    assert snap["pools"]["chat"]["lifetime"]["requests"] == 1
    assert stats.unrecorded == 1


def test_latency_saved_and_loser_details() -> None:
    stats = Stats(LAYOUT, now=0.0)
    stats.record(hedge_won(0.0, primary_ran=0.8))
    stats.record(hedge_won(1.0, primary_ran=1.2))
    late = hedge_won(2.0, primary_ran=1.0)
    late.attempts[0].late_events = 2
    stats.record(late)
    v = view(stats, 10.0)
    saved = v["latency_saved_ms"]
    assert saved["count"] == 3
    assert saved["p50"] == pytest.approx(1000, rel=0.011)
    # DDSketch ranks at q * (n - 1): of three values, p99 is still the middle one
    assert saved["p99"] == pytest.approx(1000, rel=0.011)
    assert v["losers"]["events_received_after_commit"] == 2
    assert v["losers"]["close_ms"]["p50"] == pytest.approx(2.0, rel=0.01)


def test_latency_saved_only_when_a_hedge_beat_a_running_primary() -> None:
    assert latency_saved(hedge_won(0.0, primary_ran=0.7)) == pytest.approx(0.7)
    assert latency_saved(hedge_lost(0.0)) is None
    failover = summary(
        0.0,
        [
            attempt(0, "a", "primary", 0.0, "failed", reason="status 500"),
            attempt(1, "b", "failover", 0.01, "won", ttft=0.1),
        ],
        winner=1,
    )
    assert latency_saved(failover) is None


def test_snapshot_reads_live_pool_state() -> None:
    runtime = pool_runtime(DelaySettings(mode="fixed", value=0.25))
    runtime.balancer.pause("b", 30.0, 0.0)
    runtime.inflight_requests = 3
    stats = Stats.for_pools({"chat": runtime}, now=0.0)
    snap = snapshot(stats, {"chat": runtime}, 10.0)
    pool = snap["pools"]["chat"]
    assert pool["inflight_requests"] == 3
    assert pool["budget"]["tokens"] == 10.0
    assert pool["budget"]["ratio"] == 0.1 and pool["budget"]["burst"] == 10.0
    assert pool["budget"]["ineffective"] is False
    a, b = pool["backends"]["a"], pool["backends"]["b"]
    assert (a["state"], a["reason"], a["group"]) == ("ok", None, "z1")
    assert a["hedge_delay_ms"] == 250.0 and a["hedge_delay_mode"] == "fixed"
    assert b["state"] == "paused" and "retry-after" in b["reason"]
    assert snap["uptime_s"] == 10.0
    json.dumps(snap, allow_nan=False)


def test_delay_mode_initial_then_adaptive() -> None:
    runtime = pool_runtime(DelaySettings(initial=0.5, min_samples=20))
    stats = Stats.for_pools({"chat": runtime}, now=0.0)
    a = snapshot(stats, {"chat": runtime}, 1.0)["pools"]["chat"]["backends"]["a"]
    assert (a["hedge_delay_ms"], a["hedge_delay_mode"]) == (500.0, "initial")
    for i in range(40):
        runtime.delays["a"].observe(0.2, 1.0 + i * 0.01)
    runtime.refresh_delays(5.0)
    a = snapshot(stats, {"chat": runtime}, 5.0)["pools"]["chat"]["backends"]["a"]
    assert a["hedge_delay_mode"] == "adaptive"
    assert a["hedge_delay_ms"] == pytest.approx(200, rel=0.02)
    # the default quantile is auto: 1 - 0.8 x the budget ratio (0.1)
    assert (a["hedge_delay_quantile"], a["hedge_delay_rule"]) == (0.92, "auto")


def test_a_pinned_quantile_shows_as_such() -> None:
    runtime = pool_runtime(DelaySettings(quantile=0.99))
    stats = Stats.for_pools({"chat": runtime}, now=0.0)
    a = snapshot(stats, {"chat": runtime}, 1.0)["pools"]["chat"]["backends"]["a"]
    assert (a["hedge_delay_quantile"], a["hedge_delay_rule"]) == (0.99, "pinned")


def test_failures_are_counted_by_their_code_not_their_text() -> None:
    stats = Stats(LAYOUT, now=0.0)
    failed = [
        ("malformed stream: SSE line longer than 10 bytes", "protocol_error"),
        ("unexpected content type text/html", "protocol_error"),
        ("status 502", "server_error"),
        ("status 500", "server_error"),
        ("connect error", "connect_error"),
        ("made up by a provider", "not_a_code"),
        ("no code at all", None),
    ]
    for i, (reason, code) in enumerate(failed):
        stats.record(summary(float(i), [
            attempt(0, "a", "primary", float(i), "failed", reason=reason, failure=code)
        ], winner=None, error="upstream_failed"))
    a = snapshot(stats, {}, 10.0)["pools"]["chat"]["backends"]["a"]["lifetime"]
    assert a["failures"] == {"protocol_error": 2, "server_error": 2, "connect_error": 1,
                             "other": 1, "unknown": 1}
    known = failure_codes()
    assert failure_class(attempt(0, "a", "primary", 0.0, "failed", failure="unavailable"),
                         known) == "unavailable"


def test_counter_ring_drops_stale_and_old() -> None:
    ring = CounterRing(60.0)
    ring.add({"x": 1}, 0.0)
    ring.add({"x": 2}, 55.0)
    assert ring.total(59.0)["x"] == 3
    assert ring.total(61.0)["x"] == 2  # slice 0-10 s is out
    ring.add({"x": 5}, 125.0)  # reuses the slot of slice 0 (ids 0 and 12 share it)
    ring.add({"x": 7}, 1.0)  # older than everything the slot now holds: dropped
    assert ring.total(125.0)["x"] == 5


def test_bucket_histogram_is_cumulative() -> None:
    h = BucketHistogram((0.1, 0.5))
    for value in (0.05, 0.1, 0.3, 2.0):
        h.add(value)
    assert h.cumulative() == [("0.1", 2), ("0.5", 3), ("+Inf", 4)]
    assert h.count == 4 and h.sum == pytest.approx(2.45)


def test_metrics_are_per_app_and_read_at_scrape_time() -> None:
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.stats.prometheus import Metrics

    runtime = pool_runtime()
    stats_1 = Stats.for_pools({"chat": runtime}, now=0.0)
    stats_2 = Stats.for_pools({"chat": runtime}, now=0.0)
    metrics_1 = Metrics(stats_1, {"chat": runtime}, lambda: 5.0)
    metrics_2 = Metrics(stats_2, {"chat": runtime}, lambda: 5.0)
    stats_1.record(hedge_won(0.0))

    def value(metrics: Metrics, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(metrics.render().decode()):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        raise AssertionError(f"no sample {name} {labels}")

    assert value(metrics_1, "hedge_gateway_hedges_won_total", pool="chat") == 1
    assert value(metrics_2, "hedge_gateway_hedges_won_total", pool="chat") == 0
    assert value(metrics_1, "hedge_gateway_attempts_total", pool="chat", backend="b",
                 kind="hedge", outcome="won") == 1
    assert value(metrics_1, "hedge_gateway_client_ttft_seconds_count", pool="chat") == 1
    assert value(metrics_1, "hedge_gateway_backend_state", pool="chat", backend="a",
                 state="ok") == 1
    runtime.inflight_requests = 4  # gauges are read live
    assert value(metrics_2, "hedge_gateway_inflight_requests", pool="chat") == 4
    assert b"hedge_gateway" not in generate_latest(REGISTRY)


def test_panic_refusals_and_time_left_are_counted_and_shown() -> None:
    """`panic` and `refused_no_backend` per pool (stats and metrics); per backend
    its state with the seconds left (stats and the `stats` command's table)."""
    import io

    from prometheus_client.parser import text_string_to_metric_families

    from gateway.stats.prometheus import Metrics
    from gateway.stats.table import render

    runtime = pool_runtime()
    stats = Stats.for_pools({"chat": runtime}, now=0.0)
    panicked = plain(1.0)
    panicked.panic = True
    stats.record(panicked)
    stats.record(summary(2.0, [], winner=None, error="no_backend_available"))
    runtime.balancer.pause("b", 12.5, 0.0)
    snap = snapshot(stats, {"chat": runtime}, 2.5)
    pool = snap["pools"]["chat"]
    for scope in ("lifetime", "window"):
        assert pool[scope]["panic"] == 1 and pool[scope]["refused_no_backend"] == 1
    a, b = pool["backends"]["a"], pool["backends"]["b"]
    assert (a["state"], a["seconds_left"]) == ("ok", None)
    assert (b["state"], b["seconds_left"]) == ("paused", 10.0)

    samples = {
        (s.name, s.labels.get("pool")): s.value
        for family in text_string_to_metric_families(
            Metrics(stats, {"chat": runtime}, lambda: 2.5).render().decode()
        )
        for s in family.samples
    }
    assert samples[("hedge_gateway_panic_total", "chat")] == 1
    assert samples[("hedge_gateway_refused_no_backend_total", "chat")] == 1

    out = io.StringIO()
    render(json.loads(json.dumps(snap)), out)
    table = out.getvalue()
    assert "paused 10.0s (retry-after)" in table
    assert "panic" in table and "no backend" in table
