"""`GET /dashboard` and the JSON behind it: `/hedge/series` and `/hedge/races`.

The page (`static/index.html`), its script and its style ship inside the package (package data
in pyproject.toml) and are read once when the router is built. They load nothing from outside
the gateway, and a Content-Security-Policy says so to the browser as well. Same exposure as
`/hedge/stats`: no gateway key needed, no prompt or key in any of it.

`run_sampler` is the one background task: it adds a point to the `Series` once a second.
Under `serve --workers N` both JSON documents cover the whole server whichever worker answers
(`gateway.stats.shared`: every worker samples the whole server, and the races of every worker
are merged), and say which worker answered (`answered_by`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from gateway.errors import RouteNotFound
from gateway.stats.series import Reading, Series
from gateway.stats.shared import StatsSource

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


def build_dashboard_router(series: Series, source: StatsSource) -> APIRouter:
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
        doc = series.view(since)
        answered = source.answered_by()
        if answered is not None:
            doc["answered_by"] = answered
        return JSONResponse(doc)

    @router.get("/hedge/races")
    async def hedge_races() -> JSONResponse:
        return JSONResponse(await source.races_async())

    return router


Read = Callable[[], Awaitable[tuple[float, Reading]]]


async def sample_now(series: Series, read: Read) -> None:
    """Add a point now. `read`: (now, the reading at now), `StatsSource.series_reading_async`.
    The app takes the first before it serves: the baseline its rates start from."""
    try:
        now, reading = await read()
    except ValueError:  # peers' numbers that do not merge (a mixed upgrade): no point now
        return
    series.sample(reading, now)


async def run_sampler(series: Series, read: Read, clock: Callable[[], float]) -> None:
    """Sample the series on each whole second until cancelled (at app shutdown)."""
    due = series.next_at()
    while True:
        await asyncio.sleep(max(0.0, due - clock()))
        await sample_now(series, read)
        due = max(series.next_at(), due + series.interval)
