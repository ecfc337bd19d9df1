"""`serve --workers N` without processes: the per-worker budget and the restart
bound. Plain numbers as the clock."""

from __future__ import annotations

import math

import pytest

from gateway.hedge.budget import HedgeBudget
from gateway.server.workers import (
    MAX_RESTARTS,
    RESTART_WINDOW,
    RestartLimiter,
    with_response_id_secret,
    worker_settings,
)
from gateway.settings import (
    BackendSettings,
    BudgetSettings,
    HedgingSettings,
    PoolSettings,
    Settings,
)


def settings(burst: float, ratio: float = 0.1, reserve: float = 0.5) -> Settings:
    budget = BudgetSettings(ratio=ratio, burst=burst, min_per_second=reserve)
    pool = PoolSettings("p", (BackendSettings("a", provider="sim"),
                              BackendSettings("b", provider="sim")),
                        hedging=HedgingSettings(budget=budget))
    return Settings(pools=(pool,))


@pytest.mark.parametrize(("burst", "workers", "each"), [
    (10.0, 2, 5.0), (10.0, 3, 4.0), (10.0, 16, 1.0), (1.0, 4, 1.0), (2.5, 2, 2.0)])
def test_each_worker_bucket_holds_burst_over_n_rounded_up(
        burst: float, workers: int, each: float) -> None:
    split = worker_settings(settings(burst), workers)
    budget = split.pools[0].hedging.budget
    assert budget.burst == each
    assert (budget.ratio, budget.min_per_second) == (0.1, 0.5)  # deposits and reserve as before


def test_each_worker_holds_its_share_of_the_input_token_bucket() -> None:
    budget = worker_settings(settings(10.0), 3).pools[0].hedging.budget
    assert budget.burst_input_tokens == 33_334  # ceil(100,000 / 3)
    assert budget.input_tokens


def test_one_worker_keeps_the_settings_unchanged() -> None:
    original = settings(10.0)
    assert worker_settings(original, 1) is original


def test_the_host_keeps_the_configured_budget_when_every_request_wants_a_hedge() -> None:
    """N buckets of ceil(burst / N), every request asking for an extra attempt (all backends
    slow at once): the host's extras stay within ratio x requests + N x ceil(burst / N) +
    N x reserve x seconds, i.e. the configured burst plus rounding, not N x burst."""
    workers, burst, ratio, reserve = 4, 10.0, 0.1, 0.5
    split = worker_settings(settings(burst, ratio, reserve), workers).pools[0].hedging.budget
    buckets = [HedgeBudget(split, 0.0) for _ in range(workers)]
    requests = extras = 0
    seconds = 20.0
    for step in range(2000):
        now = step * seconds / 2000
        budget = buckets[step % workers]  # the kernel spreads connections over the workers
        budget.on_request(now)
        requests += 1
        if budget.try_spend(now, inflight_requests=100, hedge=False) is None:
            extras += 1
            budget.release()
    bound = ratio * requests + workers * math.ceil(burst / workers) + workers * reserve * seconds
    assert extras <= bound
    assert extras > ratio * requests  # the budget was the limit, and was used


def test_restarts_are_bounded_per_window() -> None:
    limiter = RestartLimiter()
    assert all(limiter.allow(float(i)) for i in range(MAX_RESTARTS))
    assert not limiter.allow(float(MAX_RESTARTS))  # a crash loop stops here
    assert limiter.allow(RESTART_WINDOW + 0.5)  # the oldest restart left the window
    assert not limiter.allow(RESTART_WINDOW + 0.6)


def test_the_supervisor_gives_its_workers_one_response_id_secret() -> None:
    """Made once before the fork, so every worker (and a replacement) reads the others' ids;
    a configured secret is kept, so replicas can share one."""
    from dataclasses import replace

    from gateway.server.supervisor import Supervisor

    base = settings(burst=4)
    made = with_response_id_secret(base).server.response_id_secret
    assert made and made != with_response_id_secret(base).server.response_id_secret
    configured = replace(base, server=replace(base.server, response_id_secret="shared"))
    assert with_response_id_secret(configured) is configured
    sup = Supervisor(base, 2, log_config=None, build_app=lambda *a, **k: None)
    secret = sup.settings.server.response_id_secret
    assert secret and secret not in repr(sup.settings)  # never shown
