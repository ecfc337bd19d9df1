"""The composition root: the one place that wires concrete classes together.

`create_app(settings)` builds the shared HTTP client, one provider per backend, one
`PoolRuntime` per pool, the stats and the proxy, and hands each what it needs. Nothing else
constructs these; nothing holds module-level state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from gateway.clock import Clock, monotonic
from gateway.dashboard import build_dashboard_router, run_sampler
from gateway.drain import Drain
from gateway.pool import PoolRuntime
from gateway.proxy import Proxy
from gateway.routes import build_ops_router, build_router, install_error_handlers
from gateway.settings import Settings
from gateway.stats import Stats
from gateway.stats.prometheus import Metrics
from gateway.stats.series import Series
from gateway.tracing import Tracing, build_tracing
from providers.registry import build_provider


def make_http_client(settings: Settings) -> httpx.AsyncClient:
    """One client for every upstream: bounded pool, no redirects, no env proxies."""
    cap = settings.server.max_concurrent_requests * 2
    return httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=cap, max_keepalive_connections=64, keepalive_expiry=30.0
        ),
        follow_redirects=False,
        trust_env=False,
    )


def build_pools(
    settings: Settings, client: httpx.AsyncClient, clock: Clock, rng: random.Random
) -> dict[str, PoolRuntime]:
    pools: dict[str, PoolRuntime] = {}
    now = clock()
    for pool in settings.pools:
        providers = {
            b.name: build_provider(b, client, pool.timeouts, rng) for b in pool.backends
        }
        pools[pool.name] = PoolRuntime.build(
            pool,
            providers,
            global_hedging=settings.hedging_enabled,
            now=now,
            rng=random.Random(rng.random()),
        )
    return pools


def create_app(
    settings: Settings,
    *,
    clock: Clock = monotonic,
    seed: int | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The app. `tracing`: injected (tests); else built from `server.tracing` and the
    OTEL_* variables, None when off."""
    rng = random.Random(seed)
    if tracing is None:
        tracing = build_tracing(settings.server.tracing, os.environ)
    client = make_http_client(settings)
    pools = build_pools(settings, client, clock, rng)
    stats = Stats.for_pools(pools, now=clock())
    metrics = Metrics(stats, pools, clock)
    series = Series(stats, pools)
    drain = Drain()
    proxy = Proxy(settings.server, stats, clock, drain, tracing)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sampler = asyncio.create_task(run_sampler(series, clock), name="series-sampler")
        try:
            yield
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            if tracing is not None:
                tracing.shutdown()
            for pool in pools.values():
                for provider in pool.providers.values():
                    await provider.aclose()
            await client.aclose()

    app = FastAPI(
        title="hedge-gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)
    app.include_router(build_router(settings, pools, proxy))
    app.include_router(build_ops_router(pools, clock, stats=stats, metrics=metrics))
    app.include_router(build_dashboard_router(stats, series))
    app.state.pools = pools
    app.state.stats = stats
    app.state.proxy = proxy
    #: `drain.start()` on SIGTERM: new requests get 503, live streams get `shutdown_grace`
    app.state.drain = drain
    return app
