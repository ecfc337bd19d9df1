"""The client key of a request and its rules: who it is, whether it is within its limits, and
the rate-limit headers of every answer to it. What the key allows once the body has named a
pool (the pool, the TTFT objective) is `gateway.api.terms`, a later step of the request.

`TenantGate` is the one check every inference route calls: `server.api_keys` (keys without
rules, `gateway.api.keys.KeyRing`) and the named keys of `keys:` (`gateway.tenants`). While
neither holds a key, `active` is False and a request pays that one test. A key with limits
has each admitted request wrapped (`limited`): the limits' headers go on the answer, whatever
it is; as the answer ends (before the client can see that end: `Settled`) its slot goes back
and the upstream's usage is charged, and once the request has ended its usage is counted.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.end import SUMMARY_KEY
from gateway.api.keys import KeyRing
from gateway.api.stream import SSEResponse
from gateway.clock import Clock
from gateway.errors import (
    BudgetExceeded,
    KeyRateLimited,
    StoreDown,
    Unauthorized,
)
from gateway.hedge.prefill import estimate_tokens
from gateway.settings.tenants import TenantKeySettings
from gateway.stats import RequestSummary
from gateway.tenants.headers import Instants, ratelimit_headers
from gateway.tenants.lease import Leasing
from gateway.tenants.limits import Refusal
from gateway.tenants.registry import Tenant, Tenants
from gateway.tenants.spend import MICRO, PeriodSpend, over_budget
from gateway.wire.base import Hooks

#: the key in a request's scope state under which a named key's tenant is kept, so that an
#: error the route raises before admission still states the key's quotas
TENANT_KEY = "hedge_tenant"


def supplied_key(request: Request, *, x_api_key: bool) -> str:
    """The key a request presents: Bearer's token, or (`x_api_key`: Anthropic's routes)
    `x-api-key`."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    supplied = token.strip() if scheme.lower() == "bearer" else ""
    if not supplied and x_api_key:
        supplied = request.headers.get("x-api-key", "").strip()
    return supplied


class TenantGate:
    """The client keys a route checks: `ring` (`server.api_keys`, no rules) and `tenants`
    (`keys:`), both replaced whole by a reload. `clock`: the limits' clock (monotonic
    seconds); `wall`: the time of day, for Anthropic's RFC 3339 resets."""

    __slots__ = ("budgets", "clock", "configured", "fail_closed", "instants", "leasing",
                 "required", "ring", "sending", "spent", "store_down", "stored", "tenants",
                 "unread", "usage", "wake", "wall")

    def __init__(self, ring: KeyRing, keys: Iterable[TenantKeySettings], clock: Clock,
                 wall: Callable[[], float] = time.time, *, required: bool = False,
                 fail_closed: bool = False, leasing: Leasing | None = None) -> None:
        self.ring = ring
        #: the keys' per-minute limits are shared with other processes through the store
        #: (`gateway.tenants.lease`); None: each process holds them whole
        self.leasing = leasing
        #: Anthropic's reset instants written this second (`ratelimit_headers`)
        self.instants = Instants()
        #: asks for a round of leases now (`TenantSync` sets it): a key's slice ran low
        self.wake: Callable[[], None] = _nothing
        #: `server.store_down: closed`: while the store cannot be read (`store_down`, set by
        #: `TenantSync`), a named key's request is refused with 503
        self.fail_closed = fail_closed
        self.store_down = False
        #: a key is asked even while none is known: a gateway with a store of keys, whose
        #: last key revoked must not leave it open to anyone
        self.required = required
        self.clock = clock
        self.wall = wall
        #: the file's `keys:` and the store's keys made at run time (`TenantSync`)
        self.configured: tuple[TenantKeySettings, ...] = tuple(keys)
        self.stored: tuple[TenantKeySettings, ...] = ()
        self.tenants = Tenants(self.configured, clock(), leasing=leasing)
        #: whether any key in force has a budget (`budgeted`), found once per change of keys
        self.budgets = _any_budget(self.tenants)
        #: each named key's usage since the last batch went to the store: [requests, input
        #: tokens, output tokens, spend in micro-dollars], one entry per key (bounded by the
        #: keys)
        self.usage: dict[str, list[int]] = {}
        #: the batch being written (`take_usage`), still counted against budgets until the
        #: store's spend that includes it is read (`adopt_spend`)
        self.sending: dict[str, list[int]] = {}
        #: a key's spend of batches written whose read-back failed: still counted until a
        #: read of the store includes them (micro-dollars per key)
        self.unread: dict[str, int] = {}
        #: each key's spend (today's, this month's) as the store last said it
        self.spent: dict[str, PeriodSpend] = {}

    @property
    def active(self) -> bool:
        """Whether a key is asked (else every request is let in, unnamed)."""
        return self.required or bool(self.ring.digests) or bool(self.tenants.by_digest)

    def replace(self, keys: Iterable[TenantKeySettings]) -> None:
        """A reload's `keys:`: in force for the next request; unchanged keys keep their
        live limits (`gateway.tenants.registry`)."""
        self.configured = tuple(keys)
        self._rebuild()

    def adopt_stored(self, keys: Iterable[TenantKeySettings]) -> list[str]:
        """The store's active keys (made at run time), in force for the next request; a key
        missing from them was revoked. One whose name or digest the file's `keys:` has is
        skipped (the file wins): its name is returned, for a warning."""
        names = {key.name for key in self.configured}
        digests = {key.key_sha256 for key in self.configured}
        kept, clashing = [], []
        for key in keys:
            if key.name in names or key.key_sha256 in digests:
                clashing.append(key.name)
            else:
                kept.append(key)
        self.stored = tuple(kept)
        self._rebuild()
        return clashing

    def _rebuild(self) -> None:
        self.tenants = Tenants(self.configured + self.stored, self.clock(), self.tenants,
                               self.leasing)
        self.budgets = _any_budget(self.tenants)

    def take_usage(self) -> dict[str, list[int]]:
        """The usage counted since the last call, handed over whole (to be written); it
        still counts against budgets until `adopt_spend` or `keep_unsent`."""
        usage, self.usage = self.usage, {}
        for name, counts in self.sending.items():  # written, but never read back
            self.unread[name] = self.unread.get(name, 0) + counts[3]
        self.sending = usage
        return usage

    def adopt_spend(self, spent: dict[str, PeriodSpend],
                    written: dict[str, list[int]] | None = None) -> None:
        """The store's spend per key. `written`: the batch (`take_usage`) this was read
        after, which is in it now and no longer counted apart; a read that is not after a
        batch of its own (a poll) leaves a batch being written counted, twice at worst for
        a moment, never missed."""
        self.spent = spent
        self.unread = {}  # written before this read began: in it
        if written is not None and self.sending is written:
            self.sending = {}

    def keep_unsent(self, batch: dict[str, list[int]]) -> None:
        """`batch` (`take_usage`) could not be written: back into the next one. It is the
        batch given, never whatever is being written now: a later batch taken meanwhile (an
        admin's flush beside the loop's) is neither lost nor put back twice; and a batch
        a later take moved to `unread` leaves it, counted once, in `usage`."""
        if self.sending is batch:
            self.sending = {}
        else:
            for name, counts in batch.items():
                left = self.unread.get(name, 0) - counts[3]
                if left > 0:
                    self.unread[name] = left
                else:
                    self.unread.pop(name, None)
        for name, counts in batch.items():
            kept = self.usage.get(name)
            if kept is None:
                self.usage[name] = counts
            else:
                for index, count in enumerate(counts):
                    kept[index] += count

    def budgeted(self) -> bool:
        """Whether any key in force has a budget (its spend is then read at every poll):
        known since the keys last changed, not looked for among them at every poll."""
        return self.budgets

    def check_budget(self, tenant: Tenant) -> None:
        """`BudgetExceeded` for a key that has spent its budget of the period: the store's
        figure plus this process's unwritten spend (other processes' unwritten spend, at
        most one batch each, is the overshoot: docs/tenants.md)."""
        budget = tenant.settings.budget
        if budget.usd is None:
            return
        name = tenant.name
        unsent = self.unread.get(name, 0) + sum(
            counts[3] for counts in (self.usage.get(name), self.sending.get(name))
            if counts is not None)
        if over_budget(budget.usd, budget.period, self.spent.get(name, (0, 0)), unsent):
            raise BudgetExceeded(name, budget.usd, budget.period)

    def identify(self, request: Request, *, x_api_key: bool = False) -> Tenant | None:
        """The named key the request presents, None for a key of `server.api_keys` (or when
        no key is configured); `Unauthorized` for any other. The 401 never repeats it."""
        if not self.active:
            return None
        supplied = supplied_key(request, x_api_key=x_api_key)
        tenant = self.tenants.find(supplied)
        if tenant is not None:
            if tenant.limits is not None:
                request.scope.setdefault("state", {})[TENANT_KEY] = tenant
            return tenant
        if self.ring.matches(supplied):
            return None
        raise Unauthorized("missing or invalid gateway API key")

    async def guard(self, request: Request) -> None:
        """`identify` as a route dependency (the model list, stored responses)."""
        self.identify(request)

    async def limited(self, request: Request, tenant: Tenant, body_bytes: int, *,
                      anthropic: bool, handle: Callable[[], Awaitable[Response]]) -> Response:
        """Run `handle` (the proxy) for a request of a named key, or refuse it with 429 when
        one of its limits says so; its limits are charged as its answer ends (`Settled`), and
        its usage is counted once it has ended."""
        limits = tenant.limits
        estimated = estimate_tokens(body_bytes)
        headers: list[tuple[bytes, bytes]] | None = None
        #: whether the shared slices took part in the admission (settled and refunded only
        #: then: `KeyLimits.leased`)
        leased = False
        if self.store_down and self.fail_closed:
            raise StoreDown()
        self.check_budget(tenant)  # before the limits: a refused request takes nothing
        if limits is not None:
            verdict = limits.admit(self.clock(), estimated)
            if isinstance(verdict, Refusal):
                refused = KeyRateLimited(tenant.name, verdict.kind, verdict.retry_after)
                refused.headers = ratelimit_headers(verdict.quotas, anthropic=anthropic,
                                                    wall=self.wall(), instants=self.instants)
                raise refused
            leased = limits.leased()
            headers = ratelimit_headers(verdict, anthropic=anthropic, wall=self.wall(),
                                        instants=self.instants)
            if limits.lease is not None and limits.lease.wanted:
                self.wake()  # prefetch: the next request must not find the slice empty
        state = request.scope.setdefault("state", {})
        #: the request's (input, output) tokens, once charged (`charge`); and whether its
        #: usage was counted (`settle`)
        tokens: tuple[int | None, int | None] | None = None
        counted = False

        def charge() -> None:
            """Once, as the answer's end is about to go out (a stream's as it is done with
            its body, another answer's before it is sent): the slot back and the tokens
            charged, so that the client's next request, sent as it reads that end, meets
            them."""
            nonlocal tokens
            if tokens is not None:
                return
            tokens = (None, None)  # (what follows is made once, even if it fails: a bug)
            try:
                summary = state.get(SUMMARY_KEY)
                tokens = charged(summary if isinstance(summary, RequestSummary) else None,
                                 estimated)
            finally:  # the slot goes back whatever the count did
                if limits is not None:
                    limits.settle(self.clock(), estimated, *tokens, leased=leased)
                    if limits.lease is not None and limits.lease.wanted:
                        self.wake()

        def settle() -> None:
            """Once, after the answer (the request has ended: its cost is known): charged if
            it was not yet, and its usage counted."""
            nonlocal counted
            charge()
            if counted or tokens is None:
                return
            counted = True
            summary = state.get(SUMMARY_KEY)
            counts = self.usage.get(tenant.name)
            if counts is None:
                counts = self.usage[tenant.name] = [0, 0, 0, 0]
            counts[0] += 1
            counts[1] += tokens[0] or 0
            counts[2] += tokens[1] or 0
            cost = summary.cost if isinstance(summary, RequestSummary) else None
            if cost is not None:
                counts[3] += round(cost * MICRO)

        try:  # no await between the admission and here: the slot cannot leak
            response = await handle()  # the answer, errors included (`gateway.api.answer`)
        except BaseException:  # no answer will be sent (cancelled, a bug of ours)
            settle()
            raise
        if not sent_upstream(state.get(SUMMARY_KEY)):  # refused by the gateway itself
            tokens, counted = (None, None), True  # nothing to settle: it takes nothing
            if limits is not None:
                limits.refund(self.clock(), estimated, leased=leased)
                headers = ratelimit_headers(limits.quotas(), anthropic=anthropic,
                                            wall=self.wall(), instants=self.instants)
                answer_headers(response.raw_headers, headers)
            return response
        if headers is not None:
            answer_headers(response.raw_headers, headers)
        return Settled(response, charge, settle)


def _any_budget(tenants: Tenants) -> bool:
    """Whether any of `tenants` has a budget."""
    return any(t.settings.budget.usd is not None for t in tenants.by_digest.values())


def _nothing() -> None:
    """No round of leases to ask for (no store shares the limits)."""


def sent_upstream(summary: object) -> bool:
    """Whether a request the proxy answered reached any upstream: False when it was refused
    before its race (no summary: untranslatable, a route no backend serves, the gateway's
    overload or drain) or before its first attempt (a summary without attempts)."""
    return isinstance(summary, RequestSummary) and bool(summary.attempts)


def charged(summary: RequestSummary | None, estimated: int) -> tuple[int | None, int | None]:
    """The (input, output) tokens a key is charged for a request: the upstream's usage; for
    an answer without it (the client left a stream before the usage came, a backend that
    reports none in a stream), the admission's estimate of its input and, for a stream, one
    output token per event relayed: leaving early must not skip the output limit. (None,
    None) for a request that never committed an answer (its input estimate stays charged)."""
    if summary is None:
        return None, None
    usage = summary.usage
    if usage is not None:
        return usage.input, usage.output
    if summary.winner is None or not summary.metered:
        return None, None
    return estimated, summary.relayed


class Settled(Response):
    """Sends `response` (the proxy's answer: its own end runs inside it) with the key's
    `charge` made before its end goes out, then calls `settle`. A stream charges as it is
    complete, before the piece that carries its end event (`SSEResponse.on_exhausted`, which
    the relay calls then); any other answer is whole when it is built (its usage read, its
    winner chosen) and charges before it is sent, and is sent even if the charge fails (a bug
    of ours: it propagates once the answer and the request's end have run). Both are plain
    code, no await, so a `finally` runs `settle` (which charges first if that never came)
    whatever happens to the sending, a cancellation included, without the cost of a shielded
    scope per request."""

    def __init__(self, response: Response, charge: Callable[[], None],
                 settle: Callable[[], None]) -> None:
        self.response = response
        self.settle = settle
        self.status_code = response.status_code
        self.raw_headers = response.raw_headers
        self.background = None
        self.charge: Callable[[], None] | None = charge
        if isinstance(response, SSEResponse):
            if response.on_exhausted is None:
                response.on_exhausted = Hooks()
            response.on_exhausted.add(charge)
            self.charge = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            try:
                if self.charge is not None:
                    self.charge()
            finally:
                await self.response(scope, receive, send)
        finally:
            self.settle()


#: the rate-limit header families; an upstream's are dropped from an answer that states a key's
_FAMILIES = (b"x-ratelimit-", b"anthropic-ratelimit-")


def answer_headers(raw: list[tuple[bytes, bytes]], ours: list[tuple[bytes, bytes]]) -> None:
    """Put the key's rate-limit headers on an answer, in place of any the winning upstream
    sent (relayed otherwise): the client of a key with limits reads the key's, never two
    values of one header."""
    raw[:] = [(name, value) for name, value in raw if not name.startswith(_FAMILIES)]
    raw.extend(ours)


def quota_headers(scope: Scope, *, anthropic: bool) -> list[tuple[bytes, bytes]]:
    """The rate-limit headers of the named key a refused request presented (none without
    one, or without limits): an error raised before admission (a bad body, a pool the key may
    not use) states the key's quotas too, as of its last admission (what remains can only
    have grown since)."""
    tenant = scope.get("state", {}).get(TENANT_KEY)
    if not isinstance(tenant, Tenant) or tenant.limits is None:
        return []
    return ratelimit_headers(tenant.limits.quotas(), anthropic=anthropic, wall=time.time())
