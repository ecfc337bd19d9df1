"""One error tree for the whole gateway.

Everything that can go wrong is one of these, so the HTTP layer turns any failure into an
OpenAI-shaped error with a fitting status, and nothing escapes as a 500 with a stack trace.
Upstream exceptions (httpx's, the simulator's) are translated into `UpstreamError` at the
provider boundary; nothing above `providers/` ever sees an httpx exception.

Messages never contain provider keys, upstream URLs or upstream error bodies: an upstream's
body can hold internal hostnames or echo a key, so we keep only its status and a short class.
"""

from __future__ import annotations

from collections.abc import Sequence


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

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


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


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class Overloaded(GatewayError):
    status = 503
    type = "server_error"
    code = "overloaded"


class AllAttemptsFailed(GatewayError):
    """Every attempt of a logical request failed before its first token (502)."""

    status = 502
    type = "upstream_error"
    code = "upstream_failed"

    def __init__(self, reasons: Sequence[str]) -> None:
        detail = "; ".join(reasons) if reasons else "no backend available"
        super().__init__(f"all upstream attempts failed: {detail}", should_retry=False)
        self.reasons = tuple(reasons)


class UpstreamClientError(GatewayError):
    """An upstream refused the request itself (400/413/422): it would fail everywhere."""

    type = "invalid_request_error"
    code = "upstream_rejected_request"

    def __init__(self, status: int, backend: str) -> None:
        super().__init__(
            f"the upstream rejected the request with status {status} (backend {backend})",
            should_retry=False,
        )
        self.status = status


class FirstTokenTimeout(GatewayError):
    """No first token before the request's deadline (504)."""

    status = 504
    type = "timeout_error"
    code = "first_token_timeout"

    def __init__(self, reasons: Sequence[str] = ()) -> None:
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        super().__init__(f"no first token before the deadline{detail}", should_retry=False)
        self.reasons = tuple(reasons)


# --- attempt-level failures, raised by providers and the attempt runner --------------------


class UpstreamError(Exception):
    """One attempt failed. Not sent to clients as such: the race decides what to do."""

    #: whether another backend could succeed where this one failed
    replaceable: bool = True

    def __init__(self, reason: str, *, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class UpstreamConnectError(UpstreamError):
    """Connection refused, DNS failure, connect timeout."""


class UpstreamTimeout(UpstreamError):
    """A read or write on the upstream took longer than allowed."""


class UpstreamStatusError(UpstreamError):
    """The upstream answered with a status other than 200."""

    def __init__(self, status: int, *, retry_after: float | None = None) -> None:
        super().__init__(f"status {status}", retry_after=retry_after)
        self.status = status
        # 400/413/422 describe the request, not the backend: it would fail everywhere.
        self.replaceable = status not in (400, 413, 422)


class UpstreamProtocolError(UpstreamError):
    """The upstream broke the stream: reset, bad framing, wrong content type, oversize line."""


class UpstreamInBandError(UpstreamError):
    """The upstream reported an error inside the stream (error event, finish_reason error)."""


class UpstreamNoToken(UpstreamError):
    """The stream ended before any token."""
