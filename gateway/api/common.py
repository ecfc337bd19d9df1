"""What every route shares: the request id, the bounded JSON body, the key guard, and the
error tree as an answer: in the shape of the route that took the request (its protocol, from
the route table), or of the path when no route did.

Routes know nothing of hedge timing: they read and check the request, find the pool and hand
a `LogicalRequest` to the proxy.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.admission import Admission
from gateway.api.answer import error_response, note_refusal
from gateway.api.keys import backoff
from gateway.api.refusals import REQUEST_ID_KEY
from gateway.api.tenancy import TenantGate, quota_headers
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    RequestTimeout,
    RouteNotFound,
    Unauthorized,
    UnsupportedMediaType,
)
from gateway.server.extensions import FAILED_KEYS_EXTENSION, FailedKeys
from gateway.tenants.registry import Tenant
from gateway.wire.base import WireProtocol
from gateway.wire.chat import CHAT
from gateway.wire.messages import MESSAGES
from gateway.wire.paths import errors_of

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Received(NamedTuple):
    """What an inference route's checks of a request found (`receive`)."""

    #: the named key it presents; None: a key of `server.api_keys`, or no key configured
    tenant: Tenant | None
    request_id: str
    #: the body's bytes, within the route's bound
    raw: bytes


async def receive(request: Request, gate: TenantGate, limit: int, admission: Admission, *,
                  x_api_key: bool = False) -> Received:
    """An inference route's checks of the request, in their order, in one call: the key
    (`gate`; before any of the body is read, so a request without a valid key never has it
    read), the request id, the content type, the body within `limit` (its bytes counted by
    `admission` as they arrive). Each refusal is raised in the order the checks are made."""
    tenant = gate.identify(request, x_api_key=x_api_key)
    rid = request_id_of(request)
    check_json_type(request)
    raw = await read_body(request, limit, admission)
    return Received(tenant, rid, raw)


def request_id_of(request: Request) -> str:
    """The client's `x-request-id` when it is sane, else a fresh one; remembered per request.

    A fresh one is a UUID (version 4) because upstreams that validate request ids accept only
    UUIDs: then the gateway's own id goes upstream unchanged, and both sides' logs show the
    same id (a client's id that is not a UUID is mapped for the upstream, see
    `providers.requestid`).

    Kept in the request's state dict (`scope["state"]`, what `request.state` wraps) and read
    from it directly: a miss through `request.state` raises and catches an AttributeError,
    which was a few percent of a request's CPU."""
    state = request.scope.setdefault("state", {})
    existing = state.get(REQUEST_ID_KEY)
    if isinstance(existing, str):
        return existing
    supplied = request.headers.get("x-request-id", "")
    rid = supplied if _REQUEST_ID.fullmatch(supplied) else str(uuid.uuid4())
    state[REQUEST_ID_KEY] = rid
    return rid


def check_json_type(request: Request) -> None:
    """Inference bodies must be declared `application/json` (any parameters): the types a
    web page may post without asking first (`text/plain`, forms, and no type at all, which a
    page's `fetch` of an untyped Blob sends) get 415. Every SDK declares its JSON."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaType("content type must be application/json")


async def read_body(request: Request, limit: int,
                    admission: Admission | None = None) -> bytes:
    """The body, refused with 413 as soon as it crosses `limit` (never buffered past it).
    With `admission`, its bytes count against `server.max_inflight_body` while they arrive:
    the declared length before anything is read, a chunked body piece by piece (503 past
    the bound, before more is buffered)."""
    declared = request.headers.get("content-length")
    length = int(declared) if declared is not None and declared.isascii() \
        and declared.isdigit() else None
    if length is not None and length > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    parts: list[bytes] = []
    size = reserved = 0
    try:
        if admission is not None and length:
            admission.reserve(length)
            reserved = length
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            if admission is not None and size > reserved:
                admission.reserve(size - reserved, reserved)
                reserved = size
            parts.append(chunk)
    except ClientDisconnect:  # gone, or cut off by `server.body_timeout` (the 408 is out)
        raise RequestTimeout("the request body did not arrive") from None
    finally:  # the proxy counts the body from here (`Admission.enter`), with no await between
        if admission is not None:
            admission.unreserve(reserved)
    return b"".join(parts)


def gateway_error_response(request: Request, exc: GatewayError,
                           protocol: WireProtocol | None = None) -> Response:
    """The answer to an error of ours raised while handling `request` (noted for the
    request log's line, `gateway.api.refusals`), in `protocol`'s shape: the route's, when a
    route took the request (`gateway.api.asgi` passes it from the route table); None: no
    route did (an unknown path, a refusal before any route), and the path's rule decides. A
    wrong key is answered more slowly the more of them its connection sent
    (`gateway.api.keys.backoff`)."""
    note_refusal(request.scope, exc)
    shape = protocol if protocol is not None else protocol_for_path(request.url.path)
    if not exc.headers:  # a named key's quotas on every answer to it
        exc.headers = quota_headers(request.scope,
                                    anthropic=errors_of(request.url.path) == "anthropic")
    response = error_response(exc, request_id_of(request), shape)
    if isinstance(exc, Unauthorized):
        return slowed(request, response)
    return response


def slowed(request: Request, response: Response) -> Response:
    """`response` to a wrong key, delayed and closing the connection as its count says."""
    failed = ((request.scope.get("extensions") or {}).get(FAILED_KEYS_EXTENSION)
              or {}).get("failed")
    if not isinstance(failed, FailedKeys):
        return response
    failed.count += 1
    delay, close = backoff(failed.count)
    if close:
        response.headers["connection"] = "close"
    return Delayed(response, delay) if delay > 0 else response


class Delayed(Response):
    """Sends `inner` after `seconds` (a bounded wait: see `gateway.api.keys.backoff`)."""

    def __init__(self, inner: Response, seconds: float) -> None:
        self.inner = inner
        self.seconds = seconds
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(self.seconds)
        await self.inner(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return gateway_error_response(request, exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error: GatewayError
        if exc.status_code == 404:
            error = RouteNotFound("no such route")
        elif exc.status_code == 405:
            error = MethodNotAllowed("method not allowed")
        else:  # the framework refused the request in some other way
            error = InvalidRequest(str(exc.detail))
        allow = (exc.headers or {}).get("Allow") if exc.status_code == 405 else None
        note_refusal(request.scope, error)
        return error_response(error, request_id_of(request),
                              protocol_for_path(request.url.path),
                              {"allow": allow} if allow else None)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        error = InvalidRequest("invalid request")
        note_refusal(request.scope, error)
        return error_response(error, request_id_of(request),
                              protocol_for_path(request.url.path))

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)


def protocol_for_path(path: str) -> WireProtocol:
    """The protocol whose error shape answers a request to `path` that no route took (an
    unknown path, a wrong method, a refusal before routing: `gateway.wire.paths.errors_of`,
    which the server's own answers read too). A route's answers take its own protocol."""
    return MESSAGES if errors_of(path) == "anthropic" else CHAT
