"""Which store `server.store` names: the embedded SQLite file, or a PostgreSQL server shared by
replicas. Both have one interface (`TenantStore`); the PostgreSQL driver (the `[postgres]`
extra) is imported only when one is named, so the embedded default never needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gateway.tenants.store import SqliteStore, path_of

if TYPE_CHECKING:
    from gateway.tenants.pgstore import PostgresStore

    TenantStore = SqliteStore | PostgresStore

#: the extra that installs the PostgreSQL driver
POSTGRES_EXTRA = "postgres"


def is_shared(url: str | None) -> bool:
    """Whether `server.store` names a PostgreSQL server rather than a file."""
    return url is not None and url.startswith(("postgresql://", "postgres://"))


def missing_store_extra(url: str | None) -> str | None:
    """An error line when `url` names PostgreSQL and its driver is not installed (what
    check-config and serve print, naming the extra); None when the store can be opened."""
    if not is_shared(url):
        return None
    try:
        importlib.import_module("psycopg")
    except ImportError as exc:  # not installed, or its libpq missing ("no pq wrapper")
        return (f"server.store: a PostgreSQL store needs the extra {POSTGRES_EXTRA!r}, which "
                f"is not installed ({str(exc).splitlines()[0]}): pip install "
                f"'hedge-gateway[{POSTGRES_EXTRA}]'")
    return None


def open_store(url: str | None) -> TenantStore:
    """The store `url` names (None: the embedded default file). Blocking: connects to the
    server or opens the file; call it off the event loop."""
    if url is not None and is_shared(url):
        from gateway.tenants.pgstore import PostgresStore

        return PostgresStore(url)
    return SqliteStore(path_of(url))
