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
