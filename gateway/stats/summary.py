"""What one logical request leaves behind for the stats, the request log, the traces and the
recent races: written by the proxy as the request runs, read once at its end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.hedge.budget import SuppressReason
from gateway.hedge.sizing import RequestSize
from gateway.wire.base import RelayOutcome, StreamEnd
from gateway.wire.usage import Usage

if TYPE_CHECKING:
    from gateway.hedge.attempt import AttemptRecord, ContinuationCounts
    from gateway.hedge.race import RaceResult


@dataclass(slots=True)
class RequestSummary:
    """Everything the stats and the request log need about one logical request."""

    request_id: str
    pool: str
    endpoint: str
    stream: bool
    started: float
    attempts: Sequence[AttemptRecord] = ()
    suppressed: Sequence[SuppressReason] = ()
    winner: AttemptRecord | None = None
    committed_at: float | None = None
    ended: float | None = None
    error: str | None = None
    relay_end: StreamEnd | None = None
    #: tokens of the winning attempt, when its response reported usage
    usage: Usage | None = None
    #: a stream's events relayed to the client (`RelayOutcome.events`): its output, one token
    #: per event, where `usage` is None; None for an answer that was not streamed
    relayed: int | None = None
    #: a backend choice of this request ran in panic mode
    panic: bool = False
    #: False for a read of stored state: no tokens, no TTFT samples (`LogicalRequest.metered`)
    metered: bool = True
    #: how affinity chose the primary: "hit", "spill", "miss"; None when the pool has it off
    affinity: str | None = None
    #: the client's route as the route table writes it (`/v1/responses/{response_id}`)
    route: str | None = None
    method: str = "POST"
    #: the model name the client sent, already made loggable (`gateway.stats.loggable`)
    model: str | None = None
    #: the name of the client's named key (`keys:`); None: none, or a key without a name
    key: str | None = None
    #: the HTTP status the client was answered with (499: it left before the first token)
    status: int | None = None
    #: the machine reason of an error answer (`GatewayError.log_reason`); None: the outcome
    reason: str | None = None
    #: the backends its choices left out for low quota headroom, once per choice
    headroom_skips: Sequence[str] = ()
    #: the request's estimated input, all of it and at its conversation's home (None: unknown)
    size: RequestSize | None = None
    #: what its continuations did after commit (None: it could have none)
    continuations: ContinuationCounts | None = None
    #: what the request cost in US dollars, its losing attempts included (None: not priced);
    #: set by the request's end (`gateway.stats.spend`)
    cost: float | None = None
    #: its answer came from a backend of another API: `client->backend` (`chat->messages`)
    translated: str | None = None
    #: its TTFT objective in seconds (None: none): met or missed, counted per key
    objective: float | None = None

    def take_relayed(self, outcome: RelayOutcome) -> None:
        """What the relay of a streamed answer counted (its usage, the events it relayed),
        taken as the stream is complete (`gateway.wire.base.Hooks`): before the client can see
        its end, when a client key's charge reads them (`gateway.api.tenancy`)."""
        self.usage, self.relayed = outcome.usage, outcome.events

    def attach(
        self,
        attempts: Sequence[AttemptRecord],
        suppressed: Sequence[SuppressReason],
        result: RaceResult | None,
    ) -> None:
        self.attempts = attempts
        self.suppressed = suppressed
        if result is not None:
            self.winner = result.winner
            self.committed_at = result.committed_at

    @property
    def client_ttft(self) -> float | None:
        return None if self.committed_at is None else self.committed_at - self.started

    @property
    def objective_met(self) -> bool | None:
        """Whether its first token came within its objective; None without an objective or
        when the client left first (499: the gateway's answer was never due)."""
        if self.objective is None or self.status == 499:
            return None
        ttft = self.client_ttft
        return ttft is not None and ttft <= self.objective

    @property
    def deadline_hedges(self) -> int:
        """Hedges sent early for its objective."""
        return sum(a.deadline for a in self.attempts)
