"""Stalls after commit, in virtual time: the stall delay each backend learns (one value per
stream, pure), and the race between a stalled stream and its continuation in the relay (the
first of the two to yield wins; the other is cancelled and closed)."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Literal

import anyio

from gateway.errors import UpstreamDisconnected
from gateway.hedge.continuation import may_continue
from gateway.hedge.gaps import MIN_SAMPLES, GapSketch
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.relay import MAX_KEPT_BYTES, Continued, relay
from gateway.settings import BackendSettings, HedgingSettings, PoolSettings, StallSettings
from gateway.wire.base import RelayOutcome, StreamEnd
from gateway.wire.chat import CHAT
from gateway.wire.resume import Splice, relayed_answer
from gateway.wire.sse import SSEBatch, SSEEvent
from tests.harness.virtualtime import VirtualLoop, run_virtual


def test_the_stall_delay_follows_the_longest_gaps_clamped() -> None:
    gaps = GapSketch(window=100.0)
    assert gaps.delay(2.0, 30.0, now=0.0) == 2.0  # nothing learnt: the minimum
    for i in range(MIN_SAMPLES - 1):
        gaps.observe(5.0, now=float(i))
    assert gaps.delay(2.0, 30.0, now=20.0) == 2.0  # too few streams yet
    gaps.observe(5.0, now=20.0)
    # read once per slice of the window (100 s / 6): the same until the next slice
    assert gaps.delay(2.0, 30.0, now=21.0) == 2.0
    assert math.isclose(gaps.delay(2.0, 30.0, now=34.0), 10.0, rel_tol=0.02)  # 5 s x 2
    assert gaps.delay(2.0, 8.0, now=34.0) == 8.0  # clamped to the maximum
    assert gaps.delay(2.0, 30.0, now=500.0) == 2.0  # the window forgot them


def chunk(text: str | None = None, finish: str | None = None, role: bool = False) -> SSEEvent:
    delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
    if text is not None:
        delta["content"] = text
    return SSEEvent(json.dumps({"id": "c", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]}).encode())


class Upstream:
    """An upstream whose events come at virtual times; records its close."""

    def __init__(self, timed: list[tuple[float, SSEEvent]]) -> None:
        self.headers: Mapping[str, str] = {}
        self.timed = timed
        self.closed = False

    async def _gen(self) -> AsyncIterator[SSEBatch]:
        for delay, event in self.timed:
            await asyncio.sleep(delay)
            yield SSEBatch([event])

    def batches(self) -> AsyncIterator[SSEBatch]:
        return self._gen()

    async def aclose(self) -> None:
        self.closed = True


def prefix_of(upstream: Upstream, buffered: list[SSEEvent]) -> Prefix:
    return Prefix(upstream, upstream.batches(), buffered)


class Resumer:
    """A continuation that yields its first token `ttft` seconds after it is asked."""

    def __init__(self, ttft: float, continuation: Upstream) -> None:
        self.ttft = ttft
        self.continuation = continuation
        self.asked: list[tuple[float, bool]] = []
        self.cancelled = False
        self.won: list[str] = []
        self.refusals: list[tuple[str, str]] = []

    async def __call__(self, relayed: list[SSEEvent], backend: str, stall: bool = False
                       ) -> Continued | None:
        self.asked.append((asyncio.get_running_loop().time(), stall))
        try:
            await asyncio.sleep(self.ttft)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        answer = relayed_answer("chat", relayed)
        assert answer is not None
        first = [chunk(role=True), chunk("tok2 ")]
        return Continued(prefix_of(self.continuation, first), Splice(answer), "b")

    def stall_delay(self, backend: str) -> float:
        return 2.0 if backend == "a" else math.inf

    def stall_won(self, backend: str) -> None:
        self.won.append(backend)

    def ended(self, backend: str, longest_gap: float) -> None:
        """Nothing learnt here."""

    def took(self, continued: Continued) -> None:
        """Nothing charged here."""

    def refused(self, reason: str, backend: str) -> None:
        self.refusals.append((reason, backend))


async def run_relay(stalled: Upstream, resumer: Resumer) -> tuple[str, RelayOutcome]:
    outcome = RelayOutcome()
    loop = asyncio.get_running_loop()
    parts = [part async for part in relay(
        prefix_of(stalled, [chunk(role=True), chunk("tok0 ")]), request_id="r", idle=60.0,
        max_stream_deadline=loop.time() + 600.0, clock=loop.time, outcome=outcome,
        protocol=CHAT, resume=resumer, backend="a")]
    return b"".join(parts).decode(), outcome


def texts(raw: str) -> str:
    out = ""
    for line in raw.split("\n"):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out += choice["delta"].get("content") or ""
    return out


def test_a_continuation_that_yields_first_wins_and_the_stalled_stream_is_closed() -> None:
    async def main(loop: VirtualLoop) -> None:
        stalled = Upstream([(0.0, chunk("tok1 ")), (3600.0, chunk("late "))])
        continuation = Upstream([(0.1, chunk("tok3 ")), (0.0, chunk(None, "stop")),
                                 (0.0, SSEEvent(b"[DONE]"))])
        resumer = Resumer(0.5, continuation)
        raw, outcome = await run_relay(stalled, resumer)
        assert texts(raw) == "tok0 tok1 tok2 tok3 " and raw.count('"role"') == 1
        assert outcome.end is StreamEnd.DONE
        assert resumer.asked == [(2.0, True)]  # 2 s after the last token: the stall delay
        assert resumer.won == ["b"] and stalled.closed and continuation.closed
        assert loop.time() < 3.0  # the stall was not waited out

    run_virtual(main)


def test_a_stalled_stream_that_comes_back_first_wins_and_the_continuation_is_cancelled(
        ) -> None:
    async def main(loop: VirtualLoop) -> None:
        stalled = Upstream([(0.0, chunk("tok1 ")), (3.0, chunk("tok2 ")),
                            (0.0, chunk(None, "stop")), (0.0, SSEEvent(b"[DONE]"))])
        continuation = Upstream([])
        resumer = Resumer(10.0, continuation)
        raw, outcome = await run_relay(stalled, resumer)
        assert texts(raw) == "tok0 tok1 tok2 " and outcome.end is StreamEnd.DONE
        assert resumer.asked == [(2.0, True)] and resumer.cancelled and resumer.won == []
        assert math.isclose(loop.time(), 3.0, abs_tol=0.1)

    run_virtual(main)


def test_a_break_while_the_stall_continuation_is_on_its_way_takes_that_continuation(
        ) -> None:
    """The stalled stream breaks before the continuation has its token: the relay waits for
    the continuation already started (no second one) and goes on with it."""
    async def main(loop: VirtualLoop) -> None:
        continuation = Upstream([(0.0, chunk("tok3 ")), (0.0, chunk(None, "stop")),
                                 (0.0, SSEEvent(b"[DONE]"))])

        class Breaking(Upstream):
            async def _gen(self) -> AsyncIterator[SSEBatch]:
                yield SSEBatch([chunk("tok1 ")])
                await asyncio.sleep(3.0)
                raise UpstreamDisconnected("reset")

        broken = Breaking([])
        resumer = Resumer(5.0, continuation)
        raw, outcome = await run_relay(broken, resumer)
        assert texts(raw) == "tok0 tok1 tok2 tok3 " and outcome.end is StreamEnd.DONE
        assert resumer.asked == [(2.0, True)]  # one continuation, the stall's
        assert math.isclose(loop.time(), 7.0, abs_tol=0.1) and broken.closed

    run_virtual(main)


def test_a_client_that_leaves_during_the_stall_race_leaves_nothing_running() -> None:
    async def main(loop: VirtualLoop) -> None:
        stalled = Upstream([(0.0, chunk("tok1 ")), (3600.0, chunk("late "))])
        resumer = Resumer(10.0, Upstream([]))
        outcome = RelayOutcome()
        body = relay(prefix_of(stalled, [chunk(role=True), chunk("tok0 ")]), request_id="r",
                     idle=60.0, max_stream_deadline=loop.time() + 600.0, clock=loop.time,
                     outcome=outcome, protocol=CHAT, resume=resumer, backend="a")
        reader = asyncio.ensure_future(body.__anext__())
        await asyncio.sleep(0)
        first = await reader
        assert b"tok0" in first
        pending = asyncio.ensure_future(body.__anext__())
        await asyncio.sleep(3.0)  # the stall at 2 s started the continuation
        assert resumer.asked == [(2.0, True)]
        pending.cancel()  # the client went away
        await asyncio.wait({pending})
        assert isinstance(body, AsyncGenerator)  # closed as the client response closes it
        await body.aclose()
        assert resumer.cancelled and stalled.closed  # run_virtual: no task left behind

    run_virtual(main)


def test_a_client_that_leaves_under_the_streams_scope_still_closes_what_the_relay_read(
        ) -> None:
    """The relay reads a continuation (its upstream is the relay's alone: no race closes a
    winner), that one stalls too and a second continuation is on its way when the client
    leaves: the client stream cancels its anyio scope, which re-delivers the cancellation at
    every await of the relay's close. The second is cancelled and the first closed all the
    same."""

    class Stalling(Resumer):
        def stall_delay(self, backend: str) -> float:
            return 2.0  # the continuation's stalls are watched too

    async def main(loop: VirtualLoop) -> None:
        class Breaking(Upstream):
            async def _gen(self) -> AsyncIterator[SSEBatch]:
                yield SSEBatch([chunk("tok1 ")])
                await asyncio.sleep(0.5)
                raise UpstreamDisconnected("reset")

        first = Upstream([(0.0, chunk("tok3 ")), (3600.0, chunk("late "))])
        resumer = Stalling(0.0, first)
        body = relay(prefix_of(Breaking([]), [chunk(role=True), chunk("tok0 ")]),
                     request_id="r", idle=60.0, max_stream_deadline=loop.time() + 600.0,
                     clock=loop.time, outcome=RelayOutcome(), protocol=CHAT, resume=resumer,
                     backend="a")
        assert isinstance(body, AsyncGenerator)

        async def client() -> None:
            async for _ in body:
                if resumer.asked:  # the break's continuation is taken: the stall's is slow
                    resumer.ttft = 10.0

        async with anyio.create_task_group() as group:
            group.start_soon(client)
            await asyncio.sleep(3.0)  # broke at 0.5 (first taken), stalled at 2.5
            assert [stall for _, stall in resumer.asked] == [False, True]
            group.cancel_scope.cancel()  # the client left
        with anyio.CancelScope(shield=True):
            await body.aclose()  # as the client stream does
        assert resumer.cancelled
        assert first.closed, "the continuation the relay was reading stayed open"

    run_virtual(main)


def test_a_continuation_ready_while_the_client_was_written_to_is_taken_at_once() -> None:
    """The stall's continuation has its first token while the relay is handing a piece to a
    slow client (no read pending, so nothing to interrupt): the relay takes it as it comes
    back, not after the stalled stream's idle deadline (60 s here)."""

    async def main(loop: VirtualLoop) -> None:
        stalled = Upstream([(0.0, chunk("tok1 ")), (3600.0, chunk("late "))])
        continuation = Upstream([(0.0, chunk(None, "stop")), (0.0, SSEEvent(b"[DONE]"))])
        resumer = Resumer(0.5, continuation)
        body = relay(prefix_of(stalled, [chunk(role=True), chunk("tok0 ")]), request_id="r",
                     idle=60.0, max_stream_deadline=loop.time() + 600.0, clock=loop.time,
                     outcome=RelayOutcome(), protocol=CHAT, resume=resumer, backend="a")
        parts = []
        async for part in body:
            parts.append(part)
            if len(parts) == 2:  # tok1 out at 0: the client takes 3 s to be written to
                await asyncio.sleep(3.0)  # the stall at 2 s, its continuation's token at 2.5
        assert texts(b"".join(parts).decode()) == "tok0 tok1 tok2 "
        assert resumer.won == ["b"] and stalled.closed
        assert loop.time() < 4.0  # not the idle deadline's 60 s

    run_virtual(main)


Style = Literal["prefill", "continue_final_message", "none"]


def test_a_request_may_be_continued_only_where_a_continuation_could_go() -> None:
    """Checked once per request: a stream of a continued route, not bound to stored state,
    with two usable backends or more of which one continues answers."""
    def pool(*styles: Style, stall: StallSettings | None = None) -> PoolRuntime:
        backends = tuple(BackendSettings(name=f"b{i}", provider="openai", model="m",
                                         base_url="http://127.0.0.1:9/v1", continuation=style)
                         for i, style in enumerate(styles))
        settings = PoolSettings("p", backends, hedging=HedgingSettings(
            stall=stall or StallSettings()))
        return PoolRuntime.build(settings, {}, global_hedging=True, now=0.0,
                                 rng=random.Random(1))

    two = pool("prefill", "none")
    assert may_continue(two, "chat", True, False, None)
    assert may_continue(two, "messages", True, False, None)
    assert not may_continue(two, "chat", False, False, None)  # whole answers
    assert not may_continue(two, "completions", True, False, None)
    assert not may_continue(two, "responses", True, True, None)  # stored state
    assert not may_continue(two, "chat", True, False, "b0")  # pinned
    assert not may_continue(two, "chat", True, False, None, frozenset({"b1"}))  # one left
    assert not may_continue(pool("prefill"), "chat", True, False, None)
    assert not may_continue(pool("none", "none"), "chat", True, False, None)
    assert not may_continue(pool("prefill", "prefill", stall=StallSettings(enabled=False)),
                            "chat", True, False, None)
    assert not may_continue(pool("prefill", "prefill",
                                 stall=StallSettings(max_continuations=0)),
                            "chat", True, False, None)


def test_a_break_past_the_kept_bytes_is_not_continued_and_is_counted() -> None:
    """The relay keeps at most `MAX_KEPT_BYTES` of what it relayed: a stream that broke past
    that is not continued (the client gets the in-band error of before) and the refusal is
    counted, `too_long`; a break before it is continued."""
    big = "x" * (MAX_KEPT_BYTES // 3)

    def breaking(reads: int) -> Upstream:
        class Breaking(Upstream):
            async def _gen(self) -> AsyncIterator[SSEBatch]:
                for _ in range(reads):
                    yield SSEBatch([chunk(big)])
                raise UpstreamDisconnected("reset")
        return Breaking([])

    async def main(loop: VirtualLoop) -> None:
        done = [(0.0, chunk(None, "stop")), (0.0, SSEEvent(b"[DONE]"))]
        resumer = Resumer(0.0, Upstream(done))
        raw, outcome = await run_relay(breaking(2), resumer)
        assert outcome.end is StreamEnd.DONE and [s for _, s in resumer.asked] == [False]
        assert resumer.refusals == []

        resumer = Resumer(0.0, Upstream(done))
        raw, outcome = await run_relay(breaking(4), resumer)
        assert resumer.asked == [] and resumer.refusals == [("too_long", "a")]
        assert outcome.end is StreamEnd.FAILED and "upstream_failed" in raw
        assert texts(raw) == "tok0 " + big * 4

    run_virtual(main)
