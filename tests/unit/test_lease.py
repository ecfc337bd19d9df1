"""The slices of a key's per-minute limits that several processes lease from one shared bucket
(`gateway.tenants.lease`), in virtual time: the store is a dict settled by `draw`, the clock a
number, the processes `KeyLimits` with their leases.

- the bucket's arithmetic: refilled at limit / 60 a second, debts taken whatever its level,
  slices given back, a grant never past a quarter of what it holds (one request's worth
  while it has it);
- three processes sharing a 60-a-minute key admit 60 (within 5 %) where each alone would
  admit 60, with rounds off the request path; almost every request is admitted from a slice
  held before it came (prefetch), not borrowed;
- the same for output tokens, charged at each request's end;
- a slice adapts: large while the bucket is full, one request near the limit; an idle one is
  given back;
- the store down (`Leasing.up` False): each process holds its whole limit again.
"""

from __future__ import annotations

import pytest

from gateway.settings.tenants import TenantLimits
from gateway.tenants.lease import (
    IDLE,
    ROUND_RETRY,
    SPREAD,
    Ask,
    Grant,
    KeyLease,
    Leasing,
    draw,
)
from gateway.tenants.limits import KeyLimits, Refusal

ROUND = 0.25


class Store:
    """The shared buckets as the store keeps them: (level, at) per (name, kind)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], tuple[float, float]] = {}

    def lease(self, asks: list[Ask], now: float) -> list[Grant]:
        grants = []
        for ask in asks:
            level, at = self.rows.get((ask.name, ask.kind), (None, None))
            grant = draw(level, at, ask, now)
            self.rows[(ask.name, ask.kind)] = (grant.level, now)
            grants.append(grant)
        return grants


def process(limits: TenantLimits, leasing: Leasing, now: float = 0.0) -> KeyLimits:
    lease = KeyLease("team-a", leasing, now, limits.requests_per_minute,
                     limits.input_tokens_per_minute, limits.output_tokens_per_minute)
    return KeyLimits(limits, now, lease)


def round_of(store: Store, limits: KeyLimits, now: float) -> None:
    """One process's batch, settled at once (the store's clock is the processes')."""
    assert limits.lease is not None
    pairs = limits.lease.asks(now)
    for (piece, _), grant in zip(pairs, store.lease([ask for _, ask in pairs], now),
                                 strict=True):
        piece.settled(grant, now)


def ask(capacity: float = 60.0, sent: float = 0.0, want: float = 0.0,
        unit: float = 1.0) -> Ask:
    return Ask("team-a", "requests", capacity, sent, want, unit)


def test_the_shared_bucket_refills_takes_debts_and_grants_at_most_a_share_of_its_level(
) -> None:
    assert draw(None, None, ask(want=100.0), 0.0) == Grant(60.0 / SPREAD, 60.0 - 60.0 / SPREAD)
    assert draw(0.0, 0.0, ask(want=5.0), 30.0) == Grant(5.0, 25.0)  # refilled 1 a second
    assert draw(50.0, 0.0, ask(), 600.0) == Grant(0.0, 60.0)  # never past the limit
    assert draw(2.0, 0.0, ask(sent=-5.0, want=1.0), 0.0) == Grant(0.0, -3.0)  # owed: taken
    assert draw(10.0, 0.0, ask(sent=4.0), 0.0) == Grant(0.0, 14.0)  # given back
    # near the limit: one request's worth while the bucket holds it, then what is left
    assert draw(2.0, 0.0, ask(want=10.0), 0.0) == Grant(1.0, 1.0)
    assert draw(0.5, 0.0, ask(want=10.0), 0.0) == Grant(0.5, 0.0)
    assert draw(0.0, 0.0, ask(want=10.0), 0.0) == Grant(0.0, 0.0)


def admit_round_robin(processes: list[KeyLimits], store: Store, *, steps: int,
                      step: float, output: int = 0) -> tuple[int, int]:
    """A client sends one request every `step` seconds to the processes in turn, each
    settled at once with `output` tokens; each process runs its round every `ROUND` seconds
    and at once when its request asked for one. (admitted, admitted from a slice held before
    the request came)."""
    admitted = from_slice = 0
    next_round = [0.0] * len(processes)
    for n in range(steps):
        now = n * step
        for index, limits in enumerate(processes):
            if now >= next_round[index]:
                round_of(store, limits, now)
                next_round[index] = now + ROUND
        limits = processes[n % len(processes)]
        assert limits.lease is not None
        held = limits.lease.slices[0].held
        verdict = limits.admit(now, 0)
        if isinstance(verdict, Refusal):
            continue
        admitted += 1
        from_slice += held >= (1.0 if limits.lease.requests is not None else 1e-9)
        limits.settle(now, 0, 0, output, leased=True)
        if limits.lease.wanted:  # the gate wakes the round: it runs right after
            round_of(store, limits, now + step / 10)
            next_round[n % len(processes)] = now + step / 10 + ROUND
    return admitted, from_slice


def test_three_processes_admit_one_limit_within_five_percent() -> None:
    """60 a minute; 300 requests in 3 s round the three: one bucket admits 60 plus the 3 s
    of refill (3), not three times that."""
    leasing, store = Leasing(), Store()
    processes = [process(TenantLimits(requests_per_minute=60), leasing) for _ in range(3)]
    admitted, from_slice = admit_round_robin(processes, store, steps=300, step=0.01)
    one_bucket = 60 + 3
    assert one_bucket * 0.95 <= admitted <= one_bucket * 1.05
    assert from_slice >= admitted * 0.5  # most never waited for, nor borrowed from, a round


def test_without_leases_each_process_holds_the_whole_limit() -> None:
    """What the leases change: the same traffic on three lone processes takes three limits
    (the store down under `store_down: open`, the leases off)."""
    leasing, store = Leasing(), Store()
    leasing.up = False
    processes = [process(TenantLimits(requests_per_minute=60), leasing) for _ in range(3)]
    admitted, _ = admit_round_robin(processes, store, steps=300, step=0.01)
    assert admitted >= 180


def test_three_processes_hold_one_output_token_limit() -> None:
    """Output tokens are charged at each request's end (a process may go into debt, paid
    to the shared bucket at its next round): 400 a minute, 4 a request."""
    leasing, store = Leasing(), Store()
    processes = [process(TenantLimits(output_tokens_per_minute=400), leasing)
                 for _ in range(3)]
    admitted, _ = admit_round_robin(processes, store, steps=600, step=0.005, output=4)
    one_bucket = (400 + 400 / 60 * 3) / 4  # requests of 4 tokens
    assert admitted <= one_bucket * 1.05 + 3  # + one request each in debt at the end
    assert admitted >= 400 / 4 * 0.95


def test_a_slice_is_large_while_the_bucket_is_full_and_one_request_near_the_limit() -> None:
    leasing, store = Leasing(), Store()
    limits = process(TenantLimits(requests_per_minute=600), leasing)
    assert limits.lease is not None and limits.lease.requests is not None
    piece = limits.lease.requests
    for n in range(100):  # 100 a second
        assert not isinstance(limits.admit(n * 0.01, 0), Refusal)
        if limits.lease.wanted:
            round_of(store, limits, n * 0.01)
    assert piece.held > 10  # prefetched: about a second of its own rate
    store.rows[("team-a", "requests")] = (3.0, 1.0)  # others drained it
    for n in range(200):
        now = 1.0 + n * 0.001
        if isinstance(limits.admit(now, 0), Refusal):
            break
        if limits.lease.wanted:
            round_of(store, limits, now)
    assert piece.held <= 1.0 + 1e-9


def test_a_request_is_borrowed_once_then_refused_until_the_round() -> None:
    """The request path never waits: with no slice, a request the bucket (as last seen)
    holds is borrowed and a round asked for; a second one before it is refused with a
    retry after a round."""
    leasing, store = Leasing(), Store()
    limits = process(TenantLimits(requests_per_minute=60), leasing)
    assert limits.lease is not None
    assert not isinstance(limits.admit(0.0, 0), Refusal)
    assert limits.lease.wanted
    refused = limits.admit(0.001, 0)
    assert isinstance(refused, Refusal) and refused.kind == "requests"
    assert refused.retry_after == ROUND_RETRY
    round_of(store, limits, 0.01)
    assert not isinstance(limits.admit(0.02, 0), Refusal)
    level, _ = store.rows[("team-a", "requests")]
    assert limits.lease.requests is not None
    # the borrowed request paid to the bucket, the second taken from the slice granted
    assert level + limits.lease.requests.held == pytest.approx(60.0 - 2.0)


def test_an_idle_slice_is_given_back() -> None:
    leasing, store = Leasing(), Store()
    limits = process(TenantLimits(requests_per_minute=600), leasing)
    assert limits.lease is not None and limits.lease.requests is not None
    for n in range(50):
        limits.admit(n * 0.01, 0)
        round_of(store, limits, n * 0.01)
    held = limits.lease.requests.held
    assert held > 0
    round_of(store, limits, 0.6)  # nothing taken since: not idle long enough yet
    assert limits.lease.requests.held == held
    round_of(store, limits, 0.6 + IDLE)
    assert limits.lease.requests.held == 0
    level, _ = store.rows[("team-a", "requests")]
    assert level >= 600.0 - 50  # all but the 50 taken is in the bucket again


def test_a_failed_round_gives_the_slice_back_what_it_sent() -> None:
    leasing = Leasing()
    limits = process(TenantLimits(requests_per_minute=60), leasing)
    assert limits.lease is not None and limits.lease.requests is not None
    limits.admit(0.0, 0)  # borrowed: owes one
    ((piece, sent),) = limits.lease.asks(0.01)
    assert sent.sent == -1.0 and piece.held == 0.0
    piece.failed(sent)
    assert piece.held == -1.0 and not piece.pending  # still owed, asked again next round
    assert limits.lease.asks(0.02)[0][1].sent == -1.0
    piece.failed(sent)
    piece.borrowed = False  # however it came to owe, a debt is paid at the next round
    assert limits.lease.asks(0.03)[0][1].sent == -1.0


def test_the_last_batch_gives_every_slice_back_and_pays_every_debt() -> None:
    leasing, store = Leasing(), Store()
    limits = process(TenantLimits(requests_per_minute=60, output_tokens_per_minute=100),
                     leasing)
    assert limits.lease is not None
    limits.admit(0.0, 0)
    round_of(store, limits, 0.01)
    limits.settle(0.02, 0, 0, 30, leased=True)  # output owed beyond its slice
    pairs = limits.lease.asks(0.03, last=True)
    assert sorted(ask.kind for _, ask in pairs) == ["output_tokens", "requests"]
    for (piece, _), grant in zip(pairs, store.lease([ask for _, ask in pairs], 0.03),
                                 strict=True):
        piece.settled(grant, 0.03)
    assert all(piece.held == 0 for piece in limits.lease.slices)
    requests, _ = store.rows[("team-a", "requests")]
    output, _ = store.rows[("team-a", "output_tokens")]
    assert requests == pytest.approx(60 - 1 + 0.03, abs=0.01)  # one admitted, refilled since
    # first drawn at the round at 0.01 (the admission found the output slice empty and
    # borrowed: `Slice.reserve`): full, less the debt, refilled since
    assert output == pytest.approx(100 - 30 + 0.02 * 100 / 60)


def test_output_admitted_while_the_store_is_down_owes_the_shared_bucket_nothing() -> None:
    """Five minutes of a store outage at the key's own output rate: each request is
    admitted from the process's own bucket, so its output is charged there only; the first
    round after the outage pays no debt and the next request passes (charged to the slice,
    the outage's output would be taken from the shared bucket at that round, refusing the
    key for minutes)."""
    leasing, store = Leasing(), Store()
    limits = process(TenantLimits(output_tokens_per_minute=6000), leasing)
    assert limits.lease is not None and limits.lease.output is not None
    round_of(store, limits, 0.0)
    leasing.up = False  # the store is down (`server.store_down: open`)
    admitted, now = 0, 0.0
    while now < 300.0:
        assert not isinstance(limits.admit(now, 10), Refusal)  # its own bucket's rate
        leased = limits.leased()
        assert not leased
        admitted += 1
        limits.settle(now + 0.5, 10, 10, 100, leased=leased)
        for piece, sent in limits.lease.asks(now):  # every round fails
            piece.failed(sent)
        now += 1.0
    assert admitted == 300 and limits.lease.output.held >= 0  # no debt piled up
    leasing.up = True
    round_of(store, limits, now)
    level, _ = store.rows.get(("team-a", "output_tokens"), (6000.0, now))  # absent: full
    assert level > 0
    assert not isinstance(limits.admit(now + 1.0, 10), Refusal)


def test_a_request_settled_or_refunded_goes_to_the_slices_only_when_they_admitted_it(
        ) -> None:
    """Admitted while the store was down, a request's input correction and its refund touch
    no slice; admitted by the slices, its end is charged to them though the store has gone
    down since (a debt the shared bucket is owed)."""
    leasing = Leasing()
    limits = process(TenantLimits(requests_per_minute=60, input_tokens_per_minute=1000,
                                  output_tokens_per_minute=1000), leasing)
    lease = limits.lease
    assert lease is not None and lease.requests is not None and lease.input is not None
    assert lease.output is not None
    leasing.up = False
    assert not isinstance(limits.admit(0.0, 10), Refusal)
    limits.settle(0.1, 10, 50, 7, leased=limits.leased())  # the upstream counted 50
    assert not isinstance(limits.admit(0.2, 10), Refusal)
    leasing.up = True  # back before the request ends
    limits.refund(0.3, 10, leased=False)  # as admitted: without the slices
    assert (lease.requests.held, lease.input.held, lease.output.held) == (0.0, 0.0, 0.0)
    assert not isinstance(limits.admit(0.4, 10), Refusal)
    leased = limits.leased()
    leasing.up = False  # down before the request ends
    limits.settle(0.5, 10, 10, 7, leased=leased)
    assert lease.requests.held == -1.0 and lease.output.held == -7.0


def test_an_output_slice_that_holds_nothing_asks_before_admitting_a_second_request() -> None:
    """Output is charged at a request's end, so an admission takes nothing of its slice; a
    process whose output slice holds nothing borrows the request (a round at once) and
    refuses the next until that round, which shows it the shared bucket drained by another
    process: it admits one answer on a stale view, not fifty."""
    store = Store()
    limits = TenantLimits(output_tokens_per_minute=6000)
    busy, idle = process(limits, Leasing()), process(limits, Leasing())
    now = 0.0
    for step in range(80):  # `busy` answers 1000 tokens a second for 20 s
        if step % 4 == 0 and not isinstance(busy.admit(now, 10), Refusal):
            busy.settle(now, 10, 10, 1000, leased=True)
        round_of(store, busy, now)
        round_of(store, idle, now)
        now += ROUND
    level, at = store.rows[("team-a", "output_tokens")]
    assert level + (now - at) * 6000 / 60 <= 0  # drained: in debt until now
    admitted = sum(not isinstance(idle.admit(now, 10), Refusal) for _ in range(50))
    assert admitted == 1
    assert idle.lease is not None and idle.lease.wanted
    round_of(store, idle, now)
    assert idle.lease.output is not None and idle.lease.output.known <= 0  # seen drained
    refused = idle.admit(now, 10)
    assert isinstance(refused, Refusal) and refused.kind == "output_tokens"
