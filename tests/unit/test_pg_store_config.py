"""`server.store: postgresql://...` in the configuration: taken (Redis still refused by name,
never taken for a file), `server.store_down` only open or closed, and a PostgreSQL store
without its driver refused by check-config naming the `postgres` extra, as a provider's
missing extra is; the embedded default never needs the driver."""

from __future__ import annotations

import argparse
import io
import socket
import sys
from pathlib import Path

import pytest

from gateway.settings.fields import ConfigError
from gateway.settings.load import check_config
from gateway.settings.model import ServerSettings
from gateway.settings.parse import Invalid
from gateway.settings.tenants import store_url
from gateway.tenants.command import run
from providers.registry import missing_extras

CONFIG = """
server: {{store: "{store}"}}
pools:
  - name: alpha
    backends: [{{name: s, provider: sim}}]
"""


def test_a_postgresql_url_is_a_store_and_redis_is_refused_by_name() -> None:
    url = "postgresql://gw@db.internal:5432/hedge"
    assert store_url(url) == url
    assert store_url("postgres://gw@db/hedge") == "postgres://gw@db/hedge"
    with pytest.raises(Invalid, match="Redis store is not supported"):
        store_url("redis://cache:6379/0")
    with pytest.raises(ConfigError):
        ServerSettings(store_down="sometimes")
    assert ServerSettings().store_down == "open"


def _check(tmp_path: Path, store: str) -> tuple[int, str]:
    path = tmp_path / "gateway.yaml"
    path.write_text(CONFIG.format(store=store))
    out, err = io.StringIO(), io.StringIO()
    status = check_config(str(path), out, err, installed=missing_extras)
    return status, err.getvalue()


def test_check_config_names_the_postgres_extra_when_its_driver_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed
    status, err = _check(tmp_path, "postgresql://gw:s3cret@127.0.0.1:5432/hedge")
    assert status != 0
    assert "server.store" in err and "pip install 'hedge-gateway[postgres]'" in err
    assert "s3cret" not in err
    status, err = _check(tmp_path, f"sqlite:///{tmp_path}/t.sqlite")
    assert status == 0, err  # the embedded store never needs it


def test_keys_on_an_unreachable_postgres_store_says_so_without_a_traceback() -> None:
    """`hedge-gateway keys --store postgresql://...` with nothing listening: exit 1 and one
    line naming the failure (never the password), within the connect timeout."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ns = argparse.Namespace(store=f"postgresql://gw:s3cret@127.0.0.1:{port}/hedge", config=None,
                            action="list")
    out, err = io.StringIO(), io.StringIO()
    assert run(ns, out, err) == 1
    assert "cannot be reached" in err.getvalue() and "s3cret" not in err.getvalue()
    assert "Traceback" not in err.getvalue() and out.getvalue() == ""
