"""Who a client key is: its digest looked up among the configured keys (`keys:`). Pure.

Keys are known only as SHA-256 digests. A supplied key is hashed and its digest looked up in a
dict: the lookup's timing depends on the digest, which a prober cannot steer towards a stored
one without knowing a key, so it tells nothing, and a thousand keys cost one lookup rather
than a thousand comparisons. A reload builds a new registry; a key whose name, digest and
limits are unchanged keeps its live limits (its buckets and in-flight count), so a reload
neither resets a key's minute nor forgets its running requests; a key whose name and digest
are unchanged keeps its share of the hedge budget (`gateway.hedge.deadline.KeyShare`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.hedge.deadline import KeyShare
from gateway.settings.tenants import TenantKeySettings
from gateway.tenants.lease import KeyLease, Leasing
from gateway.tenants.limits import KeyLimits


@dataclass(frozen=True, slots=True)
class Tenant:
    """One configured key, as a request meets it."""

    name: str
    #: the pools it may use; None: every pool
    pools: frozenset[str] | None
    #: its live limits; None: no limit (the key costs its requests nothing more)
    limits: KeyLimits | None
    settings: TenantKeySettings
    #: its share of the hedge budget, paying for the hedges its deadlines send early
    share: KeyShare

    def may_use(self, pool: str) -> bool:
        return self.pools is None or pool in self.pools


def _lease(key: TenantKeySettings, leasing: Leasing | None, now: float) -> KeyLease | None:
    """The slices of `key`'s per-minute limits, when they are shared and it has any."""
    limits = key.limits
    if leasing is None or (limits.requests_per_minute is None
                           and limits.input_tokens_per_minute is None
                           and limits.output_tokens_per_minute is None):
        return None
    return KeyLease(key.name, leasing, now, limits.requests_per_minute,
                    limits.input_tokens_per_minute, limits.output_tokens_per_minute)


def digest_of(supplied: str) -> str:
    """The hex SHA-256 of a key as sent (latin-1, as HTTP headers carry it)."""
    return hashlib.sha256(supplied.encode("latin-1", "replace")).hexdigest()


class Tenants:
    """The configured keys by digest."""

    __slots__ = ("by_digest",)

    def __init__(self, keys: Iterable[TenantKeySettings], now: float,
                 previous: Tenants | None = None, leasing: Leasing | None = None) -> None:
        """`leasing`: the key's per-minute limits are shared with other processes through the
        store (`gateway.tenants.lease`); None: this process holds them whole."""
        before = previous.by_digest if previous is not None else {}
        self.by_digest: dict[str, Tenant] = {}
        for key in keys:
            assert key.key_sha256 is not None  # `TenantKeySettings` fills it in
            kept = before.get(key.key_sha256)
            if kept is not None and kept.settings.name == key.name \
                    and kept.settings.limits == key.limits:
                limits = kept.limits
            else:
                limits = KeyLimits(key.limits, now, _lease(key, leasing, now)) \
                    if key.limits.any() else None
            pools = frozenset(key.pools) if key.pools else None
            same = kept is not None and kept.settings.name == key.name
            share = kept.share if kept is not None and same else KeyShare()
            self.by_digest[key.key_sha256] = Tenant(key.name, pools, limits, key, share)

    def find(self, supplied: str) -> Tenant | None:
        """The tenant whose key was `supplied`, or None."""
        if not supplied or not self.by_digest:
            return None
        return self.by_digest.get(digest_of(supplied))
