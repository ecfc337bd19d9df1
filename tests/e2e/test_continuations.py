"""A stream that breaks after commit is continued on another backend: the client reads one
answer. Real sockets: loopback simulators (which break at token 10 in each way a real
upstream does, and continue a final assistant message honestly), the gateway under uvicorn,
the official SDKs as clients. Each test ends with the automatic leak check."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.api.inference import INFERENCE_ROUTES, InferenceRoute
from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
    StallSettings,
)
from gateway.settings.model import PriceSettings
from gateway.settings.tenants import TenantKeySettings, TenantLimits
from gateway.stats.requestlog import LOGGER_NAME
from gateway.stats.tracing import Tracing
from providers.sim.server import create_sim_app
from tests.e2e.test_route_matrix import STREAM_ENDS
from tests.harness import (
    AsgiServerFactory,
    Close,
    Head,
    RunningServer,
    Script,
    Send,
    UpstreamFactory,
)
from tests.harness.asgi import with_request_headers
from tests.harness.bodies import (
    DONE,
    SSE_HEADERS,
    error_obj,
    finish_chunk,
    role_chunk,
    smallest_body,
    sse,
    stream_script,
    token_chunk,
    usage_chunk,
)
from tests.harness.builders import InOrder
from tests.harness.limits_kit import wait_for
from tests.harness.protocol_wire import (
    message_start,
    messages_script,
    named,
    text_block_start,
    text_delta,
)

POOL = "pool"
TOKENS = 30
PROFILE = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0,
                     tokens=TOKENS, inter_token=0.0, usage=False)
WHOLE = "".join(f"tok{i} " for i in range(TOKENS))
KINDS = ("reset", "closed", "malformed", "error")
QUESTION: Any = [{"role": "user", "content": "hello there"}]


def gateway(asgi_server: AsgiServerFactory, kind: str, *, stall: StallSettings | None = None,
            faults: dict[str, str] | None = None, tracing: Tracing | None = None,
            style: Literal["prefill", "continue_final_message"] = "prefill",
            translate: bool = False,
            ) -> tuple[list[RunningServer], RunningServer]:
    """Two loopback simulators that break every fresh answer before token 10 (`kind`; or
    do what `faults` say), behind an OpenAI-compatible and an Anthropic backend each,
    continuing by prefill; no hedge before 5 s, so the first backend is the only attempt
    until it breaks. `translate`: the pool also reaches each API's backends from the
    other's (off: each API to its own backends)."""
    faults = faults or {"x-sim-break-at": "10", "x-sim-break": kind}
    sims = [asgi_server(with_request_headers(create_sim_app(PROFILE, seed=i), faults))
            for i in range(2)]
    backends = [backend for i, sim in enumerate(sims) for backend in (
        BackendSettings(name=f"o{i}", provider="openai", base_url=sim.v1, model="m",
                        group=f"g{i}", continuation=style),
        BackendSettings(name=f"a{i}", provider="anthropic", base_url=sim.base_url,
                        model="m", group=f"g{i}"))]
    hedging = HedgingSettings(delay=DelaySettings(mode="fixed", value=5.0),
                              stall=stall or StallSettings())
    # each API to its own backends: an answer reached by translation is not continued
    pool = PoolSettings(name=POOL, backends=tuple(backends), hedging=hedging, timeout=20.0,
                        translate=translate)
    return sims, asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=2,
                                                      tracing=tracing))


def stats(gw: RunningServer) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(gw.url("/hedge/stats"), timeout=5.0).json()
    return answer


@pytest.mark.parametrize("kind", KINDS)
def test_a_chat_stream_broken_after_ten_tokens_reads_as_one_answer(
        asgi_server: AsgiServerFactory, kind: str) -> None:
    """The first ten tokens, then the continuation's: one id, one model, one role, one
    finish reason, the whole answer's usage, and `[DONE]` once."""
    _, gw = gateway(asgi_server, kind)
    text, ids, models, roles, finishes, usage = "", set(), set(), 0, [], None
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=QUESTION, stream=True,
            stream_options={"include_usage": True}))
    for chunk in chunks:
        ids.add(chunk.id)
        models.add(chunk.model)
        for choice in chunk.choices:
            assert choice.index == 0
            text += choice.delta.content or ""
            roles += choice.delta.role is not None
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert text == WHOLE
    assert len(ids) == 1 and models == {"m"} and roles == 1 and finishes == ["stop"]
    assert usage is not None and usage.completion_tokens == TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_a_messages_stream_broken_after_ten_tokens_reads_as_one_answer(
        asgi_server: AsgiServerFactory, kind: str) -> None:
    """Anthropic's SDK reads one message: one message_start, one text block, one stop."""
    _, gw = gateway(asgi_server, kind)
    names: list[str] = []
    with anthropic.Anthropic(base_url=gw.base_url, api_key="x", max_retries=0) as client, \
            client.messages.stream(model=POOL, max_tokens=100,
                                   messages=QUESTION) as stream:
        for event in stream:
            names.append(event.type)
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["text"]
    assert "".join(getattr(b, "text", "") for b in message.content) == WHOLE
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == TOKENS
    assert names.count("message_start") == 1 and names.count("message_stop") == 1
    assert names.count("content_block_start") == 1


def test_raw_bytes_repeat_no_event_and_the_continuation_is_counted(
        asgi_server: AsgiServerFactory, caplog: pytest.LogCaptureFixture) -> None:
    """On the wire: ten tokens from one backend and the rest from the other, each token
    once, one role chunk, one finish chunk, one `[DONE]`. Then the break and the
    continuation are counted per pool and backend in /hedge/stats, /metrics and the
    request's log line."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    _, gw = gateway(asgi_server, "reset")
    body = {"model": POOL, "messages": QUESTION, "stream": True}
    raw = httpx.post(gw.url("/v1/chat/completions"), json=body, timeout=10.0).text
    datas = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and datas.count("[DONE]") == 1
    chunks = [json.loads(d) for d in datas[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert sum("role" in d for d in deltas) == 1
    assert [d["content"] for d in deltas if d.get("content")] == \
        [f"tok{i} " for i in range(TOKENS)]
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 1
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1

    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    doc = stats(gw)["pools"][POOL]
    counted = dict(doc["lifetime"]["continuations"])
    assert counted.pop("input_tokens") >= 10  # the request's input and the 10 tokens relayed
    assert counted == {"started": 1, "won": 1, "stalls": 0, "breaks_continued": 1,
                       "breaks_ended": 0, "refused": {}}
    by_backend = {name: b["lifetime"]["continuations"] for name, b in doc["backends"].items()}
    broke = [n for n, c in by_backend.items() if c["breaks_continued"] == 1]
    took = [n for n, c in by_backend.items() if c["won"] == 1]
    assert len(broke) == 1 and len(took) == 1 and broke != took
    metrics = httpx.get(gw.url("/metrics"), timeout=5.0).text
    assert (f'hedge_gateway_continuations_total{{backend="{took[0]}",event="won",'
            f'pool="{POOL}"}} 1.0') in metrics
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    assert lines[-1]["continuations"]["breaks_continued"] == {broke[0]: 1}
    assert lines[-1]["continuations"]["won"] == {took[0]: 1}
    # the dashboard's timeline: the continuation's bar after the race's own
    (race,) = httpx.get(gw.url("/hedge/races"), timeout=5.0).json()["races"]
    assert [(a["kind"], a["backend"], a["outcome"]) for a in race["attempts"]] == [
        ("primary", broke[0], "won"), ("continuation", took[0], "won")]
    assert race["attempts"][1]["start_ms"] >= race["attempts"][0]["end_ms"]


def test_with_continuations_off_a_break_is_the_in_band_error(
        asgi_server: AsgiServerFactory) -> None:
    """`hedging.stall.enabled: false`: the break ends the answer with an error, as before."""
    _, gw = gateway(asgi_server, "reset", stall=StallSettings(enabled=False))
    text = ""
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client, \
            pytest.raises(openai.APIError):
        for chunk in client.chat.completions.create(
                model=POOL, messages=QUESTION, stream=True):
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert text == "".join(f"tok{i} " for i in range(10))


def test_a_stream_stalled_after_ten_tokens_is_raced_by_a_continuation(
        asgi_server: AsgiServerFactory) -> None:
    """A stall of 30 s before token 10: once no token has come for the stall delay, a
    continuation starts on the other backend while the stalled stream stays open; the
    continuation's token comes first, so it wins and the stalled stream is closed. The
    client reads the whole answer once, long before the stall would have ended."""
    sims, gw = gateway(asgi_server, "", stall=StallSettings(min=0.2, max=1.0),
                       faults={"x-sim-stall-at": "10", "x-sim-stall-ms": "30000"})
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, timeout=10.0) as client:
        chunks = list(client.chat.completions.create(model=POOL, messages=QUESTION,
                                                     stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert text == WHOLE and finishes == ["stop"] and len({c.id for c in chunks}) == 1
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    counted = stats(gw)["pools"][POOL]["lifetime"]["continuations"]
    assert (counted["stalls"], counted["started"], counted["won"]) == (1, 1, 1)
    assert counted["breaks_continued"] == counted["breaks_ended"] == 0
    # the stalled stream was closed by the gateway, not waited out
    closed = [httpx.get(sim.url("/sim/stats"), timeout=5.0).json()["streams_closed_early"]
              for sim in sims]
    assert sorted(closed) == [0, 1]


def test_a_tool_call_broken_mid_arguments_is_not_continued(
        asgi_server: AsgiServerFactory) -> None:
    """Only text is continued: a stream cut inside a tool call's arguments ends with the
    in-band error, as without continuations, and the refusal is counted (`not_text`)."""
    _, gw = gateway(asgi_server, "closed", faults={"x-sim-break-at": "3",
                                                   "x-sim-break": "closed"})
    tool: Any = {"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"]}}}
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client, \
            pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model=POOL, messages=QUESTION, stream=True,
                                                tools=[tool], tool_choice="required"):
            pass
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    counted = stats(gw)["pools"][POOL]["lifetime"]["continuations"]
    assert counted["refused"] == {"not_text": 1} and counted["started"] == 0
    assert counted["breaks_ended"] == 1 and counted["breaks_continued"] == 0


CONTINUED_ENDPOINTS = frozenset({"chat/completions", "messages"})
#: what each route's request adds to its smallest body in the stall x API matrices: nothing,
#: and for the Responses API also `store: false` (a request that stores its response is not
#: continued; one that does not is)
VARIANTS: dict[str, tuple[dict[str, Any], ...]] = {"responses": ({}, {"store": False})}
#: the route table's routes that generate answers (they stream), with each variant's body
MATRIX = [pytest.param(r, extra, id=" ".join([r.method, r.path,
                                              *(f"{k}={v}" for k, v in extra.items())]))
          for r in INFERENCE_ROUTES if r.streams and not r.stored
          for extra in VARIANTS.get(r.endpoint, ({},))]


def continues(route: InferenceRoute, extra: dict[str, Any]) -> bool:
    """Whether a break of `route`'s answer with `extra` in its body is continued."""
    return route.endpoint in CONTINUED_ENDPOINTS or (route.endpoint == "responses"
                                                      and extra.get("store") is False)


def matrix_body(route: InferenceRoute, extra: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The smallest body of `route` with `extra`, long enough for every token."""
    body = smallest_body(route, POOL, stream=stream)
    assert body is not None
    if "max_tokens" in body:
        body["max_tokens"] = 100
    return {**body, **extra}


@pytest.mark.parametrize("route,extra", MATRIX)
def test_every_streamed_route_continues_or_says_it_was_cut(
        asgi_server: AsgiServerFactory, route: InferenceRoute, extra: dict[str, Any]) -> None:
    """The route table, streamed, each stream reset after 4 tokens: chat, Messages and the
    Responses API with `store: false` read as the whole answer ending once; every other
    route (legacy completions; the Responses API's smallest body, which stores its
    response) ends with its in-band error after the 4 tokens, never cleanly."""
    _, gw = gateway(asgi_server, "reset", faults={"x-sim-break-at": "4"})
    raw = httpx.post(gw.url(route.path), json=matrix_body(route, extra, True),
                     timeout=10.0).text
    tokens = re.findall(r"tok\d+ ", raw.split("response.output_text.done")[0])
    end = STREAM_ENDS[route.endpoint]
    if continues(route, extra):
        assert tokens == [f"tok{i} " for i in range(TOKENS)]
        assert raw.count(end) == 1
    else:
        assert tokens == [f"tok{i} " for i in range(4)]
        assert end not in raw and "error" in raw.rsplit("tok3 ", 1)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_responses_stream_broken_after_ten_tokens_reads_as_one_answer(
        asgi_server: AsgiServerFactory, kind: str) -> None:
    """The Responses API (`store: false`: nothing stored to fork): one response, one message
    item, sequence numbers 0, 1, 2... without a gap or a repeat, the whole text in the final
    response and its usage counting every output token once."""
    _, gw = gateway(asgi_server, kind)
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        events = list(client.responses.create(model=POOL, input="hello there", stream=True,
                                              store=False))
    types = [e.type for e in events]
    assert types.count("response.created") == 1 and types.count("response.completed") == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == WHOLE
    items = {getattr(e, "item_id", None) for e in events} - {None}
    assert len(items) == 1
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == WHOLE and final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == TOKENS


def test_a_continuation_is_its_own_span_in_the_requests_trace(
        asgi_server: AsgiServerFactory) -> None:
    """The broken primary keeps its span and outcome; the continuation is a second attempt
    span of kind `continuation` on the other backend, under the same request span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _, gw = gateway(asgi_server, "reset", tracing=Tracing(provider))
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        chunks = list(client.chat.completions.create(model=POOL, messages=QUESTION,
                                                     stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == WHOLE
    assert wait_for(lambda: len(exporter.get_finished_spans()) >= 3)
    spans = exporter.get_finished_spans()
    (request,) = [s for s in spans if s.name == "hedge_gateway.request"]
    attempts = [dict(s.attributes or {}) for s in spans if s.name == "hedge_gateway.attempt"]
    assert sorted(str(a["kind"]) for a in attempts) == ["continuation", "primary"]
    primary = next(a for a in attempts if a["kind"] == "primary")
    continuation = next(a for a in attempts if a["kind"] == "continuation")
    assert primary["outcome"] == "won" and primary["backend"] != continuation["backend"]
    assert all(s.parent is not None and request.context is not None
               and s.parent.span_id == request.context.span_id
               for s in spans if s.name == "hedge_gateway.attempt")


def test_a_continue_final_message_backend_gets_the_flags_and_continues(
        asgi_server: AsgiServerFactory) -> None:
    """`continuation: continue_final_message` (vLLM, SGLang): the same one answer, the
    upstream taking the flags (what they are: `test_continuation_bodies_per_style`)."""
    _, gw = gateway(asgi_server, "reset", style="continue_final_message")
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        chunks = list(client.chat.completions.create(model=POOL, messages=QUESTION,
                                                     stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == WHOLE


STALLED_BODIES: list[Any] = [
    pytest.param("/v1/chat/completions", {"messages": QUESTION}, id="chat"),
    pytest.param("/v1/messages", {"messages": QUESTION, "max_tokens": 100}, id="messages"),
    pytest.param("/v1/responses", {"input": "hello there", "store": False}, id="responses"),
]


@pytest.mark.parametrize("path,body", STALLED_BODIES)
def test_a_stall_is_raced_on_every_api(asgi_server: AsgiServerFactory, path: str,
                                       body: dict[str, Any]) -> None:
    """The stall race on each API, read raw: every token once and in order, one end event,
    long before the 30 s stall would have ended (the client's timeout is 10 s)."""
    _, gw = gateway(asgi_server, "", stall=StallSettings(min=0.2, max=1.0),
                    faults={"x-sim-stall-at": "10", "x-sim-stall-ms": "30000"})
    raw = httpx.post(gw.url(path), json={"model": POOL, "stream": True, **body},
                     timeout=10.0).text
    tokens = re.findall(r"tok\d+ ", raw.split("response.output_text.done")[0])
    assert tokens == [f"tok{i} " for i in range(TOKENS)]
    end = {"/v1/chat/completions": "data: [DONE]", "/v1/messages": "event: message_stop",
           "/v1/responses": "event: response.completed"}[path]
    assert raw.count(end) == 1
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    counted = stats(gw)["pools"][POOL]["lifetime"]["continuations"]
    assert (counted["stalls"], counted["won"]) == (1, 1)


def test_no_continuation_goes_through_a_translation(asgi_server: AsgiServerFactory) -> None:
    """A chat pool of one OpenAI-compatible and one Anthropic backend, translating: whichever
    answers, a break is the in-band error, never a continuation (a translated winner's
    events are another API's; the Anthropic backend is reached by chat only translated)."""
    faults = {"x-sim-break-at": "10", "x-sim-break": "reset"}
    sims = [asgi_server(with_request_headers(create_sim_app(PROFILE, seed=i), faults))
            for i in range(2)]
    backends = (BackendSettings(name="o0", provider="openai", base_url=sims[0].v1, model="m",
                                group="g0", continuation="prefill"),
                BackendSettings(name="a1", provider="anthropic", base_url=sims[1].base_url,
                                model="m", group="g1"))
    pool = PoolSettings(name=POOL, backends=backends, timeout=20.0, hedging=HedgingSettings(
        delay=DelaySettings(mode="fixed", value=5.0)))
    gw = asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=2))
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client, \
            pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model=POOL, messages=QUESTION, stream=True):
            pass
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    counted = stats(gw)["pools"][POOL]["lifetime"]["continuations"]
    assert counted["started"] == 0 and counted["breaks_continued"] == 0


#: round prices, a different one per simulator, so that each attempt's share is told apart
PRICES = (PriceSettings(input=1000.0, output=2000.0), PriceSettings(input=3000.0, output=5000.0))
TEAM = "team-c-key-0123456789abcdefghijklmnop"
ADMIN_KEY = "admin-key-0123456789abcdefghijklmnopqrstu"


CUT_AT_TEN = [
    pytest.param({"x-sim-break-at": "10", "x-sim-break": "reset"}, id="break"),
    pytest.param({"x-sim-stall-at": "10", "x-sim-stall-ms": "30000"}, id="stall"),
]


@pytest.mark.parametrize("faults", CUT_AT_TEN)
def test_a_continued_answer_costs_both_backends_and_counts_once_for_its_key(
        asgi_server: AsgiServerFactory, caplog: pytest.LogCaptureFixture,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faults: dict[str, str]) -> None:
    """A priced pool whose first backend breaks (or stalls: the continuation wins the
    race) after 10 of 30 tokens; the other continues. The request's cost is the first
    stream's input and its 10 tokens at its backend's price, plus the continuation's input
    (the request and the 10 tokens it resent) and its 20 tokens at the other's: in the log
    line, /hedge/stats (pool and key), /metrics and the store. The key's usage counts one
    request and the 30 tokens the client read, once; its limits (one request in flight, two
    a minute) see one request: the next one is let in."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    usage_profile = dataclasses.replace(PROFILE, usage=True)
    sims = [asgi_server(with_request_headers(create_sim_app(usage_profile, seed=i), faults))
            for i in range(2)]
    backends = tuple(BackendSettings(name=f"o{i}", provider="openai", base_url=sim.v1,
                                     model="m", group=f"g{i}", continuation="prefill",
                                     price=PRICES[i]) for i, sim in enumerate(sims))
    pool = PoolSettings(name=POOL, backends=backends, timeout=20.0, translate=False,
                        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=5.0),
                                                stall=StallSettings(min=0.2, max=1.0)))
    key = TenantKeySettings("team-c", key=TEAM, limits=TenantLimits(
        requests_per_minute=2, in_flight=1))
    settings = Settings(pools=(pool,), keys=(key,),
                        server=ServerSettings(admin_keys=(ADMIN_KEY,)))
    gw = asgi_server.build(lambda: create_app(settings, seed=2))
    with openai.OpenAI(base_url=gw.v1, api_key=TEAM, max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=QUESTION, stream=True,
            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == WHOLE
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == TOKENS

    def line() -> dict[str, Any] | None:
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
        return next((x for x in lines if x.get("pool") == POOL), None)

    assert wait_for(lambda: line() is not None)
    logged = line()
    assert logged is not None
    (broke,) = logged["continuations"]["breaks_continued" if "x-sim-break" in faults
                                        else "stalls"]
    (took,) = logged["continuations"]["won"]
    first, second = PRICES[int(broke[1])], PRICES[int(took[1])]
    relayed, sent = 10, usage.prompt_tokens
    expected = (sent * first.input + relayed * first.output
                + (sent + relayed) * second.input + (TOKENS - relayed) * second.output) / 1e6
    assert logged["usage"]["output"] == TOKENS  # the client's answer, counted once
    assert logged["cost_usd"] == pytest.approx(expected, abs=1e-6)
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    spend = stats(gw)["pools"][POOL]["lifetime"]["spend"]
    assert spend["usd"] == pytest.approx(expected, abs=1e-6)
    assert spend["keys"]["team-c"] == pytest.approx(expected, abs=1e-6)
    metrics = httpx.get(gw.url("/metrics"), timeout=5.0).text
    (metered,) = [ln for ln in metrics.splitlines()
                  if ln.startswith(f'hedge_gateway_spend_usd_total{{pool="{POOL}"}}')]
    assert float(metered.rsplit(" ", 1)[1]) == pytest.approx(expected, abs=1e-6)

    def stored() -> dict[str, Any] | None:
        rows = httpx.get(gw.url("/admin/keys/team-c/usage"), timeout=5.0,
                         headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
        return rows[0] if rows and rows[0]["requests"] else None

    assert wait_for(lambda: stored() is not None)
    row = stored()
    assert row is not None
    assert (row["requests"], row["output_tokens"]) == (1, TOKENS)
    assert row["spend_usd"] == pytest.approx(expected, abs=1e-6)
    # the key's limits saw one request: with two a minute, the next one is let in
    with openai.OpenAI(base_url=gw.v1, api_key=TEAM, max_retries=0) as client:
        again = list(client.chat.completions.create(model=POOL, messages=QUESTION,
                                                    stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == WHOLE


def scripted_gateway(asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory,
                     *scripts: Script, count: int = 2) -> tuple[InOrder, RunningServer]:
    """`count` scripted OpenAI-compatible backends that continue by prefill (the n-th
    request to arrive anywhere gets the n-th script); no hedge before 5 s."""
    order = InOrder(*scripts)
    upstreams = scripted_upstream(count, responder=order)
    backends = tuple(BackendSettings(name=f"o{i}", provider="openai", base_url=u.base_url,
                                     model="m", group=f"g{i}", continuation="prefill")
                     for i, u in enumerate(upstreams))
    pool = PoolSettings(name=POOL, backends=backends, timeout=20.0, translate=False,
                        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=5.0)))
    return order, asgi_server(create_app(Settings(pools=(pool,)), seed=2))


def test_a_break_after_the_last_text_keeps_the_continuations_usage(
        asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory) -> None:
    """The stream breaks after its last text delta: the continuation sends only its finish
    and usage chunks, and the client (include_usage) still reads the answer's usage."""
    cut = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(role_chunk() + token_chunk("Hello")), Send(token_chunk(" world")),
        Close()])
    rest = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(role_chunk()), Send(finish_chunk("stop")),
        Send(usage_chunk(prompt_tokens=12, completion_tokens=0)), Send(DONE)])
    order, gw = scripted_gateway(asgi_server, scripted_upstream, cut, rest)
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=QUESTION, stream=True,
            stream_options={"include_usage": True}))
    assert len(order.arrivals) == 2
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 2, 12)


def test_an_error_event_read_with_the_first_token_is_continued(
        asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory) -> None:
    """The first token and an error event arrive in one read (the race's prefix): the
    error is a break like any other, continued and counted, and the client reads one
    answer with no error in it."""
    broken = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(role_chunk() + token_chunk("Hello") + sse(error_obj("overloaded")))])
    order, gw = scripted_gateway(asgi_server, scripted_upstream, broken,
                                 stream_script([" world"]))
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=QUESTION, stream=True))
    assert len(order.arrivals) == 2
    prefill = order.arrivals[1].body["messages"][-1]
    assert prefill == {"role": "assistant", "content": "Hello"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    counted = stats(gw)["pools"][POOL]["lifetime"]["continuations"]
    assert (counted["breaks_continued"], counted["won"], counted["breaks_ended"]) == (1, 1, 0)


def test_an_error_event_in_a_continuations_first_read_is_continued_again(
        asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory) -> None:
    """A continuation whose first read holds its first token and an error event breaks like
    any stream: its text is kept and the next backend goes on from both."""
    cut = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(role_chunk() + token_chunk("Hello")), Close()])
    broken = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(role_chunk() + token_chunk(" world") + sse(error_obj("overloaded")))])
    order, gw = scripted_gateway(asgi_server, scripted_upstream, cut, broken,
                                 stream_script(["!"]), count=3)
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=QUESTION, stream=True))
    assert len(order.arrivals) == 3
    assert order.arrivals[2].body["messages"][-1] == {"role": "assistant",
                                                      "content": "Hello world"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world!"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_break_at_the_clients_max_tokens_ends_with_finish_reason_length(
        asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory) -> None:
    """The stream breaks once it relayed the client's max_tokens: no continuation goes past
    the limit (none is sent at all), and the answer ends as the limit ends it."""
    cut = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(role_chunk() + token_chunk("Hello")), Send(token_chunk(" world")),
        Close()])
    order, gw = scripted_gateway(asgi_server, scripted_upstream, cut,
                                 stream_script([" again"]))
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=QUESTION, stream=True, max_tokens=2))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert len({c.id for c in chunks}) == 1
    assert len(order.arrivals) == 1
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    counted = stats(gw)["pools"][POOL]["lifetime"]["continuations"]
    assert counted["started"] == 0 and counted["refused"] == {"max_tokens": 1}


def anthropic_gateway(asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory,
                      *scripts: Script) -> tuple[InOrder, RunningServer]:
    """Two scripted Anthropic backends (prefill), the n-th request gets the n-th script."""
    order = InOrder(*scripts)
    upstreams = scripted_upstream(2, responder=order)
    backends = tuple(BackendSettings(name=f"a{i}", provider="anthropic", base_url=u.root_url,
                                     model="m", group=f"g{i}")
                     for i, u in enumerate(upstreams))
    pool = PoolSettings(name=POOL, backends=backends, timeout=20.0, translate=False,
                        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=5.0)))
    return order, asgi_server(create_app(Settings(pools=(pool,)), seed=2))


def test_a_continued_message_keeps_its_original_input_usage(
        asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory) -> None:
    """Anthropic's SDK takes message_delta's input fields over message_start's: the
    continuation's (which read the relayed text as input) must not reach it."""
    cut = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(message_start()), Send(text_block_start()), Send(text_delta("Hello")),
        Close()])
    rest = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(message_start("msg_2")), Send(text_block_start()),
        Send(text_delta(" world")), Send(named("content_block_stop", {"index": 0})),
        Send(named("message_delta", {
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"input_tokens": 40, "cache_read_input_tokens": 30,
                      "output_tokens": 1}})),
        Send(named("message_stop"))])
    order, gw = anthropic_gateway(asgi_server, scripted_upstream, cut, rest)
    with anthropic.Anthropic(base_url=gw.base_url, api_key="x", max_retries=0) as client, \
            client.messages.stream(model=POOL, max_tokens=100, messages=QUESTION) as stream:
        message = stream.get_final_message()
    assert len(order.arrivals) == 2
    assert [getattr(b, "text", None) for b in message.content] == ["Hello world"]
    assert message.id == "msg_1" and message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 3 and not message.usage.cache_read_input_tokens
    assert message.usage.output_tokens == 2


def test_a_message_broken_at_its_max_tokens_stops_there(
        asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory) -> None:
    """Messages: a break once max_tokens was relayed is no continuation; the open block is
    closed and the message stops with `max_tokens`."""
    cut = Script(headers=SSE_HEADERS, steps=[
        Head(), Send(message_start()), Send(text_block_start()), Send(text_delta("Hello")),
        Send(text_delta(" world")), Close()])
    order, gw = anthropic_gateway(asgi_server, scripted_upstream, cut,
                                  messages_script([" again"]))
    with anthropic.Anthropic(base_url=gw.base_url, api_key="x", max_retries=0) as client, \
            client.messages.stream(model=POOL, max_tokens=2, messages=QUESTION) as stream:
        message = stream.get_final_message()
    assert len(order.arrivals) == 1
    assert [getattr(b, "text", None) for b in message.content] == ["Hello world"]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2
