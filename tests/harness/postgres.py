"""A throwaway PostgreSQL cluster for the shared store's tests: `initdb` in a temporary folder,
`pg_ctl start` on a free 127.0.0.1 port (no Unix socket outside that folder), stopped and
removed at the end. Can be stopped and started again mid-test (the store going down).

The server binaries are Debian's (`/usr/lib/postgresql/<version>/bin`, or on PATH); without
them the tests skip and say why. PostgreSQL refuses to run as root: as root the binaries run
as the `postgres` user (`runuser`), in a folder that user owns.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

#: seconds any pg_ctl or initdb call may take
TIMEOUT = 60


def server_bin() -> Path | None:
    """The folder of `initdb` and `pg_ctl`, newest version first; None when not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PgCluster:
    """One cluster: `url` for the gateways, `stop()` and `start()` for the store going down."""

    def __init__(self, bindir: Path, root: Path, runas: list[str]) -> None:
        self.bindir, self.root, self.runas = bindir, root, runas
        self.data = root / "data"
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self.runas, *args], capture_output=True, text=True,
                              timeout=TIMEOUT, check=False)
        assert done.returncode == 0, f"{args[0]}: {done.stdout}{done.stderr}"

    def init(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "-A", "trust", "--no-sync", "-E", "UTF8")

    def start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                   f"-c unix_socket_directories={self.root} -c fsync=off")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                  str(self.root / "server.log"), "-o", options, "-w", "-t", str(TIMEOUT),
                  "start")

    def stop(self) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w",
                  "-t", str(TIMEOUT), "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


@contextmanager
def pg_cluster() -> Iterator[PgCluster]:
    """A fresh cluster, running; stopped and removed at the end (skips without binaries)."""
    bindir = server_bin()
    if bindir is None:
        pytest.skip("PostgreSQL's server binaries (initdb, pg_ctl) are not installed")
    root = Path(tempfile.mkdtemp(prefix="hg-pg-"))
    runas: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse root
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        runas = ["runuser", "-u", "postgres", "--"]
    cluster = PgCluster(bindir, root, runas)
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        if cluster.running():
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
