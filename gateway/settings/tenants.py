"""The client keys with names and rules (top-level `keys:`): what each key may use and how much.

Kept apart from `gateway.settings.model` (which holds the rest of the schema) because these
are the tenants' rules, read by `gateway.tenants`, not by the race. A key is stored only as its
SHA-256 digest: a file may name the secret itself (`key: ${TEAM_A_KEY}`), which is hashed as
the file is read and then dropped, so no settings object, `repr` or log line ever holds it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from gateway.settings import parse as cv
from gateway.settings.fields import At, Checked, scalar, section

_HEX64 = re.compile(r"[0-9a-f]{64}")
#: the largest limit a key may have: past any real need, and exact as a float (a bucket holds
#: one); a larger integer (JSON carries any) made a key whose bucket could not be built
MAX_LIMIT = 10**12
_per_minute = cv.optional(cv.integer(1, MAX_LIMIT))


def _digest(value: object) -> str:
    text = cv.nonempty_text(value).strip().lower()
    if not _HEX64.fullmatch(text):
        raise cv.Invalid("must be 64 hexadecimal characters (`sha256sum` of the key)")
    return text


#: a key's SHA-256 digest as hex, as `printf %s "$KEY" | sha256sum` prints it
digest = cv.Parser(_digest, {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"}, "digest")


def _pool_names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise cv.Invalid(f"must be a list of pool names, got {cv.type_name(value)}")
    return tuple(cv.name(entry) for entry in value)


pool_names = cv.Parser(_pool_names, {"type": "array", "items": {"type": "string"}})


def shares_limits(store: str | None, workers: int = 1) -> bool:
    """Whether processes share each key's per-minute limits through the store (leases,
    `gateway.tenants.lease`): replicas (and their workers) on a PostgreSQL store, and the
    workers of one `serve --workers N` on one file. A lone process on a file holds them
    whole, as it always has."""
    return workers > 1 or (store is not None
                           and store.startswith(("postgresql://", "postgres://")))


def _store_url(value: object) -> str:
    """Where keys made at run time and usage live: `sqlite:///absolute/path`, or a PostgreSQL
    server shared by replicas (`postgresql://user@host:port/db`). Redis is not a store in this
    version: named so, never taken for a file."""
    text = cv.nonempty_text(value).strip()
    if text.startswith(("redis://", "rediss://")):
        raise cv.Invalid("a Redis store is not supported by this version; use "
                         "postgresql://host/db for replicas, sqlite:///path or null")
    if text.startswith(("postgresql://", "postgres://")) and len(text) > len("postgres://"):
        return text
    if not text.startswith("sqlite:///") or len(text) == len("sqlite:///"):
        raise cv.Invalid("must be sqlite:///relative/path, sqlite:////absolute/path or "
                         "postgresql://host/db")
    return text


#: `server.store`: a store URL
store_url = cv.Parser(_store_url, {"type": "string",
                                   "pattern": "^(sqlite:///|postgres(ql)?://)"}, "store URL")


@dataclass(frozen=True, slots=True)
class TenantLimits(Checked):
    """How much one key may use; null: no limit of that kind."""

    requests_per_minute: int | None = field(default=None, metadata=scalar(
        _per_minute, "requests a minute (a bucket of this many, refilled evenly)"))
    input_tokens_per_minute: int | None = field(default=None, metadata=scalar(
        _per_minute, "input tokens a minute: charged at admission as estimated from the "
        "body (bytes / 4), corrected by the upstream's usage at the end"))
    output_tokens_per_minute: int | None = field(default=None, metadata=scalar(
        _per_minute, "output tokens a minute: charged at the end from the upstream's usage; "
        "a key in debt is refused until the bucket refills"))
    in_flight: int | None = field(default=None, metadata=scalar(
        _per_minute, "requests of this key running at once"))

    def any(self) -> bool:
        """Whether any limit is set (a key without one costs its requests nothing)."""
        return (self.requests_per_minute is not None or self.in_flight is not None
                or self.input_tokens_per_minute is not None
                or self.output_tokens_per_minute is not None)


@dataclass(frozen=True, slots=True)
class TenantBudget(Checked):
    """A spend budget in US dollars per period: past it the key's requests are refused with
    429 `budget_exceeded` until the period ends (docs/tenants.md)."""

    usd: float | None = field(default=None, metadata=scalar(
        cv.optional(cv.number(0)), "US dollars per period, counted at the backends' prices, "
        "losing attempts included; null: no budget"))
    period: Literal["day", "month"] = field(default="month", metadata=scalar(
        cv.choice(("day", "month")), "day or month (UTC)"))


@dataclass(frozen=True, slots=True)
class TenantHedging(Checked):
    """This key's hedging override: hedges off, or its own share of the hedge budget (which
    pays for the hedges its TTFT objective sends early: docs/tenants.md)."""

    enabled: bool = field(default=True, metadata=scalar(
        cv.boolean, "false: no delay-triggered hedges for this key's requests"))
    ratio: float | None = field(default=None, metadata=scalar(
        cv.optional(cv.number(0)), "this key's own hedge budget ratio, paying for the hedges "
        "its TTFT objective sends early; null: the pool's"))


@dataclass(frozen=True, slots=True)
class TenantKeySettings(Checked):
    """One client key: its name, its secret as a digest, the pools it may use, its limits."""

    name: str = field(metadata=scalar(cv.name, "the key's name in logs, stats and errors; "
                                              "unique"))
    key_sha256: str | None = field(default=None, metadata=scalar(
        cv.optional(digest), "the key's SHA-256 as hex (`printf %s \"$KEY\" | sha256sum`); "
        "exactly one of key_sha256 and key", default_shown=False))
    key: str | None = field(default=None, repr=False, metadata=scalar(
        cv.secret, "the key itself (`${VAR}`), hashed as the file is read and never kept"))
    pools: tuple[str, ...] = field(default=(), metadata=scalar(
        pool_names, "the pools (model names) this key may use; empty: every pool"))
    limits: TenantLimits = field(default_factory=TenantLimits, metadata=section(
        TenantLimits, "requests and tokens per minute, requests in flight"))
    budget: TenantBudget = field(default_factory=TenantBudget, metadata=section(
        TenantBudget, "a spend budget per day or month"))
    ttft_objective: float | None = field(default=None, metadata=scalar(
        cv.optional(cv.duration()), "a time-to-first-token objective: a primary likely to miss "
        "it is hedged earlier; null: none"))
    hedging: TenantHedging = field(default_factory=TenantHedging, metadata=section(
        TenantHedging, "this key's hedging override and its share of the hedge budget"))

    def _complete(self) -> None:
        if self.key is not None and self.key_sha256 is None:
            self._set("key_sha256", hashlib.sha256(self.key.encode()).hexdigest())
            self._set("key", None)  # the digest is all the gateway keeps

    def _rules(self, at: At) -> Iterator[str]:
        if self.key_sha256 is None and self.key is None:
            yield f"{at('key_sha256')}: required (or `key`)"
        elif self.key is not None and self.key_sha256 is not None:
            yield f"{at('key')}: give key_sha256 or key, not both"

    def unenforced(self) -> list[str]:
        """The keys set here that this version does not act on yet (warned at start): none
        today; a rule accepted ahead of its enforcement is listed here."""
        return []
