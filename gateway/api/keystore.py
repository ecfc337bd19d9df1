"""The store behind the client keys, kept off the request path: keys made at run time come in,
usage goes out, each in the background.

`TenantSync` opens the store (`gateway.tenants.store`) when the gateway starts, in a worker
thread, and then, every `POLL_INTERVAL` seconds, reads the store's one-row keys version: when
another process (a worker, a replica on the same file, `hedge-gateway keys revoke`) made or
revoked a key, it loads the active keys into the gate (`TenantGate.adopt_stored`). Every
`FLUSH_INTERVAL` it writes the usage counted since the last batch (spend included), in one
transaction, and reads back every key's spend of the day and the month, which the budgets are
held to; while a key has a budget, the spend is also read at every poll, so another process's
batch is seen within a poll of its writing. All run in worker threads: the event loop never
waits on the file.

Where the keys' per-minute limits are shared with other processes (`TenantGate.leasing`: a
PostgreSQL store, or the workers of one `serve` on one file), `lease_forever` settles every
key's slices (`gateway.tenants.lease`) in one transaction per round: every `LEASE_INTERVAL`,
and at once when a request took a slice below its low mark or borrowed (`TenantGate.wake`),
so a slice is refilled before it runs out and no request waits on the store.

A store that cannot be read keeps the keys last read (a revocation waits for it) and is
logged once per failure streak; a batch that cannot be written is kept and added to the next
(bounded: four counters per key). At shutdown the last batch is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import logging
import sqlite3
from typing import TYPE_CHECKING

from gateway.api.tenancy import TenantGate
from gateway.server.workers import worker_limits
from gateway.tenants.lease import Ask, Grant, Slice
from gateway.tenants.spend import period_spend
from gateway.tenants.store import UsageRow, path_of
from gateway.tenants.stores import is_shared, open_store

if TYPE_CHECKING:
    from gateway.tenants.stores import TenantStore

#: how often each process looks for keys made or revoked elsewhere (seconds): a revocation
#: reaches every worker within this and a poll's time
POLL_INTERVAL = 0.5
#: how often usage is written (seconds): a killed process loses at most this much of it
FLUSH_INTERVAL = 1.0
#: how often the slices of the shared limits are settled when no request asks sooner (seconds):
#: idle slices go back, debts are paid
LEASE_INTERVAL = 0.25
#: rounds asked for by requests are at least this far apart (seconds): a flood of requests
#: makes a round each this often, not a transaction each
LEASE_GAP = 0.02
LOGGER = logging.getLogger("hedge_gateway.store")


class TenantSync:
    """Keeps `gate` in step with the store at `url` (None: the embedded default file)."""

    def __init__(self, gate: TenantGate, url: str | None, workers: int = 1) -> None:
        self.gate = gate
        #: under `serve --workers N` each worker holds its part of a stored key's limits,
        #: as of a configured key's (`gateway.server.workers.worker_limits`)
        self.workers = workers
        self.url = url
        #: the store as log lines name it: the file, or the server (never its password)
        self.path = "postgresql" if is_shared(url) else path_of(url)
        self.store: TenantStore | None = None
        self.version = -1
        self._failing = False
        #: one flush at a time (the loop's, an admin's usage read, the last at shutdown):
        #: a batch taken while another is being written would otherwise race its outcome
        self._flushing = asyncio.Lock()
        #: a round of leases is wanted now (`TenantGate.wake`)
        self._lease_wanted = asyncio.Event()
        gate.wake = self._lease_wanted.set
        #: the last round's transaction (it outlives a cancelled round: `lease_round`)
        self._leasing: asyncio.Future[list[Grant]] | None = None
        #: the last batch's write of usage (it outlives a cancelled flush: `_flush`)
        self._writing: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Open the store and load its keys and their spend (before the gateway serves)."""
        self.store = await asyncio.to_thread(open_store, self.url)
        self.path = self.store.path
        await self.poll()
        await self.read_spend()

    async def poll(self) -> None:
        """Load the store's keys if they changed since the last look."""
        store = self.store
        if store is None:
            return
        try:
            version = await asyncio.to_thread(store.keys_version)
            if version != self.version:
                keys, bad = await asyncio.to_thread(store.active_keys)
                for name in bad:
                    LOGGER.error("store key %r is not a valid key; skipped", name)
                if self.workers > 1:
                    keys = [dataclasses.replace(key, limits=worker_limits(key.limits,
                                                                          self.workers))
                            for key in keys]
                for name in self.gate.adopt_stored(keys):
                    LOGGER.warning("store key %r is also in the configuration's keys: the "
                                   "configuration's is used", name)
                self.version = version
            self._recovered()
        except (sqlite3.Error, OSError) as exc:
            self._failed("read", exc)

    async def flush(self) -> None:
        """Write the usage counted since the last batch (kept for the next on failure), then
        read back every key's spend for the budgets. One at a time (`_flushing`)."""
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        store = self.store
        usage = self.gate.take_usage()
        if store is None:
            self.gate.keep_unsent(usage)
            return
        if not usage:
            await self.read_spend(usage)
            return
        day = datetime.datetime.fromtimestamp(self.gate.wall(), tz=datetime.UTC).date()
        rows = [UsageRow(name, day.isoformat(), *counts) for name, counts in usage.items()]
        # the write runs in a thread that a cancellation (shutdown) cannot stop: its outcome
        # is taken from the thread (`_written`, whenever it comes), and `stop` waits for it
        # before the last batch and the store's close (closed under it, the batch was lost)
        work = asyncio.ensure_future(asyncio.to_thread(store.add_usage, rows))
        work.add_done_callback(functools.partial(self._written, usage))
        self._writing = work
        try:
            await asyncio.shield(work)
        except (sqlite3.Error, OSError):
            return  # kept for the next batch by `_written`
        self._recovered()
        await self.read_spend(usage)

    def _written(self, usage: dict[str, list[int]], work: asyncio.Future[None]) -> None:
        """A batch's write is over: when the store raised (nothing was committed), the batch
        goes back into the next one."""
        exc = None if work.cancelled() else work.exception()
        if work.cancelled() or exc is not None:
            self.gate.keep_unsent(usage)  # back into the next batch
        if isinstance(exc, sqlite3.Error | OSError):
            self._failed("write", exc)

    async def read_spend(self, written: dict[str, list[int]] | None = None) -> None:
        """Every key's spend of today and this month, as the store holds it (all processes'
        written batches), for the budgets (`TenantGate.check_budget`); `written`: the batch
        just written, which the read includes."""
        store = self.store
        if store is None:
            return
        today = datetime.datetime.fromtimestamp(self.gate.wall(), tz=datetime.UTC).date()
        try:
            rows = await asyncio.to_thread(store.spend_since,
                                           today.replace(day=1).isoformat())
        except (sqlite3.Error, OSError) as exc:
            self._failed("read", exc)
            return
        self.gate.adopt_spend(period_spend(rows, today.isoformat()), written)

    async def run(self) -> None:
        """Poll and flush until cancelled."""
        flushes = max(1, round(FLUSH_INTERVAL / POLL_INTERVAL))
        beat = 0
        while True:
            await asyncio.sleep(POLL_INTERVAL)
            await self.poll()
            beat += 1
            if beat % flushes == 0:
                await self.flush()  # reads the spend back
            elif self.gate.budgeted():
                await self.read_spend()

    async def lease_forever(self) -> None:
        """Settle the keys' slices until cancelled: at once when asked, else every
        `LEASE_INTERVAL`."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lease_wanted.wait(), LEASE_INTERVAL)
            self._lease_wanted.clear()
            await self.lease_round()
            await asyncio.sleep(LEASE_GAP)

    async def lease_round(self, *, last: bool = False) -> None:
        """One batch: every slice that owes, holds too much or wants more, settled in one
        transaction; on failure each gets back what it sent (`Slice.failed`) and, under
        `server.store_down: open`, the processes hold the whole limits until the store
        answers again. `last`: the batch of a process stopping, which gives every slice
        back (what it holds unused is then the other processes' at once)."""
        store, leasing = self.store, self.gate.leasing
        if store is None or leasing is None:
            return
        now = self.gate.clock()
        pairs = [pair for tenant in self.gate.tenants.by_digest.values()
                 if tenant.limits is not None and tenant.limits.lease is not None
                 for pair in tenant.limits.lease.asks(now, last=last)]
        if not pairs:
            return
        asks = [ask for _, ask in pairs]
        # the transaction runs in a thread that a cancellation (shutdown) cannot stop: it may
        # commit after this task is gone, so the slices are settled from the thread's own
        # outcome (`_settle`, whenever it comes), never from this task's; `stop` waits for it
        work = asyncio.ensure_future(asyncio.to_thread(store.lease, asks))
        work.add_done_callback(functools.partial(self._settle, pairs))
        self._leasing = work
        try:
            await asyncio.shield(work)
        except (sqlite3.Error, OSError) as exc:
            self._failed("lease from", exc)
            return
        self._recovered()

    def _settle(self, pairs: list[tuple[Slice, Ask]], work: asyncio.Future[list[Grant]]
                ) -> None:
        """A round's transaction is over: each slice settled from its grant, or, only when
        the store really raised (nothing was committed), given back what it sent."""
        if work.cancelled() or work.exception() is not None:
            for piece, ask in pairs:
                piece.failed(ask)
            return
        now = self.gate.clock()
        for (piece, _), grant in zip(pairs, work.result(), strict=True):
            piece.settled(grant, now)

    async def stop(self) -> None:
        """The last batch of usage and of leases (the slices given back), then the store
        closed."""
        if self._writing is not None:  # a flush cancelled mid-write: its outcome first
            await asyncio.wait([self._writing])
        await self.flush()
        if self._leasing is not None:  # a round cancelled mid-transaction: its outcome first
            await asyncio.wait([self._leasing])
        await self.lease_round(last=True)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None

    def _failed(self, what: str, exc: BaseException) -> None:
        self.gate.store_down = True
        if self.gate.leasing is not None:
            self.gate.leasing.up = False
        if not self._failing:
            LOGGER.error("tenant store %s: cannot %s it (%s); keys stay as last read, usage "
                         "is kept for the next batch", self.path, what, type(exc).__name__)
        self._failing = True

    def _recovered(self) -> None:
        self.gate.store_down = False
        if self.gate.leasing is not None:
            self.gate.leasing.up = True
        if self._failing:
            LOGGER.warning("tenant store %s: working again", self.path)
        self._failing = False
