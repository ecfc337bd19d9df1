"""No bare 500: an exception of ours at any step of the request path is answered in the
route's error shape, gives back every slot the request held and is counted.

Each case breaks one step (monkeypatched to raise), sends one request through the real
gateway under uvicorn (in-process simulated backends), and checks the answer's status and
shape, then that the admission slot, the pool's in-flight count and every backend's
concurrency slot are back to zero and that the bug was counted. The automatic leak check
runs at the end of each case too. Before the fix, a step that raised answered uvicorn's
plain-text 500, and one after admission kept its slot for good.

The cases are generated from the route table (`gateway.api.inference.INFERENCE_ROUTES`):
each step says from the route's fields whether a request goes through it (a stored-response
operation reads no body, a route of one attempt asks no hedge rule, only a stream is
relayed), and each answer is checked in the route's error shape. A step of the route's own
code, or one only some routes take, is tried on every route, streamed and whole; a step of
the proxy that every request takes alike, on the first route of each error shape and way of
routing (`REPRESENTATIVES`). A route added to the table joins at the steps it has.
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

from gateway.api.inference import INFERENCE_ROUTES, InferenceRoute
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
from tests.harness.bodies import smallest_body

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
    #: whether a request to the route, streamed or not, goes through the step: read from the
    #: route table, so a new route is tried at exactly the steps it has
    applies: Callable[[InferenceRoute, bool], bool] = lambda route, stream: True
    #: the bug is counted in `Stats.internal_errors` (an attempt's is a backend failure)
    counted: bool = True
    #: the step is the proxy's, past the route's own code, and every route goes through it
    #: alike: it is tried on the first route of each kind (`REPRESENTATIVES`) only, as the
    #: other routes would run the same code again (every route at every step is nearly twice
    #: the cases, and the run time)
    shared: bool = False


def _bodied(route: InferenceRoute, stream: bool) -> bool:
    """A stored-response operation has no body: its id, in the path, is all it reads."""
    return not route.stored


def _stored(route: InferenceRoute, stream: bool) -> bool:
    return route.stored


def _hedged(route: InferenceRoute, stream: bool) -> bool:
    """A route of one attempt at a time never asks whether it may be hedged."""
    return not route.single


def _whole_generation(route: InferenceRoute, stream: bool) -> bool:
    """The usage is read from a whole answer of a generation; a read of stored state counts
    no tokens (it repeats a past generation's usage)."""
    return not stream and not route.stored


def _streamed(route: InferenceRoute, stream: bool) -> bool:
    return stream


STEPS = (
    # every route reads its body through `gateway.api.common.receive`, and parses and checks it
    # through `gateway.wire.validate.validated`: the steps are patched where those call them
    Step("body read", _patch(("gateway.api.common", "read_body", _araise)),
         applies=_bodied),
    Step("body parse", _patch(("gateway.wire.validate", "parse_body", _raise)),
         applies=_bodied),
    Step("validation", _patch(("gateway.wire.validate", "check_body", _raise)),
         applies=_bodied),
    Step("response id", _patch(("gateway.api.stored.ResponseIds", "read", _raise)),
         applies=_stored),
    Step("pool lookup", _break_pool_lookup),
    Step("eligibility", _patch(("gateway.api.proxy", "routing", _raise)),
         shared=True),
    Step("admission", _patch(("gateway.api.proxy.Admission", "enter", _raise)),
         shared=True),
    Step("hedge rules", _patch(("gateway.hedge.plan", "hedge_refusal", _raise)),
         applies=_hedged),
    Step("deadline", _patch(("gateway.hedge.plan", "deadline", _raise)),
         shared=True),
    Step("usage request", _patch(("gateway.api.proxy", "ask_for_usage", _raise)),
         shared=True),
    Step("hedge delays", _patch(("gateway.hedge.pool.PoolRuntime", "sized", _raise)),
         shared=True),
    Step("request size", _patch(("gateway.hedge.pool.PoolRuntime", "size_of", _raise)),
         shared=True),
    Step("race start", _patch(("gateway.hedge.race.Race", "run", _araise)),
         shared=True),
    Step("backend choice", _patch(("gateway.hedge.balancer.Balancer", "pick", _raise)),
         shared=True),
    Step("attempt open", _patch(("providers.sim.provider.SimProvider", "open", _araise)),
         status=502, counted=False, shared=True),
    Step("first token", _patch(("gateway.hedge.runner", "open_until_first_token", _araise),
                               ("gateway.hedge.runner", "open_whole_response", _araise)),
         status=502, counted=False, shared=True),
    Step("commit", _patch(("gateway.hedge.race.Race", "_commit", _raise)),
         shared=True),
    Step("usage read", _patch(("gateway.api.proxy", "body_usage", _raise)),
         applies=_whole_generation),
    Step("relay start", _patch(("gateway.api.proxy", "relay", _raise)), applies=_streamed),
    Step("relay mid-stream", _cut_relay, status=200, applies=_streamed),
    Step("stats record", _patch(("gateway.stats.record.Stats", "record", _raise)),
         status=200, shared=True),
    Step("log line", _patch(("gateway.api.end", "log_request", _raise)), status=200,
         shared=True),
)

def body_for(route: InferenceRoute, stream: bool) -> dict[str, Any] | None:
    return smallest_body(route, POOL, stream)


def _name(route: InferenceRoute) -> str:
    return f"{route.method} {route.path}"


def _first_of_each_kind() -> tuple[InferenceRoute, ...]:
    """The first route of the table in each error shape and each way a request reaches its
    route (the fast path; the framework's routing, for a path with a stored response's id):
    past the route's own code, what differs between routes is how an error is answered and
    how the slots are given back."""
    first: dict[tuple[str, bool], InferenceRoute] = {}
    for route in INFERENCE_ROUTES:
        first.setdefault((route.errors, route.stored), route)
    return tuple(first.values())


REPRESENTATIVES = _first_of_each_kind()

CASES = [
    pytest.param(step, route, stream,
                 id=f"{step.name}-{_name(route)}-{'stream' if stream else 'json'}")
    for step in STEPS
    for route in INFERENCE_ROUTES
    for stream in ((False, True) if route.streams else (False,))
    if step.applies(route, stream) and (route in REPRESENTATIVES or not step.shared)
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
        if pool.holding:  # the request's end still running (its log line comes last)
            held.append(f"pool {name} held by {pool.holding} request(s) still ending")
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


def check_stream_error(raw: bytes, shape: str) -> None:
    """The stream's last event is an error in the route's protocol: Anthropic's `error`
    event, the Responses API's `error` event, or chat's data-only error payload."""
    last = raw.decode().replace("\r\n", "\n").strip().split("\n\n")[-1]
    head, _, data = last.partition("data: ")
    payload = json.loads(data)
    if shape == "anthropic":
        assert head == "event: error\n", raw
        assert payload["type"] == "error" and payload["error"]["type"] == "api_error", raw
    elif head:  # a protocol that names its events
        assert head == "event: error\n", raw
        assert payload["type"] == "error" and payload["code"] == "internal_error", raw
    else:
        assert payload["error"]["code"] == "internal_error", raw


def stored_path(client: httpx.Client, route: InferenceRoute) -> str:
    """The route's path with a response the gateway stored (made before the step breaks)."""
    made = client.post("/v1/responses", json={"model": POOL, "input": "hi"})
    assert made.status_code == 200, made.text
    return route.path.replace("{response_id}", made.json()["id"])


@pytest.mark.parametrize(("step", "route", "stream"), CASES)
def test_a_bug_at_any_step_is_answered_in_the_route_shape_and_releases_everything(
    step: Step, route: InferenceRoute, stream: bool, asgi_server: AsgiServerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = create_app(settings(), seed=1)
    server = asgi_server(app)
    body = body_for(route, stream)
    with httpx.Client(base_url=server.base_url, timeout=10.0, trust_env=False) as client:
        path = stored_path(client, route) if route.stored else route.path
        _wait_released(app)
        before = app.state.stats.internal_errors
        HITS.clear()
        step.breaks(monkeypatch, app)
        with client.stream(route.method, path, json=body) as r:
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
        check_shape(json.loads(raw), route.errors, status)
    elif step.name == "relay mid-stream":  # a final error event in the route's shape
        check_stream_error(raw, route.errors)
    if step.counted:  # and shown where an operator looks
        assert app.state.stats.internal_errors == before + 1
        shown = httpx.get(server.url("/hedge/stats"), timeout=5.0, trust_env=False).json()
        assert shown["internal_errors"] == before + 1
        metrics = httpx.get(server.url("/metrics"), timeout=5.0, trust_env=False).text
        assert f"hedge_gateway_internal_errors_total {before + 1}.0" in metrics
    # and the gateway serves the next request as if nothing had happened
    with httpx.Client(base_url=server.base_url, timeout=10.0, trust_env=False) as client:
        again = client.request(route.method, path, json=body_for(route, False))
    assert again.status_code == 200, again.text
    _wait_released(app)
