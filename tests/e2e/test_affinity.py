"""Conversation affinity over real sockets: three scripted loopback upstreams, the gateway under
uvicorn, the official OpenAI SDK as the client. A conversation's turns stay on one backend;
its hedge goes to the second backend of its key's order, never the third."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import httpx
import openai

from gateway.app import create_app
from gateway.hedge.affinity import rendezvous_order
from tests.harness import (
    DONE,
    AsgiServerFactory,
    Head,
    RecordedRequest,
    Script,
    ScriptedUpstream,
    Send,
    Sleep,
    UpstreamFactory,
    finish_chunk,
    role_chunk,
    stream_script,
    token_chunk,
)
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import sdk as kit_sdk

sdk = functools.partial(kit_sdk, timeout=20.0)
SSE = {"content-type": "text/event-stream"}
#: a system prompt long enough (> 1,024 tokens at 4 bytes a token) to earn a derived key
SYSTEM = "You are a careful assistant. " * 200


def fast(request: RecordedRequest) -> Script:
    return stream_script(["answer"], ttft=0.0)


def slow(request: RecordedRequest) -> Script:
    """The token comes long after the hedge delay: the hedge wins."""
    return Script(headers=SSE, steps=[
        Head(), Send(role_chunk()), Sleep(3.0), Send(token_chunk("late")),
        Send(finish_chunk()), Send(DONE)])


def start(asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory,
          responders: Sequence[Any], **settings: Any) -> tuple[list[ScriptedUpstream], str, str]:
    upstreams = [scripted_upstream.one(responder=r, name=f"b{i}")
                 for i, r in enumerate(responders)]
    config = gateway_settings([u.base_url for u in upstreams], **settings)
    server = asgi_server(create_app(config, seed=7))
    return upstreams, server.v1, server.base_url


def turn(client: openai.OpenAI, messages: list[Any], **extra: Any) -> tuple[str, dict[str, str]]:
    with client.chat.completions.with_streaming_response.create(
        model=POOL, messages=messages, stream=True, **extra
    ) as response:
        headers = dict(response.headers)
        text = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)
    return text, headers


def conversation(client: openai.OpenAI, first: str, turns: int, system: str = SYSTEM,
                 **extra: Any) -> list[str]:
    """Play `turns` turns of one conversation with a growing history; the backend of each."""
    messages: list[Any] = [{"role": "system", "content": system},
                           {"role": "user", "content": first}]
    backends = []
    for n in range(turns):
        text, headers = turn(client, messages, **extra)
        backends.append(headers["x-hedge-backend"])
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"and then? ({n})"}]
    return backends


def test_each_conversation_stays_on_one_backend(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    _, v1, root = start(asgi_server, scripted_upstream, [fast] * 3, delay=2.0)
    with sdk(v1) as client:
        seen = [conversation(client, f"question number {i}", 4) for i in range(12)]
    assert all(len(set(backends)) == 1 for backends in seen), seen
    assert len({backends[0] for backends in seen}) > 1  # conversations still spread
    deadline = time.monotonic() + 5.0
    while True:  # a request is counted once it has fully ended
        stats = httpx.get(root + "/hedge/stats", timeout=5.0).json()
        affinity = stats["pools"][POOL]["lifetime"]["affinity"]
        if affinity["hits"] >= 48 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert affinity == {"hits": 48, "spills": 0, "misses": 0, "hit_rate": 1.0}


def test_a_short_conversation_stays_on_one_engine_by_default(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """Conversations far under 1,024 tokens (a 100-token system prompt), no key from the
    client, the default config: the backends are engines (openai, not at a hosted API), which
    cache any prefix, so every turn is keyed and goes where the conversation's history is."""
    _, v1, root = start(asgi_server, scripted_upstream, [fast] * 3, delay=2.0)
    short = "You are a terse assistant. " * 15
    with sdk(v1) as client:
        seen = [conversation(client, f"question number {i}", 4, system=short)
                for i in range(12)]
    assert all(len(set(backends)) == 1 for backends in seen), seen
    assert len({backends[0] for backends in seen}) > 1  # conversations still spread
    deadline = time.monotonic() + 5.0
    while True:  # a request is counted once it has fully ended
        affinity = httpx.get(root + "/hedge/stats", timeout=5.0).json()[
            "pools"][POOL]["lifetime"]["affinity"]
        if affinity["hits"] + affinity["misses"] >= 48 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert affinity == {"hits": 48, "spills": 0, "misses": 0, "hit_rate": 1.0}


def test_a_short_request_without_a_key_is_a_miss_and_a_keyed_one_a_hit(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    _, v1, root = start(asgi_server, scripted_upstream, [fast] * 3, delay=2.0)
    hi = [{"role": "user", "content": "hi"}]
    with sdk(v1) as client:
        turn(client, hi)
        keyed = {turn(client, hi, extra_body={"prompt_cache_key": "user-42"})[1]["x-hedge-backend"]
                 for _ in range(5)}
    expected = rendezvous_order("pck:user-42", [("b0", 1.0), ("b1", 1.0), ("b2", 1.0)])[0]
    assert keyed == {expected}
    deadline = time.monotonic() + 5.0
    while True:
        affinity = httpx.get(root + "/hedge/stats", timeout=5.0).json()[
            "pools"][POOL]["lifetime"]["affinity"]
        if affinity["hits"] + affinity["misses"] >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert affinity == {"hits": 5, "spills": 0, "misses": 1, "hit_rate": 0.8333}


def test_a_hedge_goes_to_the_second_backend_of_the_keys_order(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    key = "conversation-7"
    order = rendezvous_order("pck:" + key, [("b0", 1.0), ("b1", 1.0), ("b2", 1.0)])
    responders = [slow if f"b{i}" == order[0] else fast for i in range(3)]
    upstreams, v1, _ = start(asgi_server, scripted_upstream, responders, delay=0.3)
    hi = [{"role": "user", "content": "hi"}]
    with sdk(v1) as client:
        text, headers = turn(client, hi, extra_body={"prompt_cache_key": key})
    assert text == "answer"
    assert headers["x-hedge-backend"] == order[1]
    assert headers["x-hedge-attempts"] == "2"
    by_name = {u.name: u for u in upstreams}
    assert len(by_name[order[0]].requests) == 1  # the primary: the key's first backend
    assert len(by_name[order[1]].requests) == 1  # the hedge: its second
    assert len(by_name[order[2]].requests) == 0
    primary, hedge = by_name[order[0]].requests[0], by_name[order[1]].requests[0]
    assert primary.received_at <= hedge.received_at


def test_a_lone_surrogate_in_a_client_key_is_served_not_a_500(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """JSON may escape a lone surrogate (`"\\ud800"`; JavaScript's `JSON.stringify` writes one
    for a string cut between the halves of a pair), so a `prompt_cache_key` or a
    `metadata.user_id` may hold one. The key's hash takes it as it came: the request is
    served at its key's first backend, where it was a 500 and an internal error. The
    official SDKs cannot encode such a string, so the bodies go as raw JSON."""
    _, _, root = start(asgi_server, scripted_upstream, [fast] * 3, delay=2.0)
    names = [("b0", 1.0), ("b1", 1.0), ("b2", 1.0)]
    cases = [
        ('"prompt_cache_key":"conv-\\ud800"', "pck:conv-\ud800"),
        ('"metadata":{"user_id":"u-\\udc80"}', "user:u-\udc80"),
    ]
    for field, key in cases:
        head = f'{{"model":"{POOL}","stream":true,{field},'
        body = (head + '"messages":[{"role":"user","content":"hi"}]}').encode()
        with httpx.stream("POST", root + "/v1/chat/completions", content=body, timeout=10.0,
                          headers={"content-type": "application/json"}) as response:
            raw = response.read()
        assert response.status_code == 200, raw
        assert b"answer" in raw
        assert response.headers["x-hedge-backend"] == rendezvous_order(key, names)[0]
    deadline = time.monotonic() + 5.0
    while True:  # a request is counted once it has fully ended
        stats = httpx.get(root + "/hedge/stats", timeout=5.0).json()
        affinity = stats["pools"][POOL]["lifetime"]["affinity"]
        if affinity["hits"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert affinity["hits"] == 2
    assert stats["internal_errors"] == 0
