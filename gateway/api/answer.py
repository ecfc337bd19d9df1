"""A request's answer as a value: the response to send and the request's end to run after it;
and an error of ours as JSON in a route's shape.

The proxy (`gateway.api.proxy`) returns an `Answer` on every path, an error included, but a
stream's, which is its own answer (`gateway.api.stream.SSEResponse` runs the request's end
itself as it closes): the end of an admitted request travels with its response, never on an
exception, so whoever sends the answer (the route, the app) needs to know nothing of how a
request ends. The error's
shape is its route's protocol (`WireProtocol.error_body`, chosen once per route in
`gateway.api.inference`); the app answers an error raised before any route took the request
in the shape of its path (`gateway.api.common.gateway_error_response`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, PayloadTooLarge
from gateway.wire.base import WireProtocol

#: scope state: (status, reason) of the error the request was answered with
REFUSAL_KEY = "hedge_refusal"


def note_refusal(scope: Scope, exc: GatewayError) -> None:
    """The request is answered with `exc` (the first answer counts: a request has one), for
    the log line of a request refused before any race (`gateway.api.refusals`)."""
    state: dict[str, Any] = scope.setdefault("state", {})
    state.setdefault(REFUSAL_KEY, (exc.status, exc.log_reason()))


class Answer(Response):
    """Sends `response` to the client, then runs `end` (shielded), whatever happens to the
    sending: the client gets its answer before losers are reaped and stats recorded. `end`
    is the request's `RequestEnd`; None for a request refused before it was admitted, which
    holds nothing to give back. (A stream needs no `Answer`: its response runs the end itself
    as it closes, `gateway.api.stream.SSEResponse`'s `on_close`, once, whatever ends it.)"""

    def __init__(self, response: Response,
                 end: Callable[[], Awaitable[None]] | None = None) -> None:
        self.response = response
        self.end = end
        self.status_code = response.status_code
        self.raw_headers = response.raw_headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        end = self.end
        if end is None:
            await self.response(scope, receive, send)
            return
        try:
            await self.response(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await end()


def error_response(exc: GatewayError, request_id: str, protocol: WireProtocol,
                   extra: Mapping[str, str] | None = None) -> JSONResponse:
    """The error as JSON in `protocol`'s shape (the route's: Anthropic's on the Messages
    routes, OpenAI's elsewhere), with the retry headers the SDKs obey. `extra`: headers the
    status calls for (a 405's `Allow`). Raises ValueError or TypeError when the body cannot
    be rendered (a bug of ours): the caller answers an `InternalError` instead."""
    headers = {**(extra or {}), "x-request-id": request_id}
    if exc.should_retry is not None:
        headers["x-should-retry"] = "true" if exc.should_retry else "false"
    if exc.retry_after is not None:
        headers["retry-after"] = str(max(1, round(exc.retry_after)))
        headers["retry-after-ms"] = str(int(exc.retry_after * 1000))
    if isinstance(exc, PayloadTooLarge):
        headers["connection"] = "close"
    message = exc.message
    if exc.status >= 500:  # our failure or the upstreams': the id to quote to the operator
        message = f"{exc.message} (request id {request_id})"
    body = protocol.error_body(exc, message)
    response = SafeJSONResponse(body, status_code=exc.status, headers=headers)
    if exc.headers:  # a client key's rate-limit headers
        response.raw_headers.extend(exc.headers)
    return response


class SafeJSONResponse(JSONResponse):
    """JSON whose text may hold what UTF-8 cannot encode: an error can quote a client's own
    key (`param`), and a JSON body may carry a lone surrogate (`"\\ud800"`), which parses
    into a `str` that Starlette's `ensure_ascii=False` rendering cannot encode (a bare 500
    from the server, below our handlers). Such text is written as JSON escapes instead; all
    other bodies render byte for byte as before."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("ascii")
