"""Hedging over real sockets: two scripted loopback upstreams, the gateway under
uvicorn, the official OpenAI SDK as the client. Every test ends with the automatic leak check
(no task, connection or file descriptor beyond the baseline).

Which backend the balancer picks first is random, so scripts are handed out in arrival order
across both upstreams: "the first request to arrive anywhere is the primary"."""

from __future__ import annotations

import asyncio
import functools
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import BudgetSettings, Settings, Timeouts
from tests.harness import (
    DONE,
    AsgiServerFactory,
    Gate,
    Hang,
    Head,
    LoopThread,
    RecordedRequest,
    Reset,
    Script,
    ScriptedUpstream,
    Send,
    Sleep,
    Step,
    UpstreamFactory,
    Wait,
    comment,
    error_script,
    finish_chunk,
    role_chunk,
    sse,
    stream_script,
    token_chunk,
)
from tests.harness.builders import POOL, InOrder, gateway_settings
from tests.harness.limits_kit import GatewayFactory, stream_content
from tests.harness.limits_kit import sdk as kit_sdk

SSE = {"content-type": "text/event-stream"}
#: the SDK client of these tests: their upstreams hold streams for seconds
sdk = functools.partial(kit_sdk, timeout=20.0)


def start(
    asgi_server: AsgiServerFactory,
    scripted_upstream: UpstreamFactory,
    responder: Callable[[RecordedRequest], Script],
    make_settings: Callable[[Sequence[str]], Settings],
    count: int = 2,
) -> tuple[list[ScriptedUpstream], str, object]:
    upstreams = scripted_upstream(count, responder=responder)
    settings = make_settings([u.base_url for u in upstreams])
    app = create_app(settings, seed=7)
    server = asgi_server(app)
    return upstreams, server.v1, app


def backend_of(upstreams: Sequence[ScriptedUpstream], request: RecordedRequest) -> str:
    for i, upstream in enumerate(upstreams):
        if any(r is request for r in upstream.requests):
            return f"b{i}"
    raise AssertionError("request not found on any upstream")


def slow_trap(token_after: float, text: str) -> Script:
    """200 and headers at once, keep-alive comments and a role-only chunk, the token late."""
    steps: list[Step] = [
        Head(),
        Send(comment("ping")),
        Send(role_chunk()),
        Send(comment("OPENROUTER PROCESSING"), 0.1),
        Send(sse({"choices": [{"index": 0, "delta": {"content": ""}}]})),
        Sleep(max(0.0, token_after - 0.1)),
        Send(token_chunk(text)),
        Send(token_chunk(" more"), 0.02),
        Send(token_chunk(" tokens"), 0.02),
        Send(finish_chunk()),
        Send(DONE),
    ]
    return Script(headers=SSE, steps=steps)


# --- 1. the hedge wins a trap; the reversed trap leaves the primary winning ---------------


def gated_winner(first: str, rest: Sequence[str], gate: Gate, token_after: float) -> Script:
    """Role chunk at once, `first` after `token_after`, then nothing more until `gate` opens:
    the winner's stream is provably still going while the test looks at the loser."""
    steps: list[Step] = [
        Head(), Send(role_chunk()), Send(token_chunk(first), token_after), Wait(gate),
        *[Send(token_chunk(t)) for t in rest], Send(finish_chunk()), Send(DONE),
    ]
    return Script(headers=SSE, steps=steps)


class LoserWatch:
    """A thread that waits for the race's two arrivals, then for the loser's upstream to see
    its connection closed, and only then opens the winner's gate. `closed_first` says whether
    the loser was closed while the winner was held (at commit, not at the end of
    the winner's stream)."""

    def __init__(self, order: InOrder, upstreams: Sequence[ScriptedUpstream], loser: int,
                 gate: Gate) -> None:
        self.closed_first = False
        self._order, self._upstreams, self._loser, self._gate = order, upstreams, loser, gate
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        try:
            deadline = time.monotonic() + 10.0
            while len(self._order.arrivals) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # polling, not a timing assertion
            if len(self._order.arrivals) >= 2:
                loser = self._order.arrivals[self._loser]
                owner = next(u for u in self._upstreams if loser in u.requests)
                self.closed_first = owner.wait_closed(loser, 5.0)
        finally:
            self._gate.open()

    def join(self) -> None:
        self._thread.join(15.0)


def test_hedge_after_delay_wins_and_primary_is_closed(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    gate = Gate()
    order = InOrder(slow_trap(2.0, "slow"), gated_winner("fast", [" answer"], gate, 0.05))
    upstreams, v1, _ = start(asgi_server, scripted_upstream, order, gateway_settings)
    watch = LoserWatch(order, upstreams, 0, gate)
    try:
        with sdk(v1) as client:
            sent = time.monotonic()
            text, headers = stream_content(client)
    finally:
        watch.join()

    assert text == "fast answer"
    primary, hedge = order.arrivals
    assert headers["x-hedge-backend"] == backend_of(upstreams, hedge)
    assert headers["x-hedge-attempts"] == "2"
    assert backend_of(upstreams, primary) != backend_of(upstreams, hedge)
    # causality: the hedge went out after the 300 ms delay (counted from no later than the
    # client's send), not before
    assert hedge.received_at - sent >= 0.3
    # the primary's upstream saw its connection closed while the winner was still held
    # before its second token
    assert watch.closed_first, "the loser was not closed while the winner streamed"
    assert primary.closed_at is not None and primary.closed_at <= hedge.event_times[2]
    assert primary.events_written < 5  # it never got to send its late token


def test_reversed_trap_primary_wins_and_hedge_is_closed(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    gate = Gate()
    order = InOrder(gated_winner("primary", [" more", " tokens"], gate, 0.6),
                    slow_trap(2.0, "hedge"))
    upstreams, v1, _ = start(asgi_server, scripted_upstream, order, gateway_settings)
    watch = LoserWatch(order, upstreams, 1, gate)
    try:
        with sdk(v1) as client:
            sent = time.monotonic()
            text, headers = stream_content(client)
    finally:
        watch.join()

    assert text == "primary more tokens"
    primary, hedge = order.arrivals
    assert headers["x-hedge-backend"] == backend_of(upstreams, primary)
    assert headers["x-hedge-attempts"] == "2"
    assert hedge.received_at - sent >= 0.3
    assert watch.closed_first, "the loser was not closed while the winner streamed"
    assert hedge.closed_at is not None and hedge.closed_at <= primary.event_times[2]


def test_no_hedge_when_the_first_token_beats_the_delay(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(stream_script(["quick"], ttft=0.0))
    _, v1, _ = start(
        asgi_server, scripted_upstream, order, lambda urls: gateway_settings(urls, delay=2.0)
    )
    with sdk(v1) as client:
        text, headers = stream_content(client)
    assert text == "quick"
    assert headers["x-hedge-attempts"] == "1"
    assert len(order.arrivals) == 1


@pytest.mark.parametrize(
    "opt_out",
    [
        {"extra_headers": {"x-hedge": "off"}},
        {"extra_body": {"store": True}},
        {"extra_headers": {"Idempotency-Key": "abc"}},
    ],
    ids=["x-hedge-off", "store-true", "idempotency-key"],
)
def test_opt_outs_are_not_hedged(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory, opt_out: dict[str, object]
) -> None:
    order = InOrder(slow_trap(0.6, "only"), stream_script(["hedge"], ttft=0.0))
    _, v1, _ = start(asgi_server, scripted_upstream, order, gateway_settings)
    with sdk(v1) as client:
        text, headers = stream_content(client, **opt_out)
    assert text == "only more tokens"
    assert headers["x-hedge-attempts"] == "1"
    assert len(order.arrivals) == 1


def test_hedge_prefers_another_group(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """Three backends, two in one zone: the hedge always leaves the primary's zone."""
    for _ in range(6):
        order = InOrder(slow_trap(1.0, "slow"), stream_script(["fast"], ttft=0.0))
        upstreams = scripted_upstream(3, responder=order)
        settings = gateway_settings(
            [u.base_url for u in upstreams], delay=0.05, groups=["east", "east", "west"]
        )
        server = asgi_server(create_app(settings))
        with sdk(server.v1) as client:
            stream_content(client)
        primary, hedge = order.arrivals
        zones = {"b0": "east", "b1": "east", "b2": "west"}
        p, h = backend_of(upstreams, primary), backend_of(upstreams, hedge)
        assert zones[p] != zones[h], (p, h)


# --- 3. failures before the first token ---------------------------------------------------


FAST_FAILURES = {
    "500": error_script(500, "boom"),
    "reset": Script(steps=[Reset()]),
    "429-retry-after": error_script(429, "slow down", headers={"retry-after": "30"}),
    "in-band-error": Script(
        headers=SSE, steps=[Head(), Send(role_chunk()), Send(sse({"error": {"message": "x"}}))]
    ),
    "finish-reason-error": Script(
        headers=SSE,
        steps=[
            Head(),
            Send(role_chunk()),
            Send(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "error"}]})),
        ],
    ),
    # a finish reason and `[DONE]` without a token would be an empty answer, not a failure
    # (tests/e2e/test_empty_answers.py); `[DONE]` alone answers nothing
    "done-without-finish": Script(
        headers=SSE, steps=[Head(), Send(role_chunk()), Send(DONE)]
    ),
    "closes-without-token": Script(headers=SSE, steps=[Head(), Send(role_chunk())]),
}


@pytest.mark.parametrize("failure", list(FAST_FAILURES), ids=list(FAST_FAILURES))
def test_fast_failure_never_wins_over_slower_success(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory, failure: str
) -> None:
    order = InOrder(FAST_FAILURES[failure], stream_script(["healthy", " answer"], ttft=0.2))
    upstreams, v1, app = start(
        asgi_server, scripted_upstream, order, lambda urls: gateway_settings(urls, delay=5.0)
    )
    with sdk(v1) as client:
        text, headers = stream_content(client)
    assert text == "healthy answer"
    failed, replacement = order.arrivals
    assert headers["x-hedge-backend"] == backend_of(upstreams, replacement)
    assert headers["x-hedge-attempts"] == "2"
    if failure == "429-retry-after":
        pool = app.state.pools[POOL]  # type: ignore[attr-defined]
        state, _ = pool.balancer.state(backend_of(upstreams, failed), time.monotonic())
        assert state == "paused"


def test_upstream_400_reaches_the_client_and_cancels_the_rest(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    bad = error_script(400, "bad request")
    order = InOrder(Script(steps=[Sleep(0.4), *bad.steps], headers=bad.headers, status=400),
                    Script(headers=SSE, steps=[Head(), Send(role_chunk()), Hang()]))
    upstreams, v1, _ = start(
        asgi_server, scripted_upstream, order, lambda urls: gateway_settings(urls, delay=0.1)
    )
    with sdk(v1) as client, pytest.raises(openai.BadRequestError) as info:
        stream_content(client)
    assert info.value.status_code == 400
    assert info.value.response.headers["x-should-retry"] == "false"
    hedge = order.arrivals[1]
    assert upstreams[0].wait_closed(hedge) or upstreams[1].wait_closed(hedge)


def test_all_backends_failing_gives_502_with_reasons_and_no_secret(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    canary = "sk-CANARY-0123456789"
    order = InOrder(error_script(500, f"internal {canary} at db-7.internal"))
    _, v1, _ = start(
        asgi_server,
        scripted_upstream,
        order,
        lambda urls: gateway_settings(urls, api_key=canary, max_attempts=2),
    )
    with sdk(v1) as client, pytest.raises(openai.APIStatusError) as info:
        stream_content(client)
    error = info.value
    assert error.status_code == 502
    assert error.response.headers["x-should-retry"] == "false"
    body = error.response.text
    assert "b0: status 500" in body and "b1: status 500" in body
    assert canary not in body and "db-7" not in body
    assert len(order.arrivals) == 2


def test_no_first_token_by_the_deadline_gives_504(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """One deadline for every attempt. The hedge starts at 0.4 s and would find
    its token 0.6 s later: after the request's deadline (0.8 s), before a deadline of its
    own. A shared deadline gives 504 and closes the hedge before its token; a per-attempt
    deadline would let the hedge win."""
    hang = Script(headers=SSE, steps=[Head(), Send(role_chunk()), Hang()])
    late = Script(headers=SSE, steps=[Head(), Send(role_chunk()), Sleep(0.6),
                                      Send(token_chunk("too late")), Send(DONE)])
    order = InOrder(hang, late)
    upstreams, v1, _ = start(
        asgi_server,
        scripted_upstream,
        order,
        lambda urls: gateway_settings(urls, delay=0.4, timeout=0.8),
    )
    with sdk(v1) as client, pytest.raises(openai.APIStatusError) as info:
        stream_content(client)
    assert info.value.status_code == 504
    assert info.value.response.headers["x-should-retry"] == "false"
    _, hedge = order.arrivals
    for request in order.arrivals:
        assert any(u.wait_closed(request, 2.0) for u in upstreams if request in u.requests)
    # the upstream notes the close before its writer records the outcome: wait for both
    assert any(u.wait_until(lambda: hedge.outcome is not None, 2.0)
               for u in upstreams if hedge in u.requests)
    assert hedge.events_written == 1 and hedge.outcome == "client_closed"


@pytest.mark.parametrize("header", ["x-request-timeout", "x-stainless-read-timeout"])
def test_client_timeout_header_shortens_the_deadline(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory, header: str
) -> None:
    """The pool allows 25 s and the client waits 8 s: only the header (0.5 s) can turn the
    silent upstream into a 504 before the client gives up on its own."""
    order = InOrder(Script(headers=SSE, steps=[Head(), Send(role_chunk()), Hang()]))
    upstreams, v1, _ = start(
        asgi_server, scripted_upstream, order,
        lambda urls: gateway_settings(urls, delay=5.0, timeout=25.0),
    )
    with openai.OpenAI(base_url=v1, api_key="sk-client", max_retries=0,
                       timeout=openai.Timeout(8.0)) as client, \
            pytest.raises(openai.APIStatusError) as info:
        stream_content(client, extra_headers={header: "0.5"})
    assert info.value.status_code == 504
    (request,) = order.arrivals
    assert any(u.wait_closed(request) for u in upstreams if request in u.requests)


def test_max_attempts_one_means_no_failover(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(error_script(503, "down"), stream_script(["never"]))
    _, v1, _ = start(
        asgi_server, scripted_upstream, order, lambda urls: gateway_settings(urls, max_attempts=1)
    )
    with sdk(v1) as client, pytest.raises(openai.APIStatusError) as info:
        stream_content(client)
    assert info.value.status_code == 502
    assert len(order.arrivals) == 1


def test_hedging_disabled_still_fails_over(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    order = InOrder(error_script(503, "down"), stream_script(["replacement"], ttft=0.0))
    _, v1, _ = start(
        asgi_server, scripted_upstream, order, lambda urls: gateway_settings(urls, hedging=False)
    )
    with sdk(v1) as client:
        text, headers = stream_content(client)
    assert text == "replacement"
    assert headers["x-hedge-attempts"] == "2"


# --- 4. client disconnects leave nothing open ----------------------------------------------


def raw_request(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"content-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


STREAM_BODY = (
    b'{"model": "pool", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
)


@pytest.mark.parametrize("moment", ["before-first-token", "during-hedge"])
def test_client_disconnect_before_commit_closes_every_upstream(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory, moment: str
) -> None:
    hang = Script(headers=SSE, steps=[Head(), Send(role_chunk()), Hang()])
    order = InOrder(hang)
    delay = 5.0 if moment == "before-first-token" else 0.05
    upstreams, v1, _ = start(
        asgi_server, scripted_upstream, order, lambda urls: gateway_settings(urls, delay=delay)
    )
    port = httpx.URL(v1).port
    assert port is not None
    expected = 1 if moment == "before-first-token" else 2
    sock = raw_request(port, STREAM_BODY)
    assert upstreams[0].wait_until(lambda: len(order.arrivals) == expected)
    sock.close()
    for request in order.arrivals:
        owner = next(u for u in upstreams if request in u.requests)
        assert owner.wait_closed(request), f"upstream never saw the close ({moment})"


def test_under_its_own_server_the_client_is_watched_without_a_task(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Under `hedge-gateway serve`'s server the proxy watches the client through the server's
    future of the connection's loss (`GONE_EXTENSION`): no task reads `receive` while the
    race runs, and a client that leaves before the first token still closes every upstream
    (the hedge's too)."""
    hang = Script(headers=SSE, steps=[Head(), Send(role_chunk()), Hang()])
    order = InOrder(hang)
    upstreams = scripted_upstream(2, responder=order)
    gateway = GatewayFactory(loop_thread)(
        gateway_settings([u.base_url for u in upstreams], delay=0.05))
    sock = raw_request(gateway.port, STREAM_BODY)
    assert upstreams[0].wait_until(lambda: len(order.arrivals) == 2)  # primary and hedge

    async def watchers() -> list[str]:
        return [name for t in asyncio.all_tasks()
                if (name := getattr(t.get_coro(), "__qualname__", "")) == "_wait_disconnect"]

    assert loop_thread.run(watchers()) == []
    sock.close()
    for request in order.arrivals:
        owner = next(u for u in upstreams if request in u.requests)
        assert owner.wait_closed(request), "an upstream never saw the close"


def test_client_disconnect_mid_stream_closes_the_winner(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    tokens = [f"t{i} " for i in range(50)]
    order = InOrder(stream_script(tokens, ttft=0.0, gap=0.05))
    upstreams, v1, _ = start(
        asgi_server, scripted_upstream, order, lambda urls: gateway_settings(urls, delay=5.0)
    )
    with httpx.Client(timeout=5) as client, client.stream(
        "POST", f"{v1}/chat/completions", content=STREAM_BODY,
        headers={"content-type": "application/json"},
    ) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data:"):
                seen += 1
            if seen == 3:
                break
    (request,) = order.arrivals
    owner = next(u for u in upstreams if request in u.requests)
    assert owner.wait_closed(request)
    assert request.events_written < 50


# --- 5. many hedged requests with random winners leave nothing behind ---------------------


def test_200_hedged_requests_with_random_winners_leave_no_leak(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory, loop_thread: object
) -> None:
    rng = random.Random(42)
    lock = threading.Lock()

    def random_ttft(_: RecordedRequest) -> Script:
        with lock:
            ttft = rng.uniform(0.0, 0.06)
        return stream_script(["x", "y"], ttft=ttft, gap=0.005, close=False)

    upstreams = scripted_upstream(2, responder=random_ttft)
    budget = BudgetSettings(ratio=1.0, burst=200.0)
    settings = gateway_settings([u.base_url for u in upstreams], delay=0.02, budget=budget)
    app = create_app(settings, seed=1)
    server = asgi_server(app)
    winners: dict[str, int] = {}
    with sdk(server.v1) as client:
        for _ in range(200):
            text, headers = stream_content(client)
            assert text == "xy"
            winners[headers["x-hedge-backend"]] = winners.get(headers["x-hedge-backend"], 0) + 1
    received = sum(len(u.requests) for u in upstreams)
    assert received > 230, "the scenario should hedge often"
    assert set(winners) == {"b0", "b1"}
    # every loser's connection was closed by the gateway; winners' may stay in the keep-alive pool
    losers = [
        r for u in upstreams for r in u.requests if r.outcome != "complete"
    ]
    for request in losers:
        owner = next(u for u in upstreams if request in u.requests)
        assert owner.wait_closed(request)
    pool_connections = sum(u.open_connections for u in upstreams)
    assert pool_connections <= 64  # bounded by the shared client's keep-alive pool
    # tasks, sockets and fds back to baseline: the automatic leak check at teardown


# --- 6. outage: every backend slow at once ------------------------------------------------


def run_outage(
    asgi_server: AsgiServerFactory,
    scripted_upstream: UpstreamFactory,
    budget: BudgetSettings,
    requests: int,
    concurrency: int,
) -> tuple[int, float, object]:
    slow = stream_script(["late"], ttft=0.25, close=False)
    upstreams = scripted_upstream(2, responder=lambda _: slow)
    settings = gateway_settings([u.base_url for u in upstreams], delay=0.03, budget=budget,
                                timeouts=Timeouts())
    app = create_app(settings, seed=3)
    server = asgi_server(app)
    started = time.monotonic()
    remaining = list(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        with sdk(server.v1) as client:
            while True:
                with lock:
                    if not remaining:
                        return
                    remaining.pop()
                stream_content(client)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - started
    extra = sum(len(u.requests) for u in upstreams) - requests
    return extra, elapsed, app


@pytest.mark.timeout(90)
def test_outage_extra_attempts_stay_within_the_budget(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """The bucket alone: no efficacy guard (`min_win_rate` 0), no time reserve, a small
    burst, and enough requests that ratio x N (20) dominates it (2). Every request wants a
    hedge, so the extra attempts are what the deposits allow: about ratio x N + burst, and
    far fewer than N."""
    budget = BudgetSettings(ratio=0.1, burst=2.0, min_per_second=0.0, min_win_rate=0.0)
    requests = 200
    extra, _, app = run_outage(asgi_server, scripted_upstream, budget, requests, 10)
    bound = budget.ratio * requests + budget.burst
    assert extra <= bound, (extra, bound)
    # the deposits were spent: the bucket, not something else, set the number
    assert extra >= budget.ratio * requests * 0.75, (extra, bound)
    pool = app.state.pools[POOL]  # type: ignore[attr-defined]
    assert not pool.budget.ineffective(time.monotonic())


@pytest.mark.timeout(90)
def test_outage_hedges_fall_to_the_probe_rate_once_they_stop_winning(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """A generous budget, so only the efficacy guard can hold the hedges back."""
    budget = BudgetSettings(ratio=1.0, burst=500.0)
    requests, concurrency = 120, 10
    extra, elapsed, app = run_outage(asgi_server, scripted_upstream, budget, requests, concurrency)
    pool = app.state.pools[POOL]  # type: ignore[attr-defined]
    assert pool.budget.ineffective(time.monotonic())
    # win_window (20) outcomes trip the guard; up to `concurrency` hedges were already running;
    # after that, one probe per probe_interval
    probes = elapsed / budget.probe_interval + 1
    assert extra <= budget.win_window + concurrency + probes, (extra, elapsed)
    assert extra < requests / 2


def test_a_finished_winner_returns_its_connection_to_the_pool(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    """After `[DONE]` the relay reads the body's end, so the next request reuses the
    connection instead of paying for a new one (losers, by contrast, are always dropped)."""
    order = InOrder(stream_script(["a", "b"], ttft=0.0, close=False))
    upstreams, v1, _ = start(
        asgi_server, scripted_upstream, order, gateway_settings, count=1
    )
    with sdk(v1) as client:
        for _ in range(5):
            assert stream_content(client)[0] == "ab"
    assert len(order.arrivals) == 5
    assert upstreams[0].connections_total == 1
