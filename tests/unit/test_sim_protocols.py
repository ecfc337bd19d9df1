"""The simulator's Responses API and Messages streams: the early-headers trap (the
scaffolding at once, the first text only after the TTFT), the end events, the faults, and the
in-process provider playing them. Pure: a fake sleep records the delays."""

from __future__ import annotations

import json

from gateway.settings import BackendSettings, SimProfile
from gateway.wire.base import Kind, WireProtocol
from gateway.wire.messages import MESSAGES
from gateway.wire.responses import RESPONSES
from gateway.wire.sse import SSEEvent
from providers.base import UpstreamCall
from providers.sim import SimProvider
from providers.sim.protocols import protocol_body, protocol_stream
from providers.sim.wire import SimPlan

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
