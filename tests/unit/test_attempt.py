"""One attempt read to its first token or its end (`open_until_first_token`), on scripted
event batches: a complete answer without a token is handed back as an empty `Prefix`, a
token-less stream cut before its end fails, and the bound on events before the first token
counts every event, whatever the reads' sizes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

import pytest

from gateway.errors import UpstreamNoToken, UpstreamProtocolError
from gateway.hedge.attempt import MAX_PRE_TOKEN_EVENTS, open_until_first_token
from gateway.hedge.prefix import Prefix
from gateway.wire.base import Kind
from gateway.wire.chat import CHAT, chat_answered
from gateway.wire.messages import MESSAGES
from gateway.wire.responses import RESPONSES
from gateway.wire.sse import SSEBatch, SSEEvent
from providers.base import ENDPOINTS, UpstreamCall

ROLE = SSEEvent(b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}')
FINISH = SSEEvent(b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}')
DONE = SSEEvent(b"[DONE]")
TOKEN = SSEEvent(b'{"choices":[{"index":0,"delta":{"content":"x"}}]}')


def named(name: str, **payload: object) -> SSEEvent:
    return SSEEvent(json.dumps({"type": name, **payload}).encode(), name.encode())


class Stream:
    headers: Mapping[str, str] = MappingProxyType({})

    def __init__(self, reads: Sequence[Sequence[SSEEvent]], hang: bool) -> None:
        self.reads, self.hang, self.closed = reads, hang, False

    async def batches(self) -> AsyncIterator[SSEBatch]:
        for read in self.reads:
            yield SSEBatch(list(read))
        if self.hang:
            await asyncio.get_running_loop().create_future()

    async def aclose(self) -> None:
        self.closed = True


class Provider:
    name = "scripted"
    serves: frozenset[str] = frozenset(ENDPOINTS)

    def __init__(self, reads: Sequence[Sequence[SSEEvent]], hang: bool = False) -> None:
        self.stream = Stream(reads, hang)

    async def open(self, call: UpstreamCall) -> Stream:
        return self.stream

    async def aclose(self) -> None:
        return None


def read(reads: Sequence[Sequence[SSEEvent]], *, hang: bool = False,
         classify: Callable[[SSEEvent], Kind] = CHAT.classify,
         answered: Callable[[list[SSEEvent]], bool] = CHAT.answered,
         ) -> tuple[Prefix | BaseException, Provider]:
    provider = Provider(reads, hang)

    async def main() -> Prefix:
        call = UpstreamCall("chat/completions", {}, True, "req", 30.0)
        return await asyncio.wait_for(
            open_until_first_token(provider, call, lambda: False,
                                   replace(CHAT, classify=classify, answered=answered)), 1.0)

    try:
        return asyncio.run(main()), provider
    except (UpstreamNoToken, UpstreamProtocolError, TimeoutError) as exc:
        return exc, provider


def test_a_complete_chat_answer_without_a_token_is_an_empty_prefix() -> None:
    prefix, provider = read([[ROLE], [FINISH, DONE]])
    assert isinstance(prefix, Prefix) and prefix.empty
    assert prefix.buffered == [ROLE, FINISH, DONE]  # the whole answer, to relay as it came
    assert not provider.stream.closed  # the relay closes it, after draining


@pytest.mark.parametrize(("name", "reads"), [
    ("cut before [DONE]", [[ROLE, FINISH]]),
    ("cut after the role chunk", [[ROLE]]),
    ("[DONE] without a finish reason", [[ROLE, DONE]]),
])
def test_a_token_less_chat_stream_that_did_not_finish_fails(
    name: str, reads: list[list[SSEEvent]]
) -> None:
    failed, provider = read(reads)
    assert isinstance(failed, UpstreamNoToken), name
    assert provider.stream.closed


def test_a_token_still_commits_with_a_finish_in_the_same_read() -> None:
    prefix, _ = read([[ROLE, TOKEN, FINISH, DONE]])
    assert isinstance(prefix, Prefix) and not prefix.empty


@pytest.mark.parametrize(("protocol", "reads"), [
    (RESPONSES, [[named("response.created", response={"id": "r"}),
                  named("response.completed", response={"id": "r", "output": []})]]),
    (RESPONSES, [[named("response.created", response={"id": "r"})],
                 [named("response.incomplete", response={"id": "r", "output": []})]]),
    (MESSAGES, [[named("message_start", message={"id": "m"}),
                 named("message_delta", delta={"stop_reason": "end_turn"}),
                 named("message_stop")]]),
], ids=["responses completed", "responses incomplete", "messages"])
def test_named_protocols_end_events_are_complete_answers(
    protocol: object, reads: list[list[SSEEvent]]
) -> None:
    prefix, _ = read(reads, classify=protocol.classify,  # type: ignore[attr-defined]
                     answered=protocol.answered)  # type: ignore[attr-defined]
    assert isinstance(prefix, Prefix) and prefix.empty


def test_chat_answered_needs_a_finish_reason() -> None:
    assert chat_answered([ROLE, FINISH, DONE])
    assert not chat_answered([ROLE, DONE])
    assert not chat_answered([SSEEvent(b'{"choices":[{"finish_reason":null}]}'), DONE])
    assert not chat_answered([SSEEvent(b'{"finish_reason": [}'), DONE])  # malformed
    assert chat_answered([SSEEvent(b'{"choices":[{"text":"","finish_reason":"length"}]}')])


def test_the_pre_token_bound_counts_every_event_across_reads() -> None:
    """Scaffolding only (role chunks, here): the bound trips once the events read pass it,
    not one read later, and a stream just under it keeps waiting for its token."""
    half = [ROLE] * (MAX_PRE_TOKEN_EVENTS // 2 + 1)
    failed, provider = read([half, half], hang=True)
    assert isinstance(failed, UpstreamProtocolError) and provider.stream.closed
    waiting, _ = read([[ROLE] * MAX_PRE_TOKEN_EVENTS], hang=True)
    assert isinstance(waiting, TimeoutError)



def test_non_text_output_commits_before_the_bound() -> None:
    """Code interpreter deltas are output: the first one is the token, however many came."""
    deltas = [named("response.code_interpreter_call_code.delta", delta="print(1)")] * 2000
    prefix, _ = read([[named("response.created", response={"id": "r"})], deltas],
                     classify=RESPONSES.classify, answered=RESPONSES.answered)
    assert isinstance(prefix, Prefix) and not prefix.empty and len(prefix.buffered) == 2001
