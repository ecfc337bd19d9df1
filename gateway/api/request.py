"""One logical request, as a route hands it to the proxy.

What a route hands the proxy (`LogicalRequest`: the body, the route's wire rules, the upstream
call details, the commit hook); the proxy (`gateway.api.proxy`) admits it. The decisions made
from it and the pool alone before any attempt are taken once each: which backends may serve it
(`gateway.hedge.routing`, before admission), and its plan (may it be hedged, its conversation
key and backend order, its deadline: `gateway.hedge.plan`, after).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.hedge.deadline import KeyShare
from gateway.wire.base import Rewrite, WireProtocol
from gateway.wire.paths import Endpoint
from gateway.wire.sse import SSEEvent


@dataclass(frozen=True, slots=True)
class LogicalRequest:
    request_id: str
    endpoint: Endpoint
    body: Mapping[str, Any]
    stream: bool
    headers: Mapping[str, str]
    #: the route's wire rules: first token, end of stream, error shapes (the route table's
    #: entry for its route, `gateway.api.inference`: no default of one API)
    protocol: WireProtocol
    #: delay-triggered hedges refused by the route's own rule (the Responses store rules)
    stateful: bool = False
    #: one backend at a time, not hedged and not counted as refused (count_tokens)
    single: bool = False
    #: the only backend this request may use (the one holding its stored response)
    pinned: str | None = None
    #: upstream call details beyond the body (method, path, query, passed-through headers)
    method: str = "POST"
    path: str | None = None
    query: tuple[tuple[str, str], ...] = ()
    forward_headers: Mapping[str, str] = field(default_factory=dict)
    #: called once at commit with the winner's backend and buffered events; what it returns
    #: rewrites the named events it lists and a whole body (the Responses API's response id)
    on_commit: Callable[[str, list[SSEEvent]], Rewrite | None] | None = None
    #: False for a read of stored state (a stored response, its cancel): its body repeats a
    #: past generation's usage and its quick answer is no time to first token, so it counts
    #: no tokens and feeds neither the TTFT quantiles nor the hedge-delay trackers
    metered: bool = True
    #: for the request log: the client's route as the route table writes it, and the model
    #: it sent, already loggable (`gateway.stats.loggable`)
    route: str | None = None
    model: str | None = None
    #: the body's size as received (its input tokens are estimated from it); None: unknown
    body_bytes: int | None = None
    #: the name of the client's named key (`keys:`), for the request log; never the key
    key: str | None = None
    #: False: the client's key turned delay-triggered hedges off (`keys[].hedging.enabled`)
    hedging: bool = True
    #: the request's TTFT objective in seconds: the tighter of its key's and its
    #: `x-slo-ttft-ms` header's (None: none); its hedge may go early for it
    objective: float | None = None
    #: the named key's share of the hedge budget that pays for early hedges (None: no key)
    share: KeyShare | None = None
    #: the named key's own `hedging.ratio` (None: the pool's)
    share_ratio: float | None = None
