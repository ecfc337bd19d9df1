"""The race rules that only a real race shows: two or three scripted loopback upstreams,
the gateway under uvicorn, the official OpenAI SDK as the client.

- non-streaming requests and embeddings are hedged;
- the adaptive delay, learned from real TTFTs, decides when the hedge starts;
- each suppression reason (`deadline`, `no_backend`, `budget`, `ineffective`) is counted in
  /hedge/stats by a real race;
- at most max(3, 0.2 x in-flight requests) extra attempts are in flight at once.

Assertions are on order and causality (which attempt arrived, what was held when), never on
how fast something was. Every test ends with the automatic leak check.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import openai
import pytest

from gateway.hedge.budget import wilson_upper
from gateway.settings import BudgetSettings, DelaySettings, Settings
from tests.harness import (
    DONE,
    SSE_HEADERS,
    Gate,
    Hang,
    Head,
    LoopThread,
    RecordedRequest,
    Script,
    ScriptedUpstream,
    Send,
    UpstreamFactory,
    Wait,
    chat_completion_obj,
    error_script,
    finish_chunk,
    json_script,
    role_chunk,
    stream_script,
    token_chunk,
)
from tests.harness.builders import POOL, InOrder, gateway_settings
from tests.harness.limits_kit import (
    MESSAGES,
    Gateway,
    GatewayFactory,
    sdk,
    stats_of,
    stream_content,
    wait_for,
)

Responder = Callable[[RecordedRequest], Script]


def start(
    loop_thread: LoopThread,
    scripted_upstream: UpstreamFactory,
    responder: Responder,
    *,
    count: int = 2,
    adjust: Callable[[Settings], Settings] = lambda s: s,
    **settings: Any,
) -> tuple[Gateway, list[ScriptedUpstream]]:
    upstreams = scripted_upstream(count, responder=responder)
    built = adjust(gateway_settings([u.base_url for u in upstreams], **settings))
    return GatewayFactory(loop_thread)(built), upstreams


def owner(upstreams: Sequence[ScriptedUpstream], request: RecordedRequest) -> ScriptedUpstream:
    return next(u for u in upstreams if any(r is request for r in u.requests))


def suppressed(gateway: Gateway) -> dict[str, int]:
    counts: dict[str, int] = stats_of(gateway.root)["pools"][POOL]["lifetime"]["hedges"][
        "suppressed"
    ]
    return counts


def settled(
    gateway: Gateway, reason: str, at_least: int = 1, timeout: float = 5.0
) -> dict[str, int]:
    """The suppression counts once `reason` reached `at_least` (requests are recorded when
    they end, a moment after the client has its answer), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while (counts := suppressed(gateway)).get(reason, 0) < at_least:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)  # polling, not a timing assertion
    return counts


def stream_text(gateway: Gateway, **extra: Any) -> tuple[str, dict[str, str]]:
    with sdk(gateway.v1) as client:
        return stream_content(client, **extra)


def with_delay(delay: DelaySettings) -> Callable[[Settings], Settings]:
    def adjust(settings: Settings) -> Settings:
        (pool,) = settings.pools
        hedging = dataclasses.replace(pool.hedging, delay=delay)
        pool = dataclasses.replace(pool, hedging=hedging)
        return dataclasses.replace(settings, pools=(pool,))

    return adjust


def slow(text: str, token_after: float) -> Script:
    """Head and role chunk at once, the token late (or never: it ends when closed)."""
    return stream_script([text], ttft=token_after)


# --- non-streaming requests and embeddings are hedged -------------------------------------

EMBEDDING: dict[str, Any] = {
    "object": "list",
    "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
    "model": "m",
    "usage": {"prompt_tokens": 1, "total_tokens": 1},
}


@pytest.mark.parametrize("endpoint", ["chat", "embeddings"])
def test_a_slow_non_streaming_primary_is_hedged_and_the_hedge_wins(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, endpoint: str
) -> None:
    if endpoint == "chat":
        primary_body: dict[str, Any] = chat_completion_obj("primary")
        hedge_body: dict[str, Any] = chat_completion_obj("hedge")
    else:
        primary_body = {**EMBEDDING, "data": [{**EMBEDDING["data"][0], "embedding": [1.0]}]}
        hedge_body = {**EMBEDDING, "data": [{**EMBEDDING["data"][0], "embedding": [2.0]}]}
    gate = Gate()
    # the primary answers only once the gate opens, which the test does after the hedge won
    held = Script(headers={"content-type": "application/json"}, framing="length",
                  steps=[Wait(gate), Head(), Send(json.dumps(primary_body).encode())])
    order = InOrder(held, json_script(hedge_body))
    gateway, upstreams = start(loop_thread, scripted_upstream, order, delay=0.1)
    try:
        with sdk(gateway.v1) as client:
            if endpoint == "chat":
                raw: Any = client.chat.completions.with_raw_response.create(
                    model=POOL, messages=MESSAGES
                )
                assert raw.parse().choices[0].message.content == "hedge"
            else:
                raw = client.embeddings.with_raw_response.create(model=POOL, input="x")
                assert raw.parse().data[0].embedding == [2.0]
    finally:
        gate.open()
    assert raw.headers["x-hedge-attempts"] == "2"
    primary, hedge = order.arrivals
    assert raw.headers["x-hedge-backend"] == f"b{upstreams.index(owner(upstreams, hedge))}"
    assert owner(upstreams, primary).wait_closed(primary)
    assert primary.head_at is None  # it lost before it had said anything

# --- the adaptive delay through a real race -----------------------------------------------


def test_the_hedge_starts_after_the_learned_delay_not_the_initial_one(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Fast TTFTs teach both backends a short delay; then a primary whose token comes well
    before `initial` (5 s) but well after the learned delay is hedged, and the hedge wins.
    With `initial` in force the primary would have won alone."""
    delay = DelaySettings(mode="adaptive", initial=5.0, min=0.05, max=5.0, min_samples=3)
    warm = stream_script(["warm"], ttft=0.0, close=False)
    gate = Gate()
    trap = Script(headers=SSE_HEADERS, steps=[Head(), Send(role_chunk()), Wait(gate),
                                              Send(token_chunk("primary")), Send(DONE)])
    arrivals: list[RecordedRequest] = []
    lock = threading.Lock()

    def responder(request: RecordedRequest) -> Script:
        # by request id, not by arrival count: a warm-up attempt that fails over (a pooled
        # connection the upstream closed meanwhile) must not shift the trap
        if request.headers.get("x-client-request-id") != "trap":
            return warm
        with lock:
            arrivals.append(request)
            first_of_trap = len(arrivals) == 1
        return trap if first_of_trap else stream_script(["hedge"], ttft=0.0)

    gateway, upstreams = start(loop_thread, scripted_upstream, responder,
                               adjust=with_delay(delay), delay=None)
    for _ in range(WARM_UP):
        assert stream_text(gateway)[0] == "warm"
    learned = wait_adaptive(gateway)
    assert all(ms < 1000 for ms in learned.values()), learned
    try:
        text, headers = stream_text(gateway, extra_headers={"x-request-id": "trap"})
    finally:
        gate.open()
    assert text == "hedge"
    assert headers["x-hedge-attempts"] == "2"
    primary, _ = arrivals
    assert owner(upstreams, primary).wait_closed(primary)
    assert primary.events_written == 1  # role chunk only: it lost before its token


#: requests that teach both backends their TTFT (min_samples 3 each, with room for the
#: balancer's random choices)
WARM_UP = 12


def wait_adaptive(gateway: Gateway) -> dict[str, float]:
    """Each backend's delay once both have left `initial` (the threshold is refreshed off
    the request path, so it may take a moment after the last sample)."""
    deadline = time.monotonic() + 5.0
    while True:
        backends = stats_of(gateway.root)["pools"][POOL]["backends"]
        modes = {name: b["hedge_delay_mode"] for name, b in backends.items()}
        if all(mode == "adaptive" for mode in modes.values()):
            return {name: b["hedge_delay_ms"] for name, b in backends.items()}
        assert time.monotonic() < deadline, f"the delay never became adaptive: {modes}"
        time.sleep(0.05)  # polling, not a timing assertion


# --- each suppression reason, counted by a real race ---------------------------------------


def test_no_backend_when_the_only_other_backend_is_paused(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Three backends. Request 1: a 429 with Retry-After pauses its backend, a failover
    answers. Request 2: its primary fails (500), the failover is slow, and when the hedge is
    due every backend is paused or already tried."""
    order = InOrder(
        error_script(429, "slow down", headers={"retry-after": "30"}),
        stream_script(["first"]),
        error_script(500, "boom"),
        slow("second", 0.8),
    )
    gateway, _ = start(loop_thread, scripted_upstream, order, count=3, delay=0.1,
                               max_attempts=3)
    assert stream_text(gateway)[0] == "first"
    text, headers = stream_text(gateway)
    assert (text, headers["x-hedge-attempts"]) == ("second", "2")
    assert len(order.arrivals) == 4  # no hedge went out
    assert settled(gateway, "no_backend")["no_backend"] >= 1


def test_deadline_when_too_little_time_is_left_for_the_target_backend(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Both backends learn a median TTFT of at least 0.35 s; a request whose deadline
    (`x-request-timeout: 1.0`) leaves at most 0.2 s when its hedge is due (0.8 s) hedges
    nothing and gets its 504."""
    warm = stream_script(["warm"], ttft=0.35)
    hang = Script(headers=SSE_HEADERS, steps=[Head(), Send(role_chunk()), Hang()])
    arrivals: list[RecordedRequest] = []
    lock = threading.Lock()
    #: set once the warm-up requests are answered: every attempt before is warm (a hedge a
    #: loaded machine sends during the warm-up included: counted by arrival, it took a warm
    #: answer from a later warm-up request, which then hung until its client gave up)
    measuring = threading.Event()

    def responder(request: RecordedRequest) -> Script:
        with lock:
            arrivals.append(request)
        return hang if measuring.is_set() else warm

    gateway, _ = start(loop_thread, scripted_upstream, responder, delay=0.8)
    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(stream_text(gateway)[0]))
               for _ in range(DEADLINE_WARM_UP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert answers == ["warm"] * DEADLINE_WARM_UP  # every warm-up answered, none hung
    measuring.set()
    backends = stats_of(gateway.root)["pools"][POOL]["backends"]
    # 0.35 s and up, read through DDSketch's 1 % relative accuracy: well above the 0.2 s left
    assert all((b["lifetime"]["ttft_ms"]["p50"] or 0) >= 340 for b in backends.values()), backends
    # the medians are refreshed off the request path: until the learned ones are in force a
    # request may still hedge (and get its 504 all the same), so try a few
    for _ in range(8):
        with lock:
            before = len(arrivals)
        with pytest.raises(openai.APIStatusError) as info:
            stream_text(gateway, extra_headers={"x-request-timeout": "1.0"})
        assert info.value.status_code == 504
        if settled(gateway, "deadline", timeout=1.0).get("deadline", 0) >= 1:
            break
    assert suppressed(gateway)["deadline"] >= 1
    assert len(arrivals) == before + 1  # that request's hedge was suppressed


#: concurrent warm-up requests: enough that each backend gets a median of its own
DEADLINE_WARM_UP = 8


def test_budget_when_the_bucket_is_empty(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """A bucket of one token and no refill: the first slow request hedges, the second
    cannot."""
    budget = BudgetSettings(ratio=0.0, burst=1.0, min_per_second=0.0, min_win_rate=0.0)
    order = InOrder(slow("p1", 0.8), stream_script(["h1"]), slow("p2", 0.4))
    gateway, _ = start(loop_thread, scripted_upstream, order, delay=0.1, budget=budget)
    text, headers = stream_text(gateway)
    assert (text, headers["x-hedge-attempts"]) == ("h1", "2")
    text, headers = stream_text(gateway)
    assert (text, headers["x-hedge-attempts"]) == ("p2", "1")
    assert len(order.arrivals) == 3
    assert settled(gateway, "budget")["budget"] >= 1


def by_request_id(first: Script, later: Script) -> Responder:
    """The first attempt of each logical request (by the `x-request-id` the gateway sends)
    gets `first`; its hedges get `later`."""
    seen: set[str] = set()
    lock = threading.Lock()

    def responder(request: RecordedRequest) -> Script:
        rid = request.headers.get("x-request-id", "")
        with lock:
            is_first = rid not in seen
            seen.add(rid)
        return first if is_first else later

    return responder


def test_ineffective_once_a_window_of_hedges_has_lost(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Every hedge loses (primaries answer at 0.12 s, hedges at 3 s): once the lost hedges
    are evidence of a win rate under `min_win_rate` (16 straight losses) the guard lets one
    probe through per `probe_interval`, and the next hedge is suppressed as `ineffective`."""
    budget = BudgetSettings(ratio=1.0, burst=100.0)
    responder = by_request_id(stream_script(["p"], ttft=0.12), slow("h", 3.0))
    gateway, _ = start(loop_thread, scripted_upstream, responder, delay=0.03, budget=budget)
    pool = gateway.app.state.pools[POOL]
    losses = next(n for n in range(1, budget.win_window + 1)
                  if wilson_upper(0, n) < budget.min_win_rate)
    assert losses == 16
    for _ in range(losses + 1):  # the lost hedges, then the probe
        assert stream_text(gateway)[0] == "p"
    assert pool.budget.ineffective(time.monotonic())
    assert suppressed(gateway).get("ineffective", 0) == 0
    _, headers = stream_text(gateway)
    assert headers["x-hedge-attempts"] == "1"
    assert settled(gateway, "ineffective")["ineffective"] >= 1


# --- the budget: at most max(3, 0.2 x in-flight) extra attempts at once --------------------------


def test_extra_attempts_in_flight_are_capped_by_the_in_flight_requests(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """20 requests held at once, every attempt waiting on one gate, a budget that never runs
    out and hedges due after 50 ms: while they are held, exactly max(3, 0.2 x 20) = 4
    hedges go out, and every other hedge is refused (`budget`) until the gate opens."""
    requests = 20
    cap = max(3, int(0.2 * requests))
    gate = Gate()
    held = Script(headers=SSE_HEADERS, steps=[Head(), Send(role_chunk()), Wait(gate),
                                              Send(token_chunk("x")), Send(finish_chunk()),
                                              Send(DONE)])
    arrivals: list[RecordedRequest] = []
    lock = threading.Lock()

    def responder(request: RecordedRequest) -> Script:
        with lock:
            arrivals.append(request)
        return held

    budget = BudgetSettings(ratio=1.0, burst=1000.0, min_win_rate=0.0)
    gateway, _ = start(loop_thread, scripted_upstream, responder, delay=0.05,
                               budget=budget)
    texts: list[str] = []
    threads = [threading.Thread(target=lambda: texts.append(stream_text(gateway)[0]))
               for _ in range(requests)]
    for t in threads:
        t.start()
    try:
        def ids() -> list[str]:
            with lock:
                return [r.headers.get("x-request-id", "") for r in arrivals]

        # polled: the arrivals are spread over both upstreams
        assert wait_for(lambda: len(set(ids())) == requests, 10.0)
        assert wait_for(lambda: len(ids()) >= requests + cap, 10.0)
        # an absence needs a window: ten more hedge delays in which every held request
        # asks again, and must be refused
        time.sleep(0.5)
        extras = len(ids()) - len(set(ids()))
    finally:
        gate.open()
        for t in threads:
            t.join(20)
    assert texts == ["x"] * requests
    assert extras == cap, (extras, cap)
    assert settled(gateway, "budget", at_least=requests)["budget"] >= requests
