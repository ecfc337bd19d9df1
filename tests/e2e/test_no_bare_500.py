"""No bare 500: an exception of ours at any step of the request path is answered in the
route's error shape, gives back every slot the request held and is counted.

Each case breaks one step (monkeypatched to raise), sends one request through the real
gateway under uvicorn (in-process simulated backends), and checks the answer's status and
shape, then that the admission slot, the pool's in-flight count and every backend's
concurrency slot are back to zero and that the bug was counted. The automatic leak check
runs at the end of each case too. Before the fix, a step that raised answered uvicorn's
plain-text 500, and one after admission kept its slot for good.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    Settings,
    SimProfile,
)
from tests.harness import AsgiServerFactory

POOL = "pool"
FAST = SimProfile(ttft_median=0.001, ttft_sigma=0.0, straggler_probability=0.0, tokens=3,
                  inter_token=0.001, seed=3)


class Boom(RuntimeError):
    """The injected bug."""


#: one entry per injected raise: the step was reached (and, at the request's end, is over)
HITS: list[str] = []


def _boom() -> Boom:
    HITS.append("hit")
    return Boom("injected")


def _raise(*_: object, **__: object) -> Any:
    raise _boom()


async def _araise(*_: object, **__: object) -> Any:
    raise _boom()


class _ExplodingPools(Mapping[str, Any]):
    """The generation's pool table, broken: the route's pool lookup raises."""

    def __init__(self, pools: Mapping[str, Any]) -> None:
        self._pools = pools

    def __getitem__(self, name: str) -> Any:
        raise _boom()

    def get(self, *_: object, **__: object) -> Any:
        raise _boom()

    def __iter__(self) -> Iterator[str]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)


def _break_pool_lookup(monkeypatch: pytest.MonkeyPatch, app: FastAPI) -> None:
    live = app.state.live
    monkeypatch.setattr(live, "current",
                        dataclasses.replace(live.current, pools=_ExplodingPools(
                            live.current.pools)))


def _patch(*targets: tuple[str, str, Callable[..., Any]]) -> Callable[..., None]:
    def apply(monkeypatch: pytest.MonkeyPatch, app: FastAPI) -> None:
        for module, name, replacement in targets:
            monkeypatch.setattr(f"{module}.{name}", replacement)

    return apply


def _cut_relay(monkeypatch: pytest.MonkeyPatch, app: FastAPI) -> None:
    """The relay yields its first chunk, then fails: the stream is under way already."""
    from gateway.hedge.relay import relay as real

    def relay(*args: Any, **kwargs: Any) -> AsyncIterator[bytes]:
        inner = real(*args, **kwargs)

        async def cut() -> AsyncIterator[bytes]:
            try:
                yield await inner.__anext__()
                raise _boom()
            finally:
                await inner.aclose()  # type: ignore[attr-defined]

        return cut()

    monkeypatch.setattr("gateway.api.proxy.relay", relay)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    breaks: Callable[[pytest.MonkeyPatch, FastAPI], None]
    #: the status the client gets: 500 for a bug of ours; 502 when the bug is inside an
    #: attempt (the race counts it as that attempt's failure and no attempt is left); 200
    #: when the answer was out before the step (the request's end, a cut stream)
    status: int = 500
    #: the step exists only for streamed (True) or whole (False) answers
    stream: bool | None = None
    #: the bug is counted in `Stats.internal_errors` (an attempt's is a backend failure)
    counted: bool = True


STEPS = (
    Step("body read", _patch(("gateway.api.chat", "read_body", _araise),
                             ("gateway.api.protocols", "read_body", _araise))),
    Step("body parse", _patch(("gateway.api.chat", "parse_body", _raise),
                              ("gateway.api.protocols", "parse_body", _raise))),
    Step("validation", _patch(("gateway.api.chat", "check_body", _raise),
                              ("gateway.api.protocols", "check_body", _raise))),
    Step("pool lookup", _break_pool_lookup),
    Step("eligibility", _patch(("gateway.api.proxy", "excluded_backends", _raise))),
    Step("admission", _patch(("gateway.api.proxy.Admission", "enter", _raise))),
    Step("hedge rules", _patch(("gateway.api.proxy", "hedge_refusal", _raise))),
    Step("deadline", _patch(("gateway.api.proxy.Proxy", "deadline", _raise))),
    Step("usage request", _patch(("gateway.api.proxy", "ask_for_usage", _raise))),
    Step("hedge delays", _patch(("gateway.hedge.pool.PoolRuntime", "sized", _raise))),
    Step("request size", _patch(("gateway.hedge.pool.PoolRuntime", "size_of", _raise))),
    Step("race start", _patch(("gateway.hedge.race.Race", "run", _araise))),
    Step("backend choice", _patch(("gateway.hedge.balancer.Balancer", "pick", _raise))),
    Step("attempt open", _patch(("providers.sim.provider.SimProvider", "open", _araise)),
         status=502, counted=False),
    Step("first token", _patch(("gateway.api.proxy", "open_until_first_token", _araise),
                               ("gateway.api.proxy", "open_whole_response", _araise)),
         status=502, counted=False),
    Step("commit", _patch(("gateway.hedge.race.Race", "_commit", _raise))),
    Step("usage read", _patch(("gateway.api.proxy", "body_usage", _raise)), stream=False),
    Step("relay start", _patch(("gateway.api.proxy", "relay", _raise)), stream=True),
    Step("relay mid-stream", _cut_relay, status=200, stream=True),
    Step("stats record", _patch(("gateway.stats.record.Stats", "record", _raise)),
         status=200),
    Step("log line", _patch(("gateway.api.end", "log_request", _raise)), status=200),
)

#: (path, body, error shape) of the routes the steps are tried on
ROUTES: dict[str, tuple[str, dict[str, Any], str]] = {
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}]}, "openai"),
    "messages": ("/v1/messages",
                 {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
                 "anthropic"),
}

CASES = [
    pytest.param(step, route, stream, id=f"{step.name}-{route}-{'stream' if stream else 'json'}")
    for step in STEPS
    for route in ROUTES
    for stream in (False, True)
    if step.stream in (None, stream)
]


def settings() -> Settings:
    backends = tuple(BackendSettings(name=f"b{i}", provider="sim", model="m", group=f"g{i}",
                                     sim=dataclasses.replace(FAST, seed=i))
                     for i in range(2))
    pool = PoolSettings(name=POOL, backends=backends, hedging=HedgingSettings(
        delay=DelaySettings(mode="fixed", value=5.0)))
    return Settings(pools=(pool,))


def _released(app: FastAPI) -> list[str]:
    held = []
    if app.state.proxy.admission.active:
        held.append(f"admission {app.state.proxy.admission.active}")
    for name, pool in app.state.pools.items():  # the pools at start: no reload here
        if pool.inflight_requests:
            held.append(f"pool {name} in flight {pool.inflight_requests}")
        for backend in pool.balancer.names:
            if pool.balancer.inflight(backend):
                held.append(f"backend {backend} in flight {pool.balancer.inflight(backend)}")
    return held


def _wait_released(app: FastAPI) -> None:
    deadline = time.monotonic() + 5.0
    while _released(app):  # the end runs right after the answer: poll for it, bounded
        if time.monotonic() > deadline:
            pytest.fail(f"still held after the answer: {_released(app)}")
        time.sleep(0.01)


def check_shape(body: Any, shape: str, status: int) -> None:
    if shape == "anthropic":
        assert body["type"] == "error", body
        assert body["error"]["type"] == "api_error", body  # a 500 and a 502 alike
        assert isinstance(body["error"]["message"], str)
    else:
        assert set(body) == {"error"}, body
        assert body["error"]["code"] == ("internal_error" if status == 500
                                         else "upstream_failed"), body
        assert body["error"]["type"] in ("server_error", "upstream_error"), body


@pytest.mark.parametrize(("step", "route", "stream"), CASES)
def test_a_bug_at_any_step_is_answered_in_the_route_shape_and_releases_everything(
    step: Step, route: str, stream: bool, asgi_server: AsgiServerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = create_app(settings(), seed=1)
    server = asgi_server(app)
    path, body, shape = ROUTES[route]
    before = app.state.stats.internal_errors
    HITS.clear()
    step.breaks(monkeypatch, app)
    with httpx.Client(base_url=server.base_url, timeout=10.0, trust_env=False) as client, \
            client.stream("POST", path, json={"model": POOL, "stream": stream, **body}) as r:
        raw = r.read()
        status, content_type = r.status_code, r.headers.get("content-type", "")
    _wait_released(app)
    if step.counted:  # the request's end may still be recording it: poll, bounded
        deadline = time.monotonic() + 5.0
        while app.state.stats.internal_errors == before and time.monotonic() < deadline:
            time.sleep(0.01)
    monkeypatch.undo()
    assert HITS, "the broken step was never reached"
    assert status == step.status, raw
    if status != 200:
        assert content_type.startswith("application/json"), raw
        check_shape(json.loads(raw), shape, status)
    elif step.name == "relay mid-stream":  # a final error event in the route's shape
        last = raw.decode().strip().split("\n\n")[-1]
        if shape == "anthropic":
            assert last.startswith("event: error\n"), raw
            assert json.loads(last.split("data: ", 1)[1])["type"] == "error"
        else:
            assert json.loads(last.removeprefix("data: "))["error"]["code"] == "internal_error"
    if step.counted:  # and shown where an operator looks
        assert app.state.stats.internal_errors == before + 1
        shown = httpx.get(server.url("/hedge/stats"), timeout=5.0, trust_env=False).json()
        assert shown["internal_errors"] == before + 1
        metrics = httpx.get(server.url("/metrics"), timeout=5.0, trust_env=False).text
        assert f"hedge_gateway_internal_errors_total {before + 1}.0" in metrics
    # and the gateway serves the next request as if nothing had happened
    with httpx.Client(base_url=server.base_url, timeout=10.0, trust_env=False) as client:
        again = client.post(path, json={"model": POOL, **body})
    assert again.status_code == 200, again.text
    _wait_released(app)


def test_a_bug_on_a_framework_route_is_answered_in_its_shape(
    asgi_server: AsgiServerFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stored-response operations are routed by the framework (their path has the id),
    not by the fast path: a bug there is answered by the same rule."""
    app = create_app(settings(), seed=1)
    server = asgi_server(app)
    HITS.clear()
    monkeypatch.setattr("gateway.api.stored.ResponseIds.read", _raise)
    with httpx.Client(base_url=server.base_url, timeout=10.0, trust_env=False) as client:
        reply = client.get("/v1/responses/resp_1")
    monkeypatch.undo()
    assert HITS
    assert reply.status_code == 500, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    check_shape(reply.json(), "openai", 500)
    assert app.state.stats.internal_errors == 1
    _wait_released(app)
