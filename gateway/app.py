"""The composition root: the one place that wires concrete classes together.

`create_app(settings)` builds the shared HTTP client, one provider per backend, one
`PoolRuntime` per pool, the stats and the proxy, and hands each what it needs. Nothing else
constructs these; nothing holds module-level state. A reload (`Reloader`, on SIGHUP) builds
the next generation here too, carrying over what the surviving pools and backends learnt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.api.admin import build_admin_router
from gateway.api.asgi import FastRoutes, GatewayAPI
from gateway.api.browser import BrowserGuard
from gateway.api.chat import build_router
from gateway.api.common import gateway_error_response, install_error_handlers
from gateway.api.end import report_bug
from gateway.api.keys import KeyRing
from gateway.api.keystore import TenantSync
from gateway.api.messages import build_messages_router
from gateway.api.ops import build_ops_router
from gateway.api.proxy import Proxy
from gateway.api.responses import build_responses_router
from gateway.api.tenancy import TenantGate
from gateway.clock import Clock, monotonic
from gateway.dashboard import PerSecond, build_dashboard_router, run_sampler, sample_now
from gateway.drain import Drain
from gateway.hedge.generation import Generation, Live, LivePools
from gateway.hedge.pool import PoolRuntime
from gateway.server.serve import tune_collector
from gateway.server.workers import worker_settings
from gateway.settings import (
    RELOADED_SERVER_KEYS,
    ConfigError,
    PoolSettings,
    ServerSettings,
    Settings,
    load_settings,
)
from gateway.settings.load import weak_secrets
from gateway.settings.origin import CONFIG_ENV, ConfigOrigin
from gateway.settings.tenants import shares_limits
from gateway.stats import Stats
from gateway.stats.prometheus import Metrics
from gateway.stats.series import Series
from gateway.stats.shared import Peers, StatsSource
from gateway.stats.tracing import Tracing, build_tracing
from gateway.tenants.lease import Leasing
from gateway.wire.translate.routes import TRANSLATIONS
from providers.base import CarriesCredentials, Provider
from providers.http import UpstreamClient
from providers.registry import build_provider, missing_extras
from providers.tls import CaContexts


def make_http_client(settings: Settings) -> UpstreamClient:
    """One client for every upstream: bounded pool, no redirects, no env proxies."""
    return UpstreamClient(
        max_connections=settings.server.max_concurrent_requests * 2, keepalive_expiry=30.0
    )


#: reload outcomes go to the operator's log (configured by `hedge-gateway serve`)
LOGGER = logging.getLogger("hedge_gateway.config")


def build_pools(
    settings: Settings,
    client: UpstreamClient,
    clock: Clock,
    rng: random.Random,
    previous: Mapping[str, PoolRuntime] | None = None,
    contexts: CaContexts | None = None,
) -> dict[str, PoolRuntime]:
    """One runtime per configured pool. With `previous` (a reload), a pool that keeps its
    name carries over its learnt state (`PoolRuntime.carried_over`) and a backend whose
    settings and pool timeouts are unchanged keeps its provider. `contexts`: the TLS
    contexts by CA bundle, built once for every backend and reload that names a bundle."""
    pools: dict[str, PoolRuntime] = {}
    #: rebuilt cloud backends and the providers whose credentials they take over, once every
    #: pool is built: a build that fails half-way must leave the running providers as they are
    adoptions: list[tuple[CarriesCredentials, Provider]] = []
    #: each pool's providers, all built before any pool's runtime: carrying a pool over
    #: re-limits its running budget and re-weighs its running backends in place, which a
    #: later pool's provider failing to build (a bad CA bundle) must find undone
    built: list[tuple[PoolSettings, PoolRuntime | None, dict[str, Provider]]] = []
    now = clock()
    for pool in settings.pools:
        before = (previous or {}).get(pool.name)
        kept: Mapping[str, object] = {}
        if before is not None and before.settings.timeouts == pool.timeouts:
            kept = {b.name: b for b in before.settings.backends}
        providers: dict[str, Provider] = {}
        for b in pool.backends:
            old = before.providers.get(b.name) if before is not None else None
            if old is not None and kept.get(b.name) == b:
                providers[b.name] = old
                continue
            provider = build_provider(b, client, pool.timeouts, rng, contexts)
            if old is not None and isinstance(provider, CarriesCredentials):
                adoptions.append((provider, old))  # a rebuilt backend keeps its credentials
            providers[b.name] = provider
        built.append((pool, before, providers))
    for pool, before, providers in built:
        if before is None:
            pools[pool.name] = PoolRuntime.build(
                pool,
                providers,
                global_hedging=settings.hedging_enabled,
                now=now,
                rng=random.Random(rng.random()),
                translations=TRANSLATIONS,
            )
        else:
            pools[pool.name] = before.carried_over(
                pool, providers, global_hedging=settings.hedging_enabled, now=now
            )
    for heir, predecessor in adoptions:
        heir.adopt_credentials(predecessor)
    return pools


#: how often the hedge delays are recomputed (seconds); kept off the request path
DELAY_REFRESH_INTERVAL = 1.0


async def refresh_delays(live: Live, clock: Clock, interval: float) -> None:
    """Recompute the hedge delays of every pool of the current generation now and then every
    `interval` seconds, until cancelled. The one place a delay's quantile is computed:
    requests only read the result. Reading `live.current` each time follows reloads."""
    while True:
        now = clock()
        for pool in live.current.pools.values():
            pool.refresh_delays(now)
        await asyncio.sleep(interval)


async def close_retired(live: Live, stats: Stats, interval: float) -> None:
    """Every `interval` seconds, close the providers a reload retired that no running
    request holds any more (`Live.reap`), until cancelled."""
    while True:
        await asyncio.sleep(interval)
        done = live.reap()
        while done:
            try:
                await done[0].aclose()
            except asyncio.CancelledError:  # shutdown: it closes what is left (idempotent)
                live.retired.extend(done)
                raise
            except Exception as exc:  # noqa: BLE001 - a bug of ours: reported, the rest closed
                report_bug(stats, exc)
            done.pop(0)


def _layout(pools: Mapping[str, PoolRuntime]) -> dict[str, list[str]]:
    return {name: [b.name for b in p.settings.backends] for name, p in pools.items()}


class Reloader:
    """Re-reads the configuration file and swaps in the next generation.

    On SIGHUP (`hangup`) the blocking part runs in a worker thread: reading the file,
    validating it (which loads every CA bundle it names) and loading those bundles into the
    app's TLS contexts (`providers.tls.CaContexts`). Then, on the event loop and in one step,
    the generation is built from those contexts and swapped in, so no request can see a
    half-built one and the loop never waits on a file. `reload_file` does it all at once, for
    callers without a running loop. An invalid file changes nothing: the error, with every
    key path, goes to the log and `failed_reloads` counts it. The `server` section is bound at
    start (the listening socket, the connection and concurrency limits): a reload that
    changes it keeps the running values and says which keys need a restart.
    """

    def __init__(
        self,
        live: Live,
        stats: Stats,
        client: UpstreamClient,
        clock: Clock,
        rng: random.Random,
        workers: int = 1,
        keys: Mapping[str, KeyRing] | None = None,
        contexts: CaContexts | None = None,
        gate: TenantGate | None = None,
    ) -> None:
        """`workers`: under `serve --workers N`, a reloaded file's budgets are split as at
        start (`gateway.server.workers.worker_settings`). `keys`: the rings the routes
        check, by their `server` field (`api_keys`, `ops_keys`): a reload that changes one
        swaps it in. `contexts`: the TLS contexts the backends were built with. `gate`: the
        client keys of `keys:`, replaced by a reloaded file's (a revoked key is refused from
        the next request)."""
        self.live = live
        self.stats = stats
        self._client = client
        self._clock = clock
        self._rng = rng
        self._workers = workers
        self._keys = dict(keys or {})
        self._contexts = contexts if contexts is not None else CaContexts()
        self._gate = gate
        #: the reload a SIGHUP started, and whether another SIGHUP came meanwhile
        self._running: asyncio.Task[bool] | None = None
        self._again = False

    def _read(self, path: str) -> tuple[bytes, Settings] | list[str]:
        """The file's bytes and its validated settings, or the errors that refuse it.
        Blocking (file reads, CA bundles): the SIGHUP path runs it in a worker thread."""
        try:
            with open(path, "rb") as file:
                data = file.read()
            settings = worker_settings(load_settings(path, installed=missing_extras),
                                       self._workers)
            self._contexts.load({b.tls.ca_file for pool in settings.pools
                                 for b in pool.backends
                                 if b.tls.verify and b.tls.ca_file is not None})
        except (ConfigError, OSError) as exc:
            return list(exc.errors) if isinstance(exc, ConfigError) else [f"{path}: {exc.strerror}"]
        except Exception as exc:  # noqa: BLE001 - a bug of ours must not kill the handler
            # never the message or traceback: they could repeat a value from the environment
            return [f"{path}: could not be loaded ({type(exc).__name__})"]
        return data, settings

    def reload_file(self, path: str, *, started_server: ServerSettings | None = None) -> bool:
        """Load `path`; on success swap it in and return True. `started_server`: the file's
        `server` section as loaded at start (before command-line overrides), to name the
        server keys a reload cannot change. Blocks while it reads (see `hangup`)."""
        return self._swap_in(path, self._read(path), started_server)

    async def reload(self, path: str, *, started_server: ServerSettings | None = None) -> bool:
        """`reload_file` with its blocking part in a worker thread."""
        return self._swap_in(path, await asyncio.to_thread(self._read, path), started_server)

    def hangup(self, path: str, *, started_server: ServerSettings | None = None) -> None:
        """SIGHUP, on the loop: start `reload`, or, while one runs, one more after it (the
        file may have changed again since it was read). One task at most."""
        if self._running is not None and not self._running.done():
            self._again = True
            return

        async def run() -> bool:
            done = await self.reload(path, started_server=started_server)
            while self._again:
                self._again = False
                done = await self.reload(path, started_server=started_server)
            return done

        self._running = asyncio.get_running_loop().create_task(run(), name="config-reload")

    def _swap_in(self, path: str, loaded: tuple[bytes, Settings] | list[str],
                 started_server: ServerSettings | None) -> bool:
        if isinstance(loaded, list):
            return self._refused(loaded)
        data, settings = loaded
        current_keys = self.live.current.settings.keys
        running = self.live.current.settings.server
        # keys take effect now (rotating a leaked one must not need a restart)
        swapped = {name: getattr(settings.server, name) for name in self._keys
                   if getattr(settings.server, name) != getattr(running, name)}
        running = dataclasses.replace(running, **swapped)
        changed = [key for key in _changed_keys(started_server or running, settings.server)
                   if key not in self._keys]
        if changed:
            LOGGER.warning("configuration reload: server.%s take%s effect only after a "
                           "restart; the running values stay", ", server.".join(changed),
                           "s" if len(changed) == 1 else "")
        try:
            self.apply(dataclasses.replace(settings, server=running),
                       ConfigOrigin.of_file(data, now=self._clock()))
        except Exception as exc:  # noqa: BLE001 - building a backend failed: nothing swapped
            return self._refused([f"{path}: its backends could not be built "
                                  f"({type(exc).__name__})"])
        if self._gate is not None and settings.keys != current_keys:
            self._gate.replace(settings.keys)
            LOGGER.warning("configuration reload: keys changed (%d named key%s), in effect "
                           "for new requests", len(settings.keys),
                           "" if len(settings.keys) == 1 else "s")
        for name, value in swapped.items():
            self._keys[name].replace(value)
            LOGGER.warning("configuration reload: server.%s changed (%d key%s), in effect for "
                           "new requests", name, len(value), "" if len(value) == 1 else "s")
        if swapped:
            for line in weak_secrets(running):
                LOGGER.warning("configuration reload: %s", line)
        current = self.live.current
        LOGGER.info("configuration reloaded from %s: generation %d, sha256 %s, pools %s",
                       path, current.number, current.origin.sha256[:12],
                       ", ".join(current.pools) or "none")
        return True

    def _refused(self, errors: Sequence[str]) -> bool:
        self.live.failed_reloads += 1
        LOGGER.error("configuration reload refused, the running configuration is "
                     "unchanged (%d error%s):\n  %s", len(errors),
                     "" if len(errors) == 1 else "s", "\n  ".join(errors))
        return False

    def apply(self, settings: Settings, origin: ConfigOrigin) -> None:
        """Swap in a validated configuration: new runtimes carrying over the learnt state,
        the stats re-laid, then the one assignment that new requests will see."""
        old = self.live.current
        pools = build_pools(settings, self._client, self._clock, self._rng, old.pools,
                            self._contexts)
        self.stats.adopt(_layout(pools))
        self.live.swap(Generation(settings, pools, origin, old.number + 1))


def _changed_keys(before: ServerSettings, after: ServerSettings) -> list[str]:
    return [f.name for f in dataclasses.fields(before)
            if getattr(before, f.name) != getattr(after, f.name)]


def create_app(
    settings: Settings,
    *,
    clock: Clock = monotonic,
    seed: int | None = None,
    delay_refresh: float = DELAY_REFRESH_INTERVAL,
    origin: ConfigOrigin | None = None,
    peers: Peers | None = None,
    workers: int = 1,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The app for `settings`. `origin`: where they came from (a file's checksum); by default
    they count as embedded and are checksummed by their `repr`. `delay_refresh`: seconds
    between recomputations of the hedge delays. Under `serve --workers N`: `workers` is N
    (each budget bucket holds burst / N, at start and after a reload) and `peers` this
    worker's view of the shared stats directory, so that its stats endpoints show the whole
    server (`gateway.stats.shared`). `tracing`: injected (tests); else built from
    `server.tracing` and the OTEL_* variables, None when off."""
    settings = worker_settings(settings, workers)
    rng = random.Random(seed)
    if tracing is None:
        tracing = build_tracing(settings.server.tracing, os.environ)
    client = make_http_client(settings)
    contexts = CaContexts()
    pools = build_pools(settings, client, clock, rng, contexts=contexts)
    stats = Stats.for_pools(pools, now=clock())
    live = Live(Generation(settings, pools, origin or ConfigOrigin.embedded(settings,
                                                                            now=clock())))
    source = StatsSource(stats, LivePools(live), clock, peers, live=live)
    metrics = Metrics(stats, LivePools(live), clock, read=source.reading)
    series = Series(source.origin)
    drain = Drain()
    proxy = Proxy(settings.server, stats, clock, drain, tracing)
    rings = {name: KeyRing(getattr(settings.server, name)) for name in RELOADED_SERVER_KEYS}
    api_keys, ops_keys = rings["api_keys"], rings["ops_keys"]
    # the store only where keys are named (usage to keep) or made at run time: a gateway
    # without them opens no file and asks no key. With it, a key is always asked (revoking
    # the last key must not open the gateway to anyone)
    keyed = bool(settings.keys or settings.server.admin_keys or settings.server.store)
    gate = TenantGate(api_keys, settings.keys, clock, required=keyed,
                      fail_closed=settings.server.store_down == "closed",
                      leasing=Leasing() if keyed and shares_limits(settings.server.store,
                                                                   workers)
                      else None)
    sync = TenantSync(gate, settings.server.store, workers) if keyed else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        refresher = asyncio.create_task(
            refresh_delays(live, clock, delay_refresh), name="hedge-delay-refresh"
        )
        publisher = asyncio.create_task(
            source.publish_forever(), name="stats-publish") if peers else None
        tasks = [refresher, asyncio.create_task(
            close_retired(live, stats, delay_refresh), name="close-retired-providers")]
        try:
            if sync is not None:  # the keys made at run time, before the first request
                await sync.start()
                tasks.append(asyncio.create_task(sync.run(), name="tenant-store-sync"))
                if gate.leasing is not None:
                    tasks.append(asyncio.create_task(sync.lease_forever(),
                                                     name="tenant-store-leases"))
            await sample_now(series, source.series_reading_async)  # before serving: the baseline
            tasks.append(asyncio.create_task(
                run_sampler(series, source.series_reading_async, clock), name="series-sampler"))
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            if sync is not None:
                await sync.stop()  # the last batch of usage
            if publisher is not None:
                publisher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await publisher
            if tracing is not None:
                tracing.shutdown()
            for provider in live.providers():
                await provider.aclose()
            await client.aclose()

    fast = FastRoutes()
    app = GatewayAPI(
        fast=fast,
        on_error=gateway_error_response,
        report=functools.partial(report_bug, stats),
        browser=BrowserGuard(listen_host=settings.server.host,
                             allowed_origins=settings.server.allowed_origins,
                             allowed_hosts=settings.server.allowed_hosts),
        ops_keys=ops_keys,
        title="hedge-gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # no 307 to the path without its trailing slash: its Location would be built from
        # the client's own Host header, and a POST body would be sent twice; a 404 instead
        redirect_slashes=False,
    )
    install_error_handlers(app)
    app.include_router(build_router(settings, live, proxy, fast, gate))
    app.include_router(build_responses_router(settings, live, proxy, fast, gate))
    app.include_router(build_messages_router(settings, live, proxy, fast, gate))
    if settings.server.admin_keys:  # else there is no admin API, not even its routes
        app.include_router(build_admin_router(rings["admin_keys"], sync, live))
    #: the per-second caches of /hedge/stats and /metrics (their `builds` count)
    app.state.ops_read_caches = (PerSecond(), PerSecond())
    app.include_router(build_ops_router(live, clock, stats=source, metrics=metrics, drain=drain,
                                        caches=app.state.ops_read_caches))
    #: the per-second caches of /hedge/series and /hedge/races (their `builds` count)
    app.state.ops_caches = (PerSecond(), PerSecond())
    app.include_router(build_dashboard_router(series, source, app.state.ops_caches))
    #: the pools at start; after a reload, `app.state.live.current.pools`
    app.state.pools = pools
    app.state.live = live
    #: `reloader.hangup(path)` on SIGHUP (wired by `hedge-gateway serve`)
    app.state.reloader = Reloader(live, stats, client, clock, rng, workers, keys=rings,
                                  contexts=contexts, gate=gate)
    #: the client keys (`server.api_keys`, `keys:`) and their live limits
    app.state.tenant_gate = gate
    #: the store behind the keys (None: the gateway opens none)
    app.state.tenant_sync = sync
    app.state.stats = stats
    #: the `/hedge/stats` document as of now (the endpoint's is up to a second old)
    app.state.stats_source = source
    app.state.proxy = proxy
    #: `drain.start()` on SIGTERM: new requests get 503, live streams get `shutdown_grace`
    app.state.drain = drain
    #: the shared upstream client (the test harness checks that no connection stays in use)
    app.state.http_client = client
    return app


def app_from_env() -> FastAPI:
    """The app for the file named by `$HEDGE_GATEWAY_CONFIG`, for ASGI servers that import a
    factory (`granian --interface asgi --factory gateway.app:app_from_env`): the bench's
    front-server comparison (`bench --servers`). Under such a server the app works,
    but the connection limits of `gateway.server.connection` (431, lingering 413, 408, the
    connection cap, the stuck-client abort) and the early drain of `gateway.server.serve` are
    not there: they belong to `hedge-gateway serve` (README "The front server")."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(f"{CONFIG_ENV}: not set (the path of the configuration file to serve)")
    with open(path, "rb") as file:
        origin = ConfigOrigin.of_file(file.read(), now=monotonic())
    settings = load_settings(path, installed=missing_extras)
    app = create_app(settings, origin=origin)
    tune_collector(settings.server)  # as `serve` does, so the comparison is of the servers alone
    return app
