"""Reload carry-over, pure parts: what survives a new generation and what starts
fresh. Fake clock, no sockets (the upstream client is built but never used: sim backends)."""

from __future__ import annotations

import json
import random
import ssl
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import certifi
import pytest

from gateway.app import Reloader, build_pools
from gateway.hedge.balancer import Balancer
from gateway.hedge.budget import HedgeBudget
from gateway.hedge.delay import HedgeDelay
from gateway.hedge.generation import Generation, Live
from gateway.settings import (
    BackendSettings,
    BudgetSettings,
    DelaySettings,
    HealthSettings,
    HedgingSettings,
    PoolSettings,
    Settings,
    SimProfile,
    load_settings,
)
from gateway.settings.origin import ConfigOrigin
from gateway.stats import Stats
from gateway.stats.view import snapshot
from providers.base import ENDPOINTS
from providers.http import UpstreamClient
from providers.openai import OpenAIProvider
from providers.tls import CaContexts


def backend(name: str, weight: float = 1.0) -> BackendSettings:
    return BackendSettings(name=name, provider="sim", model="m", weight=weight,
                           sim=SimProfile(seed=1))


def pool(name: str, *names: str, initial: float = 0.5) -> PoolSettings:
    hedging = HedgingSettings(delay=DelaySettings(initial=initial))
    return PoolSettings(name=name, backends=tuple(backend(n) for n in names), hedging=hedging)


def test_balancer_adopt_keeps_health_and_inflight_of_survivors() -> None:
    health = HealthSettings(eject_after=1)
    old = Balancer([backend("a"), backend("b")], health, random.Random(1))
    old.on_failure("a", 0.0)  # ejected
    old.on_start("b")
    new = old.adopt([backend("b", weight=3.0), backend("c")], health)
    assert new.names == ["b", "c"]
    assert new.inflight("b") == 1
    old.on_finish("b")  # an attempt of a request that started before the reload ends
    assert new.inflight("b") == 0
    assert new.state("c", 0.1) == ("ok", None)
    carried = old.adopt([backend("a")], health)
    assert carried.state("a", 0.1)[0] == "ejected"


def test_hedge_delay_adopt_keeps_the_sketch_and_applies_new_settings() -> None:
    settings = DelaySettings(initial=0.3, min_samples=5, min=0.0)
    delay = HedgeDelay(settings)
    for _ in range(10):
        delay.observe(0.1, 1.0)
    assert delay.adopt(settings, budget_ratio=0.1, now=1.0) is delay
    changed = delay.adopt(replace(settings, initial=0.2, max=0.05), budget_ratio=0.1, now=1.0)
    assert changed.samples(1.0) == 10
    assert changed.adaptive(1.0)
    assert changed.delay(1.0) == pytest.approx(0.05)  # the new `max` clamps the quantile
    fresh = delay.adopt(replace(settings, window=120.0), budget_ratio=0.1, now=1.0)  # new sketch
    assert fresh.samples(1.0) == 0


def test_budget_reconfigure_keeps_level_inflight_and_outcomes() -> None:
    budget = HedgeBudget(BudgetSettings(burst=10, min_per_second=0.0), 0.0)
    assert budget.try_spend(0.0, inflight_requests=1, hedge=False) is None
    budget.record_hedge(True, 0.0)
    budget.reconfigure(BudgetSettings(burst=4, min_per_second=0.0), 1.0)
    assert budget.tokens(1.0) == 4  # capped at the new burst, not refilled
    assert budget.extra_in_flight == 1
    assert budget.win_rate() == 1.0


def test_stats_adopt_keeps_survivors_and_drops_removed() -> None:
    stats = Stats({"p": ["a", "b"], "gone": ["x"]}, now=0.0)
    pool_stats, a_stats = stats.pools["p"], stats.pools["p"].backends["a"]
    stats.adopt({"p": ["a", "c"], "new": ["n"]})
    assert stats.pools["p"] is pool_stats
    assert stats.pools["p"].backends["a"] is a_stats
    assert set(stats.pools["p"].backends) == {"a", "c"}
    assert set(stats.pools) == {"p", "new"}


def test_build_pools_carries_runtimes_over_by_name() -> None:
    client = UpstreamClient(max_connections=8)
    clock = lambda: 5.0  # noqa: E731
    rng = random.Random(1)
    first = build_pools(Settings(pools=(pool("p", "a", "b"), pool("q", "x"))), client, clock,
                        rng)
    second = build_pools(Settings(pools=(pool("p", "a", "c", initial=0.2), pool("r", "y"))),
                         client, clock, rng, first)
    p_old, p_new = first["p"], second["p"]
    assert p_new is not p_old and p_new.budget is p_old.budget
    assert p_new.providers["a"] is p_old.providers["a"]  # unchanged backend: same provider
    assert p_new.delays["a"].delay(5.0) == 0.2  # same sketch, new settings
    assert p_new.delays["c"].samples(5.0) == 0
    assert set(second) == {"p", "r"}
    assert p_old.settings.hedging.delay.initial == 0.5  # the old generation is untouched
    # the per-configuration maps every attempt reads follow the new backends
    assert set(p_new.models) == set(p_new.models_json) == {"a", "c"}
    assert p_new.models_json["c"] == json.dumps(p_new.models["c"]).encode()


def _live(settings: Settings) -> tuple[Live, Stats, Reloader]:
    client = UpstreamClient(max_connections=8)
    pools = build_pools(settings, client, lambda: 0.0, random.Random(1))
    stats = Stats.for_pools(pools, now=0.0)
    live = Live(Generation(settings, pools, ConfigOrigin.embedded(settings, now=0.0)))
    return live, stats, Reloader(live, stats, client, lambda: 10.0, random.Random(2))


def test_reloader_refuses_an_invalid_file_and_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live, stats, reloader = _live(Settings(pools=(pool("p", "a"),)))
    before = live.current
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - name: p\n    timeout: soon\n    backends: []\n")
    assert not reloader.reload_file(str(bad))
    assert live.current is before and live.failed_reloads == 1
    assert "pools[0].timeout" in caplog.text
    doc = snapshot(stats, live.current.pools, 12.0, live=live)
    assert doc["config"]["failed_reloads"] == 1 and doc["config"]["generation"] == 1


def test_reloader_swaps_a_valid_file_with_its_checksum(tmp_path: Path) -> None:
    live, stats, reloader = _live(Settings(pools=(pool("p", "a"),)))
    good = tmp_path / "good.yaml"
    good.write_bytes(b"pools:\n  - name: q\n    backends:\n"
                     b"      - {name: b, provider: sim}\n")
    assert reloader.reload_file(str(good))
    doc = snapshot(stats, live.current.pools, 12.5, live=live)
    assert doc["config"]["sha256"] == ConfigOrigin.of_file(good.read_bytes(), now=0).sha256
    assert doc["config"]["generation"] == 2 and doc["config"]["loaded_s_ago"] == 2.5
    assert list(doc["pools"]) == ["q"]
    assert len(live.retired) == 1  # the removed backend's provider, closed at shutdown


def test_a_carried_over_pool_has_the_delays_of_every_route_streamed_or_not() -> None:
    """A reloaded pool answers `delays_for` for every route there is, like a fresh one: the
    non-streaming trackers are built from the one route table both times, so a route cannot
    be left out of one of the two lists."""
    client = UpstreamClient(max_connections=8)
    clock = lambda: 5.0  # noqa: E731
    rng = random.Random(1)
    first = build_pools(Settings(pools=(pool("p", "a"),)), client, clock, rng)
    second = build_pools(Settings(pools=(pool("p", "a", "b"),)), client, clock, rng, first)
    for runtime in (first["p"], second["p"]):
        assert set(runtime.whole_delays) == set(ENDPOINTS)
        for endpoint in ENDPOINTS:
            for stream in (True, False):
                assert set(runtime.delays_for(endpoint, stream)) == {
                    b.name for b in runtime.settings.backends}
    for endpoint in ENDPOINTS:  # the learnt sketch of a surviving backend is the same one
        old = first["p"].whole_delays[endpoint]["a"]
        assert second["p"].whole_delays[endpoint]["a"] is old


def test_the_inflight_count_survives_a_reload_and_old_requests_leave_it() -> None:
    """Requests in flight across a reload still count in the new runtime (the budget's
    in-flight cap reads it), and one that ends on the old runtime leaves the shared count."""
    client = UpstreamClient(max_connections=8)
    clock = lambda: 5.0  # noqa: E731
    rng = random.Random(1)
    first = build_pools(Settings(pools=(pool("p", "a"),)), client, clock, rng)
    first["p"].inflight_requests += 2
    second = build_pools(Settings(pools=(pool("p", "a"),)), client, clock, rng, first)
    assert second["p"].inflight_requests == 2
    first["p"].inflight_requests -= 1  # a request that started before the reload ends
    assert second["p"].inflight_requests == 1
    second["p"].inflight_requests += 1
    assert first["p"].inflight_requests == second["p"].inflight_requests == 2


async def test_reloads_share_one_tls_context_per_ca_bundle_loaded_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend with its own CA bundle and a key from the environment, rotated by five
    reloads: each reload rebuilds it, and every one of its clients trusts the one context
    loaded for that bundle; what a reload loads (the check of the file, the bundle) is loaded
    in a worker thread, never on the loop."""
    ca_file = certifi.where()
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "pools:\n  - name: p\n    backends:\n"
        "      - {name: a, provider: openai, base_url: 'http://127.0.0.1:9/v1', model: m,\n"
        f"         api_key: '${{TOKEN}}', tls: {{ca_file: '{ca_file}'}}}}\n")
    monkeypatch.setenv("TOKEN", "token-0")
    contexts = CaContexts()
    client = UpstreamClient(max_connections=8)
    settings = load_settings(str(config))
    pools = build_pools(settings, client, lambda: 0.0, random.Random(1), contexts=contexts)
    live = Live(Generation(settings, pools, ConfigOrigin.embedded(settings, now=0.0)))
    reloader = Reloader(live, Stats.for_pools(pools, now=0.0), client, lambda: 1.0,
                        random.Random(2), contexts=contexts)
    loaded_on: list[int] = []
    real = ssl.create_default_context

    def recorded(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        loaded_on.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", recorded)
    built = [live.current.pools["p"].providers["a"]]
    for n in range(1, 6):
        monkeypatch.setenv("TOKEN", f"token-{n}")
        assert await reloader.reload(str(config))
        built.append(live.current.pools["p"].providers["a"])
    assert len({id(p) for p in built}) == 6  # rebuilt by every reload
    tls = {id(cast(OpenAIProvider, p)._client.ssl) for p in built}
    assert len(tls) == 1 and contexts.loads == 1
    assert loaded_on and threading.get_ident() not in loaded_on


def test_a_reload_whose_later_pool_fails_to_build_leaves_the_running_pools_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Carrying a pool over re-limits its running budget and re-weighs its running backends
    in place; a reload whose second pool's provider fails to build (a bad CA bundle) swaps
    nothing in, so the first pool's running budget and weights must be as they were."""
    import time

    import gateway.app as app
    from gateway.settings import BudgetSettings
    from tests.harness.builders import gateway_settings

    base = gateway_settings(["http://127.0.0.1:9/v1"] * 2)
    first, second = base.pools[0], replace(base.pools[0], name="other")
    old = replace(base, pools=(first, second))
    client = app.make_http_client(old)
    rng = random.Random(1)
    running = build_pools(old, client, time.monotonic, rng)
    kept = running[first.name]
    backend = first.backends[0]
    budget, weight = kept.budget.settings, kept.balancer._backends[backend.name].weight
    level = kept.budget.tokens(time.monotonic())

    new_first = replace(first, hedging=replace(first.hedging, budget=BudgetSettings(burst=2.0)),
                        backends=(replace(backend, weight=5.0), *first.backends[1:]))
    new_second = replace(second, timeouts=replace(second.timeouts,
                                                  idle=second.timeouts.idle + 1))
    real = app.build_provider  # type: ignore[attr-defined]

    def build(settings: Any, *args: Any, **kwargs: Any) -> Any:
        if settings is new_second.backends[0]:
            raise OSError("bad CA bundle")
        return real(settings, *args, **kwargs)

    monkeypatch.setattr(app, "build_provider", build)
    with pytest.raises(OSError):
        build_pools(replace(old, pools=(new_first, new_second)), client, time.monotonic, rng,
                    previous=running)
    assert kept.budget.settings == budget
    assert kept.budget.tokens(time.monotonic()) == level
    assert kept.balancer._backends[backend.name].weight == weight
