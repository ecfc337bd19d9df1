"""Every request to an inference route writes exactly one request-log line, refused ones
included: the route table (`gateway.api.inference.INFERENCE_ROUTES`) x every way a request
is refused, over real sockets, the gateway under the server class `serve` runs.

The cases are generated: a route added to the table is refused here in every way that
applies to it. Each request carries its own `x-request-id`; once every request task of the
server has ended (nothing more can be written), the log must hold exactly one line with that
id, naming the route, the method, the model as sent (or null where the body was never
read), the status answered and the machine reason, and neither the client's credentials
nor the gateway's or the provider's keys. The answer itself must be in the route's error
shape. Raw httpx sends the requests, because most of these are requests an SDK will not
make (a wrong content type, broken JSON, a wrong method); the SDK tests at the end show the
refusals an SDK does make.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.api.inference import INFERENCE_ROUTES, InferenceRoute
from gateway.api.stored import ResponseIds
from gateway.settings import (
    BackendSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
)
from gateway.stats.requestlog import LOGGER_NAME
from gateway.wire.paths import errors_of
from tests.harness import LoopThread
from tests.harness.bodies import PROMPTS, smallest_body
from tests.harness.limits_kit import Gateway, GatewayFactory, connect, request_head, wait_for

CLIENT_KEY = "gw-client-key-7f3a9c"
WRONG_KEY = "sk-wrong-0b8e4d21aa97c6f3"
PROVIDER_KEY = "sk-provider-4c2e8f1d9b7a"
SECRET = "response-id-secret-5d1c"
POOL = "pool"
#: held before its first token for as long as a test runs (the overload case's occupant)
SLOW = "slow"
#: a pool whose only backend speaks Anthropic's Messages and nothing else, and which keeps
#: each request on its own API (`translate: false`)
MESSAGES_ONLY = "msgonly"
#: the same backend in a pool that translates: a chat request Messages cannot carry (`n: 2`)
#: is refused naming the field
TRANSLATING = "translating"
MAX_BODY = 2048
#: a model name with a newline, an escape sequence and a bidi override in it
HOSTILE_MODEL = "no-such\nmodel\x1b[2J\u202e"
HOSTILE_LOGGED = "no-such\\x0amodel\\x1b[2J\\u202e"
_ids = itertools.count()


def settings() -> Settings:
    fast = SimProfile(ttft_median=0.005, ttft_sigma=0.1, straggler_probability=0.0, tokens=3,
                      inter_token=0.001, seed=1)
    slow = SimProfile(ttft_median=600.0, ttft_sigma=0.0, straggler_probability=0.0, seed=2)
    return Settings(
        pools=(
            PoolSettings(name=POOL, backends=(
                BackendSettings(name="s0", provider="sim", model="m", sim=fast),)),
            PoolSettings(name=SLOW, backends=(
                BackendSettings(name="z0", provider="sim", model="m", sim=slow),)),
            PoolSettings(name=MESSAGES_ONLY, backends=(
                BackendSettings(name="a0", provider="anthropic", model="m",
                                base_url="http://127.0.0.1:9", api_key=PROVIDER_KEY),),
                         translate=False),
            PoolSettings(name=TRANSLATING, backends=(
                BackendSettings(name="a1", provider="anthropic", model="m",
                                base_url="http://127.0.0.1:9", api_key=PROVIDER_KEY),)),
        ),
        server=ServerSettings(api_keys=(CLIENT_KEY,), max_body_bytes=MAX_BODY,
                              max_concurrent_requests=1, response_id_secret=SECRET),
    )


# ---- what a refusal kind sends, and what its line must say ----------------------------------


@dataclass
class Ctx:
    """One case's gateway, and how to reach it."""

    gateway: Gateway
    loop_thread: LoopThread
    http: httpx.Client
    #: cleanups of what a kind's `prepare` holds (the occupant of the admission slot)
    undo: list[Callable[[], None]] = field(default_factory=list)


@dataclass(frozen=True)
class Kind:
    name: str
    status: int
    reason: str
    #: whether it applies to a route
    applies: Callable[[InferenceRoute], bool]
    #: the request: (method, path, headers, body bytes or None) from the route's defaults
    shape: Callable[[InferenceRoute, dict[str, Any]], dict[str, Any]] = \
        lambda route, request: request
    #: the model the line must name (None: the body was never read)
    model: Callable[[InferenceRoute], str | None] = lambda route: None
    #: what must hold before the request is sent
    prepare: Callable[[Ctx], None] | None = None
    #: the line names no route (the path matched none): it carries the path
    unmatched: bool = False


def stored_id(binding_key: str | None = CLIENT_KEY) -> str:
    """An id the gateway would have minted for a response of pool `POOL`'s backend."""
    ids = ResponseIds(SECRET)
    minted = ids.mint(POOL, "s0", "resp_upstream_1", ids.binding(binding_key))
    assert minted is not None
    return minted


def default_request(route: InferenceRoute, model: str = POOL) -> dict[str, Any]:
    path = route.path.replace("{response_id}", stored_id())
    headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-request-id": f"refused-{next(_ids)}"}
    body = smallest_body(route, model)
    if body is not None:
        headers["content-type"] = "application/json"
    return {"method": route.method, "path": path, "headers": headers,
            "content": None if body is None else json.dumps(body).encode()}


def _with_body(request: dict[str, Any], **changes: Any) -> dict[str, Any]:
    body = json.loads(request["content"])
    body.update(changes)
    return {**request, "content": json.dumps(body).encode()}


def _headers(request: dict[str, Any], **changes: str) -> dict[str, Any]:
    return {**request, "headers": {**request["headers"], **changes}}


def hold_the_only_slot(ctx: Ctx) -> None:
    """A streamed request to the slow pool takes the one admission slot and keeps it (no
    first token comes) until the case ends and its connection closes."""
    body = json.dumps({"model": SLOW, "stream": True, "messages": PROMPTS["messages"]})
    sock = connect(ctx.gateway.port)
    sock.sendall(request_head("/v1/chat/completions", {
        "authorization": f"Bearer {CLIENT_KEY}", "content-type": "application/json",
        "content-length": str(len(body)), "x-request-id": "occupant"}) + body.encode())
    ctx.undo.append(lambda: _hang_up(sock))
    assert wait_for(lambda: ctx.gateway.app.state.proxy.admission.active == 1)


def _hang_up(sock: socket.socket) -> None:
    sock.close()


def start_draining(ctx: Ctx) -> None:
    async def drain() -> None:
        ctx.gateway.app.state.drain.start()

    ctx.loop_thread.run(drain())


def _bodied(route: InferenceRoute) -> bool:
    return not route.stored


KINDS = (
    Kind("unauthorized", 401, "unauthorized", lambda r: True,
         lambda r, q: _headers(q, authorization=f"Bearer {WRONG_KEY}")),
    Kind("forbidden_origin", 403, "forbidden_origin", lambda r: True,
         lambda r, q: _headers(q, origin="https://evil.example")),
    Kind("method_not_allowed", 405, "method_not_allowed", lambda r: True,
         lambda r, q: {**q, "method": "PATCH"}),
    Kind("unknown_route", 404, "unknown_route", lambda r: True,
         lambda r, q: {**q, "path": q["path"].removeprefix("/v1")}, unmatched=True),
    Kind("unsupported_media_type", 415, "unsupported_media_type", _bodied,
         lambda r, q: _headers(q, **{"content-type": "text/plain"})),
    Kind("body_too_large", 413, "body_too_large", _bodied,
         lambda r, q: _with_body(q, padding="x" * (MAX_BODY + 1))),
    Kind("invalid_json", 400, "invalid_json", _bodied,
         lambda r, q: {**q, "content": b'{"model": "pool", '}),
    Kind("forbidden_field", 400, "forbidden_field", _bodied,
         lambda r, q: _with_body(q, api_base="http://127.0.0.1:9"), lambda r: POOL),
    Kind("unknown_model", 404, "unknown_model", _bodied,
         lambda r, q: _with_body(q, model=HOSTILE_MODEL), lambda r: HOSTILE_LOGGED),
    Kind("route_not_served", 404, "route_not_served",
         lambda r: _bodied(r) and r.errors == "openai",
         lambda r, q: _with_body(q, model=MESSAGES_ONLY), lambda r: MESSAGES_ONLY),
    Kind("untranslatable_field", 400, "untranslatable_field",
         lambda r: r.endpoint == "chat/completions",
         lambda r, q: _with_body(q, model=TRANSLATING, n=2), lambda r: TRANSLATING),
    Kind("unknown_response", 404, "unknown_response", lambda r: r.stored,
         lambda r, q: {**q, "path": r.path.replace("{response_id}", stored_id("other-key"))}),
    Kind("overloaded", 503, "overloaded", lambda r: True,
         model=lambda r: None if r.stored else POOL, prepare=hold_the_only_slot),
    Kind("draining", 503, "draining", lambda r: True,
         model=lambda r: None if r.stored else POOL, prepare=start_draining),
)

CASES = [pytest.param(route, kind, id=f"{route.method} {route.path} {kind.name}")
         for route in INFERENCE_ROUTES for kind in KINDS if kind.applies(route)]


# ---- the log -------------------------------------------------------------------------------


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The request log's lines, as parsed from the message (what an operator's file holds);
    each message's structured copy must say the same."""
    found = []
    for record in caplog.records:
        if record.name == LOGGER_NAME:
            line = json.loads(record.getMessage())
            assert line == record.hedge_request  # type: ignore[attr-defined]
            found.append(line)
    return found


def settle(gateway: Gateway) -> None:
    """Every request task of the server has ended: no line can be written after this."""
    assert wait_for(lambda: not gateway.server.server_state.tasks)


def no_secret_in(caplog: pytest.LogCaptureFixture) -> None:
    text = "\n".join(r.getMessage() for r in caplog.records)
    for secret in (CLIENT_KEY, WRONG_KEY, PROVIDER_KEY, SECRET):
        assert secret not in text, f"{secret!r} is in the log"


def check_shape(path: str, reply: httpx.Response, status: int) -> None:
    """The answer: the status, in the error shape of the path (the route's, for a path of
    the table)."""
    assert reply.status_code == status, reply.text
    body = reply.json()
    if errors_of(path) == "anthropic":
        assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
    else:
        assert isinstance(body["error"]["message"], str), body


@pytest.fixture
def ctx(loop_thread: LoopThread) -> Iterator[Ctx]:
    gateway = GatewayFactory(loop_thread)(settings())
    with httpx.Client(base_url=gateway.root, timeout=10.0, trust_env=False) as http:
        context = Ctx(gateway, loop_thread, http)
        try:
            yield context
        finally:
            for undo in context.undo:
                undo()


@pytest.mark.parametrize(("route", "kind"), CASES)
def test_each_refused_request_writes_one_line(
    route: InferenceRoute, kind: Kind, ctx: Ctx, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    if kind.prepare is not None:
        kind.prepare(ctx)
    request = kind.shape(route, default_request(route))
    rid = request["headers"]["x-request-id"]
    reply = ctx.http.request(request["method"], request["path"], headers=request["headers"],
                             content=request["content"])
    check_shape(request["path"], reply, kind.status)
    assert reply.headers["x-request-id"] == rid
    for undo in ctx.undo:  # the occupant leaves: its own line is written too
        undo()
    ctx.undo.clear()
    settle(ctx.gateway)
    mine = [line for line in lines(caplog) if line["id"] == rid]
    assert len(mine) == 1, mine
    line = mine[0]
    assert line["status"] == kind.status
    assert line["reason"] == kind.reason
    assert line["method"] == request["method"]
    assert line["model"] == kind.model(route)
    if kind.unmatched:  # the path, a response id in it redacted (it is shaped like a token)
        assert line["route"] is None
        assert line["path"] == request["path"].replace(stored_id(), "[redacted]")
    else:
        assert line["route"] == route.path
    if kind.reason in ("overloaded", "draining"):  # reached a pool: the proxy's full line
        assert line["outcome"] == "overloaded" and line["attempts"] == []
    else:
        assert line["outcome"] == "refused"
    no_secret_in(caplog)


def test_an_answered_request_of_each_route_writes_one_line_too(
    ctx: Ctx, caplog: pytest.LogCaptureFixture
) -> None:
    """The other half of "every request": answered requests carry the same leading fields.
    The stored-response operations act on a response the gateway created just before."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    sent: list[tuple[InferenceRoute, str]] = []
    auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    for route in INFERENCE_ROUTES:
        request = default_request(route)
        if route.stored:
            made = ctx.http.post("/v1/responses", json={"model": POOL, "input": "hi"},
                                 headers=auth)
            assert made.status_code == 200, made.text
            request["path"] = route.path.replace("{response_id}", made.json()["id"])
        reply = ctx.http.request(request["method"], request["path"],
                                 headers=request["headers"], content=request["content"])
        assert reply.status_code == 200, (route, reply.text)
        sent.append((route, request["headers"]["x-request-id"]))
    settle(ctx.gateway)
    logged = lines(caplog)
    for route, rid in sent:
        mine = [line for line in logged if line["id"] == rid]
        assert len(mine) == 1, (route, mine)
        line = mine[0]
        assert (line["route"], line["method"], line["status"], line["reason"]) == \
            (route.path, route.method, 200, "ok"), line
        assert line["model"] == (None if route.stored else POOL)
        assert line["outcome"] == "ok" and line["pool"] == POOL
    no_secret_in(caplog)


def test_a_key_sent_as_the_model_is_not_logged(ctx: Ctx,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A client that pastes a key into `model` (its own gateway key, the provider's, or
    anything shaped like a key) is refused as an unknown model; the line says `[redacted]`."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    chat = INFERENCE_ROUTES[0]
    rids = []
    for model in (CLIENT_KEY, PROVIDER_KEY, f"Bearer {CLIENT_KEY}", "sk-ant-api03-abcdefghijkl"):
        request = _with_body(default_request(chat), model=model)
        reply = ctx.http.request(request["method"], request["path"],
                                 headers=request["headers"], content=request["content"])
        assert reply.status_code == 404
        rids.append(request["headers"]["x-request-id"])
    settle(ctx.gateway)
    logged = {line["id"]: line for line in lines(caplog)}
    assert [logged[rid]["model"] for rid in rids] == ["[redacted]"] * 4
    no_secret_in(caplog)
    assert "sk-ant-api03" not in caplog.text


# ---- the refusals an SDK makes ----------------------------------------------------------------


def test_the_sdks_refusals_each_write_one_line(
    ctx: Ctx, caplog: pytest.LogCaptureFixture
) -> None:
    """The official SDKs, with their default retries: a wrong key and an unknown model are
    answered with `x-should-retry: false`, so each is sent once and logged once; a base URL
    without `/v1` is an unknown route, logged with its path."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    root = ctx.gateway.root
    user: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]
    with (openai.OpenAI(base_url=root + "/v1", api_key=WRONG_KEY, max_retries=2) as client,
          pytest.raises(openai.AuthenticationError)):
        client.chat.completions.create(model=POOL, messages=PROMPTS["messages"],
                                       extra_headers={"x-request-id": "sdk-1"})
    with (openai.OpenAI(base_url=root + "/v1", api_key=CLIENT_KEY, max_retries=2) as client,
          pytest.raises(openai.NotFoundError)):
        client.chat.completions.create(model="gpt-nope", messages=PROMPTS["messages"],
                                       extra_headers={"x-request-id": "sdk-2"})
    with (openai.OpenAI(base_url=root, api_key=CLIENT_KEY, max_retries=2) as client,
          pytest.raises(openai.NotFoundError)):
        client.responses.create(model=POOL, input="hi", extra_headers={"x-request-id": "sdk-3"})
    with (anthropic.Anthropic(base_url=root, api_key=WRONG_KEY, max_retries=2) as claude,
          pytest.raises(anthropic.AuthenticationError)):
        claude.messages.create(model=POOL, max_tokens=8, messages=user,
                               extra_headers={"x-request-id": "sdk-4"})
    with (anthropic.Anthropic(base_url=root, api_key=CLIENT_KEY, max_retries=2) as claude,
          pytest.raises(anthropic.NotFoundError)):
        claude.messages.count_tokens(model="claude-nope", messages=user,
                                     extra_headers={"x-request-id": "sdk-5"})
    settle(ctx.gateway)
    got = {(line["id"], line["route"], line["status"], line["reason"], line["model"])
           for line in lines(caplog)}
    assert got == {
        ("sdk-1", "/v1/chat/completions", 401, "unauthorized", None),
        ("sdk-2", "/v1/chat/completions", 404, "unknown_model", "gpt-nope"),
        ("sdk-3", None, 404, "unknown_route", None),
        ("sdk-4", "/v1/messages", 401, "unauthorized", None),
        ("sdk-5", "/v1/messages/count_tokens", 404, "unknown_model", "claude-nope"),
    }
    assert len(lines(caplog)) == 5  # one each: no SDK retry
    no_secret_in(caplog)


def test_ops_reads_write_no_line(ctx: Ctx, caplog: pytest.LogCaptureFixture) -> None:
    """The log is of requests for a model: health, stats and the model list are not."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    for path in ("/healthz", "/readyz", "/hedge/stats", "/metrics", "/v1/models"):
        assert ctx.http.get(path, headers=auth).status_code == 200, path
    assert ctx.http.get("/v1/models").status_code == 401
    settle(ctx.gateway)
    assert lines(caplog) == []
