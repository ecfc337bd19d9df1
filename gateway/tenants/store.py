"""The embedded store: client keys made at run time and each key's usage, in one SQLite file.

Blocking (stdlib `sqlite3`): the app calls it from worker threads (`asyncio.to_thread`), never
on the event loop, and never on a request's path. Workers and the `hedge-gateway keys`
command share the file: WAL mode lets readers go on while one writes, and a busy writer waits
up to `BUSY_TIMEOUT` rather than failing.

What the request path needs of it is kept in memory and refreshed off the path: each process
polls `keys_version` (one row) a few times a second and reloads the keys when it moved, so a
key revoked by any process is refused by every worker within a second; usage is counted in
memory per key and written here in one batch a second (`add_usage`), so a process that is
killed loses at most its last batch.

Keys are stored as SHA-256 digests; a new key's secret is returned once, by `create_key`, and
never kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.settings.fields import ConfigError
from gateway.settings.tenants import TenantBudget, TenantKeySettings, TenantLimits
from gateway.tenants.lease import Ask, Grant, draw
from gateway.tenants.spend import MICRO

#: seconds a writer waits for another's transaction before it gives up
BUSY_TIMEOUT = 5.0
#: the file `server.store: null` names, under `$XDG_STATE_HOME` (default ~/.local/state)
DEFAULT_FILE = os.path.join("hedge-gateway", "tenants.sqlite")
#: a new key's secret: this prefix and 32 random URL-safe bytes
KEY_PREFIX = "hg-"

#: the names a key made at run time may have: each is a segment of the admin API's paths
#: (`/admin/keys/{name}`), so no `/`, `%` or space, and no leading `.` (a path's `.` and `..`
#: segments are folded away by clients), or the key could never be revoked or read
KEY_NAME = re.compile(r"(?!.*\.\.)[A-Za-z0-9_-][A-Za-z0-9._:-]{0,199}")
#: what `KEY_NAME` allows, as an error says it
KEY_NAME_RULE = ("1-200 characters of A-Z a-z 0-9 . _ : -, not starting with '.' nor "
                 "holding '..'")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    name TEXT PRIMARY KEY, key_sha256 TEXT NOT NULL UNIQUE, pools TEXT NOT NULL,
    limits TEXT NOT NULL, created REAL NOT NULL, revoked REAL, budget TEXT);
CREATE TABLE IF NOT EXISTS usage (
    name TEXT NOT NULL, day TEXT NOT NULL, requests INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    spend_micro_usd INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (name, day));
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (name, value) VALUES ('keys_version', 0);
CREATE TABLE IF NOT EXISTS buckets (
    name TEXT NOT NULL, kind TEXT NOT NULL, level REAL NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (name, kind));
"""


def default_path(env: dict[str, str] | None = None) -> str:
    """The embedded store's file: `$XDG_STATE_HOME/hedge-gateway/tenants.sqlite`, or under
    `~/.local/state` when the variable is unset."""
    environ = os.environ if env is None else env
    state = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                          "state")
    return os.path.join(state, DEFAULT_FILE)


def path_of(url: str | None) -> str:
    """The file of a `server.store` URL, or the default for None. As SQLAlchemy reads them:
    `sqlite:///relative/path`, `sqlite:////absolute/path`."""
    return default_path() if url is None else url[len("sqlite:///"):]


def _add_spend_column(db: sqlite3.Connection) -> None:
    """A file made by a version without spend gets its columns: each day's spend (0 for the
    days before) and each key's budget (none for the keys made before)."""
    added = (("usage", "spend_micro_usd", "INTEGER NOT NULL DEFAULT 0"),
             ("keys", "budget", "TEXT"))
    for table, column, kind in added:
        columns = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column not in columns:
            with contextlib.suppress(sqlite3.OperationalError):  # another process added it
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")


def budget_of(text: str | None) -> TenantBudget:
    """A key's budget as stored (JSON; NULL for a key made before budgets: none)."""
    return TenantBudget() if text is None else TenantBudget(**json.loads(text))


def _pools(text: str) -> tuple[str, ...]:
    """A key's pools as stored (a JSON list of names); ValueError for anything else."""
    pools = json.loads(text)
    if not isinstance(pools, list) or not all(isinstance(pool, str) for pool in pools):
        raise ValueError("pools: not a list of names")
    return tuple(pools)


def _instant(value: object) -> float | None:
    """A stored time (seconds since the epoch), None for NULL or anything not a number."""
    return float(value) if isinstance(value, int | float) else None


@dataclass(frozen=True, slots=True)
class StoredKey:
    """A key made at run time, as listed (never its secret or digest)."""

    name: str
    pools: tuple[str, ...]
    limits: TenantLimits
    created: float
    revoked: float | None
    budget: TenantBudget = field(default_factory=TenantBudget)
    #: its row does not make a valid key (written by hand, or by another version): listed,
    #: with no pools, limits or budget, so that it can be seen and revoked; never in force
    invalid: bool = False


def active_of(rows: Iterable[Sequence[Any]]) -> tuple[list[TenantKeySettings], list[str]]:
    """Rows of (name, digest, pools, limits, budget) as key settings, and the names of those
    that make no valid key: one reader for every store, so a bad row is skipped alike."""
    keys: list[TenantKeySettings] = []
    bad: list[str] = []
    for name, digest, pools, limits, budget in rows:
        try:
            keys.append(TenantKeySettings(name=name, key_sha256=digest,
                                          pools=tuple(json.loads(pools)),
                                          limits=TenantLimits(**json.loads(limits)),
                                          budget=budget_of(budget)))
        except (ConfigError, ValueError, TypeError):
            bad.append(str(name))
    return keys, bad


def listed_key(row: Sequence[Any]) -> StoredKey:
    """One `(name, pools, limits, created, revoked, budget)` row as listed; a row that does
    not make a valid key is listed as `invalid` (both stores read their rows so)."""
    name, pools, limits, created, revoked, budget = row
    when = _instant(created) or 0.0
    try:
        return StoredKey(str(name), _pools(pools), TenantLimits(**json.loads(limits)), when,
                         _instant(revoked), budget_of(budget))
    except (ConfigError, ValueError, TypeError):
        return StoredKey(str(name), (), TenantLimits(), when, _instant(revoked), invalid=True)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One key's usage on one UTC day."""

    name: str
    day: str
    requests: int
    input_tokens: int
    output_tokens: int
    #: what its requests cost, losing attempts included, in millionths of a US dollar (whole
    #: numbers add up exactly across batches and processes)
    spend_micro_usd: int = 0

    @property
    def spend_usd(self) -> float:
        return self.spend_micro_usd / MICRO


def usage_batch(rows: Iterable[UsageRow]) -> list[tuple[str, str, int, int, int, int]]:
    """One batch of usage as both stores' `INSERT ... ON CONFLICT` takes its parameters:
    `(name, day, requests, input_tokens, output_tokens, spend_micro_usd)` per row."""
    return [(r.name, r.day, r.requests, r.input_tokens, r.output_tokens, r.spend_micro_usd)
            for r in rows]


class StoreError(Exception):
    """The store refused an operation (a name taken, an unknown key): said to the caller."""


class StoreUnavailable(OSError):
    """A shared store could not be reached or did not answer in time (its message names the
    driver's error class, never the URL): handled as an unreadable file is."""


class SqliteStore:
    """The embedded store at `path` (its folder made if missing). Thread-safe: one
    connection, its use serialised by a lock."""

    def __init__(self, path: str) -> None:
        folder = os.path.dirname(path)
        if folder:  # a folder made here is its owner's alone (existing ones are left as are)
            os.makedirs(folder, mode=0o700, exist_ok=True)
        # the file is made 0600 before SQLite opens it (not under a umask: that is the whole
        # process's, threads included): SQLite gives its -wal and -shm files the database's
        # permissions, so the digests and usage are never readable by other users
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT, check_same_thread=False,
                                   isolation_level=None)
        with self._locked() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            _add_spend_column(db)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- keys -----------------------------------------------------------------------------

    def create_key(self, name: str, pools: Sequence[str] = (),
                   limits: TenantLimits | None = None, *, now: float | None = None,
                   budget: TenantBudget | None = None) -> tuple[str, TenantKeySettings]:
        """A new key `name`: its secret (returned once, never stored) and its settings.
        `StoreError` when the name is taken or invalid."""
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
        with self._locked() as db:
            try:
                db.execute("BEGIN IMMEDIATE")
                db.execute("INSERT INTO keys (name, key_sha256, pools, limits, created, "
                           "budget) VALUES (?, ?, ?, ?, ?, ?)",
                           (key.name, digest, json.dumps(list(key.pools)),
                            json.dumps(asdict(key.limits)), time.time() if now is None else now,
                            json.dumps(asdict(key.budget))))
                db.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")
                db.execute("COMMIT")
            except sqlite3.IntegrityError:
                db.execute("ROLLBACK")
                raise StoreError(f"a key named {name!r} exists already") from None
        return secret, key

    def revoke(self, name: str, *, now: float | None = None) -> None:
        """Revoke key `name` (kept, marked, for its usage); `StoreError` when unknown."""
        with self._locked() as db:
            db.execute("BEGIN IMMEDIATE")
            changed = db.execute("UPDATE keys SET revoked = ? WHERE name = ? AND revoked IS "
                                 "NULL", (time.time() if now is None else now, name)).rowcount
            if changed:
                db.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")
            db.execute("COMMIT")
        if not changed:
            raise StoreError(f"no active key named {name!r}")

    def keys_version(self) -> int:
        """A number that moves whenever a key is made or revoked (what workers poll)."""
        with self._locked() as db:
            row = db.execute("SELECT value FROM meta WHERE name = 'keys_version'").fetchone()
        return int(row[0]) if row else 0

    def active_keys(self) -> tuple[list[TenantKeySettings], list[str]]:
        """Every key not revoked, as settings (digests, never secrets), and the names of rows
        that do not make a valid key (written by hand, or by another version): skipped, so one
        bad row never keeps the others, or a revocation, from taking effect."""
        with self._locked() as db:
            rows = db.execute("SELECT name, key_sha256, pools, limits, budget FROM keys WHERE "
                              "revoked IS NULL ORDER BY name").fetchall()
        return active_of(rows)

    def list_keys(self) -> list[StoredKey]:
        """Every key, revoked ones included; a row that does not make a valid key is listed
        as `invalid` (the guard `active_keys` has): one bad row never hides the others."""
        with self._locked() as db:
            rows = db.execute("SELECT name, pools, limits, created, revoked, budget FROM keys "
                              "ORDER BY name").fetchall()
        return [listed_key(row) for row in rows]

    # --- usage ----------------------------------------------------------------------------

    def add_usage(self, rows: Iterable[UsageRow]) -> None:
        """Add one batch of usage (one transaction: all of it or none)."""
        batch = usage_batch(rows)
        if not batch:
            return
        with self._locked() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(
                    "INSERT INTO usage (name, day, requests, input_tokens, output_tokens, "
                    "spend_micro_usd) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name, day) DO "
                    "UPDATE SET requests = requests + excluded.requests, "
                    "input_tokens = input_tokens + excluded.input_tokens, "
                    "output_tokens = output_tokens + excluded.output_tokens, "
                    "spend_micro_usd = spend_micro_usd + excluded.spend_micro_usd", batch)
            except sqlite3.Error:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def usage(self, name: str | None = None) -> list[UsageRow]:
        """Usage per key and day, newest day first; one key's with `name`."""
        query = ("SELECT name, day, requests, input_tokens, output_tokens, spend_micro_usd "
                 "FROM usage")
        args: tuple[Any, ...] = ()
        if name is not None:
            query += " WHERE name = ?"
            args = (name,)
        with self._locked() as db:
            rows = db.execute(query + " ORDER BY day DESC, name", args).fetchall()
        return [UsageRow(*row) for row in rows]

    def spend_since(self, first_day: str) -> list[tuple[str, str, int]]:
        """(name, day, spend in micro-dollars) of every key from `first_day` (ISO) on: what
        the budgets of a day or a month are held to (`gateway.tenants.budget`)."""
        with self._locked() as db:
            rows = db.execute("SELECT name, day, spend_micro_usd FROM usage WHERE day >= ? "
                              "AND spend_micro_usd > 0", (first_day,)).fetchall()
        return [(str(name), str(day), int(spent)) for name, day, spent in rows]

    # --- the per-minute limits shared by processes ------------------------------------

    def lease(self, asks: Sequence[Ask], *, now: float | None = None) -> list[Grant]:
        """Settle one batch of slices against the keys' shared buckets
        (`gateway.tenants.lease`), in one transaction: the grants, in the asks' order. The
        clock is this machine's, which every process on the file shares, read once the
        file's write lock is held: read before, a batch that waited behind another's later
        one would write an older `at`, and the next draw would count that refill twice (a
        bucket's `at` never goes back, whatever clock a caller hands in)."""
        if not asks:
            return []
        grants = []
        with self._locked() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                clock = time.time() if now is None else now
                for ask in asks:
                    row = db.execute("SELECT level, at FROM buckets WHERE name = ? AND kind = ?",
                                     (ask.name, ask.kind)).fetchone()
                    when = clock if row is None else max(clock, float(row[1]))
                    grant = draw(None, None, ask, when) if row is None else \
                        draw(float(row[0]), float(row[1]), ask, when)
                    db.execute("INSERT INTO buckets (name, kind, level, at) VALUES (?, ?, ?, ?) "
                               "ON CONFLICT (name, kind) DO UPDATE SET level = excluded.level, "
                               "at = excluded.at", (ask.name, ask.kind, grant.level, when))
                    grants.append(grant)
            except sqlite3.Error:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        return grants
