"""The one table of inference routes (`gateway.api.inference`) is the app's: the app serves
exactly its routes, the fast path takes every POST of it without a path parameter, and each
route's errors come in the shape the table gives it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from gateway.api.common import protocol_for_path
from gateway.api.inference import INFERENCE_ROUTES
from gateway.app import create_app
from gateway.settings import BackendSettings, PoolSettings, Settings
from gateway.wire.messages import MESSAGES
from gateway.wire.paths import ANTHROPIC_PREFIXES, errors_of

#: API routes of the app that are not inference: they list or observe, they send nothing
#: upstream
NOT_INFERENCE = {"/v1/models"}
SETTINGS = Settings(pools=(PoolSettings(
    name="p", backends=(BackendSettings(name="a", provider="sim", model="m"),)),))


def _api_routes(routes: Iterable[BaseRoute]) -> Iterator[APIRoute]:
    """Every APIRoute, through the routers included without a prefix."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _api_routes(included.routes)


def _served() -> set[tuple[str, str]]:
    app = create_app(SETTINGS)
    return {
        (method, route.path)
        for route in _api_routes(app.routes)
        if route.path.startswith("/v1/") and route.path not in NOT_INFERENCE
        for method in route.methods or ()
    }


def test_the_app_serves_exactly_the_table() -> None:
    table = {(r.method, r.path) for r in INFERENCE_ROUTES}
    assert len(table) == len(INFERENCE_ROUTES)  # no route twice
    assert _served() == table


def test_the_fast_path_takes_every_post_without_a_path_parameter() -> None:
    app = create_app(SETTINGS)
    fast = set(app._fast)  # type: ignore[attr-defined]
    assert fast == {(r.method, r.path) for r in INFERENCE_ROUTES if "{" not in r.path}


def test_the_fast_path_answers_each_routes_refusals_in_the_routes_protocol() -> None:
    """The shape of a route's errors is decided once, by its entry in the table: the fast
    path holds the entry's protocol beside its handler, and the request the route hands the
    proxy carries the same protocol (`LogicalRequest.protocol`)."""
    app = create_app(SETTINGS)
    held = {key: protocol for key, (_, protocol) in app._fast.items()}  # type: ignore[attr-defined]
    assert held == {(r.method, r.path): r.protocol for r in INFERENCE_ROUTES if "{" not in r.path}
    for r in INFERENCE_ROUTES:
        assert r.errors == r.protocol.errors, r


def test_each_route_answers_errors_in_its_shape() -> None:
    for r in INFERENCE_ROUTES:
        path = r.path.replace("{response_id}", "resp_1")
        assert errors_of(path) == r.errors, r
        assert (protocol_for_path(path) is MESSAGES) == (r.errors == "anthropic"), r
    for prefix in ANTHROPIC_PREFIXES:  # an unknown path below it is Anthropic's too
        assert errors_of(prefix + "/nope") == "anthropic"
    assert errors_of("/v1/messagesx") == errors_of("/v1/nope") == "openai"


def test_only_the_routes_that_stream_are_marked_so() -> None:
    streaming = {r.endpoint for r in INFERENCE_ROUTES if r.streams}
    assert streaming == {"chat/completions", "completions", "responses", "messages"}
    assert all(not r.streams for r in INFERENCE_ROUTES if r.stored)


def test_only_counting_tokens_and_the_stored_operations_are_never_hedged() -> None:
    single = {r.endpoint for r in INFERENCE_ROUTES if r.single}
    assert single == {"messages/count_tokens", "responses/item"}
    assert all(r.single for r in INFERENCE_ROUTES if r.stored)
