"""What a request's key allows once its body has named the pool: the pool itself (a key may
be limited to some), and the request's TTFT objective with who pays for its early hedges.

Apart from `gateway.api.tenancy`, which checks the key before any of the body is read: the two
are two moments of the request (the body's read between them), and a file holding both was
entered twice by each request's walk (`docs/architecture.md`, "A request's walk"). Pure: no
I/O, the tenant and the headers are handed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from gateway.errors import ModelNotFound
from gateway.hedge.deadline import OBJECTIVE_HEADER, KeyShare, request_objective
from gateway.tenants.registry import Tenant

#: what a request for a pool its key may not use is told: the same as for a pool that does not
#: exist, so a key cannot learn which pools other keys use
NOT_FOUND = "the model does not exist in this gateway; GET /v1/models lists them"


def check_pool(tenant: Tenant | None, pool: str) -> None:
    """A named key asking for a pool it may not use is answered as for an unknown model."""
    if tenant is not None and not tenant.may_use(pool):
        raise ModelNotFound(NOT_FOUND, param="model")


class Deadline(NamedTuple):
    """A request's TTFT objective and who pays for the hedges it sends early."""

    #: seconds; None: no objective
    objective: float | None
    #: the named key's share of the hedge budget (None: no named key: no early hedge)
    share: KeyShare | None
    #: the key's own `hedging.ratio` (None: the pool's)
    ratio: float | None
    #: headers to send upstream: the objective in force as `x-slo-ttft-ms`, for in-cluster
    #: schedulers (the key's when it is the tighter: they see what the gateway holds it to)
    forward: dict[str, str]


def key_terms(tenant: Tenant | None, pool: str, headers: Mapping[str, str]) -> Deadline:
    """What the request's key says once the body has named its pool: refused as an unknown
    model when the key may not use it (`check_pool`), else the request's objective
    (`deadline_of`). One call for the route, after its body's checks."""
    check_pool(tenant, pool)
    return deadline_of(tenant, headers)


def deadline_of(tenant: Tenant | None, headers: Mapping[str, str]) -> Deadline:
    """The request's objective: the tighter of its key's `ttft_objective` and its
    `x-slo-ttft-ms` header (a malformed header is ignored: `header_objective`)."""
    key = None if tenant is None else tenant.settings.ttft_objective
    seconds = request_objective(key, headers.get(OBJECTIVE_HEADER))
    forward = {} if seconds is None else {OBJECTIVE_HEADER: str(max(1, round(seconds * 1000)))}
    if tenant is None:
        return Deadline(seconds, None, None, forward)
    return Deadline(seconds, tenant.share, tenant.settings.hedging.ratio, forward)
