"""`GET /dashboard` and the JSON behind it: `/hedge/series` and `/hedge/races` (SPEC §17).

The page (`static/index.html`), its script and its style ship inside the package (package data
in pyproject.toml) and are read once when the router is built. They load nothing from outside
the gateway, and a Content-Security-Policy says so to the browser as well. Same exposure as
`/hedge/stats`: no gateway key needed, no prompt or key in any of it.

`run_sampler` is the one background task: it adds a point to the `Series` once a second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import resources

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from gateway.errors import RouteNotFound
from gateway.stats import Stats
from gateway.stats.series import INTERVAL, Series

#: the files served under /dashboard/, with their media types
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {"content-security-policy": CSP, "cache-control": "no-cache",
            "x-content-type-options": "nosniff"}


def _read(name: str) -> bytes:
    return (resources.files(__name__) / "static" / name).read_bytes()


def build_dashboard_router(stats: Stats, series: Series) -> APIRouter:
    page = _read("index.html")
    assets = {name: (_read(name), media) for name, media in ASSETS.items()}
    router = APIRouter()

    @router.get("/dashboard")
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    @router.get("/dashboard/{name}")
    async def asset(name: str) -> Response:
        found = assets.get(name)
        if found is None:
            raise RouteNotFound("no such dashboard file")
        return Response(found[0], media_type=found[1], headers=_HEADERS)

    @router.get("/hedge/series")
    async def hedge_series(since: int = 0) -> JSONResponse:
        return JSONResponse(series.view(since))

    @router.get("/hedge/races")
    async def hedge_races() -> JSONResponse:
        return JSONResponse(stats.races.view())

    return router


async def run_sampler(
    series: Series, clock: Callable[[], float], interval: float = INTERVAL
) -> None:
    """Sample the series every `interval` seconds until cancelled (at app shutdown)."""
    while True:
        series.sample(clock())
        await asyncio.sleep(interval)
