"""Operational reads are bounded and can be put behind a key, over real sockets.

`/hedge/series` and `/hedge/races` are built at most once per second however many reads
arrive (counted by the app's caches, never timed), and never answer more than their size
cap; with `server.ops_keys` every operational read (/hedge/*, /metrics, /dashboard) needs
one of the keys, as Bearer or as a browser's Basic password, while the probes stay open.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import gateway.dashboard as dashboard
from gateway.dashboard import CACHE_KEYS, PerSecond, build_dashboard_router, capped
from gateway.settings import ServerSettings
from gateway.stats.record import Stats
from gateway.stats.series import Reading, Series
from gateway.stats.shared import StatsSource
from tests.harness import LoopThread, UpstreamFactory
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import MESSAGES, Gateway, GatewayFactory, wait_for

OPS_KEY = "ops-key-0001"
OPS_PATHS = ["/hedge/stats", "/hedge/series", "/hedge/races", "/metrics", "/dashboard",
             "/dashboard/dashboard.js"]


def start(loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
          server: ServerSettings | None = None) -> Gateway:
    upstream = scripted_upstream.one(name="upstream")
    return GatewayFactory(loop_thread)(gateway_settings([upstream.base_url], server=server))


def test_a_flood_of_series_and_race_reads_builds_each_at_most_a_few_times_a_second(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway = start(loop_thread, scripted_upstream)
    series_cache, races_cache = gateway.app.state.ops_caches
    first = int(time.monotonic())
    with httpx.Client(base_url=gateway.root, timeout=5.0) as http:
        for since in range(200):
            assert http.get("/hedge/series", params={"since": since * 7919}).status_code == 200
            assert http.get("/hedge/races").status_code == 200
    seconds = int(time.monotonic()) - first + 1  # the seconds the reads fell into
    assert series_cache.builds <= CACHE_KEYS * seconds
    assert races_cache.builds <= seconds


def test_a_flood_of_stats_and_metrics_reads_builds_each_at_most_once_a_second(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Each GET of /hedge/stats or /metrics used to build its document anew on the event
    loop (tens of milliseconds with a few pools). Counted by the app's caches, never timed."""
    gateway = start(loop_thread, scripted_upstream)
    stats_cache, metrics_cache = gateway.app.state.ops_read_caches
    first = int(time.monotonic())
    with httpx.Client(base_url=gateway.root, timeout=5.0) as http:
        for _ in range(30):
            assert http.get("/hedge/stats").status_code == 200
            assert http.get("/hedge/stats", params={"mergeable": 1}).status_code == 200
            assert http.get("/metrics").status_code == 200
    seconds = int(time.monotonic()) - first + 1  # the seconds the reads fell into
    assert stats_cache.builds <= 2 * seconds  # the document and the mergeable export
    assert metrics_cache.builds <= seconds


def test_a_cached_stats_read_shows_a_request_within_a_second(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """The cache never serves a document built in an earlier second: a request shows up in
    /hedge/stats and /metrics on the reads of the next second at the latest."""
    gateway = start(loop_thread, scripted_upstream)
    def counted(http: httpx.Client) -> tuple[int, bool]:
        requests = http.get("/hedge/stats").json()["pools"][POOL]["lifetime"]["requests"]
        metric = any(line.startswith("hedge_gateway_requests_total{") and 'outcome="ok"' in line
                     and line.endswith(" 1.0") for line in http.get("/metrics").text.splitlines())
        return requests, metric

    with httpx.Client(base_url=gateway.root, timeout=5.0) as http:
        assert counted(http) == (0, False)  # both documents are now cached for this second
        reply = http.post("/v1/chat/completions", json={"model": POOL, "messages": MESSAGES})
        assert reply.status_code == 200
        assert wait_for(lambda: counted(http) == (1, True), timeout=3.0)


def test_a_cached_series_read_still_returns_the_points_a_reader_asked_for(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway = start(loop_thread, scripted_upstream)
    with httpx.Client(base_url=gateway.root, timeout=5.0) as http:
        http.post("/v1/chat/completions", json={"model": POOL, "messages": MESSAGES})
        whole = http.get("/hedge/series").json()
        assert POOL in whole["pools"] and whole["seq"] >= 1
        assert http.get("/hedge/series", params={"since": 10**9}).json()["pools"][POOL] == []


def test_series_and_races_answers_are_cut_to_the_size_cap(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dashboard, "MAX_JSON_BYTES", 300)
    gateway = start(loop_thread, scripted_upstream)
    with httpx.Client(base_url=gateway.root, timeout=5.0) as http:
        for _ in range(3):
            http.post("/v1/chat/completions", json={"model": POOL, "messages": MESSAGES})
        races = http.get("/hedge/races")
    assert len(races.content) <= 300 and races.json()["truncated"] is True


def test_capped_keeps_the_newest_items_within_the_limit_in_a_few_encodings() -> None:
    doc: dict[str, Any] = {"pools": {"a": [{"seq": i} for i in range(1000)],
                                     "b": [{"seq": i} for i in range(10)]}}
    body = capped(doc, lambda d: [(d["pools"], n) for n in d["pools"]], 2000)
    out = json.loads(body)
    assert len(body) <= 2000 and out["truncated"] is True
    assert out["pools"]["a"][-1] == {"seq": 999}
    small = capped({"pools": {"a": [1]}}, lambda d: [(d["pools"], "a")], 2000)
    assert "truncated" not in json.loads(small)


async def test_per_second_builds_once_per_key_and_second_and_bounds_its_keys() -> None:
    now = [100.2]
    cache = PerSecond(lambda: now[0], keys=2)

    async def build(key: object) -> bytes:
        return repr(key).encode()

    assert [await cache.get(k, 0, build) for k in (1, 1, 2, 3, 4)] == [b"1", b"1", b"2",
                                                                        b"0", b"0"]
    assert cache.builds == 3  # 1, 2, and the fallback once
    now[0] = 101.0
    assert await cache.get(1, 0, build) == b"1" and cache.builds == 4


async def test_readers_during_a_build_wait_for_it_and_a_failed_build_is_not_kept() -> None:
    """Under `--workers` a build merges the peers' files in a thread: readers that came
    meanwhile each started a build of their own. Now they wait for the one under way."""
    cache = PerSecond(lambda: 100.5)
    release = asyncio.Event()
    outcomes: Iterator[bytes | ValueError] = iter([ValueError("peers do not merge"), b"built"])

    async def build(_: object) -> bytes:
        await release.wait()
        outcome = next(outcomes)
        if isinstance(outcome, ValueError):
            raise outcome
        return outcome

    readers = [asyncio.ensure_future(cache.get(None, None, build)) for _ in range(5)]
    await asyncio.sleep(0)
    release.set()
    results = await asyncio.gather(*readers, return_exceptions=True)
    assert cache.builds == 1
    assert all(isinstance(result, ValueError) for result in results)
    assert await cache.get(None, None, build) == b"built"  # the failure was not kept
    assert cache.builds == 2


class CountedSeries(Series):
    """A full series (every point kept) that records which `since` each view was built for."""

    def __init__(self) -> None:
        super().__init__(0.0)
        stats = Stats({"p": ["a"]}, now=0.0)
        for second in range(self.capacity):
            self.sample(Reading(stats, float(second), {}, {}), float(second))
        self.built: list[int] = []

    def view(self, since: int = 0) -> dict[str, Any]:
        self.built.append(since)
        return super().view(since)


async def test_a_flood_of_old_since_values_costs_one_whole_series_build_a_second() -> None:
    """Each `since` was a document of its own, up to eight a second: a reader asking for
    since=0..7 made eight builds of nearly the whole series every second. A `since` older
    than the last few points now gets the whole series, which a reader filters by `seq` as
    the dashboard does: what it asked for is in it. Counted on a frozen clock, never timed."""
    series = CountedSeries()
    source = StatsSource(Stats({"p": ["a"]}, now=0.0), {}, lambda: 0.0)
    app = FastAPI()
    app.include_router(build_dashboard_router(
        series, source, (PerSecond(lambda: 100.5), PerSecond(lambda: 100.5))))
    newest = series.seq
    asked = [*range(51), *range(newest - 3, newest + 2)]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        for since in asked:
            reply = (await http.get("/hedge/series", params={"since": since})).json()
            seqs = [point["seq"] for point in reply["pools"]["p"] if point["seq"] > since]
            assert seqs == list(range(since + 1, newest + 1)), since
    large = [since for since in series.built if newest - since > 10]
    assert len(large) <= 1, large


def basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"ops:{password}".encode()).decode()


def test_ops_keys_guard_every_operational_read_and_leave_probes_and_inference_alone(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gateway = start(loop_thread, scripted_upstream, ServerSettings(ops_keys=(OPS_KEY,)))
    with httpx.Client(base_url=gateway.root, timeout=5.0) as http:
        for path in OPS_PATHS:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": basic("x")}):
                refused = http.get(path, headers=headers)
                assert refused.status_code == 401, path
                assert refused.json()["error"]["code"] == "invalid_api_key"
                assert refused.headers["www-authenticate"].startswith("Basic ")
            for auth in (f"Bearer {OPS_KEY}", basic(OPS_KEY)):
                assert http.get(path, headers={"authorization": auth}).status_code == 200, path
        for probe in ("/healthz", "/readyz"):
            assert http.get(probe).status_code == 200
        reply = http.post("/v1/chat/completions", json={"model": POOL, "messages": MESSAGES})
        assert reply.status_code == 200
        assert OPS_KEY not in reply.text
