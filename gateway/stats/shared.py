"""What `/hedge/stats` and `/metrics` read: this process, or the whole server.

Without workers, `StatsSource` reads this process's `Stats` and pools, as it always did. Under
`serve --workers N` each worker also *publishes* its mergeable export
(`gateway.stats.merge.export`) to a private directory the supervisor created (and removes at
exit): every `PUBLISH_INTERVAL` seconds, from a task of its own rather than on the request path,
written to a temporary file and renamed so a reader never sees half of one. Whichever worker a
scrape reaches merges its own fresh export with its peers' files, so the answer covers the
whole server and no number in it is older than `MAX_AGE`: a file older than that (a worker
stopped, hung, or gone) is left out, and its absence shows as a missing entry in `workers`.

Why files and not shared memory or a socket between workers: a worker stays a plain uvicorn
process with no lock and no peer protocol on its hot path; a dead worker cannot corrupt what
the others read; and the cost is one small write per worker per half second. Timestamps are
the app clock (`time.monotonic`, system-wide on Linux), so ages compare across the workers of
one host.

The dashboard's data reads the same files: the series sampler of every worker reads the whole
server once a second (`series_reading_async`, `gateway.stats.series`), and `/hedge/races`
merges the workers' last races (`races_async`). Both count time from the supervisor's start
(`Peers.started`), so the workers' points and races share one time axis.

The pure parts (export, merge, document, races, series) live in `gateway.stats.merge`,
`.races` and `.series`; this module only reads and writes files and picks which numbers an
endpoint shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.stats.merge import document, export, lifetime_only, merge, only_pools, rebuild
from gateway.stats.prometheus import Metrics, Reading
from gateway.stats.races import merge_races, races_view
from gateway.stats.series import Reading as SeriesReading
from gateway.stats.series import own_reading, whole_reading
from gateway.stats.view import config_view, live_view, snapshot

if TYPE_CHECKING:
    from gateway.hedge.generation import Live
    from gateway.hedge.pool import PoolRuntime
    from gateway.stats.record import Stats

PUBLISH_INTERVAL = 0.5
#: peers' numbers older than this are left out (at most 2 s stale)
MAX_AGE = 2.0
_PREFIX = "worker-"
#: the lifetime numbers of workers that died, merged into one file by the supervisor
RETIRED = "retired.json"


class Peers:
    """The shared directory as one worker sees it: its own file and its peers'."""

    def __init__(self, directory: Path, index: int, pid: int | None = None, *,
                 started: float | None = None) -> None:
        """`started`: when the server started (the supervisor's clock, which is the workers'
        too), for the dashboard's time axis."""
        self.directory = directory
        self.index = index
        self.pid = os.getpid() if pid is None else pid
        self.started = started

    def _path(self, index: int) -> Path:
        return self.directory / f"{_PREFIX}{index}.json"

    def publish(self, item: Mapping[str, Any], now: float) -> None:
        """Replace this worker's file with `item`, stamped `now`, atomically."""
        _write(self._path(self.index), item, now)

    def read(self, now: float) -> list[dict[str, Any]]:
        """The peers' exports no older than `MAX_AGE` at `now` (their `workers` entries
        carrying `age_s`), and the retired numbers; unreadable, torn or stale files are left
        out. A dead worker is counted once, in its file or in the retired numbers, never in
        both or neither: a file the retired numbers have absorbed is skipped, and a read that
        saw the retired file change under it is done again (`retire` writes them first, then
        removes the worker's file)."""
        retired_path = self.directory / RETIRED
        for _ in range(READ_TRIES):
            before = _read_text(retired_path)
            retired = _parse(before)
            absorbed = set(retired.get("absorbed", ())) if retired is not None else set()
            out = [item for path in sorted(self.directory.glob(f"{_PREFIX}*.json"))
                   if path != self._path(self.index)
                   and (item := _peer(path, now, absorbed)) is not None]
            if _read_text(retired_path) == before:
                break
        if retired is not None:
            out.append(retired["export"])
        return out


#: reads of the directory before one that saw no retirement under it is given up on (a
#: retirement is a worker's death: two in a row inside one read do not happen)
READ_TRIES = 3
#: identities of absorbed workers the retired file keeps (only the latest can still have a
#: file: `retire` removes it right after)
ABSORBED_KEPT = 16


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _parse(text: str | None) -> dict[str, Any] | None:
    """A file's wrapper (`export`, and `written_at` or the retired file's `absorbed`), None
    when absent, unreadable or not an export."""
    if text is None:
        return None
    try:
        wrapper = json.loads(text)
        merge([wrapper["export"]])  # checked: a bad file spoils no answer
    except (ValueError, KeyError, TypeError):
        return None
    return wrapper if isinstance(wrapper, dict) else None


def _identities(item: Mapping[str, Any]) -> list[str]:
    return [f"{w.get('worker')}:{w.get('pid')}" for w in item.get("workers", ())]


def _peer(path: Path, now: float, absorbed: set[str]) -> dict[str, Any] | None:
    """A peer's export when it is fresh and not absorbed into the retired numbers."""
    try:
        wrapper = json.loads(path.read_text())
        age = now - float(wrapper["written_at"])
        item = merge([wrapper["export"]])  # checked: one bad file spoils no answer
        for worker in item["workers"]:
            worker["age_s"] = round(max(0.0, age), 3)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # removed under us, or not an export: left out
    if age > MAX_AGE or absorbed.intersection(_identities(item)):
        return None
    return item


def _write(path: Path, item: Mapping[str, Any], now: float, **extra: Any) -> None:
    temp = path.with_suffix(f".{os.getpid()}.tmp")
    temp.write_text(json.dumps({"written_at": now, "export": item, **extra}, allow_nan=False))
    os.replace(temp, path)


def retire(directory: Path, index: int) -> None:
    """A worker died (the supervisor calls this, before it starts a replacement): fold the
    lifetime numbers of its last file into the directory's retired file, which every worker
    adds to the whole server, then remove its file. In that order, with the dead worker named
    in the retired file, so that a peer reading meanwhile counts it exactly once (`read`):
    the server's counters never dip. The requests it served in its last moments, after its
    last publish, are lost with it."""
    path = directory / f"{_PREFIX}{index}.json"
    wrapper = _parse(_read_text(path))
    if wrapper is not None:
        dead = wrapper["export"]
        before = _parse(_read_text(directory / RETIRED))
        try:
            folded = merge([lifetime_only(dead), *([] if before is None
                                                   else [before["export"]])])
        except ValueError:
            folded = None  # not ours to repair: the retired numbers stay as they were
        if folded is not None:
            absorbed = [*(before.get("absorbed", []) if before is not None else []),
                        *_identities(dead)][-ABSORBED_KEPT:]
            _write(directory / RETIRED, folded, 0.0, absorbed=absorbed)
    path.unlink(missing_ok=True)


class StatsSource:
    """The numbers behind `/hedge/stats` (plain or mergeable) and `/metrics`."""

    def __init__(self, stats: Stats, pools: Mapping[str, PoolRuntime],
                 clock: Callable[[], float], peers: Peers | None = None, *,
                 live: Live | None = None) -> None:
        """`pools`: a view that follows reloads (`LivePools`); `live`: for the `config`
        section (the configuration in force)."""
        self._stats = stats
        self._pools = pools
        self._clock = clock
        self.peers = peers
        self._live = live

    @property
    def origin(self) -> float:
        """When the server started: the supervisor's start under workers (one time axis for
        every worker's series and races), else this process's."""
        peers = self.peers
        if peers is None or peers.started is None:
            return self._stats.started
        return peers.started

    def answered_by(self) -> dict[str, int] | None:
        """Under workers, the worker answering (`worker`, `pid`); None without workers."""
        peers = self.peers
        return None if peers is None else {"worker": peers.index, "pid": peers.pid}

    def _own(self, now: float) -> dict[str, Any]:
        peers = self.peers
        identity: dict[str, Any] = {"worker": 0 if peers is None else peers.index,
                                    "pid": os.getpid() if peers is None else peers.pid}
        if self._live is not None:
            identity["config"] = config_view(self._live, now)
        return export(self._stats, live_view(self._pools, now), now, identity)

    def _whole(self, own: dict[str, Any], now: float) -> dict[str, Any]:
        """This worker's export merged with its peers' files (no live object is touched, so
        this may run in a thread)."""
        peers = self.peers
        if peers is None:
            return own
        names = own["pools"].keys()
        return merge([own, *(only_pools(item, names) for item in peers.read(now))])

    def mergeable(self) -> dict[str, Any]:
        """This process's export, or the whole server's merged one under workers."""
        now = self._clock()
        return self._whole(self._own(now), now)

    def document(self) -> dict[str, Any]:
        """The `/hedge/stats` document: this process's, or the whole server's."""
        if self.peers is None:
            return snapshot(self._stats, self._pools, self._clock(), live=self._live)
        return document(self.mergeable())

    def reading(self) -> Reading:
        """What a Prometheus scrape reads: this process's, or the whole server's."""
        if self.peers is None:
            return self._stats, live_view(self._pools, self._clock())
        stats, live, _now = rebuild(self.mergeable())
        return stats, live

    # The endpoints' forms. Under workers, reading the peers' files and merging them costs a
    # few ms per worker: that part runs in a thread, off the event loop that relays streams.
    # Only this worker's own export is taken on the loop (it reads live state; ~0.5 ms).

    async def document_async(self) -> dict[str, Any]:
        if self.peers is None:
            return self.document()
        now = self._clock()
        own = self._own(now)
        doc = await asyncio.to_thread(lambda: document(self._whole(own, now)))
        doc["answered_by"] = {k: own["workers"][0][k] for k in ("worker", "pid")}
        return doc

    async def mergeable_async(self) -> dict[str, Any]:
        if self.peers is None:
            return self.mergeable()
        now = self._clock()
        return await asyncio.to_thread(self._whole, self._own(now), now)

    async def metrics_async(self, metrics: Metrics) -> bytes:
        """The `/metrics` text: this process's, or the whole server's."""
        if self.peers is None:
            return metrics.render()
        now = self._clock()
        own = self._own(now)

        def build() -> bytes:
            stats, live, _now = rebuild(self._whole(own, now))
            return metrics.render_from((stats, live))

        return await asyncio.to_thread(build)

    async def series_reading_async(self) -> tuple[float, SeriesReading]:
        """(now, what the series samples at now): this process's, or the whole server's."""
        now = self._clock()
        peers = self.peers
        if peers is None:
            return now, own_reading(self._stats, live_view(self._pools, now), now, os.getpid())
        own = self._own(now)
        reading = await asyncio.to_thread(lambda: whole_reading([own, *peers.read(now)], now))
        return now, reading

    async def races_async(self) -> dict[str, Any]:
        """The `/hedge/races` document: this process's last races, or the whole server's (the
        newest of every worker's, `answered_by` added)."""
        races = self._stats.races
        peers = self.peers
        if peers is None:
            return races.view()
        now = self._clock()
        own = races.export({"worker": peers.index, "pid": peers.pid})

        def build() -> dict[str, Any]:
            merged = merge_races([own, *(item["races"] for item in peers.read(now))])
            return races_view(merged, self.origin)

        doc = await asyncio.to_thread(build)
        doc["answered_by"] = self.answered_by()
        return doc

    async def publish_forever(self, interval: float = PUBLISH_INTERVAL) -> None:
        """Publish this worker's export every `interval` seconds until cancelled."""
        peers = self.peers
        if peers is None:
            return
        while True:  # the file stays when this ends: the supervisor retires or removes it
            now = self._clock()
            with contextlib.suppress(OSError):  # the directory is going away: shutdown
                peers.publish(self._own(now), now)
            await asyncio.sleep(interval)
