"""Why one attempt failed: the `UpstreamError` tree (the second tree of `gateway.errors`).

Providers translate their transport's exceptions into these at their boundary, and the attempt
runner raises them for what it reads; the race decides what each means for the request. Each
class carries its `code`: the failure class the stats count per backend (`failures.<code>`),
`/metrics` labels (`attempt_failures_total{code}`) and the request log writes
(`attempts[].failure`). One code per class, so the set is bounded by this tree
(`failure_codes()`); the README's Observability section lists it. The `reason` is the
human-readable detail, for the client's 502 and the request log, never for counting.

`gateway.errors` re-exports every name here, so both trees import from one place.
"""

from __future__ import annotations

from typing import ClassVar


class UpstreamError(Exception):
    """One attempt failed. Not sent to clients as such: the race decides what to do."""

    code: str = "upstream_error"
    #: whether another backend could succeed where this one failed
    replaceable: bool = True
    #: whether the failure counts against the backend's health (SPEC §7); False when the
    #: gateway itself failed the attempt
    backend_fault: bool = True

    def __init__(self, reason: str, *, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class InternalAttemptError(UpstreamError):
    """A bug of the gateway's inside an attempt: not the backend's fault."""

    code = "internal_error"


class UpstreamConnectError(UpstreamError):
    """Connection refused, DNS failure."""

    code = "connect_error"


class UpstreamConnectTimeout(UpstreamConnectError):
    """No connection (or no free pooled connection) within `timeouts.connect`."""

    code = "connect_timeout"


class GatewayPoolFull(UpstreamError):
    """No free connection in the gateway's own upstream pool in time (`GatewayPoolFull`).

    The backend was never asked, so this must not eject it: a full pool on our side would
    otherwise take healthy backends out one after another. Another backend may still be
    tried (the pool is shared, but a connection may free up meanwhile)."""

    code = "gateway_pool_full"
    backend_fault = False


class UpstreamTimeout(UpstreamError):
    """A read or write on the upstream took longer than allowed."""

    code = "read_timeout"


class UpstreamStatusError(UpstreamError):
    """The upstream answered with a status other than 200. Build it with `of(status)`, which
    picks the subclass that says what the status means (and whether it is replaceable);
    this class itself is every status no subclass claims (redirects, 408, other 4xx)."""

    code = "bad_status"
    #: the statuses a subclass stands for
    statuses: ClassVar[frozenset[int]] = frozenset()

    def __init__(self, status: int, *, retry_after: float | None = None) -> None:
        super().__init__(f"status {status}", retry_after=retry_after)
        self.status = status

    @classmethod
    def of(cls, status: int, *, retry_after: float | None = None) -> UpstreamStatusError:
        for sub in UpstreamStatusError.__subclasses__():
            if status in sub.statuses:
                return sub(status, retry_after=retry_after)
        return UpstreamStatusError(status, retry_after=retry_after)


class UpstreamRejectedRequest(UpstreamStatusError):
    """400/413/422 describe the request, not the backend: it would fail everywhere."""

    code = "request_rejected"
    replaceable = False
    statuses = frozenset({400, 413, 422})


class UpstreamAuthFailed(UpstreamStatusError):
    """401/403: this backend's key or permissions are wrong."""

    code = "auth_failed"
    statuses = frozenset({401, 403})


class UpstreamNotFound(UpstreamStatusError):
    """404: this backend does not serve the route or the model (a configuration error)."""

    code = "not_found"
    statuses = frozenset({404})


class UpstreamRateLimited(UpstreamStatusError):
    code = "rate_limited"
    statuses = frozenset({429})


class UpstreamUnavailable(UpstreamStatusError):
    code = "unavailable"
    statuses = frozenset({503})


class UpstreamServerError(UpstreamStatusError):
    """Any other 5xx."""

    code = "server_error"
    statuses = frozenset(range(500, 600)) - {503}


class UpstreamProtocolError(UpstreamError):
    """The upstream broke the protocol: bad framing, wrong content type or encoding, an
    oversize line or body, a body that is not JSON."""

    code = "protocol_error"


class UpstreamDisconnected(UpstreamProtocolError):
    """The upstream closed or reset the connection before the response was complete."""

    code = "connection_reset"


class UpstreamInBandError(UpstreamError):
    """The upstream reported an error inside the stream (error event, finish_reason error)."""

    code = "error_event"


class UpstreamNoToken(UpstreamError):
    """The stream ended before any token."""

    code = "no_token"


def failure_codes() -> frozenset[str]:
    """Every attempt failure code: one per class of the `UpstreamError` tree."""
    codes: set[str] = set()
    pending: list[type[UpstreamError]] = [UpstreamError]
    while pending:
        cls = pending.pop()
        codes.add(cls.code)
        pending.extend(cls.__subclasses__())
    return frozenset(codes)
