"""`GET /dashboard` and the JSON behind it: `/hedge/series` and `/hedge/races`.

The page (`static/index.html`), its script and its style ship inside the package (package data
in pyproject.toml) and are read once when the router is built. They load nothing from outside
the gateway, and a Content-Security-Policy says so to the browser as well. Same exposure as
`/hedge/stats`: no gateway key needed, no prompt or key in any of it.

Both JSON documents are bounded reads: each is built and encoded at most once per second
(`PerSecond`), and an encoding larger than `MAX_JSON_BYTES` keeps only the newest points or
races that fit (`"truncated": true`). A `since` more than `RECENT_POINTS` behind the newest
point gets the whole series, which the page filters by `seq` anyway (`series_key`), so a
flood of reads costs at most one build of the whole series a second, and a few of the last
few points.
Behind `server.ops_keys` they need a key, like `/hedge/stats` and `/metrics`
(`gateway.api.asgi`).

`run_sampler` is the one background task: it adds a point to the `Series` once a second.
Under `serve --workers N` both JSON documents cover the whole server whichever worker answers
(`gateway.stats.shared`: every worker samples the whole server, and the races of every worker
are merged), and say which worker answered (`answered_by`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

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


#: the largest /hedge/series or /hedge/races answer (bytes of JSON)
MAX_JSON_BYTES = 2 * 1024 * 1024
#: how many different documents (`since` values) one second's cache holds
CACHE_KEYS = 8
#: a `since` at most this many points behind the newest gets a document of its own: the page
#: asks for the points after the last one it has, one or two behind; the documents of every
#: such `since`, within a second in which the newest point moves on once, and the whole
#: series fit in `CACHE_KEYS`
RECENT_POINTS = 5


def series_key(since: int, newest: int) -> int:
    """The `since` the series document answering `since` is built for, when the newest point
    is `newest`: itself if it is one of the last `RECENT_POINTS` points, else 0, the whole
    series. The reader filters by `seq`, so a whole series answers any `since`; one document
    per old `since` let a reader asking for since=0, 1, 2... force a build of nearly the whole
    series for each, several a second."""
    key = max(0, min(since, newest))  # a `since` past the newest point: none newer
    return key if newest - key <= RECENT_POINTS else 0


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def capped(doc: dict[str, Any], lists: Callable[[dict[str, Any]], list[tuple[Any, str]]],
           limit: int) -> bytes:
    """`doc` encoded, within `limit` bytes: while it is larger, the lists `lists(doc)` names
    (container, key) keep only their newer half, and the document says `"truncated": true`.
    At most a few encodings (halving), never unbounded work."""
    body = _encode(doc)
    while len(body) > limit:
        shortened = False
        for container, key in lists(doc):
            items = container[key]
            if items:
                container[key] = items[len(items) // 2:] if len(items) > 1 else []
                shortened = True
        doc["truncated"] = True
        body = _encode(doc)
        if not shortened:
            break
    return body


class PerSecond:
    """Encoded documents by key, each built at most once per second: at most `keys` keys a
    second; past that, callers use `fallback` (a key that is always allowed). Readers that
    arrive while a build is under way (under `--workers` it merges the peers' files in a
    thread) wait for that build instead of starting their own; a build that fails is not
    kept, so the next reader tries again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, keys: int = CACHE_KEYS
                 ) -> None:
        self._clock = clock
        self._keys = keys
        self._second = -1
        self._cache: dict[object, asyncio.Future[bytes]] = {}
        #: documents built (for tests: a flood of reads is not a flood of builds)
        self.builds = 0

    async def get(self, key: object, fallback: object,
                  build: Callable[[object], Awaitable[bytes]]) -> bytes:
        second = int(self._clock())
        if second != self._second:
            self._second, self._cache = second, {}
        if key not in self._cache and len(self._cache) >= self._keys:
            key = fallback
        while (found := self._cache.get(key)) is not None:
            try:
                return await asyncio.shield(found)
            except asyncio.CancelledError:
                if not found.cancelled():  # this reader was cancelled, not the build
                    raise
        self.builds += 1
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._cache[key] = future
        try:
            body = await build(key)
        except BaseException as exc:
            if self._cache.get(key) is future:
                del self._cache[key]
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()  # its readers build for themselves
            else:
                future.set_exception(exc)
                future.exception()  # retrieved: no "never retrieved" warning without readers
            raise
        future.set_result(body)
        return body


def _read(name: str) -> bytes:
    return (resources.files(__name__) / "static" / name).read_bytes()


def build_dashboard_router(series: Series, source: StatsSource,
                           caches: tuple[PerSecond, PerSecond] | None = None) -> APIRouter:
    """The page, its files and its two JSON reads; `caches`: (series, races), each built at
    most once a second."""
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

    series_cache, races_cache = caches if caches is not None else (PerSecond(), PerSecond())

    async def build_series(since: object) -> bytes:
        assert isinstance(since, int)
        doc = series.view(since)
        answered = source.answered_by()
        if answered is not None:
            doc["answered_by"] = answered
        return capped(doc, lambda d: [(d["pools"], name) for name in d["pools"]],
                      MAX_JSON_BYTES)

    async def build_races(_: object) -> bytes:
        doc = await source.races_async()
        return capped(doc, lambda d: [(d, "races")], MAX_JSON_BYTES)

    @router.get("/hedge/series")
    async def hedge_series(since: int = 0) -> Response:
        body = await series_cache.get(series_key(since, series.seq), 0, build_series)
        return Response(body, media_type="application/json")

    @router.get("/hedge/races")
    async def hedge_races() -> Response:
        return Response(await races_cache.get(None, None, build_races),
                        media_type="application/json")

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
