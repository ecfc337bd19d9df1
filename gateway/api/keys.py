"""Gateway keys as a ring the routes read on every request, so a reload can change them.

Keys are kept as SHA-256 digests and compared with `hmac.compare_digest`: that is constant-time
only for inputs of equal length, so comparing the raw strings would tell a prober each key's
length. Every key is compared, so the timing does not say which one matched either.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable

#: wrong keys a connection may send before its answers slow down
FREE_FAILURES = 3
#: the first slowed answer waits this long; each further one twice as long, up to the cap
BACKOFF_FIRST = 0.05
BACKOFF_CAP = 1.0
#: after this many wrong keys the connection is closed with its answer
MAX_FAILURES = 8


def backoff(failures: int, *, first: float = BACKOFF_FIRST, cap: float = BACKOFF_CAP,
            free: int = FREE_FAILURES, most: int = MAX_FAILURES) -> tuple[float, bool]:
    """After the `failures`-th wrong key on a connection: how long its 401 waits, and whether
    the connection ends with it. A guesser on one keep-alive connection made thousands of
    guesses a second; now the first `free` are answered at once (a client with a stale key
    hears at once), then each waits twice as long as the one before (at most `cap`), and
    the `most`-th closes the connection: bounded in time and in what it holds."""
    late = failures - free
    delay = 0.0 if late <= 0 else min(cap, first * 2 ** (late - 1))
    return delay, failures >= most


class KeyRing:
    """The configured keys (digests); empty: no key is asked."""

    __slots__ = ("digests",)

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.digests: tuple[bytes, ...] = ()
        self.replace(keys)

    def replace(self, keys: Iterable[str]) -> None:
        """Swap in new keys (a reload): the next request is checked against them."""
        self.digests = tuple(hashlib.sha256(key.encode()).digest() for key in keys)

    def matches(self, supplied: str) -> bool:
        digest = hashlib.sha256(supplied.encode("latin-1", "replace")).digest()
        ok = False
        for key in self.digests:
            ok |= hmac.compare_digest(digest, key)
        return ok and bool(supplied)


def credential(authorization: str) -> str:
    """The key in an `Authorization` value: Bearer's token, or Basic's password (what a
    browser sends for a page after asking for it, so the dashboard works behind a key)."""
    scheme, _, token = authorization.partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return token.strip()
    if scheme == "basic":
        try:
            decoded = base64.b64decode(token.strip(), validate=True).decode("latin-1")
        except (binascii.Error, ValueError):
            return ""
        return decoded.partition(":")[2]
    return ""


#: the operational reads `server.ops_keys` guards (the probes /healthz and /readyz stay open)
def is_ops_path(path: str) -> bool:
    return (path.startswith("/hedge/") or path == "/metrics" or path == "/dashboard"
            or path.startswith("/dashboard/"))
