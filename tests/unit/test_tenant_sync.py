"""The store kept off the request path (`gateway.api.keystore.TenantSync`), on a real file but
with the store's failures injected: a store that cannot be read keeps the keys last read, a
batch that cannot be written is kept for the next, and a row that no longer validates is
skipped rather than ending the sync. No sockets; `asyncio.run` drives it."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from pathlib import Path

import pytest

from gateway.api.keys import KeyRing
from gateway.api.keystore import TenantSync
from gateway.api.tenancy import TenantGate
from gateway.errors import BudgetExceeded
from gateway.settings.tenants import TenantBudget, TenantKeySettings, TenantLimits
from gateway.tenants.lease import Ask, Grant, Leasing
from gateway.tenants.limits import Refusal
from gateway.tenants.store import SqliteStore, UsageRow

WAIT = 10.0


def gate() -> TenantGate:
    return TenantGate(KeyRing(), (), clock=lambda: 0.0, wall=lambda: 86_400.0, required=True)


def fail(*_: object) -> None:
    raise sqlite3.OperationalError("disk I/O error")


def test_a_store_that_fails_keeps_the_keys_and_the_usage_until_it_works_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hedge_gateway.store")
    the_gate = gate()
    sync = TenantSync(the_gate, f"sqlite:///{tmp_path}/t.sqlite")

    async def scenario() -> None:
        await sync.start()
        assert sync.store is not None
        secret, _ = sync.store.create_key("team-a")
        await sync.poll()
        assert the_gate.tenants.find(secret) is not None
        real_version, real_add = sync.store.keys_version, sync.store.add_usage
        sync.store.keys_version = fail  # type: ignore[method-assign,assignment]
        sync.store.add_usage = fail  # type: ignore[method-assign,assignment]
        the_gate.usage["team-a"] = [2, 20, 10]
        await sync.poll()
        await sync.flush()
        assert the_gate.tenants.find(secret) is not None  # the keys last read
        assert the_gate.usage == {"team-a": [2, 20, 10]}  # kept for the next batch
        the_gate.usage["team-a"][0] += 1
        sync.store.keys_version = real_version  # type: ignore[method-assign]
        sync.store.add_usage = real_add  # type: ignore[method-assign]
        await sync.flush()
        assert sync.store.usage("team-a") == [UsageRow("team-a", "1970-01-02", 3, 20, 10)]
        await sync.stop()

    asyncio.run(scenario())
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "cannot" in m]) == 1  # once per failure streak
    assert any("working again" in m for m in messages)


def test_a_row_that_no_longer_validates_is_skipped_and_the_sync_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    the_gate = gate()
    path = tmp_path / "t.sqlite"
    sync = TenantSync(the_gate, f"sqlite:///{path}")

    async def scenario() -> None:
        await sync.start()
        assert sync.store is not None
        good, _ = sync.store.create_key("good")
        sync.store.create_key("bad")
        with sqlite3.connect(path) as db:  # written by something else, or by hand
            db.execute("UPDATE keys SET limits = '{\"in_flight\": 0}' WHERE name = 'bad'")
            db.execute("UPDATE meta SET value = value + 1")
        await sync.poll()
        assert the_gate.tenants.find(good) is not None
        await sync.stop()

    asyncio.run(scenario())
    assert any("'bad'" in r.getMessage() for r in caplog.records)


def test_processes_share_a_keys_spend_through_the_stores_batches(tmp_path: Path) -> None:
    """Two processes (two gates, two syncs) on one file, one key with a budget of 5 USD a
    day. What one process spent counts at the other once its batch is written and read
    back: until then only its own unwritten spend counts (the documented overshoot)."""
    key = TenantKeySettings("team-a", key="team-a-secret", budget=TenantBudget(5.0, "day"))
    one, two = (TenantGate(KeyRing(), (key,), clock=lambda: 0.0, wall=lambda: 86_400.0)
                for _ in range(2))
    url = f"sqlite:///{tmp_path}/t.sqlite"
    (tenant,) = one.tenants.by_digest.values()
    (tenant_two,) = two.tenants.by_digest.values()

    async def scenario() -> None:
        first, second = TenantSync(one, url), TenantSync(two, url)
        await first.start()
        await second.start()
        one.usage["team-a"] = [1, 10, 10, 3_000_000]  # 3 USD spent in process one
        two.usage["team-a"] = [1, 10, 10, 2_500_000]  # 2.50 USD in process two
        one.check_budget(tenant)  # each alone is under 5 USD
        two.check_budget(tenant_two)
        await first.flush()  # process one's batch written, the store read back
        await second.read_spend()
        with pytest.raises(BudgetExceeded):  # two: its own 2.50 + the store's 3
            two.check_budget(tenant_two)
        one.check_budget(tenant)  # one has not seen two's unwritten 2.50 yet
        await second.flush()
        await first.read_spend()
        with pytest.raises(BudgetExceeded):
            one.check_budget(tenant)
        assert [row.spend_usd for row in first.store.usage("team-a")] == [5.5]  # type: ignore[union-attr]
        await first.stop()
        await second.stop()

    asyncio.run(scenario())


def test_a_batch_written_but_not_read_back_still_counts_against_the_budget(
    tmp_path: Path
) -> None:
    """The batch is written, the read of the spend fails, the next batch is taken: the
    written one still counts until a read includes it."""
    key = TenantKeySettings("team-a", key="team-a-secret", budget=TenantBudget(5.0, "day"))
    the_gate = TenantGate(KeyRing(), (key,), clock=lambda: 0.0, wall=lambda: 86_400.0)
    (tenant,) = the_gate.tenants.by_digest.values()

    async def scenario() -> None:
        sync = TenantSync(the_gate, f"sqlite:///{tmp_path}/t.sqlite")
        await sync.start()
        assert sync.store is not None
        real_read = sync.store.spend_since
        sync.store.spend_since = fail  # type: ignore[method-assign,assignment]
        the_gate.usage["team-a"] = [1, 10, 10, 6_000_000]
        await sync.flush()  # written; its read-back failed
        await sync.flush()  # the next (empty) batch taken
        with pytest.raises(BudgetExceeded):
            the_gate.check_budget(tenant)
        sync.store.spend_since = real_read  # type: ignore[method-assign]
        await sync.read_spend()  # the store's figure now holds it, once
        assert the_gate.spent == {"team-a": (6_000_000, 6_000_000)}
        assert the_gate.unread == {} and the_gate.sending == {}
        await sync.stop()

    asyncio.run(scenario())


def test_overlapping_flushes_lose_no_batch_when_a_write_fails(tmp_path: Path) -> None:
    """The loop's flush is writing batch A when an admin's usage read flushes batch B; A's
    write fails. A is kept for the next batch and B is written once: the store ends with
    both requests, never one lost or one counted twice."""
    the_gate = gate()
    sync = TenantSync(the_gate, f"sqlite:///{tmp_path}/t.sqlite")
    release = threading.Event()
    writes: list[int] = []

    async def scenario() -> None:
        await sync.start()
        assert sync.store is not None
        real_add = sync.store.add_usage

        def add_usage(rows: list[UsageRow]) -> None:
            writes.append(sum(row.requests for row in rows))
            if len(writes) == 1:  # batch A: held, then the disk fails
                release.wait(5.0)
                raise sqlite3.OperationalError("disk I/O error")
            real_add(rows)

        sync.store.add_usage = add_usage  # type: ignore[method-assign,assignment]
        the_gate.usage["team-a"] = [1, 10, 5, 0]
        first = asyncio.create_task(sync.flush())
        while not writes:  # A is being written
            await asyncio.sleep(0.001)
        the_gate.usage["team-a"] = [1, 10, 5, 0]  # batch B, counted meanwhile
        second = asyncio.create_task(sync.flush())
        await asyncio.sleep(0.05)  # B's flush runs as far as it may
        release.set()
        await asyncio.gather(first, second)
        await sync.flush()  # whatever was kept
        assert sync.store.usage("team-a") == [UsageRow("team-a", "1970-01-02", 2, 20, 10)]
        assert the_gate.usage == {} and the_gate.sending == {} and the_gate.unread == {}
        await sync.stop()

    asyncio.run(scenario())


def test_a_failed_batch_put_back_is_the_one_given_not_the_one_being_written() -> None:
    """Two batches taken (A, then B while A was still out): A's failure puts A back, leaves
    B being written, and takes A's spend out of what was counted as written."""
    the_gate = gate()
    the_gate.usage["team-a"] = [1, 10, 5, 7]
    batch_a = the_gate.take_usage()
    the_gate.usage["team-a"] = [2, 20, 10, 11]
    batch_b = the_gate.take_usage()
    assert the_gate.unread == {"team-a": 7}  # A taken for written
    the_gate.keep_unsent(batch_a)
    assert the_gate.usage == {"team-a": [1, 10, 5, 7]}
    assert the_gate.sending is batch_b and the_gate.unread == {}


def test_a_round_of_leases_settles_every_slice_and_a_failed_one_fails_open(
        tmp_path: Path) -> None:
    """`TenantSync.lease_round`: the slices of every key in one batch; the store failing,
    each slice gets back what it sent and the leases are off (`store_down: open`: each
    process holds its whole limit), on again at the next round that works."""
    leasing = Leasing()
    the_gate = TenantGate(KeyRing(), (), clock=lambda: 0.0, wall=lambda: 86_400.0,
                          required=True, leasing=leasing)
    sync = TenantSync(the_gate, f"sqlite:///{tmp_path}/t.sqlite")

    async def scenario() -> None:
        await sync.start()
        assert sync.store is not None
        secret, _ = sync.store.create_key("team-a", limits=TenantLimits(requests_per_minute=60))
        await sync.poll()
        tenant = the_gate.tenants.find(secret)
        assert tenant is not None and tenant.limits is not None
        lease = tenant.limits.lease
        assert lease is not None and lease.requests is not None
        assert not isinstance(tenant.limits.admit(0.0, 0), Refusal)  # borrowed
        assert lease.wanted and lease.requests.held == -1.0
        real = sync.store.lease
        sync.store.lease = fail  # type: ignore[method-assign,assignment]
        await sync.lease_round()
        assert lease.requests.held == -1.0 and not leasing.up and the_gate.store_down
        sync.store.lease = real  # type: ignore[method-assign]
        await sync.lease_round()
        assert leasing.up and not the_gate.store_down
        assert lease.requests.held > 0  # the debt paid, a slice granted
        await sync.stop()

    asyncio.run(scenario())


def test_whether_any_key_has_a_budget_follows_every_change_of_keys() -> None:
    """Found once per change of keys (the file's, the store's), not at every poll."""
    the_gate = gate()
    assert not the_gate.budgeted()
    budgeted = TenantKeySettings(name="team-a", key="team-a-secret-0123456789abcdef",
                                 budget=TenantBudget(usd=1.0))
    the_gate.adopt_stored([budgeted])
    assert the_gate.budgeted()
    the_gate.adopt_stored([])
    assert not the_gate.budgeted()
    the_gate.replace([budgeted])
    assert the_gate.budgeted()


def test_a_process_stopping_gives_its_slices_back(tmp_path: Path) -> None:
    """What a process holds unused of a shared limit goes back to the bucket in its last
    batch: only what it admitted stays taken."""
    path = tmp_path / "t.sqlite"
    the_gate = TenantGate(KeyRing(), (), clock=lambda: 0.0, wall=lambda: 86_400.0,
                          required=True, leasing=Leasing())
    sync = TenantSync(the_gate, f"sqlite:///{path}")

    async def scenario() -> None:
        await sync.start()
        assert sync.store is not None
        secret, _ = sync.store.create_key("team-a", limits=TenantLimits(requests_per_minute=60))
        await sync.poll()
        tenant = the_gate.tenants.find(secret)
        assert tenant is not None and tenant.limits is not None
        lease = tenant.limits.lease
        assert lease is not None and lease.requests is not None
        assert not isinstance(tenant.limits.admit(0.0, 0), Refusal)
        await sync.lease_round()
        assert lease.requests.held > 0  # a slice beyond the one request admitted
        await sync.stop()

    asyncio.run(scenario())
    with sqlite3.connect(path) as db:
        (level,) = db.execute("SELECT level FROM buckets WHERE name = 'team-a'").fetchone()
    assert 59.0 <= level < 59.5  # 60 less the one admitted (plus a moment's refill)


def test_a_round_cancelled_mid_transaction_settles_from_what_the_store_committed(
        tmp_path: Path) -> None:
    """Shutdown cancels the leasing task while its transaction runs in a worker thread,
    which no cancellation stops: the transaction commits (the idle slice's 10 given back),
    so the slice is settled from it, not handed its 10 again, and the last batch at `stop`
    (which waits for that transaction) gives nothing back a second time."""
    path = tmp_path / "t.sqlite"
    clock = [0.0]
    the_gate = TenantGate(KeyRing(), (), clock=lambda: clock[0], wall=lambda: 86_400.0,
                          required=True, leasing=Leasing())
    sync = TenantSync(the_gate, f"sqlite:///{path}")
    entered, release = threading.Event(), threading.Event()

    async def scenario() -> None:
        await sync.start()
        store = sync.store
        assert isinstance(store, SqliteStore)
        secret, _ = store.create_key("team-a", limits=TenantLimits(requests_per_minute=600))
        await sync.poll()
        tenant = the_gate.tenants.find(secret)
        assert tenant is not None and tenant.limits is not None
        lease = tenant.limits.lease
        assert lease is not None and lease.requests is not None
        real = store.lease

        def fixed(asks: list[Ask]) -> list[Grant]:
            """The store's clock held still: the levels are exact."""
            return real(asks, now=1000.0)

        store.lease = fixed  # type: ignore[method-assign,assignment]
        assert not isinstance(tenant.limits.admit(0.0, 0), Refusal)
        await sync.lease_round()
        assert lease.requests.held == 10.0
        with sqlite3.connect(path) as db:  # the other replicas drew the rest
            db.execute("UPDATE buckets SET level = 100")

        def slow(asks: list[Ask]) -> list[Grant]:
            entered.set()
            release.wait(WAIT)
            return real(asks, now=1000.0)

        store.lease = slow  # type: ignore[method-assign,assignment]
        clock[0] = 10.0  # idle past `IDLE`: the slice gives its 10 back
        task = asyncio.create_task(sync.lease_round())
        await asyncio.to_thread(entered.wait, WAIT)
        task.cancel()  # mid-transaction
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        release.set()
        await sync.stop()
        assert lease.requests.held == 0.0

    asyncio.run(scenario())
    with sqlite3.connect(path) as db:
        (level,) = db.execute("SELECT level FROM buckets WHERE name = 'team-a'").fetchone()
    assert level == 110.0  # 100 and the slice's 10, once


def test_a_flush_cancelled_mid_write_loses_no_usage_at_stop(tmp_path: Path) -> None:
    """Shutdown cancels the sync's task while a batch of usage is being written in a worker
    thread, which no cancellation stops: `stop` waits for that write before its last batch
    and the store's close, so both batches are in the store. (Closed under the thread, the
    first batch was lost: a second of a key's usage missing after a clean stop.)"""
    the_gate = gate()
    sync = TenantSync(the_gate, f"sqlite:///{tmp_path}/t.sqlite")
    entered, release = threading.Event(), threading.Event()

    async def scenario() -> None:
        await sync.start()
        store = sync.store
        assert store is not None
        real = store.add_usage

        def slow(rows: list[UsageRow]) -> None:
            store.add_usage = real  # type: ignore[method-assign]  # only this batch waits
            entered.set()
            release.wait(WAIT)
            real(rows)

        store.add_usage = slow  # type: ignore[method-assign,assignment]
        the_gate.usage["team-a"] = [2, 20, 10, 0]
        task = asyncio.create_task(sync.flush())
        await asyncio.to_thread(entered.wait, WAIT)
        task.cancel()  # mid-write
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        the_gate.usage["team-a"] = [1, 5, 5, 0]  # counted after the cancelled batch was taken
        stopping = asyncio.create_task(sync.stop())
        await asyncio.sleep(0.05)
        assert not stopping.done()  # waiting for the write under way
        release.set()
        await stopping

    asyncio.run(scenario())
    reopened = SqliteStore(str(tmp_path / "t.sqlite"))
    try:
        assert reopened.usage("team-a") == [UsageRow("team-a", "1970-01-02", 3, 25, 15)]
    finally:
        reopened.close()
