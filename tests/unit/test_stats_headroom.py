"""Quota headroom in the stats: skips counted per pool and per backend, the backend's `low`
state and headroom in `/hedge/stats`, in the metrics and over several workers."""

from __future__ import annotations

import io
import json

from prometheus_client.parser import text_string_to_metric_families

from gateway.stats import Stats
from gateway.stats.merge import combined_live, document, export, merge
from gateway.stats.prometheus import Metrics
from gateway.stats.table import render
from gateway.stats.view import live_view, snapshot
from tests.unit.test_stats import plain, pool_runtime

WALL = 1735689600.0
LOW = {"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "20",
       "x-ratelimit-reset-tokens": "8s"}


def test_skips_are_counted_per_pool_and_backend_and_the_state_shows_low() -> None:
    runtime = pool_runtime()
    runtime.balancer.observe_quota("a", LOW, 1.0, WALL)
    stats = Stats.for_pools({"chat": runtime}, now=0.0)
    skipped_twice = plain(1.0, backend="b")
    skipped_twice.headroom_skips = ["a", "a"]  # the primary's choice and a failover's
    stats.record(skipped_twice)
    stats.record(plain(1.5, backend="b"))
    snap = snapshot(stats, {"chat": runtime}, 2.0)
    pool = snap["pools"]["chat"]
    for scope in ("lifetime", "window"):
        assert pool[scope]["headroom_skips"] == 2
        assert pool["backends"]["a"][scope]["headroom_skips"] == 2
        assert pool["backends"]["b"][scope]["headroom_skips"] == 0
    a, b = pool["backends"]["a"], pool["backends"]["b"]
    assert (a["state"], a["seconds_left"], a["headroom"], a["headroom_resource"]) == (
        "low", 7.0, 0.02, "tokens")
    assert a["reason"] == "2.0% of its tokens quota left"
    assert (b["state"], b["headroom"], b["headroom_resource"]) == ("ok", None, None)
    json.dumps(snap, allow_nan=False)

    samples = {
        (s.name, s.labels.get("backend"), s.labels.get("state")): s.value
        for family in text_string_to_metric_families(
            Metrics(stats, {"chat": runtime}, lambda: 2.0).render().decode())
        for s in family.samples
    }
    assert samples[("hedge_gateway_headroom_skips_total", "a", None)] == 2
    assert samples[("hedge_gateway_headroom_skips_total", "b", None)] == 0
    assert samples[("hedge_gateway_backend_state", "a", "low")] == 1
    assert samples[("hedge_gateway_backend_state", "a", "ok")] == 0
    assert samples[("hedge_gateway_backend_headroom", "a", None)] == 0.02
    assert ("hedge_gateway_backend_headroom", "b", None) not in samples  # unknown: no sample

    out = io.StringIO()
    render(json.loads(json.dumps(snap)), out)
    assert "low 7.0s (2.0% of its tokens quota left)" in out.getvalue()


def test_after_the_reset_the_state_is_ok_and_the_headroom_unknown() -> None:
    runtime = pool_runtime()
    runtime.balancer.observe_quota("a", LOW, 1.0, WALL)
    a = live_view({"chat": runtime}, 9.0)["chat"]["backends"]["a"]
    assert (a["state"], a["seconds_left"], a["headroom"]) == ("ok", None, None)


def test_workers_merge_skips_and_the_least_headroom() -> None:
    one, two = pool_runtime(), pool_runtime()
    one.balancer.observe_quota("a", {**LOW, "x-ratelimit-remaining-tokens": "400"}, 0.0, WALL)
    two.balancer.observe_quota("a", LOW, 0.0, WALL)
    exports = []
    for index, runtime in enumerate((one, two)):
        stats = Stats.for_pools({"chat": runtime}, now=0.0)
        skipped = plain(0.5, backend="b")
        skipped.headroom_skips = ["a"]
        stats.record(skipped)
        exports.append(export(stats, live_view({"chat": runtime}, 1.0), 1.0,
                              {"worker": index, "pid": 100 + index}))
    doc = document(merge(exports))
    pool = doc["pools"]["chat"]
    assert pool["lifetime"]["headroom_skips"] == 2
    assert pool["backends"]["a"]["lifetime"]["headroom_skips"] == 2
    a = pool["backends"]["a"]
    assert (a["state"], a["headroom"], a["headroom_resource"]) == ("low", 0.02, "tokens")
    only_one_low = combined_live([{"worker": 0, "pools": live_view({"chat": one}, 1.0)}])
    assert only_one_low["chat"]["backends"]["a"]["state"] == "ok"  # 40 % left: room
