"""The inference routes answered without the framework's routing and middleware.

A streamed chat completion passes through FastAPI's router and its middleware stack (server
errors, exception handlers, the exit stack, telemetry, a body limit of its own) on the way in,
and every one of its fifty-odd body messages passes back out through a send wrapper per
layer. Profiled at c=50 that was a fifth of the gateway's CPU, none of it doing anything these
routes need: they read and bound their own body, check their own key and turn our own error
tree into answers (`gateway.api.common.gateway_error_response`), in the shape of the route's
protocol, which the table holds beside each handler.

So the few routes that carry traffic are kept in `FastRoutes`, a table of exact (method, path)
pairs, and `GatewayAPI` answers a request that matches one by calling its handler directly
with the server's own `send`. The same handlers are registered on the FastAPI router too, so
the route table lists them and a wrong method still gets 405; both ways run the same code,
the key check included (the handlers do it themselves). Everything else (the ops routes, the
dashboard, routes with path parameters) goes through FastAPI as before.

A `GatewayError` raised by a handler (before it handed its request to the proxy, which returns
its own answers, errors included) becomes its answer in the route's shape; anything else is a
bug of ours: `report` logs and counts it, and the answer is an `InternalError` (a 500 in the
route's error shape), on these routes as on the framework's (in the path's shape there),
so the server never answers a bare 500 of its own. A bug that escapes while the answer is
being sent (a stream already under way) is reported; the answer it interrupted stays the
only one.

Every HTTP request ends here too, whichever way it was answered, so this is where a request
refused before any race gets its request-log line (`gateway.api.refusals`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.answer import REFUSAL_KEY
from gateway.api.browser import BrowserGuard
from gateway.api.end import LINE_KEY
from gateway.api.keys import KeyRing, credential, is_ops_path
from gateway.api.refusals import write_refusal_line
from gateway.errors import ForbiddenOrigin, GatewayError, InternalError, Unauthorized
from gateway.wire.base import WireProtocol

#: a route's handler: the request in, the response out (it may raise a `GatewayError`)
Handler = Callable[[Request], Awaitable[Response]]
#: the answer to a `GatewayError`, in the shape of the route's protocol (None: no route took
#: the request, the path decides)
OnError = Callable[[Request, GatewayError, WireProtocol | None], Response]
#: logs and counts any other exception (a bug of ours)
Report = Callable[[Exception], None]


class FastRoutes:
    """Exact (method, path) -> (handler, the route's protocol); filled while the routers
    are built."""

    def __init__(self) -> None:
        self.handlers: dict[tuple[str, str], tuple[Handler, WireProtocol]] = {}

    def post(self, router: APIRouter, path: str,
             protocol: WireProtocol) -> Callable[[Handler], Handler]:
        """Decorator: `handler` answers `POST path`, on the router (route table, 405s) and in
        this table (the shortcut), its errors in `protocol`'s shape."""

        def register(handler: Handler) -> Handler:
            router.add_api_route(path, handler, methods=["POST"])
            self.handlers[("POST", path)] = (handler, protocol)
            return handler

        return register


class GatewayAPI(FastAPI):
    """FastAPI, plus the shortcut for the routes of a `FastRoutes` table."""

    def __init__(self, *, fast: FastRoutes, on_error: OnError, report: Report,
                 browser: BrowserGuard | None = None, ops_keys: KeyRing | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fast = fast.handlers
        self._on_error = on_error
        self._report = report
        self._browser = browser
        #: `server.ops_keys`: while it holds keys, the operational reads need one
        self._ops_keys = ops_keys
        # the framework's routes: its outermost middleware sends this handler's answer
        self.add_exception_handler(Exception, self._framework_bug)

    def _on_bug(self, request: Request, exc: Exception,
                protocol: WireProtocol | None = None) -> Response:
        self._report(exc)
        return self._on_error(request, InternalError.of(exc), protocol)

    def _answer(self, request: Request, exc: GatewayError,
                protocol: WireProtocol | None = None) -> Response:
        """The answer to `exc` (in `protocol`'s shape, the route's; None: the path's); if
        that answer cannot be rendered (a client's text that JSON cannot carry, a bug of
        ours), the route's shaped internal error instead, reported: never the server's bare
        500. The refusal noted for the log line is replaced, so the line says what was
        answered."""
        try:
            return self._on_error(request, exc, protocol)
        except (ValueError, TypeError) as bug:  # rendering failed: a bug of ours
            request.scope.get("state", {}).pop(REFUSAL_KEY, None)
            self._report(bug)
            return self._on_error(request, InternalError.of(bug), protocol)

    async def _framework_bug(self, request: Request, exc: Exception) -> Response:
        return self._on_bug(request, exc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        try:
            await self._http(scope, receive, send)
        finally:  # answered (or given up): a refused request's one log line, if it needs one
            state = scope.get("state")
            if state is None or not state.get(LINE_KEY):  # else the proxy's end wrote it
                write_refusal_line(scope)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._browser is not None:  # before any route: see `gateway.api.browser`
            why = self._browser.refusal(scope["headers"], scope.get("scheme", "http"),
                                        scope["path"])
            if why is not None:
                scope["app"] = self
                request = Request(scope, receive)
                await self._answer(request, ForbiddenOrigin(why))(scope, receive, send)
                return
        ops = self._ops_keys
        if ops is not None and ops.digests and is_ops_path(scope["path"]) \
                and not ops.matches(_authorization(scope["headers"])):
            scope["app"] = self
            response = self._answer(Request(scope, receive),
                                    Unauthorized("missing or invalid operations key"))
            # a browser asks for it (the dashboard's own reads then carry it too)
            response.headers["www-authenticate"] = 'Basic realm="hedge-gateway ops"'
            await response(scope, receive, send)
            return
        fast = self._fast.get((scope["method"], scope["path"]))
        if fast is not None:
            handler, protocol = fast
            scope["app"] = self
            request = Request(scope, receive)
            try:  # the proxy's answers come back as values; a raise is the route's refusal
                response = await handler(request)
            except GatewayError as exc:
                response = self._answer(request, exc, protocol)
            except Exception as exc:  # noqa: BLE001 - a bug: answered, reported
                response = self._on_bug(request, exc, protocol)
            try:
                await response(scope, receive, send)
            except Exception as exc:  # noqa: BLE001 - the answer has begun: report only
                self._report(exc)
            return
        try:
            await super().__call__(scope, receive, send)
        except Exception:  # noqa: BLE001
            # already answered and reported by `_framework_bug` (Starlette's outermost
            # middleware re-raises after sending it): not the server's to answer again
            return


def _authorization(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"authorization":
            return credential(value.decode("latin-1"))
    return ""
