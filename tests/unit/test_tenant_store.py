"""The embedded store (a SQLite file in the test's folder: no sockets) and the gate's view of
its keys: keys made and revoked, seen by a second connection as a second worker would see
them, usage added in batches, a key kept only as its digest."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from gateway.api.keys import KeyRing
from gateway.api.tenancy import TenantGate
from gateway.settings.tenants import TenantKeySettings, TenantLimits
from gateway.tenants.lease import Ask
from gateway.tenants.store import SqliteStore, StoreError, UsageRow, default_path, path_of


def test_the_default_file_is_under_the_state_home() -> None:
    assert default_path({"XDG_STATE_HOME": "/srv/state"}) == \
        "/srv/state/hedge-gateway/tenants.sqlite"
    assert default_path({}).endswith("/.local/state/hedge-gateway/tenants.sqlite")
    assert path_of("sqlite:////var/lib/gw.db") == "/var/lib/gw.db"


def test_keys_made_and_revoked_are_seen_by_another_process_and_the_version_moves(
    tmp_path: Path
) -> None:
    path = str(tmp_path / "s" / "tenants.sqlite")
    one, other = SqliteStore(path), SqliteStore(path)  # two workers on one file
    try:
        before = other.keys_version()
        secret, key = one.create_key("team-a", ("alpha",), TenantLimits(in_flight=2), now=5.0)
        assert secret.startswith("hg-") and len(secret) > 40
        assert key.key_sha256 == hashlib.sha256(secret.encode()).hexdigest()
        assert other.keys_version() > before
        assert other.active_keys() == ([TenantKeySettings(
            "team-a", key_sha256=key.key_sha256, pools=("alpha",),
            limits=TenantLimits(in_flight=2))], [])
        with pytest.raises(StoreError, match="exists already"):
            other.create_key("team-a")
        version = one.keys_version()
        other.revoke("team-a", now=6.0)
        assert one.keys_version() > version and one.active_keys() == ([], [])
        (listed,) = one.list_keys()
        assert (listed.name, listed.created, listed.revoked) == ("team-a", 5.0, 6.0)
        with pytest.raises(StoreError, match="no active key"):
            one.revoke("team-a")
    finally:
        one.close()
        other.close()
    assert secret.encode() not in Path(path).read_bytes()  # only its digest is kept


def test_a_name_outside_the_safe_set_is_refused_before_anything_is_written(
    tmp_path: Path
) -> None:
    """`hedge-gateway keys create` goes to the store directly: a name its admin path could not
    reach (`/`, a leading `.`) is refused there too, and nothing is written."""
    store = SqliteStore(str(tmp_path / "tenants.sqlite"))
    try:
        for bad in ("team/a", ".a", "a..b", "a b", ""):
            with pytest.raises(StoreError, match="must be 1-200 characters"):
                store.create_key(bad)
        assert store.list_keys() == []
    finally:
        store.close()


def test_the_store_and_its_folder_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    """Under the usual umask (022) the folder made is 0700 and the database with its -wal and
    -shm files 0600: no other user reads the keys' digests or usage."""
    path = tmp_path / "state" / "hedge-gateway" / "tenants.sqlite"
    old = os.umask(0o022)
    try:
        store = SqliteStore(str(path))
        try:
            store.create_key("team-a")
            store.add_usage([UsageRow("team-a", "2026-12-07", 1, 2, 3)])
            files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
            assert all(file.exists() for file in files)
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            assert [stat.S_IMODE(file.stat().st_mode) for file in files] == [0o600] * 3
        finally:
            store.close()
    finally:
        os.umask(old)


def test_usage_batches_add_up_per_key_and_day(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "t.sqlite"))
    try:
        store.add_usage([UsageRow("a", "2026-12-07", 2, 100, 10),
                         UsageRow("b", "2026-12-07", 1, 5, 5)])
        store.add_usage([UsageRow("a", "2026-12-07", 1, 50, 20),
                         UsageRow("a", "2026-12-08", 1, 1, 1)])
        store.add_usage([])
        assert store.usage("a") == [UsageRow("a", "2026-12-08", 1, 1, 1),
                                    UsageRow("a", "2026-12-07", 3, 150, 30)]
        assert [row.name for row in store.usage()] == ["a", "a", "b"]
    finally:
        store.close()


def test_the_gate_takes_the_stores_keys_and_the_files_win_a_clash() -> None:
    configured = TenantKeySettings("team-a", key="secret-of-team-a")
    gate = TenantGate(KeyRing(), [configured], clock=lambda: 0.0)
    stored = [TenantKeySettings("team-a", key="another"),
              TenantKeySettings("team-b", key="secret-of-team-a-again"),
              TenantKeySettings("team-c", key="secret-of-team-c")]
    assert gate.adopt_stored(stored) == ["team-a"]
    assert gate.tenants.find("secret-of-team-c") is not None
    assert gate.tenants.find("another") is None
    assert gate.adopt_stored([]) == []  # revoked in the store
    assert gate.tenants.find("secret-of-team-c") is None
    assert gate.tenants.find("secret-of-team-a") is not None


def test_slices_leased_by_two_processes_on_one_file_draw_from_one_bucket(
        tmp_path: Path) -> None:
    """The shared bucket of `gateway.tenants.lease` on the file: two connections (two
    processes) draw from one level, refilled by the clock handed in, debts taken whatever it
    holds."""
    path = str(tmp_path / "t.sqlite")
    first, second = SqliteStore(path), SqliteStore(path)
    want = Ask("team-a", "requests", 60.0, 0.0, 100.0, 1.0)
    (one,) = first.lease([want], now=0.0)
    (two,) = second.lease([want], now=0.0)
    assert one.granted == 15.0 and two.granted == pytest.approx(45.0 / 4)  # a quarter each
    assert two.level == pytest.approx(60.0 - one.granted - two.granted)
    owed = Ask("team-a", "requests", 60.0, -50.0, 0.0, 1.0)
    (paid,) = first.lease([owed], now=10.0)  # refilled 10, then the debt taken
    assert paid.granted == 0.0 and paid.level == pytest.approx(two.level + 10.0 - 50.0)
    other = Ask("team-b", "input_tokens", 1000.0, 0.0, 10.0, 10.0)
    assert [g.granted for g in second.lease([other, want], now=10.0)] == [10.0, 0.0]
    first.close()
    second.close()


def test_a_batch_reads_its_clock_once_it_holds_the_files_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read before the lock, a batch that waited behind another process's later one would
    write an older `at`, and the next draw would count that refill twice: the clock is read
    after `BEGIN IMMEDIATE` has returned."""
    store = SqliteStore(str(tmp_path / "t.sqlite"))
    events: list[str] = []
    store._db.set_trace_callback(lambda sql: events.append(sql.strip().split()[0]))

    class Clock:
        @staticmethod
        def time() -> float:
            events.append("clock")
            return 1000.0

    monkeypatch.setattr("gateway.tenants.store.time", Clock)
    store.lease([Ask("team-a", "requests", 60.0, 0.0, 1.0, 1.0)])
    assert "clock" in events and "BEGIN" in events
    assert events.index("BEGIN") < events.index("clock")
    store.close()


def test_a_late_batch_never_moves_a_buckets_clock_back(tmp_path: Path) -> None:
    """A batch whose clock is older than the bucket's last draw (it waited for the lock
    behind a later one) draws at the bucket's time: the next draw refills only the time
    since, once."""
    path = str(tmp_path / "t.sqlite")
    first, second = SqliteStore(path), SqliteStore(path)
    everything = Ask("team-a", "requests", 600.0, 0.0, 600.0, 1.0)  # 10 a second
    while first.lease([everything], now=100.0)[0].level > 0:  # drained at 100
        pass
    (late,) = second.lease([Ask("team-a", "requests", 600.0, 0.0, 1.0, 1.0)], now=99.0)
    assert late.granted == 0.0 and late.level == 0.0
    (level, at), = first._db.execute("SELECT level, at FROM buckets").fetchall()
    assert (level, at) == (0.0, 100.0)
    (next_draw,) = first.lease([everything], now=100.5)
    assert next_draw.granted + next_draw.level == pytest.approx(5.0)  # 0.5 s refilled, once
    first.close()
    second.close()
