"""What a complete answer owes its request (`gateway.wire.base.Hooks`), and a client key's
charge around an answer that is not streamed (`gateway.api.tenancy.Settled`): each owed call
is made once, in order, whichever of the relay and the client stream comes first, and a bug
in one call neither skips the others nor keeps the answer and the request's end from
running."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import Response
from starlette.types import Message

from gateway.api.answer import Answer
from gateway.api.tenancy import Settled
from gateway.wire.base import Hooks


def test_each_call_is_made_once_in_order_whoever_calls_first() -> None:
    seen: list[str] = []
    hooks = Hooks(lambda: seen.append("counts"))
    hooks.add(lambda: seen.append("slot"))
    hooks()  # the relay, as it has the end event
    hooks()  # the stream, as it is done with the body: nothing owed any more
    assert seen == ["counts", "slot"]
    hooks.add(lambda: seen.append("late"))  # added once they ran: made at once
    assert seen == ["counts", "slot", "late"]


def test_a_call_that_raises_skips_none_of_the_others_and_the_first_error_propagates() -> None:
    seen: list[str] = []

    def first() -> None:
        seen.append("first")
        raise ValueError("first")

    def second() -> None:
        seen.append("second")
        raise KeyError("second")

    hooks = Hooks(first, second, lambda: seen.append("third"))
    with pytest.raises(ValueError):
        hooks()
    assert seen == ["first", "second", "third"]
    hooks()  # made once, failing or not
    assert seen == ["first", "second", "third"]


def test_a_charge_that_raises_still_sends_the_answer_and_runs_the_requests_end() -> None:
    """The charge of a whole answer is made before it is sent; a bug in it must not cost the
    client its answer, nor the request its end (its slots, its upstreams, its log line)."""
    ended: list[bool] = []
    settled: list[bool] = []
    sent: list[Message] = []

    async def end() -> None:
        ended.append(True)

    def charge() -> None:
        raise RuntimeError("a bug in the key's charge")

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def main() -> None:
        answer = Settled(Answer(Response(b"{}"), end), charge, lambda: settled.append(True))
        with pytest.raises(RuntimeError):
            await answer({"type": "http"}, receive, send)

    asyncio.run(main())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert ended == [True] and settled == [True]
