"""Whole-server stats: exports of several processes merge into what one process that
saw every request would report. Plain numbers as the clock; no files, no sockets."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.hedge.latency import LifetimeSketch, WindowedSketch, merge_states, quantiles_of
from gateway.stats import Stats
from gateway.stats.merge import combined_live, document, export, lifetime_only, merge
from gateway.stats.prometheus import Metrics
from gateway.stats.shared import MAX_AGE, Peers, retire
from gateway.stats.view import live_view, snapshot
from tests.unit.test_stats import LAYOUT, hedge_lost, hedge_won, plain, pool_runtime

NOW = 30.0


def traffic(seed: int, n: int) -> list[Any]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t = rng.uniform(0.0, 25.0)
        kind = rng.random()
        if kind < 0.7:
            out.append(plain(t, ttft=rng.lognormvariate(-2.0, 0.5), backend=rng.choice("ab")))
        elif kind < 0.85:
            out.append(hedge_won(t, primary_ran=rng.uniform(0.4, 2.0)))
        else:
            out.append(hedge_lost(t))
    return sorted(out, key=lambda s: s.ended)


def fed(summaries: list[Any]) -> Stats:
    stats = Stats(LAYOUT, now=0.0)
    for s in summaries:
        stats.record(s)
    return stats


def scopes(doc: dict[str, Any]) -> dict[str, Any]:
    """The counted parts of a document (what the merge must reproduce exactly)."""
    pool = doc["pools"]["chat"]
    return {
        "pool": {scope: pool[scope] for scope in ("lifetime", "window")},
        "backends": {b: {scope: v[scope] for scope in ("lifetime", "window")}
                     for b, v in pool["backends"].items()},
    }


def test_two_exports_merge_into_what_one_process_would_count() -> None:
    first, second = traffic(1, 300), traffic(2, 200)
    whole = fed(sorted(first + second, key=lambda s: s.ended))
    exports = [export(fed(part), {}, NOW, {"worker": i, "pid": 100 + i})
               for i, part in enumerate((first, second))]
    merged = document(merge(exports))
    expected = snapshot(whole, {}, NOW)
    assert scopes(merged) == scopes(expected)  # counts summed, quantiles of the union, exactly
    assert merged["pools"]["chat"]["lifetime"]["requests"] == 500
    assert merged["pools"]["chat"]["lifetime"]["ttft_ms"]["count"] == 500
    assert [w["pid"] for w in merged["workers"]] == [100, 101]
    json.dumps(merged, allow_nan=False)


def test_merge_is_associative_and_survives_json() -> None:
    parts = [export(fed(traffic(seed, 50)), {}, NOW, {"worker": seed, "pid": seed})
             for seed in range(3)]
    wire = [json.loads(json.dumps(p)) for p in parts]
    left = merge([merge(wire[:2]), wire[2]])
    flat = merge(wire)
    assert scopes(document(left)) == scopes(document(flat))


def test_internal_errors_add_up_over_the_workers() -> None:
    parts = []
    for seed, bugs in ((1, 2), (2, 3)):
        stats = fed(traffic(seed, 10))
        stats.internal_errors = bugs
        parts.append(export(stats, {}, NOW, {"worker": seed, "pid": seed}))
    assert document(merge(parts))["internal_errors"] == 5
    assert document(merge([merge(parts), parts[0]]))["internal_errors"] == 7


def test_one_export_reads_like_the_single_process_snapshot() -> None:
    runtime = pool_runtime()
    runtime.inflight_requests = 2
    runtime.balancer.pause("b", 30.0, 0.0)
    stats = fed(traffic(5, 80))
    live = live_view({"chat": runtime}, NOW)
    doc = document(export(stats, live, NOW, {"worker": 0, "pid": 1}))
    single = snapshot(stats, {"chat": runtime}, NOW)
    workers = doc["pools"]["chat"].pop("workers")
    assert doc.pop("workers") == [{"worker": 0, "pid": 1, "age_s": 0.0}]
    assert doc == single
    assert workers[0]["requests"] == 80 and workers[0]["inflight_requests"] == 2


def test_live_state_combines_per_worker() -> None:
    one, two = pool_runtime(), pool_runtime()
    one.inflight_requests, two.inflight_requests = 1, 4
    two.balancer.pause("b", 30.0, 0.0)
    workers = [{"worker": i, "pools": live_view({"chat": rt}, 1.0)}
               for i, rt in enumerate((one, two))]
    chat = combined_live(workers)["chat"]
    assert chat["inflight_requests"] == 5
    assert chat["budget"]["burst"] == 20.0 and chat["budget"]["tokens"] == 20.0
    assert chat["budget"]["min_per_second"] == 1.0
    assert chat["backends"]["b"]["state"] == "paused"  # the worst of the workers
    assert chat["backends"]["a"]["state"] == "ok"


def test_prometheus_reads_the_merged_server() -> None:
    a, b = fed(traffic(1, 30)), fed(traffic(2, 20))
    runtime = pool_runtime()
    exports = [export(s, live_view({"chat": runtime}, NOW), NOW, {"worker": i, "pid": i})
               for i, s in enumerate((a, b))]
    from gateway.stats.merge import rebuild

    stats, live, _now = rebuild(merge(exports))
    text = Metrics(Stats(LAYOUT, now=0.0), {}, lambda: NOW,
                   read=lambda: (stats, live)).render().decode()
    total = sum(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("hedge_gateway_requests_total{"))
    assert total == 50
    assert 'hedge_gateway_budget_tokens{pool="chat"} 20.0' in text


@pytest.mark.parametrize("bad", [
    {"format": "other"},
    {"format": "hedge-gateway-stats/1", "window_s": 60, "uptime_s": 1, "workers": [],
     "pools": {"chat": {"lifetime": {"requests": -1}}}},
    {"format": "hedge-gateway-stats/1", "window_s": 60, "uptime_s": 1, "workers": [],
     "pools": {"chat": "x"}},
    {"format": "hedge-gateway-stats/1", "pools": {}, "workers": []},
    {"format": "hedge-gateway-stats/1", "window_s": 60, "uptime_s": 1, "pools": {},
     "workers": ["x"]},
])
def test_malformed_exports_are_refused_with_value_error(bad: dict[str, Any]) -> None:
    good = export(fed(traffic(1, 5)), {}, NOW, {"worker": 0, "pid": 0})
    with pytest.raises(ValueError):
        merge([good, bad])


def test_windows_of_different_length_do_not_merge() -> None:
    a = export(Stats(LAYOUT, now=0.0, window=60.0), {}, NOW, {"worker": 0})
    b = export(Stats(LAYOUT, now=0.0, window=30.0), {}, NOW, {"worker": 1})
    with pytest.raises(ValueError, match="different windows"):
        merge([a, b])


def test_sketch_states_merge_exactly() -> None:
    rng = random.Random(3)
    values = [rng.lognormvariate(-1.0, 1.0) for _ in range(2000)]
    whole, left, right = LifetimeSketch(), LifetimeSketch(), LifetimeSketch()
    for i, v in enumerate(values):
        whole.add(v)
        (left if i % 3 else right).add(v)
    qs = (0.5, 0.9, 0.99)
    assert quantiles_of(merge_states([left.state(), right.state()]), qs) == whole.quantiles(qs)
    absorbed = LifetimeSketch()
    absorbed.absorb(left.state())
    absorbed.absorb(right.state())
    assert absorbed.quantiles(qs) == whole.quantiles(qs) and absorbed.count == 2000


def test_windowed_absorb_counts_at_now_and_ages_out() -> None:
    source = WindowedSketch(60.0)
    for i in range(10):
        source.add(0.1 * (i + 1), float(i))
    target = WindowedSketch(60.0)
    target.absorb(source.state(10.0), 10.0)
    assert target.count(10.0) == 10
    assert target.quantile(0.5, 10.0) == source.quantile(0.5, 10.0)
    assert target.count(200.0) == 0


@pytest.mark.parametrize("state", [
    {"accuracy": 0.02, "zero": 0, "bins": []},
    {"accuracy": 0.01, "zero": 0, "bins": [[1.5, 1]]},
    {"accuracy": 0.01, "zero": 0, "bins": [[1, -2]]},
])
def test_foreign_or_malformed_sketch_states_are_refused(state: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        merge_states([state])


def test_a_dead_workers_lifetime_stays_and_its_window_goes() -> None:
    dead = export(fed(traffic(1, 40)), {}, NOW, {"worker": 0, "pid": 1})
    live = export(fed(traffic(2, 10)), {}, NOW, {"worker": 1, "pid": 2})
    doc = document(merge([live, lifetime_only(dead)]))
    chat = doc["pools"]["chat"]
    assert chat["lifetime"]["requests"] == 50 and chat["lifetime"]["ttft_ms"]["count"] == 50
    assert chat["window"]["requests"] == document(live)["pools"]["chat"]["window"]["requests"]
    assert [w["pid"] for w in doc["workers"]] == [2]  # no live state of the dead one


def test_peers_read_fresh_files_and_the_retired_numbers(tmp_path: Path) -> None:
    """The file shell: a worker sees its peers' files no older than MAX_AGE, never its own,
    plus the lifetime numbers of retired workers."""
    mine, peer, dead = (Peers(tmp_path, i, pid=10 + i) for i in range(3))
    for index, p in enumerate((mine, peer, dead)):
        p.publish(export(fed(traffic(index, 5 + index)), {}, NOW, {"worker": index}), NOW)
    assert sorted(w["worker"] for item in mine.read(NOW + 1.0) for w in item["workers"]) == [1, 2]
    assert mine.read(NOW + MAX_AGE + 0.1) == []  # too old: left out
    retire(tmp_path, 2)
    items = mine.read(NOW + 1.0)
    assert [w["worker"] for item in items for w in item["workers"]] == [1]
    assert document(merge(items))["pools"]["chat"]["lifetime"]["requests"] == 6 + 7


def test_a_peer_reading_while_a_worker_is_retired_counts_it_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor retires a dead worker while live workers read the directory: a read
    just before its file goes (the retired numbers already hold it) and just after must both
    count it once. Removing the file first made the server's counters dip (a Prometheus
    counter reset); writing first without naming it would count it twice."""
    mine, peer, dead = (Peers(tmp_path, i, pid=10 + i) for i in range(3))
    for index, p in enumerate((mine, peer, dead)):
        who = {"worker": index, "pid": 10 + index}
        p.publish(export(fed(traffic(index, 5 + index)), {}, NOW, who), NOW)

    def total() -> int:
        requests: int = document(merge(mine.read(NOW + 1.0)))["pools"]["chat"]["lifetime"][
            "requests"]
        return requests

    seen: list[int] = []
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        seen.append(total())  # the dead worker's file still there
        real_unlink(self, missing_ok=missing_ok)
        seen.append(total())  # and gone

    monkeypatch.setattr(Path, "unlink", unlink)
    retire(tmp_path, 2)
    assert seen == [6 + 7, 6 + 7]


def test_a_bad_peer_file_is_left_out(tmp_path: Path) -> None:
    mine, peer = Peers(tmp_path, 0, pid=1), Peers(tmp_path, 1, pid=2)
    peer.publish(export(fed(traffic(1, 3)), {}, NOW, {"worker": 1}), NOW)
    bad = {"written_at": NOW, "export": {"format": "x", "workers": [{"worker": 2, "pools": {}}]}}
    (tmp_path / "worker-2.json").write_text(json.dumps(bad))
    (tmp_path / "worker-3.json").write_text("{not json")
    assert [w["worker"] for item in mine.read(NOW) for w in item["workers"]] == [1]


def test_a_pool_a_reload_removed_leaves_the_whole_server_too(tmp_path: Path) -> None:
    """A dead worker's retired numbers (or a peer's file) may still hold a pool the current
    configuration no longer has: the whole server's document shows the pools in force only,
    as one process does after the same reload."""
    from gateway.stats.shared import StatsSource

    mine, dead = Peers(tmp_path, 0, pid=10), Peers(tmp_path, 1, pid=11)
    old = Stats({**LAYOUT, "removed": ["a"]}, now=0.0)
    for summary in traffic(3, 5):
        old.record(summary)
    dead.publish(export(old, {}, NOW, {"worker": 1}), NOW)
    retire(tmp_path, 1)
    assert "removed" in mine.read(NOW)[0]["pools"]  # the retired numbers still hold it
    source = StatsSource(fed(traffic(4, 5)), {"chat": pool_runtime()}, lambda: NOW, mine)
    doc = source.document()
    assert list(doc["pools"]) == ["chat"]
    assert doc["pools"]["chat"]["lifetime"]["requests"] == 10  # the dead worker's chat counts
