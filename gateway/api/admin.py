"""`/admin/keys`: client keys made, listed and revoked at run time, and their usage.

Behind `server.admin_keys` (as Bearer): while that is empty the routes answer 404, as routes
that do not exist. The store is written in a worker thread; this process adopts the change at
once, the others within their next poll (`gateway.api.keystore`). A new key's secret is in the
creating answer only: the store keeps its digest.

    POST   /admin/keys                {name, pools?, limits?}  -> 201 {name, key, pools, limits}
    GET    /admin/keys                                         -> {data: [{name, source, ...}]}
    DELETE /admin/keys/{name}                                  -> {name, revoked: true}
    GET    /admin/keys/{name}/usage                            -> {data: [{day, requests, ...}]}
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from gateway.api.common import check_json_type, read_body
from gateway.api.keys import KeyRing
from gateway.api.keystore import TenantSync
from gateway.api.tenancy import supplied_key
from gateway.errors import InvalidRequest, KeyConflict, RouteNotFound, Unauthorized
from gateway.hedge.generation import Live
from gateway.settings.fields import ConfigError
from gateway.settings.tenants import TenantBudget, TenantLimits
from gateway.tenants.spend import DECIMALS
from gateway.tenants.store import KEY_NAME, KEY_NAME_RULE, StoreError
from gateway.wire.validate import parse_body

if TYPE_CHECKING:
    from gateway.tenants.stores import TenantStore

#: the largest body an admin request may send
MAX_ADMIN_BODY = 64 * 1024


def build_admin_router(admin: KeyRing, sync: TenantSync | None, live: Live) -> APIRouter:
    """The admin routes over `sync`'s store (None: the gateway has no store, so the routes
    are not there either)."""
    router = APIRouter()

    def store_for(request: Request) -> TenantStore:
        """The store, once the request shows an admin key; 404 without an admin API."""
        if not admin.digests or sync is None or sync.store is None:
            raise RouteNotFound("no such route")
        if not admin.matches(supplied_key(request, x_api_key=False)):
            raise Unauthorized("missing or invalid admin key")
        return sync.store

    async def adopt() -> None:
        if sync is not None:
            await sync.poll()

    @router.post("/admin/keys")
    async def create_key(request: Request) -> Response:
        store = store_for(request)
        check_json_type(request)
        body = parse_body(await read_body(request, MAX_ADMIN_BODY))
        name, pools, limits, budget = _key_request(body, set(live.current.pools))
        if sync is not None and any(key.name == name for key in sync.gate.configured):
            raise KeyConflict(f"key {name!r} is defined in the configuration file")
        try:
            secret, key = await asyncio.to_thread(functools.partial(
                store.create_key, name, pools, limits, budget=budget))
        except StoreError as exc:
            raise KeyConflict(str(exc)) from None
        await adopt()
        return JSONResponse({"name": key.name, "key": secret, "pools": list(key.pools),
                             "limits": dataclasses.asdict(key.limits),
                             "budget": dataclasses.asdict(key.budget)}, status_code=201)

    @router.get("/admin/keys")
    async def list_keys(request: Request) -> dict[str, Any]:
        store = store_for(request)
        stored = await asyncio.to_thread(store.list_keys)
        data: list[dict[str, Any]] = [
            {"name": key.name, "source": "config", "pools": list(key.pools),
             "limits": dataclasses.asdict(key.limits),
             "budget": dataclasses.asdict(key.budget), "created": None, "revoked": None}
            for key in (sync.gate.configured if sync is not None else ())]
        data += [{"name": key.name, "source": "store", "pools": list(key.pools),
                  "limits": dataclasses.asdict(key.limits),
                  "budget": dataclasses.asdict(key.budget), "created": key.created,
                  "revoked": key.revoked, **({"invalid": True} if key.invalid else {})}
                 for key in stored]
        return {"data": data}

    @router.delete("/admin/keys/{name}")
    async def revoke_key(request: Request, name: str) -> dict[str, Any]:
        store = store_for(request)
        if sync is not None and any(key.name == name for key in sync.gate.configured):
            raise KeyConflict(f"key {name!r} is defined in the configuration file: remove it "
                              "there and reload")
        try:
            await asyncio.to_thread(store.revoke, name)
        except StoreError as exc:
            raise RouteNotFound(str(exc)) from None
        await adopt()
        return {"name": name, "revoked": True}

    @router.get("/admin/keys/{name}/usage")
    async def key_usage(request: Request, name: str) -> dict[str, Any]:
        store = store_for(request)
        if sync is not None:
            await sync.flush()  # this process's latest batch first
        rows = await asyncio.to_thread(store.usage, name)
        return {"name": name, "data": [
            {"day": row.day, "requests": row.requests, "input_tokens": row.input_tokens,
             "output_tokens": row.output_tokens,
             "spend_usd": round(row.spend_usd, DECIMALS)} for row in rows]}

    return router


def _key_request(body: dict[str, Any], pools: set[str]
                 ) -> tuple[str, tuple[str, ...], TenantLimits, TenantBudget]:
    """The name, pools, limits and budget a create request asks for; 400 naming what is
    wrong."""
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("name: required, a string", param="name")
    if not KEY_NAME.fullmatch(name):  # 409 is kept for a name that is taken
        raise InvalidRequest(f"name: must be {KEY_NAME_RULE}", param="name")
    wanted = body.get("pools", [])
    if not isinstance(wanted, list) or not all(isinstance(p, str) for p in wanted):
        raise InvalidRequest("pools: must be a list of pool names", param="pools")
    unknown = [pool for pool in wanted if pool not in pools]
    if unknown:
        raise InvalidRequest(f"pools: no pool named {unknown[0]!r}", param="pools")
    limits = body.get("limits", {})
    fields = {f.name for f in dataclasses.fields(TenantLimits)}
    if not isinstance(limits, dict) or not set(limits) <= fields:
        raise InvalidRequest(f"limits: a mapping of {', '.join(sorted(fields))}",
                             param="limits")
    try:
        checked = TenantLimits(**limits)
    except ConfigError as exc:
        raise InvalidRequest("limits: " + "; ".join(exc.errors), param="limits") from None
    budget = body.get("budget", {})
    if not isinstance(budget, dict) or not set(budget) <= {"usd", "period"}:
        raise InvalidRequest("budget: a mapping of period, usd", param="budget")
    try:
        return name, tuple(wanted), checked, TenantBudget(**budget)
    except ConfigError as exc:
        raise InvalidRequest("budget: " + "; ".join(exc.errors), param="budget") from None
