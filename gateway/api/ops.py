"""The operational routes: liveness, readiness, `/hedge/stats` and `/metrics`."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

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
) -> APIRouter:
    ops = APIRouter()

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
    async def hedge_stats(mergeable: bool = False) -> JSONResponse:
        """`?mergeable=1`: the export `hedge-gateway stats URL URL` merges across replicas."""
        return JSONResponse(await (stats.mergeable_async() if mergeable
                                   else stats.document_async()))

    @ops.get("/metrics")
    async def prometheus() -> Response:
        return Response(await stats.metrics_async(metrics), media_type=metrics.content_type)

    return ops
