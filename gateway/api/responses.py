"""The Responses API routes: create, and the operations on a stored response.

Like `gateway.api.chat`, these only read and check a request and hand a `LogicalRequest` to the
proxy; what differs is the `WireProtocol` (first token, end, error shapes), the store rules
(hedge only a `"store": false` request that carries no stored state), and the response ids
that name the backend holding a response (`gateway.api.stored`): minted into what the gateway
relays, verified and translated back to the upstream's id on a follow-up.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.asgi import FastRoutes
from gateway.api.common import receive, request_id_of
from gateway.api.inference import InferenceRoute, route
from gateway.api.proxy import Proxy
from gateway.api.refusals import note_model
from gateway.api.request import LogicalRequest
from gateway.api.stored import (
    MAX_ID_CHARS,
    RESPONSE_OBJECT_EVENTS,
    IdRewriter,
    MintFor,
    ResponseIds,
    StoredRef,
    generate_secret,
)
from gateway.api.tenancy import TenantGate
from gateway.api.terms import key_terms
from gateway.errors import ModelNotFound, ResponseNotFound
from gateway.hedge.generation import Live
from gateway.hedge.pool import PoolRuntime
from gateway.settings import Settings
from gateway.wire.base import Rewrite
from gateway.wire.responses import response_id_of
from gateway.wire.sse import SSEEvent
from gateway.wire.validate import validated

_RESPONSE_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_ID_CHARS}}}")
#: client query parameters of `GET /v1/responses/{id}/input_items` passed upstream
_ITEM_QUERY = ("after", "before", "limit", "order", "include", "include[]")


def responses_stateful(body: Mapping[str, Any]) -> bool:
    """True unless hedging cannot store a second response or fork stored state: only
    `"store": false` without `previous_response_id`, `conversation` or background mode."""
    return (
        body.get("store") is not False
        or body.get("previous_response_id") is not None
        or body.get("conversation") is not None
        or body.get("background") is True
    )


def build_responses_router(
    settings: Settings,
    live: Live,
    proxy: Proxy,
    fast: FastRoutes,
    gate: TenantGate,
) -> APIRouter:
    """The Responses routes. Like `gateway.api.chat.build_router`, the pools
    are read from `live` once per request (a reload never changes a running request's rules);
    a stored response whose pool or backend a reload removed is unknown from then on. The
    inference routes go into `fast` too (`gateway.api.asgi`) and check the key themselves.
    Response ids are signed with `server.response_id_secret`, else with a secret of this
    app's own (a single process: the supervisor gives its workers one)."""
    ids = ResponseIds(settings.server.response_id_secret or generate_secret())
    router = APIRouter()
    limit = settings.server.max_body_bytes

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

    def binding_of(request: Request) -> bytes:
        """The binding of the client's gateway key (empty when the gateway has no keys)."""
        return ids.binding(_bearer_key(request)) if gate.active else b""

    def find(response_id: object, binding: bytes) -> StoredRef | None:
        """What a client's response id says, when it verifies and belongs to this client."""
        if not isinstance(response_id, str) or not _RESPONSE_ID.fullmatch(response_id):
            return None
        ref = ids.read(response_id)
        if ref is None or not hmac.compare_digest(ref.binding, binding):
            return None
        pool = live.current.pools.get(ref.pool)
        return ref if pool is not None and ref.backend in pool.providers else None

    def minting(pool: str, binding: bytes, previous: tuple[str, str] | None
                ) -> Callable[[str, list[SSEEvent], bool], Rewrite | None]:
        """At commit: the rewrite of the upstream's response id into the client's id, and of
        the previous response's upstream id back into the one the client sent. `streamed`:
        the upstream answered as a stream (a non-streaming request may be read as one)."""
        def on_commit(backend: str, events: list[SSEEvent], streamed: bool) -> Rewrite:
            mint = MintFor(ids, pool, backend, binding)
            pairs = [previous] if previous is not None else []
            upstream_id = response_id_of(events, stream=streamed)
            minted = None if upstream_id is None else mint(upstream_id)
            if upstream_id is not None and minted is not None:
                pairs.insert(0, (upstream_id, minted))
            rewriter = IdRewriter(pairs, mint if upstream_id is None else None)
            return RESPONSE_OBJECT_EVENTS, rewriter

        return on_commit

    async def inference(request: Request, entry: InferenceRoute) -> Response:
        # one call for the request's checks, one for the body's (as the chat route); the
        # body's size in bytes is the estimate of its input tokens
        tenant, rid, raw = await receive(request, gate, limit, proxy.admission)
        checked, size = validated(raw, needs_prompt=entry.prompt), len(raw)
        del raw  # the parsed body is what goes on: the bytes would be held to the end
        body, model, stream = checked.body, checked.model, checked.stream
        logged_model = note_model(request.scope, body, live.current.hidden)
        if checked.refused is not None:
            raise checked.refused
        pool = pool_of(model)
        headers = headers_of(request)
        deadline = key_terms(tenant, model, headers)
        pinned = translated = None
        binding = binding_of(request)
        previous = body.get("previous_response_id")
        if previous is not None:
            ref = find(previous, binding)
            if ref is None or ref.pool != pool.settings.name:
                raise ResponseNotFound(f"no response {str(previous)[:200]!r} is known "
                                       "to this gateway", param="previous_response_id")
            pinned, translated = ref.backend, (ref.upstream_id, str(previous))
            body = {**body, "previous_response_id": ref.upstream_id}
        req = LogicalRequest(
            rid, entry.endpoint, body, stream, headers,
            protocol=entry.protocol, stateful=responses_stateful(body), pinned=pinned,
            on_commit=minting(pool.settings.name, binding, translated),
            route=entry.path, model=logged_model, body_bytes=size,
            key=None if tenant is None else tenant.name,
            hedging=tenant is None or tenant.settings.hedging.enabled,
            objective=deadline.objective, share=deadline.share, share_ratio=deadline.ratio,
            forward_headers=deadline.forward,
        )
        if tenant is not None:
            return await gate.limited(request, tenant, size, anthropic=False,
                                      handle=lambda: proxy.handle(request, pool, req))
        return await proxy.handle(request, pool, req)

    async def stored(request: Request, entry: InferenceRoute, response_id: str, suffix: str
                     ) -> Response:
        """A stored response's operation, sent to the backend that made it under the id that
        backend gave it; its answer carries the client's id again. Not a generation: no
        tokens, no latency samples (`metered`), but a request of the client's key all the
        same: its limits, budget and usage count it, and a response in a pool the key may
        not use (its pools narrowed since) is answered as one that does not exist."""
        tenant = gate.identify(request) if gate.active else None
        ref = find(response_id, binding_of(request))
        pool = live.current.pools.get(ref.pool) if ref is not None else None
        if ref is None or pool is None or (tenant is not None and not tenant.may_use(ref.pool)):
            raise ResponseNotFound(f"no response {response_id[:200]!r} is known to this "
                                   "gateway", param="response_id")
        # every value of a repeated parameter (`include[]=a&include[]=b`), in order
        query = tuple((k, v) for k, v in request.query_params.multi_items()
                      if k in _ITEM_QUERY)
        rewrite: Rewrite = (RESPONSE_OBJECT_EVENTS,
                            IdRewriter([(ref.upstream_id, response_id)]))
        req = LogicalRequest(
            request_id_of(request), "responses/item", {}, False, headers_of(request),
            protocol=entry.protocol, single=entry.single, pinned=ref.backend, method=entry.method,
            path=f"responses/{quote(ref.upstream_id, safe='')}{suffix}", query=query,
            on_commit=lambda _backend, _events, _streamed: rewrite, metered=False, route=entry.path,
            key=None if tenant is None else tenant.name,
        )
        if tenant is not None:  # no body: no input estimate
            return await gate.limited(request, tenant, 0, anthropic=False,
                                      handle=lambda: proxy.handle(request, pool, req))
        return await proxy.handle(request, pool, req)

    create = route("POST", "/v1/responses")
    retrieve = route("GET", "/v1/responses/{response_id}")
    delete = route("DELETE", "/v1/responses/{response_id}")
    cancel = route("POST", "/v1/responses/{response_id}/cancel")
    items = route("GET", "/v1/responses/{response_id}/input_items")

    @fast.post(router, create.path, create.protocol)
    async def responses(request: Request) -> Response:
        return await inference(request, create)

    @router.get(retrieve.path)
    async def get_response(request: Request, response_id: str) -> Response:
        return await stored(request, retrieve, response_id, "")

    @router.delete(delete.path)
    async def delete_response(request: Request, response_id: str) -> Response:
        return await stored(request, delete, response_id, "")

    @router.post(cancel.path)
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await stored(request, cancel, response_id, "/cancel")

    @router.get(items.path)
    async def input_items(request: Request, response_id: str) -> Response:
        return await stored(request, items, response_id, "/input_items")

    return router


def _bearer_key(request: Request) -> str:
    """The gateway key a Responses request presented (the guard has checked it)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
