"""The simulator's Responses API and Messages streams: the early-headers trap (the
scaffolding at once, the first text only after the TTFT), the end events, the faults, and the
in-process provider playing them. Pure: a fake sleep records the delays."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from gateway.settings import BackendSettings, SimProfile
from gateway.wire.base import Kind, WireProtocol
from gateway.wire.messages import MESSAGES
from gateway.wire.responses import RESPONSES
from gateway.wire.sse import SSEEvent
from providers.base import UpstreamCall
from providers.sim import SimProvider
from providers.sim import messages as messages_module
from providers.sim import responses as responses_module
from providers.sim.protocols import protocol_body, protocol_stream
from providers.sim.tools import ToolCall
from providers.sim.wire import SimPlan, named_event

PLAN = SimPlan(ttft=0.2, inter_token=0.01, tokens=("a ", "b "), prompt_tokens=2)
HI = [{"role": "user", "content": "hi"}]


class Timeline:
    """A fake sleep that records, for each event, the delays asked for before it."""

    def __init__(self) -> None:
        self.slept = 0.0

    async def __call__(self, delay: float) -> None:
        self.slept += delay


async def play(plan: SimPlan, endpoint: str) -> list[tuple[float, SSEEvent]]:
    timeline = Timeline()
    out = []
    async for name, data in protocol_stream(plan, endpoint, model="m", request_id="r",
                                            sleep=timeline, created=1):
        out.append((timeline.slept, SSEEvent(data, name)))
    return out


def first_token(events: list[tuple[float, SSEEvent]], protocol: WireProtocol) -> int:
    return next(i for i, (_, e) in enumerate(events) if protocol.classify(e) is Kind.TOKEN)


async def test_messages_trap_scaffolding_at_once_text_after_ttft() -> None:
    events = await play(PLAN, "messages")
    names = [e.event for _, e in events]
    assert names[:3] == [b"message_start", b"content_block_start", b"ping"]
    assert all(at == 0.0 for at, _ in events[:3])  # the headers and the scaffolding at once
    index = first_token(events, MESSAGES)
    assert index == 3 and events[index][0] == 0.2  # the first text only after the TTFT
    assert names[-1] == b"message_stop"
    assert [MESSAGES.classify(e) for _, e in events][-1] is Kind.DONE
    text = "".join(json.loads(e.data)["delta"]["text"] for _, e in events
                   if e.event == b"content_block_delta")
    assert text == PLAN.content


async def test_responses_trap_created_and_in_progress_at_once() -> None:
    events = await play(PLAN, "responses")
    names = [e.event for _, e in events]
    assert names[:2] == [b"response.created", b"response.in_progress"]
    index = first_token(events, RESPONSES)
    assert index == 4 and all(at == 0.0 for at, _ in events[:index])
    assert events[index][0] == 0.2
    assert names[-1] == b"response.completed"
    done = json.loads(events[-1][1].data)["response"]
    assert done["output"][0]["content"][0]["text"] == PLAN.content
    assert done["id"] == json.loads(events[0][1].data)["response"]["id"]


async def test_midstream_errors_are_protocol_error_events() -> None:
    plan = SimPlan(ttft=0.1, tokens=("a ", "b ", "c "), midstream_error_after=1)
    for endpoint, protocol in (("messages", MESSAGES), ("responses", RESPONSES)):
        events = await play(plan, endpoint)
        assert events[-1][1].event == b"error"
        assert protocol.classify(events[-1][1]) is Kind.ERROR


def test_bodies() -> None:
    body = protocol_body(PLAN, "messages", method="POST", path=None, model="m",
                         request_id="r", created=1)
    assert body["content"][0]["text"] == PLAN.content and body["type"] == "message"
    assert protocol_body(PLAN, "messages/count_tokens", method="POST", path=None, model="m",
                         request_id="r", created=1) == {"input_tokens": 2}
    deleted = protocol_body(PLAN, "responses/item", method="DELETE", path="responses/x",
                            model="m", request_id="r", created=1)
    assert deleted == {"id": "x", "object": "response.deleted", "deleted": True}


async def test_in_process_provider_names_its_events() -> None:
    settings = BackendSettings(name="s", provider="sim", sim=SimProfile(
        ttft_median=0.0, straggler_probability=0.0, tokens=2, inter_token=0.0))
    provider = SimProvider(settings)
    call = UpstreamCall(endpoint="messages", body={"model": "m", "stream": True,
                                                  "max_tokens": 8, "messages": HI},
                        stream=True, request_id="r", first_byte_timeout=5.0)
    stream = await provider.open(call)
    names = [e.event async for batch in stream.batches() for e in batch.events]
    await stream.aclose()
    assert names[0] == b"message_start" and names[-1] == b"message_stop"


#: pieces that tell a splice from a dump: quotes, backslashes, control and non-ASCII
#: characters, the splice's own marker, an empty piece
AWKWARD = ("tok0 ", 'a "quoted" \\ back', "caf\u00e9 \u2028 \U0001f600", "\x00", "", "\n\t")
CALL = ToolCall(name="get_weather", arguments='{"city":"Z\\u00fcrich \\"old\\""}', key="k1")


@pytest.mark.parametrize("call", [None, CALL], ids=["text", "tool"])
async def test_messages_token_events_are_the_dicts_json_byte_for_byte(
        call: ToolCall | None) -> None:
    """A token's `content_block_delta` is spliced into bytes encoded once: exactly what
    `named_event` makes of the delta's dict, whatever the piece holds."""
    plan = SimPlan(tokens=AWKWARD, tool_call=call)
    events = [e for _, e in await play(plan, "messages") if e.event == b"content_block_delta"]
    kind, field = ("text_delta", "text") if call is None else ("input_json_delta",
                                                               "partial_json")
    pieces = AWKWARD if call is None else ("", *AWKWARD)  # a call opens with an empty delta
    assert [e.data for e in events] == [
        named_event("content_block_delta", {"index": 0, "delta": {"type": kind, field: p}})[1]
        for p in pieces]


@pytest.mark.parametrize("call", [None, CALL], ids=["text", "tool"])
async def test_responses_token_events_are_the_dicts_json_byte_for_byte(
        call: ToolCall | None) -> None:
    """The Responses deltas likewise, each with its own sequence number."""
    plan = SimPlan(tokens=AWKWARD, tool_call=call)
    events = [e for _, e in await play(plan, "responses")]
    name = "response.output_text.delta" if call is None \
        else "response.function_call_arguments.delta"
    at: dict[str, Any] = {"item_id": "msg_resp_sim_r" if call is None else "fc_k1",
                          "output_index": 0}
    if call is None:
        at["content_index"] = 0
    got = [(seq, e.data) for seq, e in enumerate(events) if e.event == name.encode()]
    assert len(got) == len(AWKWARD)
    for (seq, data), piece in zip(got, AWKWARD, strict=True):
        extra: dict[str, Any] = {"logprobs": []} if call is None else {}
        assert data == named_event(name, {"sequence_number": seq, **at, "delta": piece,
                                          **extra})[1]


@pytest.mark.parametrize("endpoint", ["messages", "responses"])
@pytest.mark.parametrize("call", [None, CALL], ids=["text", "tool"])
async def test_a_longer_answer_dumps_no_more_events(
        endpoint: str, call: ToolCall | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-token cost is the splice's: a stream of 40 tokens builds and dumps as many
    event dicts as one of 2 (its scaffolding), as the chat stream does. A bench that compares
    a translated request with an untranslated one to this simulator otherwise measures the
    slower writer: a writer that spaces its events out makes the gateway read each alone."""
    module = messages_module if endpoint == "messages" else responses_module
    dumped: list[bytes] = []

    def counting(name: str, payload: Mapping[str, Any]) -> tuple[bytes, bytes]:
        dumped.append(name.encode())
        return named_event(name, payload)

    monkeypatch.setattr(module, "named_event", counting)
    counts = []
    for n in (2, 40):
        dumped.clear()
        await play(SimPlan(tokens=tuple(f"tok{i} " for i in range(n)), tool_call=call),
                   endpoint)
        counts.append(len(dumped))
    assert counts[0] == counts[1]
