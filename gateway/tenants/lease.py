"""One key's per-minute limits held by several processes at once: the shared bucket in the store
and the slices of it each process leases. Pure: no I/O, every clock a number handed in.

The store keeps, per key and kind of limit, the one bucket all replicas draw from (`level`,
`at`: its level and when it was last refilled, by the store's clock), refilled as a process's
own bucket is (`gateway.tenants.limits`: limit / 60 a second). A process never asks it on a
request's path: it admits from its slice (`Slice.held`), and a batch a few times a second
(`gateway.api.keystore`) settles every slice at once in one transaction (`draw`):

- what the process owes (a slice gone below zero: output tokens charged at the end, input
  corrected to the upstream's count, a request borrowed) is taken from the bucket whatever
  its level, as the bucket of one process takes it;
- what it holds beyond its need is given back;
- then it is granted up to what it wants: its own rate of use over the last round times
  `LOOKAHEAD` (so it does not run out before the next round: prefetch), never more than
  `1 / SPREAD` of what the bucket holds (at least one request's worth while the bucket has
  it). Slices are thus large while the bucket is full and small near the limit, so what the
  other processes hold unused while one is refused stays a small part of the limit.

A process whose slice cannot pay for a request borrows it once, when the bucket as it last
saw it (refilled since at the bucket's rate) holds it, and asks for a round at once; a second
request before that round is refused with a retry after `ROUND_RETRY`: the request path never
waits on the store. What borrowing may admit beyond the limit is one request per process
between two of its rounds (docs/tenants.md states the bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: a per-minute limit refills over this many seconds
PERIOD = 60.0
#: a slice covers this many seconds of the process's own rate of use
LOOKAHEAD = 1.0
#: a process is granted at most this fraction of what the shared bucket holds
SPREAD = 4.0
#: a rate of use is measured over at least this long (a round right after another would
#: otherwise read a burst as a flood)
MIN_ROUND = 0.1
#: a process that holds more than this many times its need gives the rest back
EXCESS = 2.0
#: a process that took nothing of a slice for this many seconds gives it back
IDLE = 2.0
#: seconds a request refused while its process waits for a round is told to wait
ROUND_RETRY = 0.25

LeaseKind = Literal["requests", "input_tokens", "output_tokens"]


@dataclass(frozen=True, slots=True)
class Ask:
    """One slice's part of a batch: what its process sends to the shared bucket and wants."""

    name: str
    kind: LeaseKind
    capacity: float
    #: > 0: given back; < 0: owed, taken whatever the bucket's level
    sent: float
    #: how much more the process would hold (0: nothing, it only settles)
    want: float
    #: what one request needs of this kind (granted while the bucket holds it, whatever
    #: `SPREAD` says)
    unit: float


@dataclass(frozen=True, slots=True)
class Grant:
    """The bucket's answer to an `Ask`."""

    granted: float
    #: the bucket's level once the ask is settled
    level: float


def refilled(level: float, at: float, capacity: float, now: float) -> float:
    """The shared bucket's level at `now`, refilled since `at` (a capacity lowered since:
    the level is capped to it)."""
    return min(capacity, level + max(0.0, now - at) * capacity / PERIOD)


def draw(level: float | None, at: float | None, ask: Ask, now: float) -> Grant:
    """Settle `ask` against the shared bucket whose stored state is (`level`, `at`), None for
    a bucket never drawn from (full). The new state is (`Grant.level`, `now`)."""
    start = ask.capacity if level is None or at is None else refilled(level, at, ask.capacity,
                                                                       now)
    level = min(ask.capacity, start + ask.sent)
    if ask.want <= 0 or level <= 0:
        return Grant(0.0, level)
    share = max(level / SPREAD, min(level, ask.unit))
    granted = min(ask.want, share)
    return Grant(granted, level - granted)


class Slice:
    """What one process holds of one kind of a key's shared bucket (see the module)."""

    __slots__ = ("asked_at", "borrowed", "capacity", "held", "kind", "known", "known_at",
                 "low", "pending", "unit", "used")

    def __init__(self, kind: LeaseKind, capacity: int, now: float) -> None:
        self.kind = kind
        self.capacity = float(capacity)
        #: what this process may still take before its next round (below zero: owed)
        self.held = 0.0
        #: the shared bucket's level as the last round left it, and when (this clock)
        self.known = float(capacity)
        self.known_at = now
        #: a request was borrowed since the last round (one at a time)
        self.borrowed = False
        #: taken since the last ask, and when that ask was
        self.used = 0.0
        self.asked_at = now
        #: below this, a round is wanted (half the last target)
        self.low = 0.0
        #: what one request needed of this kind lately
        self.unit = 1.0
        #: an ask is being settled (its slice is not asked again meanwhile)
        self.pending = False

    def bucket_at(self, now: float) -> float:
        """The shared bucket's level as last seen, refilled since at its rate."""
        return refilled(self.known, self.known_at, self.capacity, now)

    def can_take(self, need: float, now: float) -> float:
        """0.0 when `need` can be taken now (from the slice, or borrowed); else the seconds
        to wait: a round's when the bucket holds it, else until it has refilled so far. A
        need past the capacity counts as the capacity (it passes from a full bucket)."""
        need = min(need, self.capacity)
        if self.held >= need:
            return 0.0
        missing = need - self.held - self.bucket_at(now)
        if missing <= 0:
            return ROUND_RETRY if self.borrowed else 0.0
        return max(ROUND_RETRY, missing * PERIOD / self.capacity)

    def take(self, need: float) -> bool:
        """Take `need` (after `can_take` said yes); True when a round is wanted now."""
        if self.held < need:
            self.borrowed = True
        self.held -= need
        self.used += need
        return self.held < self.low or self.borrowed

    def reserve(self) -> bool:
        """Output at a request's admission, which takes nothing (its answer is charged at the
        end): a slice that holds nothing counts it as borrowed, as `take` would, so a round
        comes at once and a second request waits for it. Without that, a slice that never
        held output would never ask, its view of the shared bucket (`known`) would never be
        refreshed, and its process would admit on a full bucket long drained by the others.
        True when a round is wanted now."""
        if self.held > 0:
            return False
        self.borrowed = True
        return True

    def charge(self, amount: float) -> bool:
        """Take `amount` at a request's end (output; an input correction, < 0 gives back);
        True when a round is wanted now."""
        self.held -= amount
        self.used += max(0.0, amount)
        return self.held < self.low

    def ask(self, name: str, now: float) -> Ask | None:
        """This slice's part of a batch at `now`, None when it has nothing to settle or want;
        what it sends leaves the slice at once (`settled` or `failed` ends the ask)."""
        if self.pending:
            return None
        if self.used == 0 and not self.borrowed:  # idle since the last ask
            if self.held == 0 or (self.held > 0 and now - self.asked_at < IDLE):
                return None
            sent, target = self.held, 0.0  # its slice back once idle; a debt paid at once
        else:
            elapsed = max(MIN_ROUND, now - self.asked_at)
            target = max(self.used / elapsed * LOOKAHEAD, self.unit)
            if self.held < 0:
                sent = self.held
            elif self.held > EXCESS * target + self.unit:
                sent = self.held - target
            else:
                sent = 0.0
        want = max(0.0, target - (self.held - sent))
        self.held -= sent
        self.used = 0.0
        self.asked_at = now
        self.low = target / 2
        self.pending = True
        return Ask(name, self.kind, self.capacity, sent, want, self.unit)

    def release(self, name: str) -> Ask | None:
        """This slice's part of a last batch: all it holds given back, all it owes paid
        (a process stopping); None when it holds and owes nothing."""
        if self.pending or self.held == 0:
            return None
        sent, self.held = self.held, 0.0
        self.pending = True
        return Ask(name, self.kind, self.capacity, sent, 0.0, self.unit)

    def settled(self, grant: Grant, now: float) -> None:
        """The store's answer to this slice's ask."""
        self.held += grant.granted
        self.known, self.known_at = grant.level, now
        self.borrowed = False
        self.pending = False

    def failed(self, ask: Ask) -> None:
        """The ask could not be settled (the store is down): what it sent comes back."""
        self.held += ask.sent
        self.pending = False


class Leasing:
    """Whether the slices are in force: False while the store cannot be reached under
    `server.store_down: open` (each process then holds the whole limit itself, as without a
    shared store). One per gate, shared by its keys' leases."""

    __slots__ = ("up",)

    def __init__(self) -> None:
        self.up = True


class KeyLease:
    """One key's slices, one per per-minute limit it has."""

    __slots__ = ("input", "leasing", "name", "output", "requests", "slices", "wanted")

    def __init__(self, name: str, leasing: Leasing, now: float, requests: int | None,
                 input_tokens: int | None, output_tokens: int | None) -> None:
        self.name = name
        self.leasing = leasing
        self.requests = None if requests is None else Slice("requests", requests, now)
        self.input = None if input_tokens is None else Slice("input_tokens", input_tokens, now)
        self.output = None if output_tokens is None else Slice("output_tokens", output_tokens,
                                                               now)
        self.slices = tuple(s for s in (self.requests, self.input, self.output)
                            if s is not None)
        #: a round is wanted now (a slice ran low, or a request was borrowed)
        self.wanted = False

    def refusal(self, now: float, input_tokens: int) -> tuple[LeaseKind, float] | None:
        """Which slice cannot admit a request of `input_tokens` at `now`, and the wait."""
        longest, why = 0.0, None
        for piece, need in ((self.requests, 1.0), (self.input, float(input_tokens)),
                            (self.output, 1e-9)):
            if piece is not None:
                wait = piece.can_take(need, now)
                if wait > longest:
                    longest, why = wait, piece.kind
        return None if why is None else (why, longest)

    def admit(self, input_tokens: int) -> None:
        """Take a request admitted by `refusal` (output: nothing until its end, but an empty
        output slice counts it as borrowed: `Slice.reserve`)."""
        if self.requests is not None:
            self.wanted |= self.requests.take(1.0)
        if self.input is not None:
            self.input.unit = max(1.0, float(input_tokens))
            self.wanted |= self.input.take(float(input_tokens))
        if self.output is not None:
            self.wanted |= self.output.reserve()

    def settle(self, estimated_input: int, input_tokens: int | None,
               output_tokens: int | None) -> None:
        """A request's end: its input corrected from the estimate, its output charged."""
        if self.input is not None and input_tokens is not None:
            self.wanted |= self.input.charge(float(input_tokens - estimated_input))
        if self.output is not None and output_tokens:
            self.output.unit = max(1.0, float(output_tokens))
            self.wanted |= self.output.charge(float(output_tokens))

    def refund(self, estimated_input: int) -> None:
        """A request refused by the gateway itself: what its admission took comes back."""
        if self.requests is not None:
            self.requests.charge(-1.0)
        if self.input is not None:
            self.input.charge(-float(estimated_input))

    def remaining(self, kind: LeaseKind, now: float) -> float | None:
        """What the key has left of `kind` across processes, as this one knows it."""
        for piece in self.slices:
            if piece.kind == kind:
                return max(0.0, piece.held) + max(0.0, piece.bucket_at(now))
        return None

    def asks(self, now: float, *, last: bool = False) -> list[tuple[Slice, Ask]]:
        """This key's part of a batch at `now`; `last`: of the last batch, which gives every
        slice back (`Slice.release`)."""
        self.wanted = False
        found = []
        for piece in self.slices:
            ask = piece.release(self.name) if last else piece.ask(self.name, now)
            if ask is not None:
                found.append((piece, ask))
        return found
