"""A complete answer without text, over real sockets: scripted loopback upstreams, the gateway
under uvicorn, the official `openai` and `anthropic` SDKs as clients.

A stream that ends normally (chat: a finish reason and `[DONE]`; Responses:
`response.completed`; Messages: `message_stop`) without any token is the answer, perhaps
empty: the client gets it as a 200 stream, no other backend is tried for it, and it never
counts against the backend's health. A token-less stream cut before its end is still a failure.
Each test ends with the automatic leak check."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HealthSettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    Timeouts,
)
from tests.harness import AsgiServerFactory, Head, Script, ScriptedUpstream, Send, UpstreamFactory
from tests.harness.bodies import (
    DONE,
    SSE_HEADERS,
    chat_completion_obj,
    finish_chunk,
    json_script,
    role_chunk,
    stream_script,
)
from tests.harness.builders import POOL, InOrder
from tests.harness.protocol_wire import message_start, named, response_obj, responses_head
from tests.harness.scripts import Sleep

KEY = "gateway-key"


def settings_for(backends: Sequence[BackendSettings], *, delay: float) -> Settings:
    """One pool; a single failure ejects a backend, so a miscounted empty answer shows."""
    pool = PoolSettings(
        name=POOL, backends=tuple(backends), timeout=10.0, timeouts=Timeouts(),
        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=delay)),
        health=HealthSettings(eject_after=1, cooldown=60.0, max_cooldown=60.0),
    )
    return Settings(pools=(pool,), server=ServerSettings(api_keys=(KEY,)))


def backends(upstreams: Sequence[ScriptedUpstream],
             provider: Literal["openai", "anthropic"] = "openai") -> list[BackendSettings]:
    return [BackendSettings(name=f"b{i}", provider=provider,
                            base_url=u.base_url if provider == "openai" else u.root_url,
                            api_key=f"sk-{i}", model=f"m-{i}", group=f"g{i}")
            for i, u in enumerate(upstreams)]


def serve(asgi_server: AsgiServerFactory, settings: Settings) -> str:
    return asgi_server(create_app(settings, seed=3)).base_url


def gpt(root: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=root + "/v1", api_key=KEY, max_retries=0, timeout=20.0)


def stats(root: str, requests: int) -> dict[str, Any]:
    """The pool's `/hedge/stats` once `requests` requests were recorded (the gateway records a
    request after the client read its end)."""
    for _ in range(500):
        doc: dict[str, Any] = httpx.get(root + "/hedge/stats", timeout=5.0,
                                        headers={"authorization": f"Bearer {KEY}"}).json()
        pool: dict[str, Any] = doc["pools"][POOL]
        if pool["lifetime"]["requests"] >= requests:
            return pool
        time.sleep(0.01)
    raise AssertionError("the requests were never recorded")


def empty_chat(*, after_role: float = 0.0) -> Script:
    """Role chunk, then (after `after_role`) a finish-only chunk and `[DONE]`: no token."""
    steps: list[Any] = [Head(), Send(role_chunk())]
    if after_role:
        steps.append(Sleep(after_role))
    steps += [Send(finish_chunk("stop")), Send(DONE)]
    return Script(headers=SSE_HEADERS, steps=steps)


def test_an_empty_chat_answer_is_relayed_and_no_other_backend_is_asked(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(empty_chat(), stream_script(["text from a failover"]))
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(backends(upstreams), delay=5.0))
    with gpt(root) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=[{"role": "user", "content": "hi"}], stream=True))
    assert [c.choices[0].delta.role for c in chunks] == ["assistant", None]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len(order.arrivals) == 1  # the answer was complete: nothing to fail over to


def test_every_backend_empty_is_a_200_and_no_backend_is_ejected(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """The hedge answers empty first; the race waits for the primary, which answers empty
    too: the client gets an empty answer, and neither backend is counted as failed."""
    order = InOrder(empty_chat(after_role=0.6), empty_chat())
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(backends(upstreams), delay=0.1))
    with gpt(root) as client, client.chat.completions.with_streaming_response.create(
        model=POOL, messages=[{"role": "user", "content": "hi"}], stream=True,
    ) as raw:
        attempts = raw.headers["x-hedge-attempts"]
        chunks = list(raw.parse())
    assert attempts == "2" and len(order.arrivals) == 2
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(not c.choices[0].delta.content for c in chunks)
    primary, hedge = order.arrivals
    assert primary.finished_at is not None and hedge.finished_at is not None
    assert hedge.finished_at < primary.finished_at  # the hedge's empty answer came first
    pool = stats(root, 1)
    assert pool["lifetime"]["empty_answers"] == 1 and pool["lifetime"]["errors"] == {}
    for name in ("b0", "b1"):
        backend = pool["backends"][name]
        assert backend["state"] == "ok" and backend["lifetime"]["failed"] == 0, backend
        assert backend["lifetime"]["failures"] == {}


def test_a_token_less_stream_cut_before_its_end_still_fails(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    cut = stream_script([], finish=None, done=False)  # role chunk, then the body ends
    upstreams = scripted_upstream(2, responder=InOrder(cut, cut))
    root = serve(asgi_server, settings_for(backends(upstreams), delay=5.0))
    with gpt(root) as client, pytest.raises(openai.APIStatusError) as failed:
        list(client.chat.completions.create(
            model=POOL, messages=[{"role": "user", "content": "hi"}], stream=True))
    assert failed.value.status_code == 502
    assert "without its end event" in failed.value.message


def test_an_empty_non_streaming_chat_body_is_the_answer(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(json_script(chat_completion_obj("")), json_script(chat_completion_obj("x")))
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(backends(upstreams), delay=5.0))
    with gpt(root) as client:
        reply = client.chat.completions.create(
            model=POOL, messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "" and reply.choices[0].finish_reason == "stop"
    assert len(order.arrivals) == 1


def test_an_empty_responses_stream_is_relayed(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    created, in_progress = responses_head("resp_e")[:2]
    completed = named("response.completed", {"sequence_number": 2,
                                             "response": response_obj("resp_e", "completed")})
    empty = Script(headers=SSE_HEADERS,
                   steps=[Head(), Send(created), Send(in_progress), Send(completed)])
    order = InOrder(empty, empty)
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(backends(upstreams), delay=5.0))
    with gpt(root) as client:
        events = list(client.responses.create(model=POOL, input="hi", store=False,
                                              stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.completed"]
    last = events[-1]
    assert isinstance(last, openai.types.responses.ResponseCompletedEvent)
    assert last.response.output == [] and len(order.arrivals) == 1


def test_an_empty_messages_stream_is_relayed(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    delta = named("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                    "usage": {"output_tokens": 0}})
    empty = Script(headers=SSE_HEADERS,
                   steps=[Head(), Send(message_start()), Send(delta), Send(named("message_stop"))])
    order = InOrder(empty, empty)
    upstreams = scripted_upstream(2, responder=order)
    root = serve(asgi_server, settings_for(backends(upstreams, "anthropic"), delay=5.0))
    with anthropic.Anthropic(base_url=root, api_key=KEY, max_retries=0, timeout=20.0) as client:
        events = list(client.messages.create(
            model=POOL, max_tokens=16, messages=[{"role": "user", "content": "hi"}],
            stream=True))
    assert [e.type for e in events] == ["message_start", "message_delta", "message_stop"]
    assert len(order.arrivals) == 1
