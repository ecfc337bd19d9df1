"""The Anthropic Messages routes: `/v1/messages` and `/v1/messages/count_tokens`.

Like `gateway.api.chat`, these only read and check a request and hand a `LogicalRequest` to the
proxy; what differs is the `WireProtocol` (first token, end, error shapes: Anthropic's, the
route table's `MESSAGES` and `COUNT_TOKENS`), the beta features the client asks for
(`anthropic-beta`, passed upstream), and the gateway key, which may come as `x-api-key` as well
as Bearer. Counting tokens is one attempt, never hedged.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.asgi import FastRoutes
from gateway.api.common import receive
from gateway.api.inference import InferenceRoute, route
from gateway.api.proxy import Proxy
from gateway.api.refusals import note_model
from gateway.api.request import LogicalRequest
from gateway.api.tenancy import TenantGate
from gateway.api.terms import key_terms
from gateway.errors import ModelNotFound
from gateway.hedge.generation import Live
from gateway.settings import Settings
from gateway.wire.validate import validated

#: client headers passed upstream on /v1/messages (the beta features it asks for)
_MESSAGES_FORWARD = ("anthropic-beta",)


def build_messages_router(settings: Settings, live: Live, proxy: Proxy, fast: FastRoutes,
                          gate: TenantGate) -> APIRouter:
    """The Messages routes. Like `gateway.api.chat.build_router`, the pools are read from
    `live` once per request (a reload never changes a running request's rules); the routes go
    into `fast` too (`gateway.api.asgi`) and check the key (`gate`) themselves."""
    router = APIRouter()
    limit = settings.server.max_body_bytes

    async def inference(request: Request, entry: InferenceRoute) -> Response:
        # one call for the request's checks, one for the body's (as the chat route)
        tenant, rid, raw = await receive(request, gate, limit, proxy.admission, x_api_key=True)
        checked, size = validated(raw, needs_prompt=entry.prompt), len(raw)
        del raw  # the parsed body is what goes on: the bytes would be held to the end
        body, model, stream = checked.body, checked.model, checked.stream
        logged_model = note_model(request.scope, body, live.current.hidden)
        if checked.refused is not None:
            raise checked.refused
        pool = live.current.pools.get(model)
        if pool is None:
            raise ModelNotFound(
                "the model does not exist in this gateway; GET /v1/models lists them",
                param="model",
            )
        headers = {k.lower(): v for k, v in request.headers.items()}
        deadline = key_terms(tenant, model, headers)
        forward = {k: headers[k] for k in _MESSAGES_FORWARD if k in headers}
        forward.update(deadline.forward)
        req = LogicalRequest(rid, entry.endpoint, body, stream, headers,
                             protocol=entry.protocol,
                             single=entry.single,
                             forward_headers=forward, route=entry.path, model=logged_model,
                             body_bytes=size, key=None if tenant is None else tenant.name,
                             hedging=tenant is None or tenant.settings.hedging.enabled,
                             objective=deadline.objective, share=deadline.share,
                             share_ratio=deadline.ratio)
        if tenant is not None:
            return await gate.limited(request, tenant, size, anthropic=True,
                                      handle=lambda: proxy.handle(request, pool, req))
        return await proxy.handle(request, pool, req)

    create = route("POST", "/v1/messages")
    count = route("POST", "/v1/messages/count_tokens")

    @fast.post(router, create.path, create.protocol)
    async def messages(request: Request) -> Response:
        return await inference(request, create)

    @fast.post(router, count.path, count.protocol)
    async def count_tokens(request: Request) -> Response:
        return await inference(request, count)

    return router
