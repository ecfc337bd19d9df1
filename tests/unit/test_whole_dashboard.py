"""The dashboard's data for the whole server under `serve --workers N`: the
series sampled from the workers' merged exports, and their last races merged. Plain numbers
as the clock; exports pass through JSON as they do through the stats directory; no sockets."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.hedge.pool import PoolRuntime
from gateway.stats import Stats
from gateway.stats.merge import export, lifetime_only, merge
from gateway.stats.races import CAPACITY, merge_races, races_view
from gateway.stats.series import Series, own_reading, whole_reading
from gateway.stats.view import live_view
from tests.unit.test_stats import LAYOUT, hedge_won, plain, pool_runtime


@dataclass
class Worker:
    """One worker process: its pid, its own stats (started when it did) and its pool."""

    pid: int
    started: float
    stats: Stats = field(init=False)
    runtime: PoolRuntime = field(default_factory=pool_runtime)

    def __post_init__(self) -> None:
        self.stats = Stats(LAYOUT, now=self.started)

    def serve(self, t: float, n: int = 1, ttft: float = 0.1) -> None:
        for i in range(n):
            self.stats.record(plain(t + i * 0.01, ttft=ttft))

    def export(self, now: float) -> dict[str, Any]:
        item = export(self.stats, live_view({"chat": self.runtime}, now), now,
                      {"worker": self.pid % 10, "pid": self.pid})
        wire: dict[str, Any] = json.loads(json.dumps(item))  # as through the files
        return wire


def whole(workers: list[Worker], now: float, retired: dict[str, Any] | None = None) -> Any:
    exports = [w.export(now) for w in workers]
    return whole_reading(exports + ([] if retired is None else [retired]), now)


def rates(series: Series, key: str = "requests") -> list[float]:
    return [p[key] for p in series.view()["pools"]["chat"]]


def test_the_series_of_two_workers_is_the_whole_servers() -> None:
    """Rates summed over the workers, quantiles from the merged sketches (the same as one
    process that served every request), gauges combined."""
    one, two = Worker(101, 0.0), Worker(102, 0.0)
    single = Worker(100, 0.0)  # one process that serves what both serve
    series, reference = Series(0.0), Series(0.0)

    def sample(now: float) -> None:
        series.sample(whole([one, two], now), now)
        reference.sample(own_reading(single.stats, live_view({"chat": single.runtime}, now),
                                     now, single.pid), now)

    sample(1.0)
    for worker, n, ttft in ((one, 3, 0.05), (two, 2, 0.3)):  # quantiles tell them apart
        worker.serve(1.2, n, ttft)
        single.serve(1.2, n, ttft)
    one.stats.record(hedge_won(1.5))
    single.stats.record(hedge_won(1.5))
    two.runtime.inflight_requests = 2
    sample(2.0)
    first, second = series.view()["pools"]["chat"]
    assert first["requests"] == 0.0  # the baseline
    assert (second["requests"], second["hedges_started"], second["hedges_won"]) == (6, 1, 1)
    expected = reference.view()["pools"]["chat"][1]
    for key in ("client_ttft_ms", "loser_close_ms_p99", "requests", "hedges_started"):
        assert second[key] == expected[key], key
    assert second["backends"]["b"]["ttft_ms"] == expected["backends"]["b"]["ttft_ms"]
    assert second["inflight"] == 2
    budget = one.runtime.budget.tokens(2.0) + two.runtime.budget.tokens(2.0)
    assert second["budget_tokens"] == pytest.approx(budget, abs=0.01)  # the host's bucket
    assert second["backends"]["a"]["state"] == "ok"


def test_a_worker_replaced_mid_run_neither_goes_negative_nor_spikes() -> None:
    """Worker 2 dies after its last publish; the supervisor folds its lifetime into the
    retired numbers; worker 3 replaces it with counters from zero. Each point shows exactly
    the requests served in its second."""
    one, two = Worker(1, 0.0), Worker(2, 0.0)
    series = Series(0.0)
    series.sample(whole([one, two], 1.0), 1.0)
    served: list[int] = []
    retired: dict[str, Any] | None = None
    alive = [one, two]
    for second in range(1, 12):
        now = second + 1.0
        if second == 5:  # worker 2 is gone: its lifetime kept, a replacement starts
            retired = lifetime_only(two.export(now - 1.0))
            three = Worker(3, now - 0.8)
            alive = [one, three]
        for worker in alive:
            worker.serve(now - 0.5, 4)
        served.append(4 * len(alive))
        series.sample(whole(alive, now, retired), now)
    assert rates(series)[1:] == served  # no dip, no catch-up spike
    assert all(r >= 0 for key in ("requests", "tokens_output") for r in rates(series, key))


def test_a_replacement_worker_does_not_count_its_peers_past() -> None:
    """The sampler of a worker started late: its peer's hundreds of earlier requests are
    no point's; from its first point on, it counts what the server serves."""
    old = Worker(1, 0.0)
    old.serve(10.0, 500)
    new = Worker(3, 100.0)
    series = Series(0.0)
    series.sample(whole([old, new], 101.0), 101.0)
    old.serve(101.3, 2)
    new.serve(101.5, 3)
    series.sample(whole([old, new], 102.0), 102.0)
    assert rates(series) == [0.0, 5.0]


def test_a_peer_first_seen_long_after_it_started_counts_from_then() -> None:
    """A peer missing from a worker's first point (its file stale) that shows up later with
    hundreds of requests behind it: they are no point's, not a spike."""
    old = Worker(1, 0.0)
    old.serve(10.0, 500)
    new = Worker(3, 100.0)
    series = Series(0.0)
    series.sample(whole([new], 100.5), 100.5)
    new.serve(101.2, 2)
    series.sample(whole([old, new], 102.0), 102.0)
    assert rates(series) == [0.0, pytest.approx(2 / 1.5, abs=0.001)]


def test_a_peer_back_after_a_gap_adds_what_it_did_meanwhile_once() -> None:
    """A peer whose file was stale (left out for two seconds) comes back: its requests of
    the gap show once, in the point it is back in, and the total stays exact."""
    one, two = Worker(1, 0.0), Worker(2, 0.0)
    series = Series(0.0)
    series.sample(whole([one, two], 1.0), 1.0)
    for second in range(1, 6):
        now = second + 1.0
        one.serve(now - 0.5)
        two.serve(now - 0.5, 2)
        series.sample(whole([one] if second in (2, 3) else [one, two], now), now)
    assert rates(series)[1:] == [3, 1, 1, 7, 3]
    assert sum(rates(series)) == 15


def test_a_late_publishing_sibling_counts_from_zero() -> None:
    """Two workers forked together; the second's file appears only after it has served:
    what it served before is counted, not taken as a baseline."""
    one, two = Worker(1, 0.0), Worker(2, 0.1)
    series = Series(0.0)
    series.sample(whole([one], 1.0), 1.0)
    two.serve(1.5, 3)
    series.sample(whole([one, two], 2.0), 2.0)
    assert rates(series) == [0.0, 3.0]


def test_the_retired_numbers_take_no_part_in_the_rates() -> None:
    """Folding a dead worker's lifetime into the retired numbers is no activity."""
    one, two = Worker(1, 0.0), Worker(2, 0.0)
    two.serve(0.5, 40)
    series = Series(0.0)
    series.sample(whole([one, two], 1.0), 1.0)
    series.sample(whole([one], 2.0, lifetime_only(two.export(1.5))), 2.0)
    assert rates(series) == [0.0, 0.0]


# -- races ------------------------------------------------------------------------------------


def test_the_races_of_every_worker_merge_newest_last_and_bounded() -> None:
    """Each worker keeps its last 50; the merge keeps the server's newest 50, in arrival
    order on the host's clock, each marked with its worker, `t` from the server's start."""
    one, two = Worker(1, 0.0), Worker(2, 30.0)  # the second started later (a replacement)
    for i in range(40):
        one.serve(31.0 + i)  # arrivals 31.0 .. 70.0
        two.serve(31.5 + i)  # arrivals 31.5 .. 70.5
    merged = merge([one.export(80.0), two.export(80.0)])
    doc = races_view(merged["races"], 0.0)
    races = doc["races"]
    assert doc["capacity"] == CAPACITY and len(races) == CAPACITY
    assert [r["t"] for r in races] == sorted(r["t"] for r in races)
    assert races[-1]["t"] == 70.5 and races[-1]["pid"] == 2  # not 40.5: one time axis
    assert races[0]["t"] == 46.0  # the oldest of the newest 50
    assert {r["pid"] for r in races} == {1, 2} and "at" not in races[0]
    assert json.loads(json.dumps(doc)) == doc


def test_races_merge_associatively_and_a_dead_worker_leaves_none() -> None:
    workers = [Worker(pid, 0.0) for pid in (1, 2, 3)]
    for i in range(30):
        for worker in workers:
            worker.serve(1.0 + i + worker.pid / 10)
    items = [w.export(40.0) for w in workers]
    assert merge([merge(items[:2]), items[2]])["races"] == merge(items)["races"]
    assert lifetime_only(items[0])["races"] == []
    assert merge_races([[], []]) == []


@pytest.mark.parametrize("race", [{"id": "x"}, {"at": "1"}, {"at": True}, "race", 3])
def test_a_malformed_race_is_refused_with_value_error(race: Any) -> None:
    item = Worker(1, 0.0).export(1.0)
    item["races"] = [race]
    with pytest.raises(ValueError, match="race"):
        merge([item])


def test_one_process_serves_its_races_as_before() -> None:
    """Without workers: `t` from this process's start, no worker marks."""
    worker = Worker(1, 5.0)
    worker.serve(7.25)
    (race,) = worker.stats.races.view()["races"]
    assert race["t"] == 2.25 and set(race) >= {"id", "pool", "attempts", "winner"}
    assert not {"at", "pid", "worker"} & set(race)
