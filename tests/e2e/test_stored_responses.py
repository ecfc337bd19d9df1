"""Stored Responses API state through the gateway: the response id the client gets names the
backend that holds the response, authenticated, so any worker and any replica that shares the
secret can route a follow-up with no shared store; a response belongs to the client key that
made it; and reading one back is not a new generation for the stats.

Scripted loopback upstreams, the gateway under uvicorn, the official `openai` SDK."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    Timeouts,
)
from tests.harness import AsgiServerFactory, Head, RecordedRequest, Script, Send, UpstreamFactory
from tests.harness.builders import POOL
from tests.harness.protocol_wire import response_obj

KEY_A = "key-of-a"
KEY_B = "key-of-b"
SECRET = "a-shared-secret-for-these-replicas"
USAGE = {"input_tokens": 11, "output_tokens": 7, "total_tokens": 18}


def stored_upstream(request: RecordedRequest) -> Script:
    """An upstream that holds `resp_up1`: creation, GET, cancel, input_items and DELETE."""
    if request.method == "DELETE":
        body: dict[str, object] = {"id": "resp_up1", "object": "response.deleted",
                                   "deleted": True}
    elif request.path.endswith("/input_items"):
        body = {"object": "list", "data": [], "first_id": None, "last_id": None,
                "has_more": False}
    else:
        body = {**response_obj("resp_up1", "completed", "stored"), "usage": USAGE}
        if request.method == "POST" and not request.path.endswith("/cancel"):
            previous = json.loads(request.raw_body or b"{}").get("previous_response_id")
            body["previous_response_id"] = previous
    return Script(headers={"content-type": "application/json"},
                  steps=[Head(), Send(json.dumps(body).encode())], framing="length")


def settings_for(upstream_url: str, *, keys: tuple[str, ...] = (KEY_A,),
                 secret: str | None = SECRET) -> Settings:
    backends = tuple(BackendSettings(name=name, provider="openai", base_url=upstream_url,
                                     api_key="sk-up", model="gpt", group=name)
                     for name in ("b0", "b1"))
    pool = PoolSettings(name=POOL, backends=backends, timeout=10.0, timeouts=Timeouts(),
                        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=5.0)))
    return Settings(pools=(pool,), server=ServerSettings(api_keys=keys,
                                                         response_id_secret=secret))


def gpt(root: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0, timeout=20.0)


def test_a_replica_with_the_same_secret_serves_a_response_another_made(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    upstream = scripted_upstream(1, responder=stored_upstream)[0]
    one = asgi_server(create_app(settings_for(upstream.base_url), seed=1)).base_url
    two = asgi_server(create_app(settings_for(upstream.base_url), seed=2)).base_url
    with gpt(one) as client:
        made = client.responses.create(model=POOL, input="hi")
    assert made.id.startswith("resp_") and made.id != "resp_up1"
    with gpt(two) as client:
        assert client.responses.retrieve(made.id).id == made.id
        follow = client.responses.create(model=POOL, input="more",
                                         previous_response_id=made.id)
        assert follow.previous_response_id == made.id  # the upstream's id, translated back
        client.responses.delete(made.id)
    sent = [(r.method, r.path) for r in upstream.requests]
    assert sent == [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_up1"),
                    ("POST", "/v1/responses"), ("DELETE", "/v1/responses/resp_up1")]
    assert json.loads(upstream.requests[2].raw_body)["previous_response_id"] == "resp_up1"


def test_a_replica_with_another_secret_knows_none_of_them(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    upstream = scripted_upstream(1, responder=stored_upstream)[0]
    one = asgi_server(create_app(settings_for(upstream.base_url), seed=1)).base_url
    other = asgi_server(create_app(settings_for(upstream.base_url, secret=None))).base_url
    with gpt(one) as client:
        made = client.responses.create(model=POOL, input="hi")
    with gpt(other) as client, pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(made.id)
    assert caught.value.body["code"] == "response_not_found"  # type: ignore[index]
    assert len(upstream.requests) == 1


def _tampered(response_id: str) -> list[str]:
    """Ids a client could make from one it got: a changed byte, the upstream's own id."""
    raw = bytearray(base64.urlsafe_b64decode(response_id[5:] + "=" * (-len(response_id) % 4)))
    raw[len(raw) // 3] ^= 1
    changed = "resp_" + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    return [changed, "resp_up1", response_id[:-2], response_id + "AA"]


def test_an_id_that_does_not_verify_is_404_and_reaches_no_backend(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    upstream = scripted_upstream(1, responder=stored_upstream)[0]
    root = asgi_server(create_app(settings_for(upstream.base_url))).base_url
    with gpt(root) as client:
        made = client.responses.create(model=POOL, input="hi")
        for forged in _tampered(made.id):
            with pytest.raises(openai.NotFoundError) as caught:
                client.responses.retrieve(forged)
            assert caught.value.body["code"] == "response_not_found"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError) as caught:
                client.responses.create(model=POOL, input="x", previous_response_id=forged)
            assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert len(upstream.requests) == 1


def test_a_stored_response_belongs_to_the_key_that_made_it(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    upstream = scripted_upstream(1, responder=stored_upstream)[0]
    root = asgi_server(create_app(settings_for(upstream.base_url, keys=(KEY_A, KEY_B)))).base_url
    with gpt(root, KEY_A) as a:
        made = a.responses.create(model=POOL, input="hi")
    assert KEY_A not in base64.urlsafe_b64decode(made.id[5:] + "==").decode("latin-1")
    with gpt(root, KEY_B) as b:
        attempts: list[Callable[[], object]] = [
            lambda: b.responses.retrieve(made.id),
            lambda: b.responses.delete(made.id),
            lambda: b.responses.cancel(made.id),
            lambda: b.responses.input_items.list(made.id),
            lambda: b.responses.create(model=POOL, input="x", previous_response_id=made.id),
        ]
        for attempt in attempts:
            with pytest.raises(openai.NotFoundError) as caught:
                attempt()
            assert caught.value.body["code"] == "response_not_found"  # type: ignore[index]
    assert len(upstream.requests) == 1  # B reached no backend
    with gpt(root, KEY_A) as a:
        assert a.responses.retrieve(made.id).id == made.id
        a.responses.cancel(made.id)
        a.responses.input_items.list(made.id)
    assert [r.method for r in upstream.requests] == ["POST", "GET", "POST", "GET"]


def _observed(app: object) -> int:
    """Every latency observation of every hedge-delay tracker of the pool."""
    pool = app.state.live.current.pools[POOL]  # type: ignore[attr-defined]
    trackers = [*pool.delays.values()]
    for delays in pool.whole_delays.values():
        trackers += delays.values()
    return sum(t.observations for t in trackers)


def test_reading_or_cancelling_a_stored_response_is_no_new_generation(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """The body of a stored response repeats its usage: counting it again would bill the
    tokens twice, and its quick answer is no time to first token."""
    upstream = scripted_upstream(1, responder=stored_upstream)[0]
    app = create_app(settings_for(upstream.base_url))
    root = asgi_server(app).base_url

    def lifetime() -> dict[str, object]:
        doc = httpx.get(root + "/hedge/stats").json()["pools"][POOL]
        backends = {name: b["lifetime"]["ttft_ms"]["count"]
                    for name, b in doc["backends"].items()}
        life = doc["lifetime"]
        return {"tokens": life["tokens"], "ttft": life["ttft_ms"]["count"],
                "backends": backends, "sketches": _observed(app)}

    with gpt(root) as client:
        made = client.responses.create(model=POOL, input="hi")
        after_create = lifetime()
        assert after_create["tokens"]["output"] == 7  # type: ignore[index]
        assert client.responses.retrieve(made.id).usage is not None
        client.responses.cancel(made.id)
        client.responses.input_items.list(made.id)
        client.responses.delete(made.id)
    assert len(upstream.requests) == 5
    assert lifetime() == after_create
