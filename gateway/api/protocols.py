"""The Responses API and Anthropic Messages endpoints.

Like `gateway.api.routes`, these only read and check a request and hand a `LogicalRequest` to the
proxy; what differs per route is the `WireProtocol` (first token, end, error shapes), the
Responses store rules (hedge only a `"store": false` request that carries no stored state), and
the response-id directory that sends a follow-up to the backend holding the response.
Errors under /v1/messages take Anthropic's shape (`gateway.api.routes.error_response` chooses by
path), and the gateway key may come there as `x-api-key` as well as Bearer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from gateway.api.asgi import FastRoutes
from gateway.api.keys import KeyRing
from gateway.api.proxy import LogicalRequest, Proxy
from gateway.api.routes import (
    Guard,
    check_json_type,
    make_auth_guard,
    read_body,
    request_id_of,
)
from gateway.api.stored import ResponseDirectory
from gateway.errors import ModelNotFound, ResponseNotFound
from gateway.hedge.generation import Live
from gateway.hedge.pool import PoolRuntime
from gateway.settings import Settings
from gateway.wire.base import WireProtocol
from gateway.wire.messages import COUNT_TOKENS, MESSAGES
from gateway.wire.responses import RESPONSES, RESPONSES_ITEM, response_id_of
from gateway.wire.sse import SSEEvent
from gateway.wire.validate import check_body, parse_body
from providers.base import Endpoint

_RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
#: client query parameters of `GET /v1/responses/{id}/input_items` passed upstream
_ITEM_QUERY = ("after", "before", "limit", "order", "include", "include[]")
#: client headers passed upstream on /v1/messages (the beta features it asks for)
_MESSAGES_FORWARD = ("anthropic-beta",)


def responses_stateful(body: Mapping[str, Any]) -> bool:
    """True unless hedging cannot store a second response or fork stored state: only
    `"store": false` without `previous_response_id`, `conversation` or background mode."""
    return (
        body.get("store") is not False
        or body.get("previous_response_id") is not None
        or body.get("conversation") is not None
        or body.get("background") is True
    )


def build_protocol_router(
    settings: Settings,
    live: Live,
    proxy: Proxy,
    fast: FastRoutes,
    directory: ResponseDirectory | None = None,
    keys: KeyRing | None = None,
) -> APIRouter:
    """The routes of Like `gateway.api.routes.build_router`, the pools are read from
    `live` once per request (a reload never changes a running request's rules); a stored
    response whose backend a reload removed is unknown from then on. The inference routes
    go into `fast` too (`gateway.api.asgi`) and check the key themselves."""
    origins = directory if directory is not None else ResponseDirectory()
    ring = keys if keys is not None else KeyRing(settings.server.api_keys)
    bearer = make_auth_guard(ring)
    either = make_auth_guard(ring, x_api_key=True)
    router = APIRouter()
    limit = settings.server.max_body_bytes

    async def read_json(request: Request) -> dict[str, Any]:
        check_json_type(request)
        return parse_body(await read_body(request, limit))

    def pool_of(model: str) -> PoolRuntime:
        pool = live.current.pools.get(model)
        if pool is None:
            raise ModelNotFound(
                "the model does not exist in this gateway; GET /v1/models lists them",
                param="model",
            )
        return pool

    def headers_of(request: Request) -> dict[str, str]:
        return {k.lower(): v for k, v in request.headers.items()}

    def remember(pool: str, stream: bool) -> Callable[[str, list[SSEEvent]], None]:
        def on_commit(backend: str, events: list[SSEEvent]) -> None:
            response_id = response_id_of(events, stream=stream)
            if response_id is not None:
                origins.remember(response_id, pool, backend)

        return on_commit

    async def inference(request: Request, endpoint: Endpoint, protocol: WireProtocol,
                        needs: str | None, guard: Guard) -> Response:
        if ring.digests:
            await guard(request)
        body = await read_json(request)
        model, stream = check_body(body, needs_prompt=needs)
        pool = pool_of(model)
        headers = headers_of(request)
        req = LogicalRequest(request_id_of(request), endpoint, body, stream, headers,
                             protocol=protocol)
        if endpoint == "responses":
            pinned = None
            previous = body.get("previous_response_id")
            if previous is not None:
                origin = origins.find(previous) if isinstance(previous, str) else None
                if origin is None or origin.pool != pool.settings.name \
                        or origin.backend not in pool.providers:
                    raise ResponseNotFound(f"no response {str(previous)[:200]!r} is known "
                                           "to this gateway", param="previous_response_id")
                pinned = origin.backend
            req = _with(req, stateful=responses_stateful(body), pinned=pinned,
                        on_commit=remember(pool.settings.name, stream))
        elif endpoint == "messages":
            forward = {k: headers[k] for k in _MESSAGES_FORWARD if k in headers}
            req = _with(req, forward_headers=forward)
        elif endpoint == "messages/count_tokens":
            forward = {k: headers[k] for k in _MESSAGES_FORWARD if k in headers}
            req = _with(req, single=True, forward_headers=forward)
        return await proxy.handle(request, pool, req)

    async def stored(request: Request, response_id: str, method: str, suffix: str) -> Response:
        """A stored response's operation, sent to the backend that made it."""
        origin = origins.find(response_id) if _RESPONSE_ID.fullmatch(response_id) else None
        pool = live.current.pools.get(origin.pool) if origin is not None else None
        if origin is None or pool is None or origin.backend not in pool.providers:
            raise ResponseNotFound(f"no response {response_id[:200]!r} is known to this "
                                   "gateway", param="response_id")
        query = {k: v for k, v in request.query_params.items() if k in _ITEM_QUERY}
        req = LogicalRequest(
            request_id_of(request), "responses/item", {}, False, headers_of(request),
            protocol=RESPONSES_ITEM, single=True, pinned=origin.backend, method=method,
            path=f"responses/{response_id}{suffix}", query=query,
        )
        response = await proxy.handle(request, pool, req)
        if method == "DELETE" and response.status_code == 200:
            origins.forget(response_id)
        return response

    @fast.post(router, "/v1/responses")
    async def responses(request: Request) -> Response:
        return await inference(request, "responses", RESPONSES, None, bearer)

    @router.get("/v1/responses/{response_id}", dependencies=[Depends(bearer)])
    async def get_response(request: Request, response_id: str) -> Response:
        return await stored(request, response_id, "GET", "")

    @router.delete("/v1/responses/{response_id}", dependencies=[Depends(bearer)])
    async def delete_response(request: Request, response_id: str) -> Response:
        return await stored(request, response_id, "DELETE", "")

    @router.post("/v1/responses/{response_id}/cancel", dependencies=[Depends(bearer)])
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await stored(request, response_id, "POST", "/cancel")

    @router.get("/v1/responses/{response_id}/input_items", dependencies=[Depends(bearer)])
    async def input_items(request: Request, response_id: str) -> Response:
        return await stored(request, response_id, "GET", "/input_items")

    @fast.post(router, "/v1/messages")
    async def messages(request: Request) -> Response:
        return await inference(request, "messages", MESSAGES, "messages", either)

    @fast.post(router, "/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await inference(request, "messages/count_tokens", COUNT_TOKENS, "messages",
                               either)

    return router


def _with(req: LogicalRequest, **changes: Any) -> LogicalRequest:
    return replace(req, **changes)
