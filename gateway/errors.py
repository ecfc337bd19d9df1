"""One error tree for the whole gateway.

Everything that can go wrong is one of these, so the HTTP layer turns any failure into an
OpenAI-shaped error with a fitting status, and nothing escapes as a 500 with a stack trace.
Upstream exceptions (aiohttp's, the simulator's) are translated into `UpstreamError` at the
provider boundary; nothing above `providers/` ever sees an httpx exception.

Messages never contain provider keys, upstream URLs or upstream error bodies: an upstream's
body can hold internal hostnames or echo a key, so we keep only its status and a short class.
The one exception is a rejection (400/413/422) that reaches the client: its upstream's own
explanation (message, type, param, code) is relayed, bounded and scrubbed of credentials and
addresses (`gateway.wire.explain`), because a client cannot fix a request without it.

Two trees, in this one file, and each class carries its facts as class attributes:

    UpstreamError (one attempt)               GatewayError (the client's answer)
    ├── UpstreamConnectError                  ├── InvalidRequest ── ForbiddenField, InvalidJSON,
    │                                         │                     Untranslatable ── Unreadable
    │   └── UpstreamConnectTimeout            ├── Unauthorized
    ├── GatewayPoolFull                       ├── ModelNotFound, RouteNotServed, RouteNotFound
    ├── UpstreamTimeout                       ├── ResponseNotFound, MethodNotAllowed
    ├── UpstreamStatusError (`of(status)`)    ├── PayloadTooLarge, RequestTimeout
    │   ├── UpstreamRejectedRequest           ├── HeadersTooLarge
    │   │   └── UpstreamRejectedHere          │
    │   ├── UpstreamAuthFailed                ├── Overloaded ── TooManyConnections, Draining,
    │   │                                     │                 StoreDown
    │   ├── UpstreamNotFound                  ├── AllAttemptsFailed
    │   ├── UpstreamRateLimited               ├── UpstreamPushback
    │   ├── UpstreamUnavailable               │   └── UpstreamRateLimitedEverywhere
    │   └── UpstreamServerError               ├── NoBackendAvailable, AnswerBroken
    ├── UpstreamProtocolError                 ├── UpstreamClientError (an upstream 4xx)
    │   └── UpstreamDisconnected              │   └── ...TooLarge, Unprocessable, NotFound, Conflict
    ├── UpstreamInBandError                   ├── FirstTokenTimeout
    ├── UpstreamNoToken                       ├── KeyRateLimited, KeyConflict (client keys)
    │                                         ├── BudgetExceeded (a client key's spend)
    │                                         └── InternalError (a bug of ours, 500)
    └── InternalAttemptError

What each status an upstream answers with means is one table, `UPSTREAM_STATUSES` (read
through `upstream_status`), at the end of this file: the attempt failure it is
(`UpstreamStatusError.of`), the client's answer when it is the request's verdict
(`UpstreamClientError.of`), whether the one backend holding a stored response answers the
client with it, and whether its Retry-After is a pushback (`all_attempts_failed`). Providers
and the race read the table or the class it picks (`replaceable`, `backend_fault`), never a
number of their own.

- `GatewayError`: what a client is answered with: `status`, `type`, `code` (the OpenAI error
  fields; the code is also the request's error class in stats and metrics), and `reason`, the
  short machine word of the request log (`unknown_model`, `invalid_json`, `draining`): finer
  than the code where clients see one code for causes an operator tells apart;
- `UpstreamError`: why one attempt failed: `code` (the failure class counted per backend)
  and `replaceable` (whether another backend could do better).
An instance adds only its own detail (message, reason, retry_after). Where a fact depends on a
value, as an upstream status does, a factory (`of`) picks the subclass that states it. The
OpenAI error JSON itself is built in one place, `error_body`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway.wire.explain import Explanation

# --- why one attempt failed: the attempt-level tree ---------------------------------------------


class UpstreamError(Exception):
    """One attempt failed. Not sent to clients as such: the race decides what to do."""

    code: str = "upstream_error"
    #: whether another backend could succeed where this one failed
    replaceable: bool = True
    #: whether the failure counts against the backend's health; False when the
    #: gateway itself failed the attempt
    backend_fault: bool = True
    #: a throttle: without a `retry_after` of its own, the race pauses the backend for the
    #: pool's `health.default_pause` and takes that as its Retry-After (every 429; Bedrock's
    #: busy errors, which name no pause either)
    throttle: bool = False

    def __init__(self, reason: str, *, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        #: the answer's rate-limit headers (`gateway.wire.ratelimit`), when it was one: a
        #: refusal states the backend's quota as a success does
        self.quota: Mapping[str, str] = {}


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


class UpstreamCredentialsUnavailable(UpstreamError):
    """The backend's cloud credentials could not be had (no AWS credentials in the chain, a
    token endpoint or metadata server that refused or did not answer): nothing was sent.
    Another backend, with credentials of its own, may still serve the request."""

    code = "credentials_unavailable"


class UpstreamTimeout(UpstreamError):
    """A read or write on the upstream took longer than allowed."""

    code = "read_timeout"


class UpstreamStatusError(UpstreamError):
    """The upstream answered with a status other than 200. Build it with `of(status)`, which
    picks the subclass the status table (`UPSTREAM_STATUSES`) names for it (and so whether it
    is replaceable); this class itself is every status no row claims (redirects, 408, other
    4xx)."""

    code = "bad_status"

    def __init__(self, status: int, *, retry_after: float | None = None) -> None:
        super().__init__(f"status {status}", retry_after=retry_after)
        self.status = status

    @classmethod
    def of(cls, status: int, *, retry_after: float | None = None) -> UpstreamStatusError:
        return upstream_status(status).failure(status, retry_after=retry_after)


class UpstreamRejectedRequest(UpstreamStatusError):
    """400/413/422: the upstream judged the request. It is the request's fault when every
    backend that could judge it otherwise agrees, and this backend's when another serves it.

    Backends of one kind (one provider: one API's checks) judge a body alike, so the race
    does not ask another of them (`replaceable` is False: no failover to the same kind); a
    backend of another provider may accept what this one refused (a beta flag Bedrock does
    not know, a model id that needs an inference profile there), so the race fails over to
    one while the pool has it. When none is left, the client gets this rejection with the
    upstream's `explanation`; when another backend then serves the body, the race counts
    this attempt as `UpstreamRejectedHere`, a failure of its backend."""

    code = "request_rejected"
    replaceable = False
    backend_fault = False

    def __init__(self, status: int, *, retry_after: float | None = None,
                 explanation: Explanation | None = None) -> None:
        super().__init__(status, retry_after=retry_after)
        #: what the upstream said of the request, scrubbed (`gateway.wire.explain`)
        self.explanation = explanation


class UpstreamRejectedHere(UpstreamRejectedRequest):
    """A rejection another backend of the pool then served: the rejecting backend's fault
    (it does not take what its peers take), counted against its health like any failure,
    so a backend that keeps rejecting what the others serve is ejected. Only the race can
    know it, after the fact (`of` never picks it: no row of the status table names it)."""

    code = "rejected_served"
    backend_fault = True


class UpstreamAuthFailed(UpstreamStatusError):
    """401/403: this backend's key or permissions are wrong."""

    code = "auth_failed"


class UpstreamNotFound(UpstreamStatusError):
    """404: this backend does not serve the route or the model (a configuration error)."""

    code = "not_found"


class UpstreamRateLimited(UpstreamStatusError):
    code = "rate_limited"
    throttle = True


class UpstreamUnavailable(UpstreamStatusError):
    code = "unavailable"


class UpstreamServerError(UpstreamStatusError):
    """Any other 5xx."""

    code = "server_error"


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


# --- what a client is answered with: the client-facing tree -------------------------------


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


#: the client errors a retry of the same request can change (a timeout, a conflict, a rate
#: limit): every other 4xx says `x-should-retry: false`
RETRYABLE_CLIENT_STATUSES = frozenset({408, 409, 429})


class GatewayError(Exception):
    """Base of every error the gateway answers a client with.

    `should_retry` becomes the `x-should-retry` header, which the OpenAI and Anthropic SDKs
    (and agent CLIs built on them) obey over their own rules. A client error that a retry
    cannot change (a wrong key, an unknown model, a bad body) says false, so a client does
    not resend it for ever; None leaves the SDK's own rule."""

    status: int = 500
    type: str = "api_error"
    code: str | None = None
    #: the request log's `reason`; empty: the code is the reason
    reason: ClassVar[str] = ""

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
        if should_retry is None and 400 <= self.status < 500:
            should_retry = False if self.status not in RETRYABLE_CLIENT_STATUSES else None
        self.should_retry = should_retry
        #: headers the answer carries besides the retry advice (a key's rate-limit headers)
        self.headers: list[tuple[bytes, bytes]] = []

    @property
    def shown_type(self) -> str:
        """The `type` the client's error body shows (an upstream's, for a relayed one)."""
        return self.type

    @property
    def shown_code(self) -> str | None:
        """The `code` the client's error body shows; `code` stays the stats' class."""
        return self.code

    def body(self, request_id: str | None = None) -> dict[str, object]:
        return error_body(self.message, type=self.shown_type, code=self.shown_code,
                          param=self.param, request_id=request_id)

    @classmethod
    def log_reason(cls) -> str:
        """The request log's machine reason for this error."""
        return cls.reason or cls.code or "error"


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSON(InvalidRequest):
    """A body that is not a JSON object (not UTF-8, not JSON, not an object): the client's
    code is the same as for any invalid request, the log tells it apart."""

    reason = "invalid_json"


class ForbiddenField(InvalidRequest):
    """A body field that could choose a destination or a credential."""

    code = "forbidden_field"


class Untranslatable(InvalidRequest):
    """A field that changes the answer and that the backend's API cannot carry (`n > 1` to
    Messages, `logprobs`): refused naming it (`param`) rather than dropped in silence."""

    code = "untranslatable_field"

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}; no backend of this model speaks the API that "
                         "carries it", param=field)


class Unreadable(Untranslatable):
    """A value the body check lets through (it looks only at the top level) that a
    translation to another API cannot read (`messages[0].content: 5`): refused like a field
    that API cannot carry, naming it, before any attempt goes there (a translation made
    mid-race must never fail any other way). Its code is a plain invalid request's: the
    body is wrong whatever the pool's APIs."""

    code = InvalidRequest.code

    def __init__(self, field: str, exc: TypeError | AttributeError | ValueError | LookupError
                 ) -> None:
        InvalidRequest.__init__(self, f"{field}: a value of an unexpected type or shape "
                                f"({type(exc).__name__})", param=field)


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    reason = "unauthorized"


class ForbiddenOrigin(GatewayError):
    """A browser request from a page the gateway does not allow, or to a host name it does
    not answer to (DNS rebinding): refused before anything else is looked at."""

    status = 403
    type = "permission_error"
    code = "origin_not_allowed"
    reason = "forbidden_origin"


class UnsupportedMediaType(GatewayError):
    """An inference request whose body is not declared as `application/json`."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    reason = "unknown_model"


class RouteNotServed(GatewayError):
    """The pool has no backend whose provider serves the request's route."""

    status = 404
    type = "invalid_request_error"
    code = "route_not_served"


class ResponseNotFound(GatewayError):
    """A stored-response id this gateway did not relay (or has forgotten)."""

    status = 404
    type = "invalid_request_error"
    code = "response_not_found"
    reason = "unknown_response"


class RouteNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"
    reason = "unknown_route"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"
    reason = "body_too_large"


class RequestTimeout(GatewayError):
    """The request's head and body did not arrive within `server.body_timeout`."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    reason = "body_timeout"


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


class StoreDown(Overloaded):
    """The tenant store cannot be read and `server.store_down` is `closed`: a named key's
    request is refused (503, retry after a second: the store is polled twice a second) rather
    than served on keys and spend that may be stale. Logged as `store_down`."""

    reason = "store_down"
    code = "store_unavailable"

    def __init__(self) -> None:
        super().__init__("the key store is unavailable", retry_after=1.0)


class Draining(Overloaded):
    """The gateway is shutting down: a new request is refused as overloaded (the client
    retries after the pause, on a replica that is not leaving), logged as `draining`."""

    reason = "draining"

    def __init__(self) -> None:
        super().__init__("the gateway is shutting down", retry_after=1.0)


class KeyRateLimited(GatewayError):
    """A client key is over one of its own limits (`keys[].limits`): 429 with the pause
    after which the request would pass, and the key's rate-limit headers. Retryable: the
    SDKs wait that long and send it again. The message names the key's name and the limit,
    never the key."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, name: str, kind: str, retry_after: float) -> None:
        super().__init__(f"key {name!r} is over its {kind.replace('_', ' ')} limit; "
                         f"retry after {retry_after:.3g} s", retry_after=retry_after)
        self.kind = kind


class BudgetExceeded(GatewayError):
    """A client key has spent its budget for the period (`keys[].budget`): 429, and
    `x-should-retry: false`, since no retry passes before the period ends or an operator
    raises the budget; the SDKs give up at once. The message names the key's name, the
    budget and the period, never the key."""

    status = 429
    type = "insufficient_quota"
    code = "budget_exceeded"

    def __init__(self, name: str, usd: float, period: str) -> None:
        super().__init__(f"key {name!r} has spent its budget of {usd:g} USD for this "
                         f"{period} (UTC)", should_retry=False)


class KeyConflict(GatewayError):
    """`/admin/keys`: a key's name that exists already, or a key of the configuration file
    (made and revoked there, not at run time)."""

    status = 409
    type = "invalid_request_error"
    code = "key_conflict"


class InternalError(GatewayError):
    """An exception of ours on the request path (a bug): the client still gets an error in
    its route's shape, every slot the request held is given back, and it is counted and
    logged with its traceback. Its message names only the exception's class."""

    status = 500
    type = "server_error"
    code = "internal_error"

    @classmethod
    def of(cls, exc: BaseException) -> InternalError:
        return cls(f"internal error ({type(exc).__name__})")


class TooManyConnections(Overloaded):
    """A new connection past `server.max_connections`."""

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


class AnswerBroken(GatewayError):
    """A non-streaming request's answer, read upstream as a stream so that it could be
    continued, broke after its first token and no continuation completed it (502). Retryable:
    the next attempt starts from the beginning on whichever backend answers."""

    status = 502
    type = "upstream_error"
    code = "answer_broken"

    def __init__(self, end: str) -> None:
        super().__init__(f"the upstream answer broke after its first token ({end}) and "
                         "could not be continued")


class UpstreamPushback(GatewayError):
    """Every attempt was refused with a pushback: a 429 or 503 carrying a Retry-After. The client
    gets 429 when all were 429, else 503, and the smallest pause as its own
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
        kind = upstream_status(status).pushback or UpstreamPushback
        return kind(reasons, retry_after)


class UpstreamRateLimitedEverywhere(UpstreamPushback):
    """Every attempt answered 429 with a Retry-After: the client gets 429 too."""

    status = 429
    type = "rate_limit_error"


class NoBackendAvailable(GatewayError):
    """No backend could take the request, so nothing was tried: 503, never 502, since no
    upstream failed. Its Retry-After is 1 s when a backend is only at its `max_concurrency`
    (a slot frees at any moment); when every one is paused (its upstream said when to come
    back) or cooling down after failures (panic routing off), it is the soonest of those ends
    (`paused_for`, seconds), so the client does not come back before any could answer."""

    status = 503
    type = "server_error"
    code = "no_backend_available"

    def __init__(self, paused_for: float | None = None) -> None:
        if paused_for is None:
            super().__init__("no backend of the pool can take the request now (all at their "
                             "concurrency limit)", retry_after=1.0)
        else:
            super().__init__("no backend of the pool can take the request now (each is "
                             "paused or cooling down)", retry_after=max(1.0, paused_for))


class UpstreamClientError(GatewayError):
    """An upstream refused the request itself (400/413/422), and no backend of the pool
    that could judge it otherwise served it.

    The client gets the upstream's status (one subclass per status, chosen by `of`) and the
    upstream's own explanation, scrubbed (`gateway.wire.explain`), with the backend named
    beside it: `message`, and in the OpenAI shape the upstream's `type`, `param` and `code`
    (`shown_type`, `shown_code`). `code` itself stays ours: it is the request's error class
    in the stats and metrics, which an upstream's words must not multiply."""

    status = 400
    type = "invalid_request_error"
    code = "upstream_rejected_request"

    def __init__(self, backend: str, explanation: Explanation | None = None) -> None:
        if explanation is None:
            message = (f"the upstream rejected the request with status {self.status} "
                       f"(backend {backend})")
        else:
            message = f"{explanation.message} (backend {backend})"
        super().__init__(message, param=explanation.param if explanation else None,
                         should_retry=False)
        self.explanation = explanation

    @property
    def shown_type(self) -> str:
        return (self.explanation and self.explanation.type) or self.type

    @property
    def shown_code(self) -> str | None:
        return (self.explanation and self.explanation.code) or self.code

    @classmethod
    def of(cls, status: int, backend: str,
           explanation: Explanation | None = None) -> UpstreamClientError:
        """The error for an upstream status that describes the request (400 if unknown)."""
        kind = upstream_status(status).verdict or UpstreamClientError
        return kind(backend, explanation)


class UpstreamRejectedTooLarge(UpstreamClientError):
    status = 413


class UpstreamRejectedUnprocessable(UpstreamClientError):
    status = 422


class UpstreamRejectedNotFound(UpstreamClientError):
    """The one backend holding a stored response no longer has it."""

    status = 404


class UpstreamRejectedConflict(UpstreamClientError):
    """The one backend holding a stored response refused the operation."""

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


def all_attempts_failed(
    reasons: Sequence[str],
    failures: Sequence[UpstreamError],
    cap: Callable[[float], float],
) -> GatewayError:
    """The answer when every attempt failed before its first token.

    All pushbacks: `UpstreamPushback` with the smallest pause, bounded by `cap` (the pool's
    `max_pause`); anything else among them (a reset, a 500, a pushback without Retry-After):
    502 `AllAttemptsFailed`, since retrying soon would likely fail the same way.
    """
    pauses = [
        f.retry_after for f in failures
        if isinstance(f, UpstreamStatusError) and upstream_status(f.status).pushback
        and f.retry_after is not None
    ]
    if not failures or len(pauses) != len(failures):
        return AllAttemptsFailed(reasons)
    # every failure is a pushback: the client hears their common kind (429 when all were
    # rate limits), else the plain one (503)
    kinds = {upstream_status(f.status).pushback for f in failures
             if isinstance(f, UpstreamStatusError)}
    kind = kinds.pop() if len(kinds) == 1 else None
    return (kind or UpstreamPushback)(reasons, cap(min(pauses)))


# --- what each upstream status means: the one table -------------------------------------------


@dataclass(frozen=True, slots=True)
class UpstreamStatus:
    """What one upstream status means: every reading of it, in one row."""

    #: the attempt failure it is (`UpstreamStatusError.of`)
    failure: type[UpstreamStatusError]
    #: the client's answer when the status is the request's verdict: a rejection no backend
    #: of another kind served, or the answer of the one backend holding a stored response
    #: (`UpstreamClientError.of`; None: a plain 400)
    verdict: type[UpstreamClientError] | None = None
    #: from the one backend holding a stored response, the status answers the client as it
    #: is (no other backend holds that state); False: a 502 (a 401 or 429 there says nothing
    #: of the client's request)
    pinned_answer: bool = False
    #: with a Retry-After, "busy, come back later": when every attempt failed so, the client
    #: is told when to come back with this answer (`all_attempts_failed`); None: no pushback
    pushback: type[UpstreamPushback] | None = None


#: the upstream statuses that mean something of their own; any other 5xx is a server error,
#: any other status (a redirect, 408, another 4xx) a plain `UpstreamStatusError`
UPSTREAM_STATUSES: Mapping[int, UpstreamStatus] = {
    400: UpstreamStatus(UpstreamRejectedRequest, UpstreamClientError, pinned_answer=True),
    401: UpstreamStatus(UpstreamAuthFailed),
    403: UpstreamStatus(UpstreamAuthFailed),
    404: UpstreamStatus(UpstreamNotFound, UpstreamRejectedNotFound, pinned_answer=True),
    409: UpstreamStatus(UpstreamStatusError, UpstreamRejectedConflict, pinned_answer=True),
    413: UpstreamStatus(UpstreamRejectedRequest, UpstreamRejectedTooLarge),
    422: UpstreamStatus(UpstreamRejectedRequest, UpstreamRejectedUnprocessable,
                        pinned_answer=True),
    429: UpstreamStatus(UpstreamRateLimited, pushback=UpstreamRateLimitedEverywhere),
    503: UpstreamStatus(UpstreamUnavailable, pushback=UpstreamPushback),
}
_SERVER_ERROR = UpstreamStatus(UpstreamServerError)
_OTHER = UpstreamStatus(UpstreamStatusError)


def upstream_status(status: int) -> UpstreamStatus:
    """The row of `UPSTREAM_STATUSES` for `status`."""
    row = UPSTREAM_STATUSES.get(status)
    if row is not None:
        return row
    return _SERVER_ERROR if 500 <= status < 600 else _OTHER
