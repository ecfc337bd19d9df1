"""`GatewayAPI`: the routes of a `FastRoutes` table are answered by their handler directly
(no middleware, no router), errors of ours become their answers, everything else is FastAPI's.

In-process ASGI calls with a recorded `send`: nothing here streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.asgi import FastRoutes, GatewayAPI
from gateway.api.keys import BACKOFF_CAP, MAX_FAILURES, backoff
from gateway.errors import GatewayError, InvalidRequest
from gateway.wire.base import WireProtocol
from gateway.wire.chat import CHAT


class Recorder:
    """A middleware that notes every request it sees."""

    def __init__(self, app: ASGIApp, seen: list[str]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append(f"{scope['method']} {scope['path']}")
        await self.app(scope, receive, send)


def build() -> tuple[GatewayAPI, list[str]]:
    fast = FastRoutes()
    router = APIRouter()

    @fast.post(router, "/v1/echo", CHAT)
    async def echo(request: Request) -> Response:
        body = json.loads(await request.body())
        if body.get("fail"):
            raise InvalidRequest("you asked for it", param="fail")
        return JSONResponse({"echo": body})

    def on_error(request: Request, exc: GatewayError, _shape: WireProtocol | None) -> Response:
        return JSONResponse({"error": {"message": exc.message, "param": exc.param}},
                            status_code=exc.status)

    app = GatewayAPI(fast=fast, on_error=on_error, report=lambda exc: None)
    app.include_router(router)
    seen: list[str] = []
    app.add_middleware(Recorder, seen=seen)
    return app, seen


def call(app: GatewayAPI, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    scope: Scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                    "method": method, "path": path, "raw_path": path.encode(),
                    "query_string": b"", "headers": [(b"content-type", b"application/json")],
                    "scheme": "http", "server": ("127.0.0.1", 80), "client": None,
                    "root_path": ""}
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload) if payload else None


def test_a_fast_route_is_answered_by_its_handler_past_the_middleware() -> None:
    app, seen = build()
    assert call(app, "POST", "/v1/echo", b'{"a": 1}') == (200, {"echo": {"a": 1}})
    assert seen == []


def test_an_error_of_ours_on_a_fast_route_becomes_its_answer() -> None:
    app, _ = build()
    status, body = call(app, "POST", "/v1/echo", b'{"fail": true}')
    assert (status, body) == (400, {"error": {"message": "you asked for it", "param": "fail"}})


def test_other_methods_and_paths_go_through_fastapi() -> None:
    app, seen = build()
    assert call(app, "GET", "/v1/echo")[0] == 405  # the same handler is on the router
    assert call(app, "POST", "/v1/other")[0] == 404
    assert seen == ["GET /v1/echo", "POST /v1/other"]


def test_wrong_keys_on_one_connection_are_answered_ever_later_then_the_connection_ends() -> None:
    """The back-off after the n-th wrong key on a connection: a few free, then doubling up
    to the cap, and the last one closes the connection. Pure: no clock is read."""
    plan = [backoff(n, first=0.5, cap=2.0, free=2, most=6) for n in range(1, 7)]
    assert plan == [(0.0, False), (0.0, False), (0.5, False), (1.0, False), (2.0, False),
                    (2.0, True)]
    delays = [backoff(n)[0] for n in range(1, MAX_FAILURES + 1)]
    assert delays == sorted(delays) and max(delays) <= BACKOFF_CAP
    assert backoff(MAX_FAILURES)[1] and not backoff(MAX_FAILURES - 1)[1]
