"""The simulator: seeded plans, wire order and shapes, the in-process provider, and one real
loopback server driven by the official OpenAI SDK."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Mapping
from typing import Any

import pytest

from gateway.cli import build_parser, main, sim_profile
from gateway.errors import UpstreamStatusError, UpstreamTimeout
from gateway.settings import BackendSettings, SimProfile
from gateway.wire.base import Kind
from gateway.wire.chat import classify
from gateway.wire.sse import SSEDecoder, SSEEvent
from providers.base import Endpoint, UpstreamCall
from providers.sim import SimProvider
from providers.sim.chat import sim_events, sim_payloads, sim_response
from providers.sim.embeddings import embedding_vector
from providers.sim.wire import SimModel, SimPlan, parse_ttft_override, wire_json

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "stream": True}


class FakeSleep:
    """Records the delays asked for instead of sleeping."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


async def collect(
    plan: SimPlan, endpoint: Endpoint = "chat/completions"
) -> tuple[list[SSEEvent], list[float]]:
    sleep = FakeSleep()
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    async for raw in sim_events(plan, endpoint=endpoint, model="m", request_id="r1", sleep=sleep):
        events.extend(decoder.feed(raw))
    return events, sleep.delays


def loads(event: SSEEvent) -> Any:
    return json.loads(event.data)


# --- plans ----------------------------------------------------------------------------------


def test_plans_are_reproducible_from_a_seed() -> None:
    profile = SimProfile(fail_probability=0.1, hang_probability=0.1)
    first = SimModel(profile, random.Random(7))
    second = SimModel(profile, random.Random(7))
    other = SimModel(profile, random.Random(8))
    plans = [first.plan(CHAT) for _ in range(50)]
    assert plans == [second.plan(CHAT) for _ in range(50)]
    assert [p.ttft for p in plans] != [other.plan(CHAT).ttft for _ in range(50)]


def test_faults_do_not_shift_the_ttft_sequence() -> None:
    calm = SimModel(SimProfile(), random.Random(3))
    faulty = SimModel(SimProfile(fail_probability=0.5, hang_probability=0.2), random.Random(3))
    assert [calm.plan(CHAT).ttft for _ in range(30)] == [faulty.plan(CHAT).ttft for _ in range(30)]


def test_straggler_share_is_near_its_probability() -> None:
    profile = SimProfile(ttft_median=0.1, ttft_sigma=0.25, straggler_probability=0.05)
    model = SimModel(profile, random.Random(11))
    plans = [model.plan(CHAT) for _ in range(20_000)]
    # the lognormal body never reaches 1 s at sigma 0.25 (that is 9 sigma); stragglers do
    share = sum(p.ttft > 1.0 for p in plans) / len(plans)
    assert 0.04 < share < 0.06
    body = sorted(p.ttft for p in plans if p.ttft < 1.0)
    assert body[len(body) // 2] == pytest.approx(0.1, rel=0.05)


def test_fault_shares_and_kinds() -> None:
    profile = SimProfile(
        fail_probability=0.2,
        fail_status=503,
        hang_probability=0.1,
        midstream_error_probability=0.1,
        tokens=10,
    )
    model = SimModel(profile, random.Random(5))
    plans = [model.plan(CHAT) for _ in range(10_000)]
    failed = [p for p in plans if p.status != 200]
    assert {p.status for p in failed} == {503}
    assert 0.18 < len(failed) / len(plans) < 0.22
    assert 0.08 < sum(p.hang for p in plans) / len(plans) < 0.12
    errors = [p.midstream_error_after for p in plans if p.midstream_error_after is not None]
    assert 0.08 < len(errors) / len(plans) < 0.12
    assert min(errors) >= 1 and max(errors) <= 5


def test_max_tokens_caps_the_content_and_override_sets_ttft() -> None:
    model = SimModel(SimProfile(tokens=30, straggler_probability=1.0), random.Random(1))
    plan = model.plan({**CHAT, "max_tokens": 3}, ttft_override=0.02)
    assert plan.tokens == ("tok0 ", "tok1 ", "tok2 ")
    assert plan.content == "tok0 tok1 tok2 "
    assert plan.ttft == 0.02
    assert plan.prompt_tokens == 3  # "hello there": 11 bytes, about 4 a token
    assert plan.truncated
    assert model.plan({**CHAT, "max_completion_tokens": 0}).tokens == ()
    assert not model.plan({**CHAT, "max_tokens": 30}).truncated  # the whole answer fits


def test_ttft_header_parsing() -> None:
    assert parse_ttft_override(None) is None
    assert parse_ttft_override("250") == 0.25
    for bad in ("x", "-1", "nan", "inf"):
        with pytest.raises(ValueError):
            parse_ttft_override(bad)


# --- wire events ----------------------------------------------------------------------------

PLAN = SimPlan(ttft=0.2, inter_token=0.01, tokens=("tok0 ", "tok1 ", "tok2 "), usage=True)


async def test_chat_stream_order_and_delays() -> None:
    events, delays = await collect(PLAN)
    kinds = [classify(e) for e in events]
    assert kinds == [
        Kind.OTHER,
        Kind.TOKEN,
        Kind.TOKEN,
        Kind.TOKEN,
        Kind.OTHER,
        Kind.OTHER,
        Kind.DONE,
    ]
    role, *tokens, finish, usage = (loads(e) for e in events[:-1])
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]
    # asked for usage: every chunk says `"usage": null` until the usage chunk, as OpenAI's do
    assert [t["usage"] for t in (role, *tokens, finish)] == [None] * 5
    assert "".join(t["choices"][0]["delta"]["content"] for t in tokens) == PLAN.content
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": "stop"}]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert events[-1].data == b"[DONE]"
    assert {loads(e)["id"] for e in events[:-1]} == {"chatcmpl-sim-r1"}
    # the role chunk goes out before any delay; then TTFT, then one gap per further token
    assert delays == [0.2, 0.01, 0.01]


async def test_usage_chunk_is_optional() -> None:
    events, _ = await collect(SimPlan(tokens=("a",), usage=False))
    assert [classify(e) for e in events] == [Kind.OTHER, Kind.TOKEN, Kind.OTHER, Kind.DONE]


async def test_legacy_completions_shape() -> None:
    events, delays = await collect(PLAN, "completions")
    assert [classify(e) for e in events] == [Kind.TOKEN] * 3 + [Kind.OTHER] * 2 + [Kind.DONE]
    first = loads(events[0])
    assert first["object"] == "text_completion"
    assert first["id"] == "cmpl-sim-r1"
    assert first["choices"][0]["text"] == "tok0 "
    assert loads(events[3])["choices"][0]["finish_reason"] == "stop"
    assert delays == [0.2, 0.01, 0.01]


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
async def test_token_chunks_are_byte_for_byte_the_dicts_json(endpoint: Endpoint) -> None:
    """Token chunks are spliced into a template encoded once: the bytes must be exactly
    `wire_json` of the chunk, whatever the token text or the model echoed before it."""
    pieces = ("tok0 ", 'a "quoted" \\ back', "caf\u00e9 \u2028", "\x00", "")
    plan = SimPlan(tokens=pieces, usage=False)
    model = "\x00"  # the marker itself
    got = [data async for data in sim_payloads(plan, endpoint=endpoint, model=model,
                                               request_id="r1", sleep=FakeSleep(), created=5)]
    chat = endpoint == "chat/completions"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-sim-r1",
            "object": "chat.completion.chunk" if chat else "text_completion", "created": 5,
            "model": model}
    for piece, data in zip(pieces, got[1:] if chat else got, strict=False):
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
            if chat else {"index": 0, "text": piece, "logprobs": None, "finish_reason": None})
        assert data == wire_json({**head, "choices": [choice]})


async def test_midstream_error_ends_the_stream() -> None:
    events, _ = await collect(SimPlan(tokens=("a", "b", "c"), midstream_error_after=2))
    assert [classify(e) for e in events] == [Kind.OTHER, Kind.TOKEN, Kind.TOKEN, Kind.ERROR]
    assert loads(events[-1])["error"]["type"] == "server_error"


async def test_hang_sends_the_role_chunk_then_waits_forever() -> None:
    events, delays = await collect(SimPlan(tokens=("a",), hang=True))
    assert [classify(e) for e in events] == [Kind.OTHER]
    assert delays == [math.inf]


def test_non_streaming_bodies_match_the_stream_content() -> None:
    chat = sim_response(PLAN, "chat/completions", "m", "r1")
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": PLAN.content,
                                             "refusal": None}
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["usage"]["completion_tokens"] == 3
    legacy = sim_response(PLAN, "completions", "m", "r1")
    assert legacy["object"] == "text_completion"
    assert legacy["choices"][0]["text"] == PLAN.content


def test_response_time_of_each_endpoint() -> None:
    assert PLAN.response_time("chat/completions") == pytest.approx(0.22)
    assert PLAN.response_time("completions") == pytest.approx(0.22)
    assert PLAN.response_time("embeddings") == 0.2  # no tokens to generate
    assert SimPlan(hang=True).response_time("embeddings") == math.inf


def test_embeddings_are_deterministic_unit_vectors() -> None:
    plan = SimModel(SimProfile(), random.Random(0)).plan({"input": ["a b", "c"]},
                                                         endpoint="embeddings")
    body = sim_response(plan, "embeddings", "e", "r")
    assert body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1]
    vector = body["data"][0]["embedding"]
    assert vector == embedding_vector("a b") and len(vector) == 8
    assert sum(x * x for x in vector) == pytest.approx(1.0, abs=1e-4)
    assert body["data"][1]["embedding"] != vector
    assert body["usage"]["prompt_tokens"] == 2  # one token per input of up to 4 bytes


# --- in-process provider --------------------------------------------------------------------


def provider(**profile: Any) -> SimProvider:
    sim = SimProfile(ttft_median=0.0, inter_token=0.0, seed=1, **profile)
    return SimProvider(BackendSettings(name="s1", provider="sim", model="mm", sim=sim))


def call(
    body: Mapping[str, Any] = CHAT,
    stream: bool = True,
    headers: Mapping[str, str] | None = None,
    endpoint: Endpoint = "chat/completions",
) -> UpstreamCall:
    return UpstreamCall(
        endpoint=endpoint,
        body=body,
        stream=stream,
        request_id="r9",
        first_byte_timeout=5.0,
        extra_headers=headers or {},
    )


async def test_provider_streams_the_same_bytes_as_the_wire() -> None:
    sim = provider(tokens=4)
    stream = await sim.open(call())
    got = [e async for batch in stream.batches() for e in batch.events]
    await stream.aclose()
    await stream.aclose()  # idempotent
    plan = SimModel(SimProfile(ttft_median=0.0, inter_token=0.0, tokens=4), random.Random(1)).plan(
        CHAT
    )
    expected = [
        SSEEvent(data)
        async for data in sim_payloads(
            plan,
            endpoint="chat/completions",
            model="mm",
            request_id="r9",
            sleep=FakeSleep(),
            created=loads(got[0])["created"],
        )
    ]
    assert got == expected
    assert sim.name == "s1"


async def test_provider_raises_fault_status_with_retry_after() -> None:
    sim = provider(fail_probability=1.0, fail_status=503)
    with pytest.raises(UpstreamStatusError) as info:
        await sim.open(call())
    assert info.value.status == 503
    assert info.value.retry_after == 1.0


async def test_provider_close_ends_a_hanging_read_from_another_task() -> None:
    sim = provider(hang_probability=1.0)
    stream = await sim.open(call())
    events = stream.batches()
    (first,) = (await anext(events)).events
    assert classify(first) is Kind.OTHER
    reader = asyncio.create_task(anext(events, None))
    await asyncio.sleep(0)
    assert not reader.done()
    await stream.aclose()
    assert await reader is None  # the parked read ends instead of hanging
    await stream.aclose()


async def test_provider_close_before_reading_and_between_events() -> None:
    sim = provider(tokens=3)
    unread = await sim.open(call())
    await unread.aclose()
    assert [b async for b in unread.batches()] == []
    partly = await sim.open(call())
    events = partly.batches()
    await anext(events)
    await partly.aclose()
    assert [e async for e in events] == []


async def test_provider_non_streaming_and_timeouts() -> None:
    sim = provider(tokens=2)
    response = await sim.open(call(stream=False))
    (event,) = [e async for batch in response.batches() for e in batch.events]
    assert loads(event)["choices"][0]["message"]["content"] == "tok0 tok1 "
    await response.aclose()
    hanging = provider(hang_probability=1.0)
    slow_call = UpstreamCall(
        endpoint="chat/completions",
        body=CHAT,
        stream=False,
        request_id="r",
        first_byte_timeout=0.0,
    )
    with pytest.raises(UpstreamTimeout):
        await hanging.open(slow_call)
    embeddings = await sim.open(call({"model": "e", "input": "a"}, stream=True,
                                     endpoint="embeddings"))
    (event,) = [e async for b in embeddings.batches() for e in b.events]  # never streamed
    assert loads(event)["data"][0]["embedding"] == embedding_vector("a")
    with pytest.raises(UpstreamStatusError) as info:
        await sim.open(call(headers={"x-sim-ttft-ms": "soon"}))
    assert info.value.status == 400


def test_profile_from_command_line_options(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert sim_profile(parser.parse_args(["sim"])) == SimProfile()
    ns = parser.parse_args(
        [
            "sim",
            "--ttft-median-ms",
            "80",
            "--straggler-extra-ms",
            "900",
            "--inter-token-ms",
            "2",
            "--fail-status",
            "429",
            "--seed",
            "4",
        ]
    )
    profile = sim_profile(ns)
    assert (profile.ttft_median, profile.straggler_extra, profile.inter_token) == (0.08, 0.9, 0.002)
    assert (profile.fail_status, profile.seed) == (429, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["sim", "--hang-probability", "1.5"])
    too_many = ["sim", "--fail-probability", "0.6", "--hang-probability", "0.6"]
    with pytest.raises(ValueError):
        sim_profile(parser.parse_args(too_many))
    # the command says so and exits 2 (no traceback, no server started)
    assert main(too_many) == 2
    assert "add up to more than 1" in capsys.readouterr().err


def test_request_draws_follow_the_request_not_the_order() -> None:
    """`draws: request`: a request meets the same TTFT on a backend whatever came before it,
    another request or another backend's seed its own."""
    profile = SimProfile(draws="request", straggler_probability=0.5)
    one = {"messages": [{"role": "user", "content": "one"}]}
    two = {"messages": [{"role": "user", "content": "two"}]}
    first, second = SimModel(profile, random.Random(7)), SimModel(profile, random.Random(7))
    a = [first.plan(one).ttft, first.plan(two).ttft]
    b = [second.plan(two).ttft, second.plan(one).ttft]
    assert a == b[::-1]
    assert a[0] != a[1]
    others = {SimModel(profile, random.Random(seed)).plan(one).ttft for seed in range(8)}
    assert len(others) == 8
    # by default the seeded sequence decides: the same request again gets the next draws
    seq = SimModel(SimProfile(), random.Random(7))
    assert seq.plan(one).ttft != seq.plan(one).ttft
