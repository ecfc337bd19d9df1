"""The simulator's mid-stream faults (stalls and breaks, per profile and per request by
header) and its honest continuation of a final assistant message."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from gateway.cli import build_parser, sim_profile
from gateway.errors import UpstreamDisconnected
from gateway.settings import BackendSettings, SimProfile
from gateway.wire.sse import SSEEvent
from providers.base import Endpoint, UpstreamCall
from providers.sim import SimProvider
from providers.sim.chat import sim_payloads
from providers.sim.protocols import protocol_stream
from providers.sim.wire import (
    SimFaults,
    SimModel,
    continue_pieces,
    parse_fault_headers,
)

USER = [{"role": "user", "content": "hello there"}]
WHOLE = "".join(f"tok{i} " for i in range(30))
FIRST_TEN = "".join(f"tok{i} " for i in range(10))


def plan_of(body: dict[str, Any], faults: SimFaults | None = None,
            profile: SimProfile | None = None, endpoint: str = "chat/completions") -> Any:
    return SimModel(profile or SimProfile(ttft_median=0), random.Random(1)).plan(
        body, endpoint=endpoint, faults=faults)


def test_fault_headers_parse_and_refuse_garbage() -> None:
    assert parse_fault_headers({}) is None
    faults = parse_fault_headers({"x-sim-stall-at": "10", "x-sim-stall-ms": "250",
                                  "x-sim-break-at": "12", "x-sim-break": "closed"})
    assert faults == SimFaults(10, 0.25, 12, "closed")
    for bad in ({"x-sim-break-at": "-1"}, {"x-sim-stall-at": "x"},
                {"x-sim-break-at": "3", "x-sim-break": "explode"}):
        with pytest.raises(ValueError):
            parse_fault_headers(bad)


def test_continue_pieces_goes_on_from_the_given_text() -> None:
    pieces = tuple(f"tok{i} " for i in range(30))
    rest, first = continue_pieces(pieces, FIRST_TEN)
    assert first == 10 and FIRST_TEN + "".join(rest) == WHOLE
    # a prefill stripped of its trailing space: the space comes back first, numbering kept
    rest, first = continue_pieces(pieces, FIRST_TEN.rstrip())
    assert first == 10 and rest[0] == " tok10 " and FIRST_TEN.rstrip() + "".join(rest) == WHOLE
    # text that is not this answer's start: the model starts over
    assert continue_pieces(pieces, "something else") == (pieces, 0)


@pytest.mark.parametrize("endpoint,body", [
    ("chat/completions", {"messages": [*USER, {"role": "assistant", "content": FIRST_TEN}]}),
    ("messages", {"max_tokens": 100, "messages": [
        *USER, {"role": "assistant", "content": [{"type": "text", "text": FIRST_TEN}]}]}),
    ("responses", {"input": [*USER, {"role": "assistant", "content": FIRST_TEN}]}),
])
def test_a_final_assistant_message_is_continued_on_every_api(
        endpoint: str, body: dict[str, Any]) -> None:
    plan = plan_of(body, endpoint=endpoint)
    assert FIRST_TEN + plan.content == WHOLE


def test_faults_count_from_the_whole_answer() -> None:
    faults = SimFaults(stall_at=5, stall=2.0, break_at=10, break_kind="reset")
    fresh = plan_of({"messages": USER}, faults)
    assert (fresh.stall_at, fresh.stall, fresh.break_at) == (5, 2.0, 10)
    continued = plan_of({"messages": [*USER, {"role": "assistant", "content": FIRST_TEN}]},
                        faults)
    assert continued.break_at is None and continued.stall_at is None  # already past both
    error = plan_of({"messages": USER}, SimFaults(break_at=10, break_kind="error"))
    assert error.midstream_error_after == 10 and error.break_at is None


def test_profile_chances_and_an_unchanged_ttft_sequence() -> None:
    calm = SimModel(SimProfile(), random.Random(3))
    rough = SimModel(SimProfile(stall_probability=1.0, break_probability=1.0),
                     random.Random(3))
    for _ in range(50):
        a, b = calm.plan({"messages": USER}), rough.plan({"messages": USER})
        assert a.ttft == b.ttft and a.stall_at is None and a.break_at is None
        assert b.stall_at is not None and 0 < b.stall_at < len(b.tokens)
        assert b.break_at is not None and 0 < b.break_at < len(b.tokens)


async def _read(provider: SimProvider, endpoint: Endpoint, body: dict[str, Any],
                headers: dict[str, str]) -> list[SSEEvent]:
    call = UpstreamCall(endpoint=endpoint, body={"model": "m", "stream": True, **body},
                        stream=True, request_id="r", first_byte_timeout=5.0,
                        extra_headers=headers)
    stream = await provider.open(call)
    events: list[SSEEvent] = []
    try:
        async for batch in stream.batches():
            events += batch.events
    finally:
        await stream.aclose()
    return events


def _texts(events: list[SSEEvent]) -> str:
    out = []
    for event in events:
        try:
            obj = json.loads(event.data)
        except ValueError:
            continue
        for choice in obj.get("choices") or []:
            out.append((choice.get("delta") or {}).get("content") or "")
        delta = obj.get("delta")
        if isinstance(delta, dict):
            out.append(delta.get("text") or "")
        if obj.get("type") == "response.output_text.delta":
            out.append(obj["delta"])
    return "".join(out)


def _provider() -> SimProvider:
    return SimProvider(BackendSettings(name="s", provider="sim", model="m",
                                       sim=SimProfile(ttft_median=0, inter_token=0)))


async def test_provider_breaks_after_ten_tokens_each_way() -> None:
    provider = _provider()
    with pytest.raises(UpstreamDisconnected):
        await _read(provider, "chat/completions", {"messages": USER},
                    {"x-sim-break-at": "10"})
    for kind in ("closed", "malformed"):
        events = await _read(provider, "chat/completions", {"messages": USER},
                             {"x-sim-break-at": "10", "x-sim-break": kind})
        assert _texts(events) == FIRST_TEN and events[-1].data != b"[DONE]"
    events = await _read(provider, "messages", {"max_tokens": 100, "messages": USER},
                         {"x-sim-break-at": "10", "x-sim-break": "error"})
    assert _texts(events) == FIRST_TEN
    assert events[-1].event == b"error" and b"overloaded_error" in events[-1].data


@pytest.mark.parametrize("endpoint", ["chat/completions", "messages", "responses"])
async def test_a_stream_stalls_before_the_token_asked(endpoint: str) -> None:
    """The stall's sleep comes after token 3 and before token 4, on every API."""
    plan = plan_of({"messages": USER, "input": USER, "max_tokens": 100},
                   SimFaults(stall_at=4, stall=7.0), endpoint=endpoint)
    log: list[tuple[float, int]] = []
    texts: list[str] = []

    async def sleep(delay: float) -> None:
        log.append((delay, len(texts)))

    items: AsyncGenerator[bytes | tuple[bytes, bytes], None]
    if endpoint == "chat/completions":
        items = sim_payloads(plan, endpoint="chat/completions", model="m", request_id="r",
                             sleep=sleep)
    else:
        items = protocol_stream(plan, endpoint, model="m", request_id="r", sleep=sleep,
                                created=0)
    async for item in items:
        data = item if isinstance(item, bytes) else item[1]
        text = _texts([SSEEvent(data)])
        if text:
            texts.append(text)
    assert (7.0, 4) in log and "".join(texts) == WHOLE


def test_sim_command_line_sets_the_midstream_faults() -> None:
    ns = build_parser().parse_args(["sim", "--stall-probability", "0.03", "--stall-length-ms",
                                    "5000", "--break-probability", "0.01", "--break-kind",
                                    "closed"])
    profile = sim_profile(ns)
    assert (profile.stall_probability, profile.stall_length, profile.break_probability,
            profile.break_kind) == (0.03, 5.0, 0.01, "closed")
