"""The operational routes: liveness, readiness, `/hedge/stats` and `/metrics`.

`/hedge/stats` and `/metrics` are each built at most once a second (`PerSecond`, as the
dashboard's reads are), so an answer is at most a second old: building one walks every pool,
backend and route on the event loop (tens of milliseconds with a few pools), and three
clients polling them in a loop used to slow every stream the gateway relayed.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from gateway.dashboard import PerSecond
from gateway.drain import Drain
from gateway.hedge.generation import Live
from gateway.stats.prometheus import Metrics
from gateway.stats.shared import StatsSource


def build_ops_router(
    live: Live,
    clock: Callable[[], float],
    *,
    stats: StatsSource,
    metrics: Metrics,
    drain: Drain,
    caches: tuple[PerSecond, PerSecond] | None = None,
) -> APIRouter:
    """`caches`: (/hedge/stats, /metrics), each built at most once a second."""
    ops = APIRouter()
    stats_cache, metrics_cache = caches if caches is not None else (PerSecond(), PerSecond())

    async def build_stats(mergeable: object) -> bytes:
        doc = await (stats.mergeable_async() if mergeable else stats.document_async())
        return json.dumps(doc, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()

    async def build_metrics(_: object) -> bytes:
        return await stats.metrics_async(metrics)

    @ops.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @ops.get("/readyz")
    async def readyz() -> Response:
        """Unready only while draining or when no pool can serve at all: a load balancer
        that drops every replica for one dead pool would take the healthy pools down too."""
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        now = clock()
        pools = live.current.pools
        unready = [name for name, pool in pools.items() if not pool.balancer.usable(now)]
        body = {"pools_without_usable_backend": unready}
        if len(unready) == len(pools):
            return JSONResponse({"status": "unready", **body}, status_code=503)
        return JSONResponse({"status": "ready", **body})

    @ops.get("/hedge/stats")
    async def hedge_stats(mergeable: bool = False) -> Response:
        """`?mergeable=1`: the export `hedge-gateway stats URL URL` merges across replicas."""
        body = await stats_cache.get(mergeable, False, build_stats)
        return Response(body, media_type="application/json")

    @ops.get("/metrics")
    async def prometheus() -> Response:
        body = await metrics_cache.get(None, None, build_metrics)
        return Response(body, media_type=metrics.content_type)

    return ops
