"""Availability under pushback, over real sockets: the gateway under its own server,
scripted upstreams, the official OpenAI SDK or httpx as clients.

- a Retry-After pauses a backend for at most `health.max_pause`, and a pool too short of
  healthy backends routes in panic mode, so one pushback never takes a pool out;
- a request whose every attempt pushed back gets 429/503 with the smallest pause as its own
  Retry-After, without `x-should-retry: false`, and the SDK retries after it;
- a request no backend has room for gets 503 with `Retry-After: 1`, never 502;
- per backend, the state and the seconds left are in `/hedge/stats` and `hedge-gateway stats`.

Assertions follow causality and counts (which upstream saw which request), never wall time.
"""

from __future__ import annotations

import io
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import HealthSettings, Settings
from gateway.stats.table import print_stats
from tests.harness import (
    DONE,
    SSE_HEADERS,
    Gate,
    Head,
    LoopThread,
    RecordedRequest,
    Reset,
    Script,
    Send,
    UpstreamFactory,
    Wait,
    default_responder,
    error_script,
    role_chunk,
    stream_script,
    token_chunk,
)
from tests.harness.builders import POOL, InOrder, gateway_settings
from tests.harness.limits_kit import MESSAGES, Gateway, GatewayFactory, sdk, stats_of

Responder = Callable[[RecordedRequest], Script]


def settings_for(
    urls: Sequence[str],
    *,
    health: HealthSettings | None = None,
    max_concurrency: int | None = None,
    **kwargs: Any,
) -> Settings:
    """`gateway_settings` plus the pool's health settings and a per-backend concurrency cap."""
    settings = gateway_settings(urls, **kwargs)
    pool = settings.pools[0]
    backends = tuple(replace(b, max_concurrency=max_concurrency) for b in pool.backends)
    pool = replace(pool, backends=backends, health=health or HealthSettings())
    return replace(settings, pools=(pool,))


def pool_stats(gateway: Gateway) -> dict[str, Any]:
    stats: dict[str, Any] = stats_of(gateway.root)["pools"][POOL]
    return stats


def settled(gateway: Gateway, requests: int) -> dict[str, Any]:
    """The pool's stats once `requests` requests are recorded (a request is recorded only
    after it fully ended, a moment after the client read its answer)."""
    for _ in range(250):
        stats = pool_stats(gateway)
        if stats["lifetime"]["requests"] >= requests:
            return stats
        threading.Event().wait(0.02)  # polling, not a timing assertion
    raise AssertionError(f"fewer than {requests} requests recorded")


def chat(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(model=POOL, messages=MESSAGES, stream=False)
    return reply.choices[0].message.content or ""


def pushback(status: int, **headers: str) -> Script:
    return error_script(status, "busy", headers=headers)


# ---- bounded pauses, panic routing, the state you can see -----------------------------------


def test_one_backend_pool_is_served_again_after_a_huge_retry_after(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """One `503` with `Retry-After: 999999`, then the upstream is healthy: the very next
    request reaches it (panic routing), and the refusal said when to come back (capped)."""
    [up] = scripted_upstream(1)
    up.queue(pushback(503, **{"retry-after": "999999"}))
    gateway = GatewayFactory(loop_thread)(settings_for([up.base_url]))
    with sdk(gateway.v1) as client:
        with pytest.raises(openai.APIStatusError) as info:
            chat(client)
        refused = info.value.response
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "30"  # health.max_pause
        assert refused.headers["retry-after-ms"] == "30000"
        assert "x-should-retry" not in refused.headers
        assert info.value.code == "upstream_pushback"

        stats = settled(gateway, 1)
        b0 = stats["backends"]["b0"]
        assert b0["state"] == "paused" and 0 < b0["seconds_left"] <= 30
        table = io.StringIO()
        assert print_stats(gateway.root, table, io.StringIO()) == 0
        assert "paused" in table.getvalue() and "s (retry-after)" in table.getvalue()

        assert chat(client) == "Hello world"  # served at once, while still "paused"
    assert len(up.requests) == 2
    stats = settled(gateway, 2)
    assert stats["lifetime"]["panic"] >= 1
    metrics = httpx.get(gateway.url("/metrics"), timeout=5.0).text
    assert f'hedge_gateway_panic_total{{pool="{POOL}"}} ' in metrics


def test_the_sdk_waits_out_a_pushback_and_retries(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """The SDK obeys the gateway's answer: it waits the pause and retries, instead of giving
    up as it does on `x-should-retry: false`."""
    [up] = scripted_upstream(1)
    up.queue(pushback(503, **{"retry-after-ms": "200"}))
    gateway = GatewayFactory(loop_thread)(settings_for([up.base_url]))
    with openai.OpenAI(base_url=gateway.v1, api_key="sk-client", max_retries=2,
                       timeout=openai.Timeout(10.0)) as client:
        assert chat(client) == "Hello world"
    first, retry = up.requests
    assert retry.received_at > first.received_at
    assert settled(gateway, 2)["lifetime"]["errors"] == {"upstream_pushback": 1}


def test_a_pool_whose_backends_are_all_ejected_still_tries_one(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    broken = threading.Event()
    broken.set()
    failures = itertools.cycle([Script(steps=[Reset()]), error_script(500, "boom")])

    def responder(request: RecordedRequest) -> Script:
        return next(failures) if broken.is_set() else default_responder(request)

    upstreams = scripted_upstream(2, responder=responder)
    health = HealthSettings(eject_after=2, cooldown=60.0, max_cooldown=60.0)
    gateway = GatewayFactory(loop_thread)(
        settings_for([u.base_url for u in upstreams], health=health, delay=5.0)
    )
    with sdk(gateway.v1) as client:
        for _ in range(2):  # primary and failover fail each time: two failures per backend
            with pytest.raises(openai.APIStatusError) as info:
                chat(client)
            assert info.value.status_code == 502
            assert info.value.response.headers["x-should-retry"] == "false"
        ejected = settled(gateway, 2)["backends"]
        assert {ejected[name]["state"] for name in ("b0", "b1")} == {"ejected"}
        broken.clear()
        assert chat(client) == "Hello world"
    assert sum(len(u.requests) for u in upstreams) == 5
    assert all(ejected[name]["seconds_left"] > 30 for name in ("b0", "b1"))
    assert settled(gateway, 3)["lifetime"]["panic"] >= 1


# ---- honest refusals ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "status", "seconds"),
    [
        (pushback(429, **{"retry-after": "7"}), pushback(429, **{"retry-after": "3"}), 429, "3"),
        (pushback(429, **{"retry-after": "2"}), pushback(503, **{"retry-after": "4"}), 503, "2"),
        (pushback(503, **{"retry-after-ms": "90000"}), pushback(429, **{"retry-after": "999"}),
         503, "5"),
    ],
    ids=["all-429", "429-and-503", "capped-at-max-pause"],
)
def test_when_every_attempt_pushed_back_the_client_is_told_when_to_retry(
    loop_thread: LoopThread,
    scripted_upstream: UpstreamFactory,
    first: Script,
    second: Script,
    status: int,
    seconds: str,
) -> None:
    order = InOrder(first, second)
    upstreams = scripted_upstream(2, responder=order)
    gateway = GatewayFactory(loop_thread)(
        settings_for([u.base_url for u in upstreams], delay=5.0,
                     health=HealthSettings(max_pause=5.0))
    )
    with sdk(gateway.v1) as client, pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
    response = info.value.response
    assert response.status_code == status
    assert response.headers["retry-after"] == seconds
    assert response.headers["retry-after-ms"] == str(int(seconds) * 1000)
    assert "x-should-retry" not in response.headers
    assert len(order.arrivals) == 2
    assert settled(gateway, 1)["lifetime"]["errors"] == {"upstream_pushback": 1}


def test_a_request_no_backend_has_room_for_gets_503_retry_after_1(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gate = Gate()
    held = Script(headers=SSE_HEADERS, steps=[Head(), Send(role_chunk()), Wait(gate),
                                              Send(token_chunk("late")), Send(DONE)])
    [up] = scripted_upstream(1)
    up.queue(held)
    gateway = GatewayFactory(loop_thread)(settings_for([up.base_url], max_concurrency=1))
    with ThreadPoolExecutor(1) as pool, sdk(gateway.v1) as client:
        first = pool.submit(
            lambda: httpx.post(gateway.v1 + "/chat/completions", timeout=10.0,
                               json={"model": POOL, "messages": MESSAGES, "stream": True})
        )
        assert up.wait_requests(1)
        with pytest.raises(openai.APIStatusError) as info:
            chat(client)
        gate.open()
        assert first.result(timeout=10.0).status_code == 200
    refused = info.value.response
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert "x-should-retry" not in refused.headers
    assert len(up.requests) == 1
    stats = settled(gateway, 2)
    assert stats["lifetime"]["refused_no_backend"] == 1
    metrics = httpx.get(gateway.url("/metrics"), timeout=5.0).text
    assert f'hedge_gateway_refused_no_backend_total{{pool="{POOL}"}} 1.0' in metrics


# ---- a pool under steady pushback --------------------------------------------------------


def every_nth_pushes_back(n: int) -> Responder:
    """Per upstream: every n-th request gets `503` + `Retry-After: 1`, the rest a stream."""
    counter = itertools.count(1)

    def responder(request: RecordedRequest) -> Script:
        if next(counter) % n == 0:
            return pushback(503, **{"retry-after": "1"})
        return stream_script(["Hello", " world"])

    return responder


@pytest.mark.timeout(180)
def test_three_backends_with_3_percent_pushback_keep_serving(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """the measurement: each of three backends answers 3 % of its requests with `503`
    and `Retry-After: 1`, 16 clients at once. No request may be refused without an upstream
    attempt, and at least 95 % succeed."""
    total, clients = 400, 16
    upstreams = [scripted_upstream.one(responder=every_nth_pushes_back(33)) for _ in range(3)]
    gateway = GatewayFactory(loop_thread)(settings_for([u.base_url for u in upstreams]))
    body = {"model": POOL, "messages": MESSAGES, "stream": True}

    def client_loop(share: int) -> list[int]:
        statuses = []
        with httpx.Client(timeout=30.0) as http:
            for _ in range(share):
                reply = http.post(gateway.v1 + "/chat/completions", json=body)
                ok = reply.status_code == 200 and "[DONE]" in reply.text
                statuses.append(200 if ok else reply.status_code)
        return statuses

    with ThreadPoolExecutor(clients) as pool:
        shares = [total // clients] * clients
        statuses = list(itertools.chain.from_iterable(pool.map(client_loop, shares)))
    assert len(statuses) == total
    lifetime = settled(gateway, total)["lifetime"]
    assert set(lifetime["errors"]) <= {"upstream_pushback"}, lifetime["errors"]
    assert sum(len(u.requests) for u in upstreams) >= total  # every request reached one
    assert statuses.count(200) >= 0.95 * total, statuses.count(200)
    assert lifetime["refused_no_backend"] == 0
