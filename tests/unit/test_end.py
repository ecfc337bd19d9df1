"""The end of a logical request through the proxy, in virtual time: one owner ends it on every
path, and the client is answered before losers are reaped and stats recorded. The race itself is in
test_race_table.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gateway.api.admission import Admission
from gateway.api.answer import Answer
from gateway.api.end import RequestEnd
from gateway.api.proxy import Proxy
from gateway.api.stream import SSEResponse
from gateway.drain import Drain
from gateway.errors import InternalError, Overloaded, UpstreamClientError
from gateway.hedge.race import Race
from gateway.server.extensions import GONE_EXTENSION
from gateway.settings import ServerSettings
from gateway.stats import Stats
from gateway.wire.chat import CHAT
from gateway.wire.messages import MESSAGES
from gateway.wire.usage import ask_for_usage
from tests.harness.raceworld import (
    HANG,
    Setup,
    Step,
    What,
    World,
    http_request,
    logical_request,
    proxy_for,
)
from tests.harness.virtualtime import VirtualLoop, run_virtual

#: a loser's upstream takes this long to close (virtual seconds): long enough to see who waits
SLOW_CLOSE = 3.0


def test_an_error_is_answered_before_the_losers_are_reaped() -> None:
    """The hedge's 400 at 0.375 s is the answer; the primary (cancelled) takes 3 s to close.
    The proxy must return the error's answer at once, holding the request's end, which runs
    after the answer is sent (the reaping and the stats), once."""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop, close_takes=SLOW_CLOSE)
        proxy, pool = proxy_for(Setup([HANG, Step("400", 0.125)]), loop, world)
        answer = await proxy.handle(http_request(), pool, logical_request(stream=True))
        assert isinstance(answer, Answer)  # an error's answer: the end travels with it
        assert loop.time() == 0.375  # answered at the 400, not after the slow close
        assert proxy.stats.summaries == []  # type: ignore[attr-defined]
        assert answer.end is not None  # the request's end travels with its answer
        sent = await _send(answer, loop, proxy)
        assert [(m["type"], at, recorded) for at, m, recorded in sent] == [
            ("http.response.start", 0.375, 0), ("http.response.body", 0.375, 0)]
        assert sent[0][1]["status"] == UpstreamClientError.status
        error = json.loads(sent[1][1]["body"])["error"]
        assert error["code"] == UpstreamClientError.code  # the route's (OpenAI's) shape
        assert proxy.admission.active == 0 and pool.inflight_requests == 0
        [(recorded_at, summary)] = proxy.stats.summaries  # type: ignore[attr-defined]
        assert recorded_at == 0.375 + SLOW_CLOSE  # after the loser closed: close_ms counts it
        assert summary.attempts[0].close_s == SLOW_CLOSE
        assert summary.status == UpstreamClientError.status
        assert set(world.closed) == set(world.opened)
        await answer.end()  # once: a second call records nothing more
        assert len(proxy.stats.summaries) == 1  # type: ignore[attr-defined]

    run_virtual(main)


def test_an_error_is_answered_in_the_shape_of_the_requests_route() -> None:
    """The route decides the shape, once: a request whose route speaks Anthropic's protocol
    gets Anthropic's error body from the proxy, whatever the URL path says (here chat's)."""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop)
        proxy, pool = proxy_for(Setup([Step("400", 0.0)]), loop, world)
        req = replace(logical_request(stream=True), protocol=MESSAGES)
        answer = await proxy.handle(http_request(), pool, req)
        sent = await _send(answer, loop, proxy)
        body = json.loads(sent[1][1]["body"])
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert sent[0][1]["status"] == 400
        assert proxy.admission.active == 0 and pool.inflight_requests == 0

    run_virtual(main)


async def _send(answer: Answer | SSEResponse, loop: VirtualLoop, proxy: Proxy
                ) -> list[tuple[float, dict[str, Any], int]]:
    """Send `answer` to a client that reads it all: each message with when it went out and
    how many summaries were recorded by then."""
    sent: list[tuple[float, dict[str, Any], int]] = []

    async def send(message: Any) -> None:
        sent.append((loop.time(), message,
                     len(proxy.stats.summaries)))  # type: ignore[attr-defined]

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    await answer({"type": "http"}, receive, send)
    return sent


def test_a_json_answer_is_sent_before_the_losers_are_reaped() -> None:
    async def main(loop: VirtualLoop) -> None:
        world = World(loop, close_takes=SLOW_CLOSE)
        proxy, pool = proxy_for(Setup([HANG, Step("token", 0.125)]), loop, world)
        response = await proxy.handle(http_request(), pool, logical_request(stream=False))
        assert loop.time() == 0.375  # the race was decided: nothing else delays the answer
        sent: list[tuple[float, dict[str, Any]]] = []

        async def send(message: Any) -> None:
            sent.append((loop.time(), message))

        async def receive() -> Any:
            return {"type": "http.disconnect"}

        await response({"type": "http"}, receive, send)
        assert [m["type"] for _, m in sent] == ["http.response.start", "http.response.body"]
        assert all(at == 0.375 for at, _ in sent)
        [(recorded_at, summary)] = proxy.stats.summaries  # type: ignore[attr-defined]
        assert recorded_at > 0.375 and summary.winner is not None
        assert proxy.admission.active == 0 and pool.inflight_requests == 0
        assert set(world.closed) == set(world.opened)

    run_virtual(main)


def test_a_failure_building_the_stream_still_ends_the_request() -> None:
    """If building the streaming response raises after the race committed, the answer is
    the route's internal error, reported, and its end closes the winner's upstream and gives
    back the admission slot and in-flight count."""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop)
        proxy, pool = proxy_for(Setup([Step("token", 0.125)]), loop, world)

        def broken(*_: object, **__: object) -> object:
            raise RuntimeError("a bug while building the response")

        proxy._streaming_response = broken  # type: ignore[method-assign,assignment]
        answer = await proxy.handle(http_request(), pool, logical_request(stream=True))
        assert answer.status_code == InternalError.status
        assert proxy.stats.internal_errors == 1  # the RuntimeError, reported once
        assert answer.end is not None  # the error's answer ends the request
        sent = await _send(answer, loop, proxy)
        assert [recorded for _, _, recorded in sent] == [0, 0]  # answered, then ended
        assert json.loads(sent[1][1]["body"])["error"]["code"] == InternalError.code
        assert proxy.admission.active == 0 and pool.inflight_requests == 0
        assert set(world.closed) == set(world.opened) == {0}
        assert len(proxy.stats.summaries) == 1  # type: ignore[attr-defined]

    run_virtual(main)


def test_a_cancelled_request_task_ends_the_request_inline() -> None:
    async def main(loop: VirtualLoop) -> None:
        world = World(loop)
        proxy, pool = proxy_for(Setup([HANG, HANG]), loop, world)
        task = asyncio.ensure_future(
            proxy.handle(http_request(), pool, logical_request(stream=True))
        )
        loop.call_at(0.375, task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert proxy.admission.active == 0 and pool.inflight_requests == 0
        assert set(world.closed) == set(world.opened) == {0, 1}

    run_virtual(main)


def test_the_client_is_first_read_after_the_primarys_first_step() -> None:
    """The watcher's task is made before the primary's, so its first step runs first: it
    yields at once, and its first read of the client comes after the primary's first step
    (which opens the upstream request), not on the way to it."""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop)
        proxy, pool = proxy_for(Setup([Step("token", 0.125)]), loop, world)
        order: list[str] = []
        provider = next(iter(pool.providers.values()))
        real_open = provider.open

        async def recording_open(call: Any) -> Any:
            order.append("primary opened")
            return await real_open(call)

        provider.open = recording_open  # type: ignore[method-assign]

        async def receive() -> Any:
            order.append("client read")
            return {"type": "http.disconnect"}

        request = http_request()
        request._receive = receive
        answer = await proxy.handle(request, pool, logical_request(stream=True))
        assert order == ["primary opened", "client read"]
        assert isinstance(answer, Answer) and answer.response.status_code == 499
        if answer.end is not None:
            await answer.end()
        assert proxy.admission.active == 0 and pool.inflight_requests == 0

    run_virtual(main)


def test_one_watcher_sees_the_client_for_the_whole_request_and_the_body_is_encoded_once(
) -> None:
    """During the race one task watches the client (no drain task), the
    streaming response keeps using that task instead of reading `receive` itself, and a
    disconnect mid-stream through it ends the request. Every attempt is sent the body
    serialized once, with the backend's own model put first."""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop)
        proxy, pool = proxy_for(Setup([HANG, Step("token", 0.125)]), loop, world)
        sent_bodies: list[tuple[bytes, dict[str, Any]]] = []
        provider = next(iter(pool.providers.values()))
        real_open = provider.open

        async def recording_open(call: Any) -> Any:
            sent_bodies.append((call.content, dict(call.body)))
            return await real_open(call)

        provider.open = recording_open  # type: ignore[method-assign]
        receives = 0
        leave = asyncio.Event()

        async def receive() -> Any:
            nonlocal receives
            receives += 1
            await leave.wait()
            return {"type": "http.disconnect"}

        request = http_request()
        request._receive = receive
        handling = asyncio.ensure_future(
            proxy.handle(request, pool, logical_request(stream=True)))
        await asyncio.sleep(0.2)  # the primary hangs, the hedge has not yet found its token
        names = sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks()  # type: ignore[union-attr]
                       if t is not asyncio.current_task() and not t.done())
        assert names.count("_wait_disconnect") == 1
        assert not any("wait_grace" in name for name in names)
        response = await handling
        sent: list[dict[str, Any]] = []

        async def send(message: Any) -> None:
            sent.append(message)

        streaming = asyncio.ensure_future(response({"type": "http"}, receive, send))
        await asyncio.sleep(1.0)
        assert [m["type"] for m in sent][:2] == ["http.response.start", "http.response.body"]
        leave.set()  # the client hangs up mid-stream
        await streaming
        assert receives == 1  # the response never read `receive` on its own
        [(_, summary)] = proxy.stats.summaries  # type: ignore[attr-defined]
        assert summary.relay_end == "client_gone"
        assert proxy.admission.active == 0 and pool.inflight_requests == 0
        assert set(world.closed) == set(world.opened)
        assert len(sent_bodies) == 2
        req = logical_request(stream=True)
        # the body the gateway sends upstream: usage asked for, model per backend
        upstream, _ = ask_for_usage(req.endpoint, req.stream, req.body)
        for content, body in sent_bodies:
            assert content.startswith(b'{"model":')
            assert json.loads(content) == body
            assert body == {**upstream, "model": body["model"]}
        models = {body["model"] for _, body in sent_bodies}
        assert len(models) == 2 and models <= set(pool.models.values())

    run_virtual(main)


def test_admission_bounds_the_body_bytes_in_flight_and_always_admits_the_first() -> None:
    admission = Admission(10, max_bytes=100)
    admission.enter(150)  # nothing in flight: admitted, however large
    with pytest.raises(Overloaded):
        admission.enter(1)
    admission.leave(150)
    admission.enter(60)
    admission.enter(40)
    with pytest.raises(Overloaded) as refused:
        admission.enter(1)
    assert refused.value.retry_after == 1.0 and refused.value.status == 503
    admission.leave(40)
    admission.leave(60)
    assert (admission.active, admission.active_bytes) == (0, 0)


def test_the_winners_backend_slot_is_back_before_its_upstream_is_closed() -> None:
    """A client may send its next request (a conversation's next turn) as soon as it has its
    answer. By then the winner's backend must no longer count this request's attempt: else
    the turn finds its home at its bound (two conversations there) and spills to a backend
    that must prefill its whole history. The slot goes back with the admission slot, before
    the winner's upstream close (3 s here) is awaited."""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop, close_takes=SLOW_CLOSE)
        proxy, pool = proxy_for(Setup([Step("token", 0.125)]), loop, world)
        response = await proxy.handle(http_request(), pool, logical_request(stream=False))
        sent: list[str] = []

        async def send(message: Any) -> None:
            sent.append(message["type"])

        async def receive() -> Any:
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(response({"type": "http"}, receive, send))
        await asyncio.sleep(1.0)
        assert sent == ["http.response.start", "http.response.body"]  # answered
        assert world.closed == {} and not task.done()  # the winner's upstream still closing
        assert pool.inflight_requests == 0
        assert all(pool.balancer.inflight(b.name) == 0 for b in pool.settings.backends)
        await task
        assert set(world.closed) == set(world.opened)
        assert all(pool.balancer.inflight(b.name) == 0 for b in pool.settings.backends)

    run_virtual(main)


@pytest.mark.parametrize("what", ["token+done", "token"])
def test_a_streams_backend_slot_is_held_while_it_runs_and_back_before_its_end_goes_out(
        what: What) -> None:
    """The winner's slot is held while its stream runs (the head and the first token go out
    with it held) and is back before the piece that ends the stream goes out: its end event
    (`token+done`: `[DONE]` in a read of its own), or the gateway's error event when the
    upstream goes quiet past the idle deadline (`token`) and the relay then closes it (3 s
    here): a client's SDK ends the answer at either, and its next request must not meet the
    slot."""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop, close_takes=SLOW_CLOSE)
        proxy, pool = proxy_for(Setup([Step(what, 0.125)], backends=1), loop, world)
        response = await proxy.handle(http_request(), pool, logical_request(stream=True))
        held: list[tuple[bytes, int]] = []

        async def send(message: Any) -> None:
            inflight = sum(pool.balancer.inflight(b.name) for b in pool.settings.backends)
            held.append((message.get("body", b""), inflight))

        async def receive() -> Any:
            await asyncio.get_running_loop().create_future()

        await response({"type": "http"}, receive, send)
        ending = b"[DONE]" if what == "token+done" else b"upstream_failed"
        (last,) = [at for at, (body, _) in enumerate(held) if ending in body]
        assert [n for _, n in held[:2]] == [1, 1]  # the head, the first token: held
        assert held[last][1] == 0  # the piece that ends the stream: given back before it

    run_virtual(main)


def test_a_streams_backend_slot_is_back_before_its_last_byte() -> None:
    """A stream's client sends its next turn as soon as it sees the stream's end, while the
    request's end still runs its clean-up: the winner's backend slot must be back before the
    piece that carries the stream's end event goes out, not after the last byte. (Here the
    upstream's one read is the whole answer, `[DONE]` included: the slot is back before the
    head and that piece leave together.)"""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop)
        proxy, pool = proxy_for(Setup([Step("empty", 0.125)]), loop, world)
        response = await proxy.handle(http_request(), pool, logical_request(stream=True))
        held: list[tuple[str, bool, int]] = []

        async def send(message: Any) -> None:
            inflight = sum(pool.balancer.inflight(b.name) for b in pool.settings.backends)
            held.append((message["type"], bool(message.get("more_body")), inflight))

        async def receive() -> Any:
            await asyncio.get_running_loop().create_future()

        await response({"type": "http"}, receive, send)
        assert held[0] == ("http.response.start", False, 0)  # complete: given back already
        assert held[-1] == ("http.response.body", False, 0)
        assert set(world.closed) == set(world.opened)
        assert all(pool.balancer.inflight(b.name) == 0 for b in pool.settings.backends)

    run_virtual(main)


async def test_the_race_result_reaches_the_proxy_in_the_same_turn_of_the_loop() -> None:
    """On the way to the first byte, the race's result is taken up by the proxy in the very
    turn of the loop of the race's last step: the race runs in the proxy's task, so a
    callback the race scheduled as it returned (one turn later) runs after the proxy has gone
    on. With the race in a task of its own the proxy resumed a turn later; through
    `asyncio.wait`, two."""
    loop = asyncio.get_running_loop()
    order: list[str] = []

    class QuickRace:
        async def run(self) -> str:
            def one_turn() -> None:
                order.append("one turn")
                loop.call_soon(order.append, "two turns")

            loop.call_soon(one_turn)
            return "result"

    async def receive() -> dict[str, Any]:
        await loop.create_future()
        raise AssertionError("unreachable")

    proxy = Proxy(ServerSettings(), cast(Stats, None), loop.time, Drain(loop.time))
    end = SimpleNamespace(watcher=None)
    result = await proxy._race_or_disconnect(cast(Race, QuickRace()), {}, receive,
                                             cast(RequestEnd, end))
    order.append("proxy")
    assert cast(object, result) == "result"
    assert order == ["proxy"]
    await asyncio.sleep(0)
    assert order == ["proxy", "one turn"]
    end.watcher.cancel()
    await asyncio.wait({end.watcher})


def test_a_streamed_answer_builds_no_final_error_event_it_does_not_send() -> None:
    """A stream's final events for a shutdown and for a bug of ours are JSON to encode; the
    proxy hands the stream the calls that build them, so a stream that ends otherwise (nearly
    every one; here the scripted upstream's stream breaks, the relay's own error event) builds
    neither, on the way to its first byte or after."""

    async def main(loop: VirtualLoop) -> None:
        world = World(loop)
        proxy, pool = proxy_for(Setup([Step("token", 0.0)]), loop, world)
        built: list[str] = []

        def counted(message: str, code: str, request_id: str) -> bytes:
            built.append(code)
            return CHAT.error_event(message, code, request_id)

        req = replace(logical_request(stream=True), protocol=replace(CHAT, error_event=counted))
        answer = await proxy.handle(http_request(), pool, req)
        unsent = {"gateway_shutdown", InternalError.code}
        assert answer.status_code == 200 and not unsent & set(built)
        sent = await _send(answer, loop, proxy)
        assert sent[-1][1] == {"type": "http.response.body", "body": b"", "more_body": False}
        assert not unsent & set(built)
        [(_, summary)] = proxy.stats.summaries  # type: ignore[attr-defined]
        assert summary.status == 200

    run_virtual(main)


def test_a_stream_that_fails_to_build_still_gives_the_winners_slot_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The winner's slot and its TTFT's learning pass from the race's leftovers to the stream
    only once the stream is built: a fault of ours while building it (here forced) leaves
    them with the end, which gives the slot back and learns the TTFT once."""
    import gateway.api.proxy as proxy_module
    from gateway.hedge.delay import HedgeDelay

    learnt: list[float] = []
    real_observe = HedgeDelay.observe

    def observe(self: HedgeDelay, ttft: float, *args: Any, **kwargs: Any) -> Any:
        learnt.append(ttft)
        return real_observe(self, ttft, *args, **kwargs)

    def broken(*args: Any, **kwargs: Any) -> SSEResponse:
        raise TypeError("a fault of ours while building the stream")

    monkeypatch.setattr(HedgeDelay, "observe", observe)
    monkeypatch.setattr(proxy_module, "SSEResponse", broken)

    async def main(loop: VirtualLoop) -> None:
        world = World(loop)
        proxy, pool = proxy_for(Setup([Step("token", 0.125)]), loop, world)
        answer = await proxy.handle(http_request(), pool, logical_request(stream=True))
        assert answer.status_code == InternalError.status
        learnt.clear()
        await _send(answer, loop, proxy)
        assert proxy.admission.active == 0 and pool.inflight_requests == 0
        assert set(world.closed) == set(world.opened)
        assert all(pool.balancer.inflight(b.name) == 0 for b in pool.settings.backends)
        assert len(learnt) == 1  # the winner's TTFT, learnt by the end

    run_virtual(main)


class _Leaving:
    """A client that leaves when its `gone` future is set (its receive says so)."""

    def __init__(self) -> None:
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def receive(self) -> dict[str, Any]:
        await self.gone
        return {"type": "http.disconnect"}


class _WaitingRace:
    """Waits until cancelled; `bug`: its clean-up then raises a bug of ours instead."""

    def __init__(self, *, bug: bool = False) -> None:
        self.bug = bug

    async def run(self) -> str:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            if self.bug:
                raise RuntimeError("a bug in the race's clean-up") from None
            raise
        raise AssertionError("unreachable")


@pytest.mark.parametrize("server", ["another server", "hedge-gateway serve"])
@pytest.mark.parametrize("bug", [False, True], ids=["cancelled", "clean-up bug"])
async def test_the_disconnect_stops_the_race_and_its_cancellation_is_taken_back(
        bug: bool, server: str) -> None:
    """The race runs in the proxy's task: the client leaving cancels that task, and the proxy
    takes that cancellation back whatever the race's clean-up did (the request's task must
    not go on as one being cancelled), and nothing cancels it later. Under `hedge-gateway
    serve` the client is watched through the server's future (`GONE_EXTENSION`), which the
    server resolves as the connection is lost, and no task reads `receive`; under another
    server, a task does."""
    loop = asyncio.get_running_loop()
    proxy = Proxy(ServerSettings(), cast(Stats, None), loop.time, Drain(loop.time))
    client, end = _Leaving(), SimpleNamespace(watcher=None)
    scope: dict[str, Any] = {}
    receive = client.receive
    if server == "hedge-gateway serve":
        scope["extensions"] = {GONE_EXTENSION: {"gone": lambda: client.gone}}

        async def receive() -> dict[str, Any]:
            raise AssertionError("the server's future watches the client: nothing reads")

    task = asyncio.current_task()
    assert task is not None
    loop.call_soon(client.gone.set_result, None)
    if bug:
        with pytest.raises(RuntimeError):
            await proxy._race_or_disconnect(cast(Race, _WaitingRace(bug=True)), scope,
                                            receive, cast(RequestEnd, end))
    else:
        assert await proxy._race_or_disconnect(cast(Race, _WaitingRace()), scope, receive,
                                               cast(RequestEnd, end)) is None
    assert task.cancelling() == 0
    await asyncio.sleep(0.01)  # no late cancellation of the request's task
    end.watcher.cancel()
    await asyncio.wait({end.watcher})
