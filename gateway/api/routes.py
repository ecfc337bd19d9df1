"""HTTP endpoints: request checks, the error tree -> OpenAI error JSON.

Routes know nothing of hedge timing: they read and check the request, find the pool and hand
a `LogicalRequest` to the proxy.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from gateway.api.asgi import FastRoutes
from gateway.api.end import AnswerThen
from gateway.api.inference import errors_of, route
from gateway.api.proxy import LogicalRequest, Proxy
from gateway.drain import Drain
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
    RouteNotFound,
    Unauthorized,
)
from gateway.hedge.generation import Live
from gateway.settings import Settings
from gateway.stats.prometheus import Metrics
from gateway.stats.shared import StatsSource
from gateway.wire.base import WireProtocol
from gateway.wire.chat import CHAT
from gateway.wire.messages import MESSAGES
from gateway.wire.validate import check_body, parse_body
from providers.base import Endpoint

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_JSON_TYPES = ("application/json", "application/x-ndjson")


def request_id_of(request: Request) -> str:
    """The client's `x-request-id` when it is sane, else a fresh one; remembered per request.

    Kept in the request's state dict (`scope["state"]`, what `request.state` wraps) and read
    from it directly: a miss through `request.state` raises and catches an AttributeError,
    which was a few percent of a request's CPU."""
    state = request.scope.setdefault("state", {})
    existing = state.get("request_id")
    if isinstance(existing, str):
        return existing
    supplied = request.headers.get("x-request-id", "")
    rid = supplied if _REQUEST_ID.fullmatch(supplied) else f"req_{uuid.uuid4().hex}"
    state["request_id"] = rid
    return rid


def error_response(exc: GatewayError, request_id: str, path: str = "",
                   extra: Mapping[str, str] | None = None) -> JSONResponse:
    """The error as JSON in the shape of the route it answers (Anthropic's on /v1/messages,
    OpenAI's elsewhere), with the retry headers the SDKs obey. `extra`: headers the status
    calls for (a 405's `Allow`)."""
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
    body = protocol_for_path(path).error_body(exc, message)
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it crosses `limit` (never buffered past it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() \
            and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            parts.append(chunk)
    except ClientDisconnect:  # gone, or cut off by `server.body_timeout` (the 408 is out)
        raise RequestTimeout("the request body did not arrive") from None
    return b"".join(parts)


def gateway_error_response(request: Request, exc: GatewayError) -> Response:
    """The answer to an error of ours raised while handling `request`."""
    response = error_response(exc, request_id_of(request), request.url.path)
    if exc.after_response is not None:  # answer first, then end the logical request
        return AnswerThen(response, exc.after_response)
    return response


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
        return error_response(error, request_id_of(request), request.url.path,
                              {"allow": allow} if allow else None)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        return error_response(
            InvalidRequest("invalid request"), request_id_of(request), request.url.path
        )

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)


#: checks a request's gateway key; raises `Unauthorized`
Guard = Callable[[Request], Awaitable[None]]


def make_auth_guard(api_keys: tuple[str, ...], *, x_api_key: bool = False) -> Guard:
    """A dependency that checks the gateway key in constant time; a no-op without keys.

    `x_api_key`: the key may also come as `x-api-key` (Anthropic's SDKs send it so).

    Keys are compared as SHA-256 digests: `compare_digest` is constant-time only for inputs of
    equal length, so comparing the raw strings would tell a prober each key's length. Every
    configured key is compared, so the timing does not say which one matched either. The
    401 never repeats what was sent."""
    digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    async def guard(request: Request) -> None:
        if not digests:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        supplied = token.strip() if scheme.lower() == "bearer" else ""
        if not supplied and x_api_key:
            supplied = request.headers.get("x-api-key", "").strip()
        digest = hashlib.sha256(supplied.encode("latin-1")).digest()  # the bytes as sent
        ok = False
        for key in digests:
            ok |= hmac.compare_digest(digest, key)
        if not ok or not supplied:
            raise Unauthorized("missing or invalid gateway API key")

    return guard


def build_router(settings: Settings, live: Live, proxy: Proxy, fast: FastRoutes) -> APIRouter:
    """The API routes. `settings.server` is bound here (keys, body limit: start-time keys);
    the pools are read from `live` once per request, so a request keeps the generation it
    started with through a reload. The inference routes go into `fast` too
    (`gateway.api.asgi`) and check the key themselves; `/v1/models` has it as a dependency."""
    keyed = bool(settings.server.api_keys)
    guard = make_auth_guard(settings.server.api_keys)
    router = APIRouter()
    # without keys the guard lets everything through: no dependency at all then, since
    # FastAPI solving one costs about 4 % of a streamed request's CPU
    guarded = APIRouter(dependencies=[Depends(guard)] if keyed else [])
    limit = settings.server.max_body_bytes

    async def proxied(request: Request, endpoint: Endpoint, needs: str | None) -> Response:
        if keyed:
            await guard(request)
        rid = request_id_of(request)
        content_type = request.headers.get("content-type", "application/json")
        if content_type.split(";")[0].strip().lower() not in _JSON_TYPES:
            raise InvalidRequest("content type must be application/json")
        body = parse_body(await read_body(request, limit))
        model, stream = check_body(body, needs_prompt=needs)
        if endpoint == "embeddings" and stream:
            raise InvalidRequest("embeddings cannot be streamed", param="stream")
        pool = live.current.pools.get(model)
        if pool is None:
            raise ModelNotFound(
                "the model does not exist in this gateway; GET /v1/models lists them",
                param="model",
            )
        headers = {k.lower(): v for k, v in request.headers.items()}
        req = LogicalRequest(rid, endpoint, body, stream, headers)
        return await proxy.handle(request, pool, req)

    chat = route("POST", "/v1/chat/completions")
    legacy = route("POST", "/v1/completions")
    embed = route("POST", "/v1/embeddings")

    @fast.post(router, chat.path)
    async def chat_completions(request: Request) -> Response:
        return await proxied(request, chat.endpoint, chat.prompt)

    @fast.post(router, legacy.path)
    async def completions(request: Request) -> Response:
        return await proxied(request, legacy.endpoint, legacy.prompt)

    @fast.post(router, embed.path)
    async def embeddings(request: Request) -> Response:
        return await proxied(request, embed.endpoint, embed.prompt)

    @guarded.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """The pools, in OpenAI's list shape, or in Anthropic's when the request carries
        `anthropic-version` (the Anthropic SDKs and tools send it on every call)."""
        names = list(live.current.pools)
        if "anthropic-version" in request.headers:
            return anthropic_model_list(names)
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "hedge-gateway"}
                for name in names
            ],
        }

    router.include_router(guarded)
    return router


def build_ops_router(
    live: Live,
    clock: Callable[[], float],
    *,
    stats: StatsSource,
    metrics: Metrics,
    drain: Drain,
) -> APIRouter:
    ops = APIRouter()

    @ops.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @ops.get("/readyz")
    async def readyz() -> Response:
        """Unready only while draining or when no pool can serve at all: a load balancer
        that drops every replica for one dead pool would take the healthy pools down too."""
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        now = clock()
        pools = live.current.pools
        unready = [name for name, pool in pools.items() if not pool.balancer.usable(now)]
        body = {"pools_without_usable_backend": unready}
        if len(unready) == len(pools):
            return JSONResponse({"status": "unready", **body}, status_code=503)
        return JSONResponse({"status": "ready", **body})

    @ops.get("/hedge/stats")
    async def hedge_stats(mergeable: bool = False) -> JSONResponse:
        """`?mergeable=1`: the export `hedge-gateway stats URL URL` merges across replicas."""
        return JSONResponse(await (stats.mergeable_async() if mergeable
                                   else stats.document_async()))

    @ops.get("/metrics")
    async def prometheus() -> Response:
        return Response(await stats.metrics_async(metrics), media_type=metrics.content_type)

    return ops


def protocol_for_path(path: str) -> WireProtocol:
    """The protocol whose error shape answers a request to `path`, even one no route matched
    (`gateway.api.inference.errors_of`)."""
    return MESSAGES if errors_of(path) == "anthropic" else CHAT


def anthropic_model_list(names: list[str]) -> dict[str, Any]:
    """Anthropic's `GET /v1/models` page: every pool on one page. A pool has no creation
    date, so `created_at` is the epoch, as OpenAI's `created: 0` says the same."""
    data = [{"type": "model", "id": name, "display_name": name,
             "created_at": "1970-01-01T00:00:00Z"} for name in names]
    return {"data": data, "has_more": False,
            "first_id": names[0] if names else None, "last_id": names[-1] if names else None}
