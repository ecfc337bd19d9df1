"""The shared store for replicas: the embedded store's interface (`SqliteStore`) on PostgreSQL.

Why PostgreSQL: spend is a ledger that must survive a crash of the store itself (a committed
batch is on disk), and one server holds both the keys and the counters, each batch in one
transaction, so replicas' batches add up exactly (`ON CONFLICT DO UPDATE` adds, never
overwrites). Replicas find changed keys as the embedded store's workers do: by polling the
one-row `keys_version` (a primary-key read) twice a second, so no LISTEN connection has to be
kept alive through the failures below.

Blocking (psycopg 3, the `[postgres]` extra): like the SQLite store it is only called from
worker threads (`asyncio.to_thread`), never on the event loop or a request's path. Every call
is bounded: `CONNECT_TIMEOUT` to connect, `STATEMENT_TIMEOUT` per statement (server side) and
TCP keep-alives, so a store that stops answering fails a call within seconds instead of
holding a thread. A failed call drops the connection; the next call connects again. Every
failure is raised as `StoreUnavailable`, which the sync treats as it does a locked SQLite file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import psycopg

from gateway.settings.fields import ConfigError
from gateway.settings.tenants import TenantBudget, TenantKeySettings, TenantLimits
from gateway.tenants.lease import Ask, Grant, draw
from gateway.tenants.store import (
    KEY_NAME,
    KEY_NAME_RULE,
    KEY_PREFIX,
    StoredKey,
    StoreError,
    StoreUnavailable,
    UsageRow,
    active_of,
    listed_key,
    usage_batch,
)

#: seconds to connect before a call fails
CONNECT_TIMEOUT = 2
#: milliseconds any one statement may run (on the server) before it is cancelled
STATEMENT_TIMEOUT_MS = 3000

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS hg_keys (name TEXT PRIMARY KEY, key_sha256 TEXT NOT NULL "
    "UNIQUE, pools TEXT NOT NULL, limits TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, "
    "revoked DOUBLE PRECISION, budget TEXT)",
    "CREATE TABLE IF NOT EXISTS hg_usage (name TEXT NOT NULL, day TEXT NOT NULL, requests "
    "BIGINT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL, "
    "spend_micro_usd BIGINT NOT NULL DEFAULT 0, PRIMARY KEY (name, day))",
    "CREATE TABLE IF NOT EXISTS hg_meta (name TEXT PRIMARY KEY, value BIGINT NOT NULL)",
    "INSERT INTO hg_meta (name, value) VALUES ('keys_version', 0) ON CONFLICT DO NOTHING",
    "CREATE TABLE IF NOT EXISTS hg_buckets (name TEXT NOT NULL, kind TEXT NOT NULL, level "
    "DOUBLE PRECISION NOT NULL, at DOUBLE PRECISION NOT NULL, PRIMARY KEY (name, kind))",
)
#: serialises the schema's creation across processes starting together
_SCHEMA_LOCK = 0x68656467


class PostgresStore:
    """The store at a `postgresql://` URL. Thread-safe: one connection, its use serialised
    by a lock, made again after a failure."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._db: psycopg.Connection[Any] | None = None
        with self._locked() as db, db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for statement in _SCHEMA:
                db.execute(statement)

    @property
    def path(self) -> str:
        """Where the store is, for log lines: the server, never its password."""
        info = psycopg.conninfo.conninfo_to_dict(self.url)
        return f"postgresql://{info.get('host', '')}:{info.get('port', '')}/" \
               f"{info.get('dbname', '')}"

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                               options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
                               keepalives=1, keepalives_idle=5, keepalives_interval=2,
                               keepalives_count=2)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[psycopg.Connection[Any]]:
        """The connection (made if there is none), under the lock; on a failure it is closed
        and `StoreUnavailable` raised."""
        with self._lock:
            try:
                if self._db is None or self._db.closed:
                    self._db = self._connect()
                yield self._db
            except psycopg.IntegrityError:
                raise
            except psycopg.Error as exc:
                if self._db is not None:
                    self._db.close()
                self._db = None
                raise StoreUnavailable(type(exc).__name__) from None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # --- keys -----------------------------------------------------------------------------

    def create_key(self, name: str, pools: Sequence[str] = (),
                   limits: TenantLimits | None = None, *, now: float | None = None,
                   budget: TenantBudget | None = None) -> tuple[str, TenantKeySettings]:
        """As `SqliteStore.create_key`."""
        if not KEY_NAME.fullmatch(name):
            raise StoreError(f"a key's name must be {KEY_NAME_RULE}")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        try:
            key = TenantKeySettings(name=name, key_sha256=digest, pools=tuple(pools),
                                    limits=limits or TenantLimits(),
                                    budget=budget or TenantBudget())
        except ConfigError as exc:
            raise StoreError("; ".join(exc.errors)) from None
        try:
            with self._locked() as db, db.transaction():
                db.execute("INSERT INTO hg_keys (name, key_sha256, pools, limits, created, "
                           "budget) VALUES (%s, %s, %s, %s, %s, %s)",
                           (key.name, digest, json.dumps(list(key.pools)),
                            json.dumps(asdict(key.limits)), time.time() if now is None else now,
                            json.dumps(asdict(key.budget))))
                db.execute("UPDATE hg_meta SET value = value + 1 WHERE name = 'keys_version'")
        except psycopg.IntegrityError:
            raise StoreError(f"a key named {name!r} exists already") from None
        return secret, key

    def revoke(self, name: str, *, now: float | None = None) -> None:
        """As `SqliteStore.revoke`."""
        with self._locked() as db, db.transaction():
            changed = db.execute("UPDATE hg_keys SET revoked = %s WHERE name = %s AND revoked "
                                 "IS NULL", (time.time() if now is None else now, name)
                                 ).rowcount
            if changed:
                db.execute("UPDATE hg_meta SET value = value + 1 WHERE name = 'keys_version'")
        if not changed:
            raise StoreError(f"no active key named {name!r}")

    def keys_version(self) -> int:
        with self._locked() as db:
            row = db.execute("SELECT value FROM hg_meta WHERE name = 'keys_version'").fetchone()
        return int(row[0]) if row else 0

    def active_keys(self) -> tuple[list[TenantKeySettings], list[str]]:
        """As `SqliteStore.active_keys`."""
        with self._locked() as db:
            rows = db.execute("SELECT name, key_sha256, pools, limits, budget FROM hg_keys "
                              "WHERE revoked IS NULL ORDER BY name").fetchall()
        return active_of(rows)

    def list_keys(self) -> list[StoredKey]:
        with self._locked() as db:
            rows = db.execute("SELECT name, pools, limits, created, revoked, budget FROM "
                              "hg_keys ORDER BY name").fetchall()
        return [listed_key(row) for row in rows]

    # --- usage ----------------------------------------------------------------------------

    def add_usage(self, rows: Iterable[UsageRow]) -> None:
        """Add one batch of usage (one transaction: all of it or none)."""
        batch = usage_batch(rows)
        if not batch:
            return
        with self._locked() as db, db.transaction(), db.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO hg_usage (name, day, requests, input_tokens, output_tokens, "
                "spend_micro_usd) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (name, day) DO "
                "UPDATE SET requests = hg_usage.requests + excluded.requests, "
                "input_tokens = hg_usage.input_tokens + excluded.input_tokens, "
                "output_tokens = hg_usage.output_tokens + excluded.output_tokens, "
                "spend_micro_usd = hg_usage.spend_micro_usd + excluded.spend_micro_usd", batch)

    def usage(self, name: str | None = None) -> list[UsageRow]:
        query = ("SELECT name, day, requests, input_tokens, output_tokens, spend_micro_usd "
                 "FROM hg_usage")
        args: tuple[Any, ...] = ()
        if name is not None:
            query += " WHERE name = %s"
            args = (name,)
        with self._locked() as db:
            rows = db.execute(query + " ORDER BY day DESC, name", args).fetchall()
        return [UsageRow(*row) for row in rows]

    def spend_since(self, first_day: str) -> list[tuple[str, str, int]]:
        with self._locked() as db:
            rows = db.execute("SELECT name, day, spend_micro_usd FROM hg_usage WHERE day >= %s "
                              "AND spend_micro_usd > 0", (first_day,)).fetchall()
        return [(str(name), str(day), int(spent)) for name, day, spent in rows]

    # --- the per-minute limits shared by replicas -------------------------------------

    def lease(self, asks: Sequence[Ask]) -> list[Grant]:
        """As `SqliteStore.lease`, by the server's clock (one clock for every replica,
        whatever theirs say), in four statements whatever the batch's size (a round of a
        thousand active keys is one transaction of four round trips, not three per ask):
        the missing rows made (full), every row locked in the order of (name, kind) so two
        replicas' batches never deadlock, the clock read once they are held (read before, a
        batch that waited for a lock would write an older `at` and the next draw would count
        that refill twice; and `at` never goes back), then every row written at once. The
        draws are `draw`'s, the embedded store's arithmetic."""
        if not asks:
            return []
        names = [ask.name for ask in asks]
        kinds = [ask.kind for ask in asks]
        with self._locked() as db, db.transaction(), db.cursor() as cursor:
            cursor.execute(
                "INSERT INTO hg_buckets (name, kind, level, at) SELECT n, k, max(c), 0 FROM "
                "unnest(%s::text[], %s::text[], %s::float8[]) AS t(n, k, c) GROUP BY n, k "
                "ORDER BY n, k ON CONFLICT DO NOTHING",
                (names, kinds, [ask.capacity for ask in asks]))
            rows = cursor.execute(
                "SELECT b.name, b.kind, b.level, b.at FROM hg_buckets b JOIN (SELECT DISTINCT "
                "n, k FROM unnest(%s::text[], %s::text[]) AS t(n, k)) AS t ON b.name = t.n "
                "AND b.kind = t.k ORDER BY b.name, b.kind FOR UPDATE OF b",
                (names, kinds)).fetchall()
            row = cursor.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
            clock = float(row[0]) if row else time.time()
            state = {(str(name), str(kind)): (float(level), float(at))
                     for name, kind, level, at in rows}
            grants = []
            for ask in asks:
                level, at = state[(ask.name, ask.kind)]
                now = max(clock, at)
                grant = draw(level, at, ask, now)
                state[(ask.name, ask.kind)] = (grant.level, now)
                grants.append(grant)
            written = sorted(state.items())
            cursor.execute(
                "UPDATE hg_buckets b SET level = t.l, at = t.a FROM unnest(%s::text[], "
                "%s::text[], %s::float8[], %s::float8[]) AS t(n, k, l, a) WHERE b.name = t.n "
                "AND b.kind = t.k",
                ([name for (name, _), _ in written], [kind for (_, kind), _ in written],
                 [level for _, (level, _) in written], [at for _, (_, at) in written]))
        return grants
