"""How the SSE response classifies the end of a stream, in virtual time
and without sockets: a socket that breaks under a send is a client that left; an exception of
ours in the relay is not, and is not swallowed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.api.stream import SSEResponse
from gateway.drain import Drain
from gateway.wire.base import Hooks
from tests.harness.virtualtime import VirtualLoop, run_virtual


def response(loop: VirtualLoop, body: AsyncIterator[bytes], ends: list[str | None]) -> SSEResponse:
    async def on_close(end: str | None) -> None:
        ends.append(end)

    return SSEResponse(body, keepalive=15.0, stuck_client=30.0,
                       drain=Drain(loop.time), grace=1.0, shutdown_event=b"",
                       on_close=on_close, clock=loop.time)


async def never() -> Any:
    await asyncio.get_running_loop().create_future()


async def chunks(fail: BaseException | None = None) -> AsyncIterator[bytes]:
    for i in range(3):
        await asyncio.sleep(0.1)
        if fail is not None and i == 1:
            raise fail
        yield b"data: x\n\n"


def test_a_socket_that_breaks_under_a_send_is_a_client_that_left() -> None:
    async def main(loop: VirtualLoop) -> list[str | None]:
        ends: list[str | None] = []
        bodies = 0

        async def send(message: Any) -> None:
            nonlocal bodies
            if message["type"] == "http.response.body":
                bodies += 1
                if bodies == 2:
                    raise BrokenPipeError("the client's socket is gone")

        await response(loop, chunks(), ends)({"type": "http"}, never, send)  # no exception
        return ends

    assert run_virtual(main) == ["client_gone"]


def test_a_bug_in_the_relay_propagates_and_is_not_a_client_that_left() -> None:
    async def main(loop: VirtualLoop) -> list[str | None]:
        ends: list[str | None] = []

        async def send(message: Any) -> None:
            return None

        with pytest.raises(BaseExceptionGroup) as info:
            await response(loop, chunks(RuntimeError("a bug")), ends)({"type": "http"},
                                                                      never, send)
        assert info.group_contains(RuntimeError)
        return ends

    assert run_virtual(main) == ["internal_error"]


def test_a_stream_shorter_than_a_tick_runs_no_extra_task_and_a_long_one_keeps_alive() -> None:
    """Per stream, the keep-alive/stuck-client ticker starts one period in (a timer
    before that), and the proxy's client watcher and the drain are callbacks: a short stream
    runs in its own task alone. A stream that goes quiet still gets its keep-alive."""

    async def main(loop: VirtualLoop) -> tuple[list[int], list[bytes]]:
        seen: list[int] = []
        sent: list[bytes] = []
        gone: asyncio.Future[None] = loop.create_future()  # the proxy's watcher: still there

        async def body() -> AsyncIterator[bytes]:
            for pause in (0.1, 0.1, 20.0):  # 20 s of silence: past the 15 s keep-alive
                await asyncio.sleep(pause)
                seen.append(len(asyncio.all_tasks()))
                yield b"data: x\n\n"

        async def send(message: Any) -> None:
            if message["type"] == "http.response.body":
                sent.append(message["body"])

        stream = SSEResponse(body(), keepalive=15.0, stuck_client=30.0,
                             drain=Drain(loop.time), grace=1.0, shutdown_event=b"",
                             on_close=lambda end: asyncio.sleep(0), clock=loop.time,
                             client_gone=gone)
        await stream({"type": "http"}, never, send)
        gone.cancel()
        return seen, sent

    seen, sent = run_virtual(main)
    assert seen[:2] == [1, 1]  # the first two chunks: the response's own task only
    assert b": keep-alive\n\n" in sent


async def test_a_normal_end_with_the_proxys_watcher_cancels_no_scope() -> None:
    """With the proxy's watcher there is no task of the response's own in its group, and a
    stream that ends normally cancels nothing: a cancel would name the cancelling task in its
    reason (anyio formats the task's repr, about 7 us per stream, for nothing to stop)."""
    loop = asyncio.get_running_loop()
    reprs: list[str] = []

    class CountingTask(asyncio.Task[None]):
        def __repr__(self) -> str:
            text = super().__repr__()
            reprs.append(text)
            return text

    async def body() -> AsyncIterator[bytes]:
        yield b"data: x\n\n"

    ends: list[str | None] = []

    async def on_close(end: str | None) -> None:
        ends.append(end)

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    gone: asyncio.Future[None] = loop.create_future()
    stream = SSEResponse(body(), keepalive=15.0, stuck_client=30.0,
                         drain=Drain(loop.time), grace=1.0, shutdown_event=b"",
                         on_close=on_close, clock=loop.time, client_gone=gone)
    await CountingTask(stream({"type": "http"}, never, send))
    assert [m.get("body") for m in sent] == [None, b"data: x\n\n", b""]
    assert ends == [None] and reprs == []
    gone.cancel()


@pytest.mark.parametrize("breaks_at", [1, 2])
def test_a_stream_that_ends_early_still_calls_each_hook_once_before_its_close(
        breaks_at: int) -> None:
    """The stream owns what the proxy hands it (the winner's slot, its TTFT to learn): each
    hook is called once whatever ends the stream. Here the client's socket breaks under the
    first piece (1: `on_first_sent` never came from the send) or under the second (2: it did,
    once): both hooks are still called, once each, before `on_close`, and a normal end calls
    each once too (`test_head_with_first_event`)."""

    async def main(loop: VirtualLoop) -> list[str]:
        seen: list[str] = []
        bodies = 0

        async def send(message: Any) -> None:
            nonlocal bodies
            if message["type"] == "http.response.body":
                bodies += 1
                if bodies == breaks_at:
                    raise BrokenPipeError("the client's socket is gone")

        async def on_close(end: str | None) -> None:
            seen.append(f"close {end}")

        stream = SSEResponse(chunks(), keepalive=15.0, stuck_client=30.0,
                             drain=Drain(loop.time), grace=1.0, shutdown_event=b"",
                             on_close=on_close, clock=loop.time, first_ready=True,
                             on_first_sent=lambda: seen.append("first"),
                             on_exhausted=Hooks(lambda: seen.append("exhausted")))
        await stream({"type": "http"}, never, send)
        return seen

    assert run_virtual(main) == ["first", "exhausted", "close client_gone"]
