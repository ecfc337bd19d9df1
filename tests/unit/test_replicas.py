"""`hedge-gateway stats URL ...` names each replica it reads, in its lines and its errors: an
ops key given in a URL's user part (`http://ops:KEY@host`) is never among what it prints."""

from __future__ import annotations

import io
import socket

from gateway.stats.replicas import print_merged, shown

KEY = "ops-key-0123456789abcdefghijklmnop"


def test_a_url_is_shown_without_its_user_part() -> None:
    assert shown(f"http://ops:{KEY}@10.0.0.7:8080/") == "http://10.0.0.7:8080/"
    assert shown("http://10.0.0.7:8080") == "http://10.0.0.7:8080"


def test_a_replica_that_cannot_be_read_is_named_without_its_key() -> None:
    with socket.socket() as probe:  # a port nobody listens on: refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out, err = io.StringIO(), io.StringIO()
    assert print_merged([f"http://ops:{KEY}@127.0.0.1:{port}"], out, err) == 1
    assert f"127.0.0.1:{port}" in err.getvalue()
    assert KEY not in err.getvalue() + out.getvalue()
