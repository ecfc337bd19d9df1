"""One error tree for the whole gateway.

Everything that can go wrong is one of these, so the HTTP layer turns any failure into an
OpenAI-shaped error with a fitting status, and nothing escapes as a 500 with a stack trace.
Upstream exceptions (aiohttp's, the simulator's) are translated into `UpstreamError` at the
provider boundary; nothing above `providers/` ever sees an httpx exception.

Messages never contain provider keys, upstream URLs or upstream error bodies: an upstream's
body can hold internal hostnames or echo a key, so we keep only its status and a short class.

Two trees, and each class carries its facts as class attributes:
- `GatewayError`: what a client is answered with: `status`, `type`, `code` (the OpenAI error
  fields; the code is also the request's error class in stats and metrics);
- `UpstreamError`: why one attempt failed: `code` (the failure class counted per backend)
  and `replaceable` (whether another backend could do better).
An instance adds only its own detail (message, reason, retry_after). Where a fact depends on a
value, as an upstream status does, a factory (`of`) picks the subclass that states it. The
OpenAI error JSON itself is built in one place, `error_body`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

# the attempt-level tree lives in gateway.failures; re-exported so both trees import from here
from gateway.failures import GatewayPoolFull as GatewayPoolFull
from gateway.failures import InternalAttemptError as InternalAttemptError
from gateway.failures import UpstreamAuthFailed as UpstreamAuthFailed
from gateway.failures import UpstreamConnectError as UpstreamConnectError
from gateway.failures import UpstreamConnectTimeout as UpstreamConnectTimeout
from gateway.failures import UpstreamDisconnected as UpstreamDisconnected
from gateway.failures import UpstreamError as UpstreamError
from gateway.failures import UpstreamInBandError as UpstreamInBandError
from gateway.failures import UpstreamNotFound as UpstreamNotFound
from gateway.failures import UpstreamNoToken as UpstreamNoToken
from gateway.failures import UpstreamProtocolError as UpstreamProtocolError
from gateway.failures import UpstreamRateLimited as UpstreamRateLimited
from gateway.failures import UpstreamRejectedRequest as UpstreamRejectedRequest
from gateway.failures import UpstreamServerError as UpstreamServerError
from gateway.failures import UpstreamStatusError as UpstreamStatusError
from gateway.failures import UpstreamTimeout as UpstreamTimeout
from gateway.failures import UpstreamUnavailable as UpstreamUnavailable
from gateway.failures import failure_codes as failure_codes


def error_body(
    message: str,
    *,
    type: str,
    code: str | None,
    param: str | None = None,
    request_id: str | None = None,
) -> dict[str, object]:
    """The OpenAI error object `{"error": {message, type, param, code}}`, which the SDKs parse
    into their exceptions. Every error the gateway (or its simulator) sends is built here:
    HTTP answers, final in-stream events, the server's 431. `request_id`, when given, is
    quoted in the message, for the failures a client reports to an operator."""
    if request_id is not None:
        message = f"{message} (request id {request_id})"
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class GatewayError(Exception):
    """Base of every error the gateway answers a client with."""

    status: int = 500
    type: str = "api_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.should_retry = should_retry
        #: what must run once this error was answered (the end of the logical request: reap
        #: its attempts, record it); the HTTP error handler runs it after sending the answer
        self.after_response: Callable[[], Awaitable[None]] | None = None

    def body(self, request_id: str | None = None) -> dict[str, object]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param,
                          request_id=request_id)


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ForbiddenField(InvalidRequest):
    """A body field that could choose a destination or a credential (SPEC §3)."""

    code = "forbidden_field"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RouteNotServed(GatewayError):
    """The pool has no backend whose provider serves the request's route (SPEC §15)."""

    status = 404
    type = "invalid_request_error"
    code = "route_not_served"


class ResponseNotFound(GatewayError):
    """A stored-response id this gateway did not relay (or has forgotten) (SPEC §15)."""

    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


class RouteNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RequestTimeout(GatewayError):
    """The request's head and body did not arrive within `server.body_timeout` (SPEC §18)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class HeadersTooLarge(GatewayError):
    """The request line and headers crossed `server.max_headers` (sent by the server itself,
    before any route runs)."""

    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"


class Overloaded(GatewayError):
    status = 503
    type = "server_error"
    code = "overloaded"


class TooManyConnections(Overloaded):
    """A new connection past `server.max_connections` (SPEC §18)."""

    code = "too_many_connections"


class AllAttemptsFailed(GatewayError):
    """Every attempt of a logical request failed before its first token (502)."""

    status = 502
    type = "upstream_error"
    code = "upstream_failed"

    def __init__(self, reasons: Sequence[str]) -> None:
        detail = "; ".join(reasons) if reasons else "no backend available"
        super().__init__(f"all upstream attempts failed: {detail}", should_retry=False)
        self.reasons = tuple(reasons)


class UpstreamPushback(GatewayError):
    """Every attempt was refused with a pushback: a 429 or 503 carrying a Retry-After (SPEC
    §19). The client gets 429 when all were 429, else 503, and the smallest pause as its own
    Retry-After, without `x-should-retry: false`: the upstreams said when to come back, and
    an SDK that waits that long and retries is what they asked for. Build it with `of`."""

    status = 503
    type = "server_error"
    code = "upstream_pushback"

    def __init__(self, reasons: Sequence[str], retry_after: float) -> None:
        detail = "; ".join(reasons)
        super().__init__(
            f"every upstream asked to retry later: {detail}", retry_after=retry_after
        )
        self.reasons = tuple(reasons)

    @classmethod
    def of(cls, status: int, reasons: Sequence[str], retry_after: float) -> UpstreamPushback:
        kind = UpstreamRateLimitedEverywhere if status == 429 else UpstreamPushback
        return kind(reasons, retry_after)


class UpstreamRateLimitedEverywhere(UpstreamPushback):
    """Every attempt answered 429 with a Retry-After: the client gets 429 too."""

    status = 429
    type = "rate_limit_error"


class NoBackendAvailable(GatewayError):
    """No backend could take the request (all at `max_concurrency`), so nothing was tried:
    503 with `Retry-After: 1` (SPEC §19), never 502, since no upstream failed."""

    status = 503
    type = "server_error"
    code = "no_backend_available"

    def __init__(self) -> None:
        super().__init__(
            "no backend of the pool can take the request now (all at their concurrency limit)",
            retry_after=1.0,
        )


class UpstreamClientError(GatewayError):
    """An upstream refused the request itself (400/413/422): it would fail everywhere.

    The client gets the upstream's status: one subclass per status, chosen by `of`."""

    status = 400
    type = "invalid_request_error"
    code = "upstream_rejected_request"

    def __init__(self, backend: str) -> None:
        super().__init__(
            f"the upstream rejected the request with status {self.status} (backend {backend})",
            should_retry=False,
        )

    @classmethod
    def of(cls, status: int, backend: str) -> UpstreamClientError:
        """The error for an upstream status that describes the request (400 if unknown)."""
        for sub in UpstreamClientError.__subclasses__():
            if sub.status == status:
                return sub(backend)
        return UpstreamClientError(backend)


class UpstreamRejectedTooLarge(UpstreamClientError):
    status = 413


class UpstreamRejectedUnprocessable(UpstreamClientError):
    status = 422


class UpstreamRejectedNotFound(UpstreamClientError):
    """The one backend holding a stored response no longer has it (SPEC §15)."""

    status = 404


class UpstreamRejectedConflict(UpstreamClientError):
    """The one backend holding a stored response refused the operation (SPEC §15)."""

    status = 409


class FirstTokenTimeout(GatewayError):
    """No first token before the request's deadline (504)."""

    status = 504
    type = "timeout_error"
    code = "first_token_timeout"

    def __init__(self, reasons: Sequence[str] = ()) -> None:
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        super().__init__(f"no first token before the deadline{detail}", should_retry=False)
        self.reasons = tuple(reasons)


# --- the answer when every attempt failed ----------------------------------------------------


#: upstream statuses whose Retry-After is a pushback: "busy, come back later"
PUSHBACK_STATUSES = (429, 503)


def all_attempts_failed(
    reasons: Sequence[str],
    failures: Sequence[UpstreamError],
    cap: Callable[[float], float],
) -> GatewayError:
    """The answer when every attempt failed before its first token (SPEC §5.4, §19).

    All pushbacks: `UpstreamPushback` with the smallest pause, bounded by `cap` (the pool's
    `max_pause`); anything else among them (a reset, a 500, a pushback without Retry-After):
    502 `AllAttemptsFailed`, since retrying soon would likely fail the same way.
    """
    pauses = [
        f.retry_after for f in failures
        if isinstance(f, UpstreamStatusError) and f.status in PUSHBACK_STATUSES
        and f.retry_after is not None
    ]
    if not failures or len(pauses) != len(failures):
        return AllAttemptsFailed(reasons)
    only_429 = all(isinstance(f, UpstreamStatusError) and f.status == 429 for f in failures)
    return UpstreamPushback.of(429 if only_429 else 503, reasons, cap(min(pauses)))
