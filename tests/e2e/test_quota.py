"""Quota headroom over real sockets: scripted upstreams and simulators whose answers carry
rate-limit headers, the gateway under its own server, the official `openai` and `anthropic`
SDKs as clients.

- a backend whose answer shows less than `health.min_headroom` of its quota left gets no
  more requests while the other has room, and each skip is counted in `/hedge/stats` and
  `/metrics`; when both are low, both keep serving (never refused);
- the client sees the rate-limit headers of the attempt that won, never a loser's, streamed
  (in the head sent at commit) and whole;
- the same with Anthropic's header family (RFC 3339 resets) from simulators with a quota.

Which backend a request goes to first is random; tests loop until the case they need has
happened, then assert what follows from it. Each test ends with the leak check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anthropic
import httpx
import openai

from gateway.hedge.affinity import AffinityRoute
from gateway.settings import (
    BackendSettings,
    HealthSettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
)
from providers.sim.server import create_sim_app
from tests.harness import (
    Gate,
    LoopThread,
    RecordedRequest,
    Script,
    ScriptedUpstream,
    UpstreamFactory,
    Wait,
    chat_completion_obj,
    json_script,
    stream_script,
)
from tests.harness.builders import POOL, InOrder, gateway_settings
from tests.harness.factories import AsgiServerFactory
from tests.harness.limits_kit import (
    MESSAGES,
    Gateway,
    GatewayFactory,
    sdk,
    stats_of,
    stream_content,
    wait_for,
)


def quota(remaining: int, limit: int = 100, reset: str = "60s") -> dict[str, str]:
    return {"x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": str(remaining),
            "x-ratelimit-reset-requests": reset}


def answering(headers: Mapping[str, str]) -> Callable[[RecordedRequest], Script]:
    """A responder: every request gets a short stream (or body) with `headers`."""

    def respond(request: RecordedRequest) -> Script:
        body = request.body
        if isinstance(body, dict) and not body.get("stream"):
            return json_script(chat_completion_obj(), headers=headers)
        return stream_script(["Hello", " world"], headers=headers)

    return respond


def start(loop_thread: LoopThread, urls: Sequence[str], *, hedging: bool = True,
          delay: float = 0.3) -> Gateway:
    settings = gateway_settings(urls, hedging=hedging, delay=delay)
    pool = dataclasses.replace(settings.pools[0], health=HealthSettings(min_headroom=0.05))
    return GatewayFactory(loop_thread)(dataclasses.replace(settings, pools=(pool,)))


def recorded(gateway: Gateway, requests: int) -> dict[str, Any]:
    """The pool's stats once `requests` requests are recorded (a moment after each answer)."""
    assert wait_for(lambda: stats_of(gateway.root)["pools"][POOL]["lifetime"]["requests"]
                    >= requests)
    pool: dict[str, Any] = stats_of(gateway.root)["pools"][POOL]
    return pool


def served_by(client: openai.OpenAI) -> str:
    response = client.chat.completions.with_raw_response.create(model=POOL, messages=MESSAGES)
    response.parse()
    return response.headers["x-hedge-backend"]


def test_a_backend_low_on_quota_gets_no_requests_while_the_other_has_room(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    low = scripted_upstream.one(responder=answering(quota(2)))  # 2 % left: under 5 %
    roomy = scripted_upstream.one(responder=answering(quota(90)))
    gateway = start(loop_thread, [low.base_url, roomy.base_url], hedging=False)
    with sdk(gateway.v1) as client:
        before = 0
        while not low.requests:  # until the low backend has answered once (a random choice)
            served_by(client)
            before += 1
            assert before < 40
        after = [served_by(client) for _ in range(12)]
    assert after == ["b1"] * 12
    assert len(low.requests) == 1  # nothing more reached it
    pool = recorded(gateway, before + 12)
    b0 = pool["backends"]["b0"]
    assert b0["state"] == "low" and 0 < b0["seconds_left"] <= 60
    assert b0["headroom"] == 0.02 and b0["headroom_resource"] == "requests"
    assert b0["reason"] == "2.0% of its requests quota left"
    assert b0["lifetime"]["headroom_skips"] == 12
    assert pool["lifetime"]["headroom_skips"] == 12
    assert pool["backends"]["b1"]["state"] == "ok"
    metrics = httpx.get(gateway.url("/metrics"), timeout=5.0).text
    assert f'hedge_gateway_headroom_skips_total{{backend="b0",pool="{POOL}"}} 12.0' in metrics
    assert f'hedge_gateway_backend_state{{backend="b0",pool="{POOL}",state="low"}} 1.0' in metrics
    assert f'hedge_gateway_backend_headroom{{backend="b0",pool="{POOL}"}} 0.02' in metrics


def test_when_every_backend_is_low_both_keep_serving(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Until both have answered, the one not heard from yet has room (and the low one is
    skipped); from then on both are low and requests are chosen as without headers (by load
    and TTFT), with no more skips and none refused."""
    ups = [scripted_upstream.one(responder=answering(quota(1))) for _ in range(2)]
    gateway = start(loop_thread, [u.base_url for u in ups], hedging=False)
    with sdk(gateway.v1) as client:
        before = 0
        while not all(u.requests for u in ups):  # an unknown TTFT is explored: soon both
            served_by(client)
            before += 1
            assert before < 40
        skips = recorded(gateway, before)["lifetime"]["headroom_skips"]
        served = [served_by(client) for _ in range(24)]  # each answered (or it raised)
    assert set(served) <= {"b0", "b1"}
    assert sum(len(u.requests) for u in ups) == before + 24  # none refused untried
    pool = recorded(gateway, before + 24)
    assert pool["lifetime"]["headroom_skips"] == skips
    assert pool["lifetime"]["errors"] == {}
    assert {b["state"] for b in pool["backends"].values()} == {"low"}


#: the headers of the attempt that loses (the primary, held back) and of the one that wins
LOSER = {**quota(11, reset="5s"), "anthropic-ratelimit-tokens-remaining": "111"}
WINNER = {**quota(22, reset="7s"), "anthropic-ratelimit-tokens-remaining": "222",
          "anthropic-ratelimit-tokens-limit": "1000",
          "x-ratelimit-limit-widgets": "9"}  # a name of neither family: never passed on


def assert_the_winners(headers: Mapping[str, str], order: InOrder,
                       ups: Sequence[ScriptedUpstream]) -> None:
    """The client's headers are those of the second arrival (the hedge, which won), none of
    the first's (the primary, held back)."""
    winner = headers["x-hedge-backend"]
    hedge = order.arrivals[1]
    assert [r is hedge for r in ups[int(winner[1:])].requests] == [True]
    assert headers["x-hedge-attempts"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "22"
    assert headers["x-ratelimit-limit-requests"] == "100"
    assert headers["x-ratelimit-reset-requests"] == "7s"
    assert headers["anthropic-ratelimit-tokens-remaining"] == "222"
    assert headers["anthropic-ratelimit-tokens-limit"] == "1000"
    assert "x-ratelimit-limit-widgets" not in headers
    assert not {"111", "11", "5s"} & set(dict(headers).values())


def test_the_winners_rate_limit_headers_reach_a_streaming_client_never_the_losers(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """The primary (the first request to arrive anywhere) sends its head and its role chunk,
    then holds its first token; the hedge answers at once and wins: its rate-limit headers
    are in the head the client gets at commit."""
    gate = Gate()
    held = stream_script(["late"], headers=LOSER)
    held = dataclasses.replace(held, steps=[*held.steps[:2], Wait(gate), *held.steps[2:]])
    order = InOrder(held, stream_script(["Hello", " world"], headers=WINNER))
    ups = scripted_upstream(2, responder=order)
    gateway = start(loop_thread, [u.base_url for u in ups], delay=0.05)
    try:
        with sdk(gateway.v1) as client:
            text, headers = stream_content(client)
        assert text == "Hello world"
        assert_the_winners(headers, order, ups)
    finally:
        gate.open()


def test_the_winners_rate_limit_headers_reach_a_whole_answer_never_the_losers(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Not streamed: the primary holds its whole answer (no head yet); the hedge's answer
    wins, and `with_raw_response` shows its rate-limit headers."""
    gate = Gate()
    body = chat_completion_obj()
    held = json_script(body, headers=LOSER)
    held = dataclasses.replace(held, steps=[Wait(gate), *held.steps])
    order = InOrder(held, json_script(body, headers=WINNER))
    ups = scripted_upstream(2, responder=order)
    gateway = start(loop_thread, [u.base_url for u in ups], delay=0.05)
    try:
        with sdk(gateway.v1) as client:
            response = client.chat.completions.with_raw_response.create(
                model=POOL, messages=MESSAGES)
            assert response.parse().choices
        assert_the_winners(response.headers, order, ups)
    finally:
        gate.open()


# --- Anthropic's family, from simulators with a quota ------------------------------------------

QUOTA_PROFILE = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0,
                           tokens=3, inter_token=0.0, rate_limit_requests=20,
                           rate_limit_window=3600.0)


def anthropic_pool(urls: Sequence[str]) -> Settings:
    backends = tuple(BackendSettings(f"s{k}", "anthropic", "claude", url, api_key="sk-up",
                                     group=f"s{k}") for k, url in enumerate(urls))
    pool = PoolSettings(POOL, backends, health=HealthSettings(min_headroom=0.1),
                        hedging=HedgingSettings(enabled=False))  # one request, one attempt
    return Settings((pool,), server=ServerSettings(api_keys=("gw-key",)))


def a_key_whose_first_backend_is(name: str, settings: Settings) -> str:
    """A conversation key (`metadata.user_id`) whose affinity order starts at `name`."""
    weights = {b.name: b.weight for b in settings.pools[0].backends}
    return next(key for key in (f"user-{k}" for k in range(1000))
                if AffinityRoute.of("user:" + key, weights, 1.25).order[0] == name)


def test_anthropic_quota_headers_move_a_conversation_and_reach_the_anthropic_sdk(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory
) -> None:
    """Two simulators allow 20 and 1,000 requests an hour and say so in Anthropic's headers
    (RFC 3339 resets). One conversation's key starts at the small one: its turns go there
    (affinity hits) until it has 1 left (5 % < 10 %), then spill to the other (each a spill and
    a headroom skip); the client sees the headers of the simulator that answered it."""
    small = create_sim_app(QUOTA_PROFILE, seed=1)
    large = create_sim_app(dataclasses.replace(QUOTA_PROFILE, rate_limit_requests=1000), seed=2)
    settings = anthropic_pool([asgi_server(app).base_url for app in (small, large)])
    key = a_key_whose_first_backend_is("s0", settings)
    gateway = GatewayFactory(loop_thread)(settings)
    with anthropic.Anthropic(base_url=gateway.root, api_key="gw-key", max_retries=0,
                             timeout=10.0) as client:
        def send() -> Mapping[str, str]:
            response = client.messages.with_raw_response.create(
                model=POOL, max_tokens=8, metadata={"user_id": key},
                messages=[{"role": "user", "content": "hi"}])
            response.parse()
            return response.headers

        for turn in range(1, 20):  # 2 left after 18 (10 %: room), 1 left after 19 (low)
            headers = send()
            assert headers["x-hedge-backend"] == "s0"
            assert headers["anthropic-ratelimit-requests-limit"] == "20"
            assert headers["anthropic-ratelimit-requests-remaining"] == str(20 - turn)
            assert headers["anthropic-ratelimit-requests-reset"].endswith("Z")
        spilled = [send() for _ in range(10)]
    assert [h["x-hedge-backend"] for h in spilled] == ["s1"] * 10
    assert [h["anthropic-ratelimit-requests-remaining"] for h in spilled] == [
        str(1000 - n) for n in range(1, 11)]  # the large simulator's own count
    assert small.stats.requests == 19 and large.stats.requests == 10
    assert wait_for(lambda: stats_of(gateway.root)["pools"][POOL]["lifetime"]["requests"] >= 29)
    pool = stats_of(gateway.root)["pools"][POOL]
    assert pool["lifetime"]["affinity"] == {"hits": 19, "spills": 10, "misses": 0,
                                            "hit_rate": round(19 / 29, 4)}
    assert pool["lifetime"]["headroom_skips"] == 10
    s0 = pool["backends"]["s0"]
    assert s0["state"] == "low" and s0["headroom"] == 0.05
    assert 0 < s0["seconds_left"] <= 30  # the hour's reset, capped by health.max_pause
    assert s0["lifetime"]["headroom_skips"] == 10
