"""The simulator as a real OpenAI-compatible HTTP server on loopback (`hedge-gateway sim`).

It takes a parsed `SimProfile`; the command line that describes one is `gateway.cli`'s.

Integration tests and benchmarks need an upstream with real sockets, real framing and real
disconnects; this serves the same plans and bytes (`providers.sim.wire`, each API's module)
as the in-process `SimProvider` (`providers.sim`). Each event is flushed as soon as it is
produced, so TTFT on the wire is the plan's TTFT. A request the real API would refuse gets its
400 in the route's shape (`providers.sim.validate`).

Per-request TTFT override: header ``x-sim-ttft-ms: <float>`` (deterministic tests and
benchmarks; never a body field, since bodies are also forwarded to real upstreams).

`GET /sim/stats` exposes per-server counters, so a test can check that the gateway really
closed a losing attempt: a stream the client drops before its end counts as `closed_early`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.settings import SimProfile
from gateway.wire.sse import encode_event
from providers.base import Endpoint
from providers.sim import protocols
from providers.sim.chat import sim_events, sim_response
from providers.sim.quota import SimQuota
from providers.sim.validate import Rejection, check_request, error_answer
from providers.sim.wire import (
    TTFT_HEADER,
    SimBreak,
    SimModel,
    SimPlan,
    parse_fault_headers,
    parse_ttft_override,
    retry_after_for,
)


@dataclass
class SimStats:
    """Counters of one server instance (not global: tests run several servers at once)."""

    requests: int = 0
    #: requests answered with a simulated fault status
    faults: int = 0
    streams_started: int = 0
    #: streams that sent [DONE]
    streams_completed: int = 0
    #: streams that ended with a simulated in-band error
    streams_errored: int = 0
    #: streams the plan broke mid-stream (reset, closed early, a half event)
    streams_broken: int = 0
    #: streams the client dropped before their end (including every hang)
    streams_closed_early: int = 0
    open_streams: int = 0
    #: token usage the server reported in full (a usage chunk of a completed stream, or a
    #: chat/completions body): what a gateway's token counters must add up to
    usage_input_tokens: int = 0
    usage_output_tokens: int = 0

    def add_usage(self, plan: SimPlan) -> None:
        self.usage_input_tokens += plan.prompt_tokens
        self.usage_output_tokens += len(plan.tokens)


#: what a `malformed` break writes before the body ends: an event cut in half
_HALF_EVENT = b'data: {"id":"cut-in-half","choices":[{"ind'


def _error(status: int, message: str | Rejection, endpoint: str = "") -> Response:
    """An error answer in the route's shape (Anthropic's on the Messages routes)."""
    rejection = message if isinstance(message, Rejection) else Rejection(message)
    body = error_answer(endpoint, status, rejection)
    headers: dict[str, str] = {}
    retry_after = retry_after_for(status)
    if retry_after is not None:
        headers["retry-after"] = str(math.ceil(retry_after))
    return JSONResponse(body, status_code=status, headers=headers)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sleep_while_connected(request: Request, delay: float) -> bool:
    """Sleep `delay` (may be inf); False if the client went away first (never a stuck task)."""
    sleeper = asyncio.ensure_future(asyncio.sleep(delay))
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({sleeper, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        watcher.cancel()
    return sleeper in done and watcher not in done


async def _encoded(
    events: AsyncGenerator[tuple[bytes, bytes], None],
) -> AsyncGenerator[bytes, None]:
    async with aclosing(events):
        async for name, data in events:
            yield encode_event(data, name)


class _SimStream(StreamingResponse):
    """A stream's response, counted in `SimStats` by how it ended (completed, the plan's
    in-band error, or dropped by the client before its end), with StreamingResponse's headers
    and the same wire: one ASGI send, so one write, per event, as soon as it is produced.

    Leaner than StreamingResponse's own `__call__` because the bench's zero-delay workload
    makes the simulator one of the processes sharing the load client's core: that runs an
    anyio task group per response; this runs one plain task that waits for the disconnect
    and then cancels the stream (which may be sleeping, even forever in a hang)."""

    def __init__(self, events: AsyncGenerator[bytes, None], stats: SimStats,
                 headers: Mapping[str, str], plan: SimPlan, *, usage: bool) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events, self._stats, self._plan, self._usage = events, stats, plan, usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats, stream = self._stats, asyncio.current_task()
        assert stream is not None
        gone = False

        async def until_disconnect() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            stream.cancel()

        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        watcher = asyncio.ensure_future(until_disconnect())
        stats.streams_started += 1
        stats.open_streams += 1
        finished = broken = False
        try:
            try:
                async with aclosing(self._events) as events:
                    async for chunk in events:
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                finished = True
            except SimBreak as exc:  # the plan breaks the stream here, as `kind` says
                broken = True
                stats.streams_broken += 1
                if exc.kind == "reset":  # the server drops the connection mid-body
                    raise
                if exc.kind == "malformed":  # half an event, then the body ends
                    await send({"type": "http.response.body", "body": _HALF_EVENT,
                                "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            stream.uncancel()  # the client went away: this response simply ends
        finally:
            # cancelled before it runs again, so the completion (which also wakes
            # `receive`) is not taken for a disconnect
            watcher.cancel()
            stats.open_streams -= 1
            if broken:
                pass
            elif not finished:
                stats.streams_closed_early += 1
            elif self._plan.midstream_error_after is not None:
                stats.streams_errored += 1
            else:
                stats.streams_completed += 1
                if self._usage and self._plan.usage:
                    stats.add_usage(self._plan)


class _SimServer:
    """The request handlers, bound to one model (one rng) and one set of counters."""

    def __init__(self, profile: SimProfile, seed: int | None) -> None:
        self.model = SimModel(profile, random.Random(seed))
        self.stats = SimStats()
        #: the request quota its answers state (`providers.sim.quota`), when it has one
        self.quota = SimQuota(profile.rate_limit_requests, profile.rate_limit_window) \
            if profile.rate_limit_requests else None

    async def _plan(self, request: Request,
                    endpoint: str) -> tuple[dict[str, Any], SimPlan] | Response:
        """The request's body and plan, or the error response (bad input, what the real API
        refuses, simulated fault). A request without a body (GET a stored response) reads as
        `{}`."""
        self.stats.requests += 1
        raw = await request.body()
        try:
            body = json.loads(raw) if raw or request.method == "POST" else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not valid JSON", endpoint)
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", endpoint)
        try:
            override = parse_ttft_override(request.headers.get(TTFT_HEADER))
            faults = parse_fault_headers(request.headers)
        except ValueError as exc:
            return _error(400, str(exc), endpoint)
        rejection = check_request(endpoint, body)
        if rejection is not None:
            return _error(400, rejection, endpoint)
        plan = self.model.plan(body, endpoint=endpoint, ttft_override=override, faults=faults)
        if plan.status != 200:
            self.stats.faults += 1
            return _error(plan.status, "simulated failure", endpoint)
        return body, plan

    async def _start(
        self, request: Request, endpoint: str
    ) -> Response | tuple[dict[str, Any], SimPlan, str, str, dict[str, str]]:
        """What both handlers begin with: the plan (or the planned failure as a response), the
        model to echo, the request id and the headers that carry it (with the quota's)."""
        quota, now = self.quota, time.monotonic()
        if quota is not None and not quota.take(now):
            self.stats.requests += 1
            self.stats.faults += 1
            refused = _error(429, "simulated quota exceeded", endpoint)
            refused.headers.update({**quota.headers(endpoint, now),
                                    "retry-after": f"{quota.retry_after(now):g}"})
            return refused
        planned = await self._plan(request, endpoint)
        if isinstance(planned, Response):
            return planned
        body, plan = planned
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        if quota is not None:
            headers.update(quota.headers(endpoint, now))
        return body, plan, str(body.get("model", "sim")), request_id, headers

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        started = await self._start(request, endpoint)
        if isinstance(started, Response):
            return started
        body, plan, model, request_id, headers = started
        if body.get("stream") is True and endpoint != "embeddings":
            headers["cache-control"] = "no-cache"
            events = sim_events(
                plan, endpoint=endpoint, model=model, request_id=request_id, sleep=asyncio.sleep
            )
            return _SimStream(events, self.stats, headers, plan, usage=True)
        wait = plan.response_time(endpoint)
        if not await _sleep_while_connected(request, wait):
            return Response(status_code=499)  # nobody is listening any more
        if plan.midstream_error_after is not None:
            return _error(500, "simulated failure")
        if endpoint != "embeddings":
            self.stats.add_usage(plan)
        return JSONResponse(sim_response(plan, endpoint, model, request_id), headers=headers)

    async def handle_protocol(self, request: Request, endpoint: str) -> Response:
        """The Responses API and Messages routes: same plans, their own wire."""
        started = await self._start(request, endpoint)
        if isinstance(started, Response):
            return started
        body, plan, model, request_id, headers = started
        created = int(time.time())
        if body.get("stream") is True and endpoint in ("responses", "messages"):
            events = protocols.protocol_stream(plan, endpoint, model=model, request_id=request_id,
                                               sleep=asyncio.sleep, created=created)
            return _SimStream(_encoded(events), self.stats, headers, plan, usage=False)
        if not await _sleep_while_connected(request, protocols.response_time(plan, endpoint)):
            return Response(status_code=499)
        if plan.midstream_error_after is not None:
            return _error(500, "simulated failure", endpoint)
        path = request.url.path.removeprefix("/v1/")
        answer = protocols.protocol_body(plan, endpoint, method=request.method, path=path,
                                         model=model, request_id=request_id, created=created)
        return JSONResponse(answer, headers=headers)

    async def chat(self, request: Request) -> Response:
        return await self.handle(request, "chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, "completions")

    async def embeddings(self, request: Request) -> Response:
        return await self.handle(request, "embeddings")

    async def models(self, request: Request) -> Response:
        card = {"id": "sim", "object": "model", "created": 0, "owned_by": "hedge-gateway-sim"}
        return JSONResponse({"object": "list", "data": [card]})

    async def stats_route(self, request: Request) -> Response:
        return JSONResponse(asdict(self.stats))


class SimApp:
    """The simulator's ASGI app. A POST to a streaming route (chat, legacy completions, the
    Responses API, Messages) goes straight to its handler, without Starlette's routing and
    middleware, which wrap every send of every event (the bench's zero-delay workload sends
    53 per request); every other request goes through the Starlette app (its routes, 404s
    and 405s). All four alike: the bench's `translated` row reads Messages where hedging-on
    reads chat, and a slower writer on one would be measured as the gateway's cost."""

    _DIRECT: Mapping[str, Endpoint] = {"/v1/chat/completions": "chat/completions",
                                       "/v1/completions": "completions"}
    _DIRECT_PROTOCOL: Mapping[str, str] = {"/v1/responses": "responses",
                                           "/v1/messages": "messages"}

    def __init__(self, server: _SimServer, routes: Starlette) -> None:
        self._server, self._routes = server, routes
        self.stats = server.stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope.get("path", "")
            endpoint = self._DIRECT.get(path)
            if endpoint is not None:
                response = await self._server.handle(Request(scope, receive), endpoint)
                await response(scope, receive, send)
                return
            protocol = self._DIRECT_PROTOCOL.get(path)
            if protocol is not None:
                response = await self._server.handle_protocol(Request(scope, receive), protocol)
                await response(scope, receive, send)
                return
        await self._routes(scope, receive, send)


def create_sim_app(profile: SimProfile, *, seed: int | None = None) -> SimApp:
    """An ASGI app simulating one backend. `seed` overrides `profile.seed` when given."""
    server = _SimServer(profile, seed if seed is not None else profile.seed)
    item = partial(server.handle_protocol, endpoint="responses/item")
    routes = Starlette(
        routes=[
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/embeddings", server.embeddings, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/responses", partial(server.handle_protocol, endpoint="responses"),
                  methods=["POST"]),
            Route("/v1/responses/{rid}", item, methods=["GET", "DELETE"]),
            Route("/v1/responses/{rid}/cancel", item, methods=["POST"]),
            Route("/v1/responses/{rid}/input_items", item, methods=["GET"]),
            Route("/v1/messages", partial(server.handle_protocol, endpoint="messages"),
                  methods=["POST"]),
            Route("/v1/messages/count_tokens",
                  partial(server.handle_protocol, endpoint="messages/count_tokens"),
                  methods=["POST"]),
            Route("/sim/stats", server.stats_route, methods=["GET"]),
        ]
    )
    return SimApp(server, routes)


async def serve_sim(host: str, port: int, profile: SimProfile, seed: int | None = None) -> None:
    """Serve until interrupted. Streams still open at shutdown are cut after 5 seconds."""
    config = uvicorn.Config(
        create_sim_app(profile, seed=seed),
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    await uvicorn.Server(config).serve()


def run_sim(host: str, port: int, profile: SimProfile, seed: int | None = None) -> None:
    asyncio.run(serve_sim(host, port, profile, seed))


def stats_of(app: SimApp) -> Mapping[str, Any]:
    """The counters of an app made by `create_sim_app`, without going over HTTP."""
    return asdict(app.stats)
