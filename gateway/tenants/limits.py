"""One key's limits as buckets: admit a request, settle its tokens, let it go. Pure: no I/O,
the clock is a number handed in.

Each per-minute limit is a bucket that holds the limit and refills evenly, limit / 60 a
second. That is what the rate-limit headers clients read describe (the limit, what remains,
the time until the bucket is full again) and what their retries can act on: a refusal says
exactly when the request would pass. A key keeps a fixed handful of numbers (one bucket per
kind of limit, an in-flight count), whatever its traffic: memory per key is bounded.

- requests: one token per request, taken at admission;
- input tokens: taken at admission as estimated from the body; corrected at the end by the
  upstream's usage, when it reports one;
- output tokens: cannot be known before the answer, so a request is admitted while the
  bucket is not in debt, and its output is taken at the end (the bucket may go below zero:
  the next requests wait until it refills past zero);
- in flight: a count, taken at admission and given back at the end.

A request larger than a bucket holds (more input tokens than the limit) is admitted only from
a full bucket, so it is slow but never refused for ever.

Where several processes hold one key (replicas on one PostgreSQL store, the workers of one
`serve`), the buckets are also held in the store and each process leases slices of them
(`lease`, `gateway.tenants.lease`): a request then passes only when both its process's own
buckets and its slices let it, so the processes together admit what one bucket would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, cast

from gateway.settings.tenants import TenantLimits
from gateway.tenants.lease import PERIOD, KeyLease, LeaseKind

#: the kinds of limit, as the headers and the refusals name them
Kind = Literal["requests", "input_tokens", "output_tokens", "in_flight"]
#: what a refusal for requests in flight advises: no clock says when one ends
IN_FLIGHT_RETRY = 1.0


class Bucket:
    """A bucket of `capacity` refilled at `capacity / 60` a second; starts full."""

    __slots__ = ("at", "capacity", "level", "limit", "rate")

    def __init__(self, capacity: int, now: float) -> None:
        self.limit = capacity
        self.capacity = float(capacity)
        self.rate = capacity / PERIOD
        self.level = float(capacity)
        self.at = now

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now


class Quota(NamedTuple):
    """One limit as an answer's headers state it (a tuple: one is made per limit per
    request)."""

    kind: Kind
    limit: int
    remaining: int
    #: seconds until the limit is whole again
    reset: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request over a limit: which one, and when it would pass."""

    kind: Kind
    retry_after: float
    quotas: tuple[Quota, ...]


class KeyLimits:
    """The live state of one key's limits (see the module docstring)."""

    __slots__ = ("buckets", "in_flight", "inflight_limit", "input", "lease", "output",
                 "requests")

    def __init__(self, limits: TenantLimits, now: float, lease: KeyLease | None = None) -> None:
        def bucket(capacity: int | None) -> Bucket | None:
            return None if capacity is None else Bucket(capacity, now)

        self.requests = bucket(limits.requests_per_minute)
        self.input = bucket(limits.input_tokens_per_minute)
        self.output = bucket(limits.output_tokens_per_minute)
        self.inflight_limit = limits.in_flight
        self.in_flight = 0
        #: the per-minute buckets in the headers' order, with their kinds
        kinds: tuple[tuple[Kind, Bucket | None], ...] = (
            ("requests", self.requests), ("input_tokens", self.input),
            ("output_tokens", self.output))
        self.buckets: tuple[tuple[Kind, Bucket], ...] = tuple(
            (kind, bucket) for kind, bucket in kinds if bucket is not None)
        #: the key's slices of the buckets shared with other processes; None: this process
        #: holds the whole limit
        self.lease = lease

    def admit(self, now: float, input_tokens: int) -> Refusal | tuple[Quota, ...]:
        """Take one request of `input_tokens` (estimated) at `now`: the quotas left after it,
        or the refusal that takes nothing. Every limit is checked before any is taken."""
        longest = 0.0
        why: Kind = "requests"
        requests, output = self.requests, self.output
        for kind, bucket in self.buckets:
            # `Bucket.refill` and `_takes` written out, then the wait until the bucket holds
            # the need (past its capacity: until it is full): every request of a key with
            # limits runs this, and a method call is a Python frame each
            if now > bucket.at:
                level = bucket.level + (now - bucket.at) * bucket.rate
                bucket.level = level if level < bucket.capacity else bucket.capacity
                bucket.at = now
            need = 1.0 if bucket is requests else 1e-9 if bucket is output \
                else float(input_tokens)
            missing = (need if need < bucket.capacity else bucket.capacity) - bucket.level
            if missing > 0 and missing / bucket.rate > longest:
                longest, why = missing / bucket.rate, kind
        lease = self.lease
        if lease is not None and lease.leasing.up:
            shared = lease.refusal(now, input_tokens)
            if shared is not None and shared[1] > longest:
                longest, why = shared[1], shared[0]
        if self.inflight_limit is not None and self.in_flight >= self.inflight_limit \
                and longest < IN_FLIGHT_RETRY:
            longest, why = IN_FLIGHT_RETRY, "in_flight"
        if longest > 0:  # the request passes only once every limit lets it
            return Refusal(why, longest, self.quotas())
        if requests is not None:
            requests.level -= 1.0
        if self.input is not None:
            self.input.level -= input_tokens
        if lease is not None and lease.leasing.up:
            lease.admit(input_tokens)
        self.in_flight += 1
        return self.quotas()

    def leased(self) -> bool:
        """Whether an admission now takes part in the lease (`admit` takes from the slices):
        read by the caller right after `admit` and handed back to `settle` or `refund`, so a
        request is charged to the slices only when they admitted it. One admitted while the
        store was down (each process on its own whole limit) owes the shared bucket nothing:
        charged to the slice, its output would be a debt paid from the shared bucket at the
        first round after the outage, refusing the key for minutes."""
        return self.lease is not None and self.lease.leasing.up

    def settle(self, now: float, estimated_input: int, input_tokens: int | None,
               output_tokens: int | None, *, leased: bool) -> None:
        """The end of an admitted request: its slot back, its input corrected from the
        estimate to the upstream's count, its output taken (either None: not reported);
        `leased`: `leased()` at its admission (the slices are charged only then)."""
        self.in_flight = max(0, self.in_flight - 1)
        if self.lease is not None and leased:
            self.lease.settle(estimated_input, input_tokens, output_tokens)
        if self.input is not None and input_tokens is not None:
            self.input.refill(now)
            self.input.level = min(self.input.capacity,
                                   self.input.level - (input_tokens - estimated_input))
        if self.output is not None and output_tokens:
            self.output.refill(now)
            self.output.level -= output_tokens

    def refund(self, now: float, estimated_input: int, *, leased: bool) -> None:
        """The end of an admitted request the gateway refused before sending it anywhere
        (untranslatable, a route no backend serves, the gateway's own overload or drain):
        everything its admission took goes back, its slot included, so a refused request
        takes nothing; `leased`: `leased()` at its admission (the slices get back only what
        they gave)."""
        self.in_flight = max(0, self.in_flight - 1)
        if self.lease is not None and leased:
            self.lease.refund(estimated_input)
        for _, bucket in self.buckets:
            if bucket is not self.output:
                bucket.refill(now)
                bucket.level = min(bucket.capacity,
                                   bucket.level + self._takes(bucket, estimated_input))

    def quotas(self) -> tuple[Quota, ...]:
        """The per-minute limits as of their last refill; under a lease, what is left across
        the processes as this one last saw it, when that is less."""
        lease = self.lease
        if lease is not None and lease.leasing.up:
            return tuple(self._shared_quota(kind, bucket, lease) for kind, bucket in self.buckets)
        # every request states them: built without a Python frame per quota (a NamedTuple's
        # own constructor is one) or per bucket method
        new = tuple.__new__
        return tuple([new(Quota, (kind, bucket.limit,
                                  math.floor(bucket.level) if bucket.level > 0 else 0,
                                  (bucket.capacity - bucket.level) / bucket.rate
                                  if bucket.level < bucket.capacity else 0.0))
                      for kind, bucket in self.buckets])

    @staticmethod
    def _shared_quota(kind: Kind, bucket: Bucket, lease: KeyLease) -> Quota:
        """One limit's quota under a lease (`quotas`)."""
        level = bucket.level
        shared = lease.remaining(cast(LeaseKind, kind), bucket.at)
        if shared is not None:
            level = min(level, shared)
        reset = max(0.0, (bucket.capacity - level) / bucket.rate)
        return Quota(kind, int(bucket.capacity), max(0, math.floor(level)), reset)

    def _takes(self, bucket: Bucket, input_tokens: int) -> float:
        """What a request needs of `bucket` at admission; output: not to be in debt, which
        waiting for a fraction of a token above zero expresses."""
        if bucket is self.requests:
            return 1.0
        return float(input_tokens) if bucket is self.input else 1e-9
