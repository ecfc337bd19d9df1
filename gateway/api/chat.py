"""The OpenAI routes: chat completions, legacy completions, embeddings, and the model list
(in Anthropic's shape too, for the Anthropic SDKs).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from gateway.api.asgi import FastRoutes
from gateway.api.common import receive
from gateway.api.inference import InferenceRoute, route
from gateway.api.proxy import Proxy
from gateway.api.refusals import note_model
from gateway.api.request import LogicalRequest
from gateway.api.tenancy import TenantGate, supplied_key
from gateway.api.terms import key_terms
from gateway.errors import (
    InvalidRequest,
    ModelNotFound,
)
from gateway.hedge.generation import Live
from gateway.settings import Settings
from gateway.wire.validate import validated


def build_router(settings: Settings, live: Live, proxy: Proxy, fast: FastRoutes,
                 gate: TenantGate) -> APIRouter:
    """The API routes. `settings.server` is bound here (body limit: a start-time key); the
    client keys are `gate`'s (`server.api_keys` and `keys:`), read per request so a reload
    can change them; the pools are read from `live` once per request, so a request keeps the
    generation it started with through a reload. The inference routes go into `fast` too
    (`gateway.api.asgi`) and check the key themselves; `/v1/models` has it as a dependency."""
    router = APIRouter()
    # the inference routes check the key only while there are keys: FastAPI solving a
    # dependency costs about 4 % of a streamed request's CPU; /v1/models is not hot
    guarded = APIRouter(dependencies=[Depends(gate.guard)])
    limit = settings.server.max_body_bytes

    async def proxied(request: Request, entry: InferenceRoute) -> Response:
        # one call for the request's checks (key, id, content type, body), one for the body's
        # (parsed, then its shape): each file of the walk entered once
        tenant, rid, raw = await receive(request, gate, limit, proxy.admission)
        checked, size = validated(raw, needs_prompt=entry.prompt), len(raw)
        del raw  # the parsed body is what goes on: the bytes would be held to the end
        body, model, stream = checked.body, checked.model, checked.stream
        generation = live.current
        logged_model = note_model(request.scope, body, generation.hidden)
        if checked.refused is not None:
            raise checked.refused
        if entry.endpoint == "embeddings" and stream:
            raise InvalidRequest("embeddings cannot be streamed", param="stream")
        pool = generation.pools.get(model)
        if pool is None:
            raise ModelNotFound(
                "the model does not exist in this gateway; GET /v1/models lists them",
                param="model",
            )
        headers = {k.lower(): v for k, v in request.headers.items()}
        deadline = key_terms(tenant, model, headers)
        req = LogicalRequest(rid, entry.endpoint, body, stream, headers, entry.protocol,
                             route=entry.path, model=logged_model, body_bytes=size,
                             key=None if tenant is None else tenant.name,
                             hedging=tenant is None or tenant.settings.hedging.enabled,
                             objective=deadline.objective, share=deadline.share,
                             share_ratio=deadline.ratio, forward_headers=deadline.forward)
        if tenant is not None:
            return await gate.limited(request, tenant, size, anthropic=False,
                                      handle=lambda: proxy.handle(request, pool, req))
        return await proxy.handle(request, pool, req)

    chat = route("POST", "/v1/chat/completions")
    legacy = route("POST", "/v1/completions")
    embed = route("POST", "/v1/embeddings")

    @fast.post(router, chat.path, chat.protocol)
    async def chat_completions(request: Request) -> Response:
        return await proxied(request, chat)

    @fast.post(router, legacy.path, legacy.protocol)
    async def completions(request: Request) -> Response:
        return await proxied(request, legacy)

    @fast.post(router, embed.path, embed.protocol)
    async def embeddings(request: Request) -> Response:
        return await proxied(request, embed)

    @guarded.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """The pools, in OpenAI's list shape, or in Anthropic's when the request carries
        `anthropic-version` (the Anthropic SDKs and tools send it on every call)."""
        names = list(live.current.pools)
        # a named key sees the pools it may use (the dependency has checked the key)
        tenant = gate.tenants.find(supplied_key(request, x_api_key=False))
        if tenant is not None:
            names = [name for name in names if tenant.may_use(name)]
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


def anthropic_model_list(names: list[str]) -> dict[str, Any]:
    """Anthropic's `GET /v1/models` page: every pool on one page. A pool has no creation
    date, so `created_at` is the epoch, as OpenAI's `created: 0` says the same."""
    data = [{"type": "model", "id": name, "display_name": name,
             "created_at": "1970-01-01T00:00:00Z"} for name in names]
    return {"data": data, "has_more": False,
            "first_id": names[0] if names else None, "last_id": names[-1] if names else None}
