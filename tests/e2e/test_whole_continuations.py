"""A non-streaming request whose upstream breaks after its first token is continued as a
stream is, and the client gets one whole answer. Real sockets: loopback simulators that break
every fresh stream at token 10 (and continue a final assistant message honestly), the gateway
under uvicorn, the official SDKs as clients, non-streaming. Each test ends with the automatic
leak check."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.api.inference import InferenceRoute
from gateway.api.stored import PREFIX as RESPONSE_ID_PREFIX
from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    Settings,
    StallSettings,
)
from gateway.stats.requestlog import LOGGER_NAME
from providers.sim.server import create_sim_app
from tests.e2e.test_continuations import (
    KINDS,
    MATRIX,
    POOL,
    PRICES,
    PROFILE,
    QUESTION,
    STALLED_BODIES,
    TOKENS,
    WHOLE,
    continues,
    gateway,
    matrix_body,
    stats,
)
from tests.e2e.test_route_matrix import WHOLE_ANSWERS
from tests.harness import AsgiServerFactory
from tests.harness.asgi import with_request_headers
from tests.harness.limits_kit import wait_for

#: a header the simulators ignore: no fault at all
NO_FAULT = {"x-sim-none": "1"}


def continued(gw: Any) -> dict[str, Any]:
    """The pool's continuation counters once the request's end has run."""
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    counted: dict[str, Any] = stats(gw)["pools"][POOL]["lifetime"]["continuations"]
    return counted


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_chat_answer_broken_after_ten_tokens_is_continued(
        asgi_server: AsgiServerFactory, kind: str) -> None:
    """One chat.completion: the first ten tokens from the backend that broke, then the
    continuation's, one id, one finish reason, the whole answer's usage; the break was
    continued (not failed over from the start)."""
    _, gw = gateway(asgi_server, kind)
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        answer = client.chat.completions.with_raw_response.create(model=POOL,
                                                                  messages=QUESTION)
    completion = answer.parse()
    assert completion.object == "chat.completion" and completion.model == "m"
    (choice,) = completion.choices
    assert choice.message.role == "assistant" and choice.message.content == WHOLE
    assert choice.finish_reason == "stop"
    usage = completion.usage
    assert usage is not None and usage.completion_tokens == TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    counted = continued(gw)
    assert counted["started"] == 1 and counted["won"] == 1
    assert counted["breaks_continued"] == 1 and counted["breaks_ended"] == 0


def test_a_whole_answer_the_other_api_s_translation_refuses_is_still_continued(
        asgi_server: AsgiServerFactory) -> None:
    """A pool that translates: a non-streaming Chat request the Messages translation refuses
    (`min_p` has no place there) reaches only the Chat backends, so it is read as a stream
    as an untranslated one is, and its break continued, not lost to the refusing backends
    it never goes to."""
    _, gw = gateway(asgi_server, "reset", translate=True)
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        completion = client.chat.completions.create(model=POOL, messages=QUESTION,
                                                    extra_body={"min_p": 0.1})
    (choice,) = completion.choices
    assert choice.message.content == WHOLE and choice.finish_reason == "stop"
    counted = continued(gw)
    assert counted["started"] == 1 and counted["breaks_continued"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_messages_answer_broken_after_ten_tokens_is_continued(
        asgi_server: AsgiServerFactory, kind: str) -> None:
    """One message: one text block holding both pieces, one stop reason, the output usage
    of the whole answer; the break was continued."""
    _, gw = gateway(asgi_server, kind)
    with anthropic.Anthropic(base_url=gw.base_url, api_key="x", max_retries=0) as client:
        message = client.messages.create(model=POOL, max_tokens=100, messages=QUESTION)
    assert message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == WHOLE  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == TOKENS and message.usage.input_tokens > 0
    counted = continued(gw)
    assert counted["started"] == 1 and counted["breaks_continued"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_responses_answer_broken_after_ten_tokens_is_continued(
        asgi_server: AsgiServerFactory, kind: str) -> None:
    """`client.responses.create` without `stream` (`store: false`: nothing stored to fork):
    one response, completed, whose one message item holds the first ten tokens and then the
    continuation's in one text part; the id is the gateway's (minted for the client, not the
    upstream's); the usage counts every output token once; the break was continued."""
    _, gw = gateway(asgi_server, kind)
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        response = client.responses.create(model=POOL, input="hello there", store=False)
    assert response.object == "response" and response.status == "completed"
    assert response.id.startswith(RESPONSE_ID_PREFIX) and not response.id.startswith("resp_sim_")
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    assert [part.type for part in item.content] == ["output_text"]
    assert response.output_text == WHOLE
    usage = response.usage
    assert usage is not None and usage.output_tokens == TOKENS and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    counted = continued(gw)
    assert counted["started"] == 1 and counted["won"] == 1
    assert counted["breaks_continued"] == 1 and counted["breaks_ended"] == 0


@pytest.mark.parametrize("route,extra", MATRIX)
def test_every_route_answered_whole_continues_or_is_answered_whole_upstream(
        asgi_server: AsgiServerFactory, route: InferenceRoute, extra: dict[str, Any]) -> None:
    """The route table, not streamed, each upstream stream reset after 4 tokens: chat,
    Messages and the Responses API with `store: false` are read upstream as a stream and
    continued (one continuation, the break continued); the others (legacy completions, a
    Responses request that stores its response) are read as one body, which the
    simulator's faults never cut. Either way the client reads every token once, in its
    route's whole answer."""
    _, gw = gateway(asgi_server, "reset", faults={"x-sim-break-at": "4"})
    answer = httpx.post(gw.url(route.path), json=matrix_body(route, extra, False),
                        timeout=10.0)
    assert answer.status_code == 200, answer.text
    field, value = WHOLE_ANSWERS[(route.endpoint, "")]
    assert answer.json()[field] == value
    assert re.findall(r"tok\d+ ", answer.text) == [f"tok{i} " for i in range(TOKENS)]
    counted = continued(gw)
    assert counted["breaks_continued"] == counted["started"] == int(continues(route, extra))
    assert counted["breaks_ended"] == 0


def _without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer less what differs between any two requests (its id, its timestamp)."""
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def test_an_unbroken_whole_answer_is_the_same_read_as_a_stream_or_as_a_body(
        asgi_server: AsgiServerFactory) -> None:
    """What the client reads for an unbroken request is the same answer, field for field,
    whether the gateway read it upstream as a stream (continuations on) or as a body
    (continuations off): chat, Messages and the Responses API."""
    answers: list[tuple[dict[str, Any], ...]] = []
    for stall in (StallSettings(), StallSettings(enabled=False)):
        _, gw = gateway(asgi_server, "reset", stall=stall, faults=NO_FAULT)
        with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
            chat = client.chat.completions.create(model=POOL, messages=QUESTION)
            response = client.responses.create(model=POOL, input="hello there", store=False)
        with anthropic.Anthropic(base_url=gw.base_url, api_key="x", max_retries=0) as anth:
            message = anth.messages.create(model=POOL, max_tokens=100, messages=QUESTION)
        answers.append((_without_ids(chat.model_dump()), _without_ids(message.model_dump()),
                        _response_without_ids(response.model_dump())))
    streamed, whole = answers
    assert streamed == whole
    assert streamed[0]["choices"][0]["message"]["content"] == WHOLE
    assert streamed[2]["output"][0]["content"][0]["text"] == WHOLE


def _response_without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    """A response less what differs between any two requests (its id, its time, its output
    items' ids)."""
    out = {k: v for k, v in answer.items() if k not in ("id", "created_at")}
    out["output"] = [{k: v for k, v in item.items() if k != "id"} for item in out["output"]]
    return out


def test_a_whole_answer_that_breaks_and_cannot_be_continued_is_a_502(
        asgi_server: AsgiServerFactory) -> None:
    """A tool call cut mid-arguments is not continued: the client gets the route's 502 (a
    retryable error, never a cut body), and the refusal is counted."""
    _, gw = gateway(asgi_server, "closed", faults={"x-sim-break-at": "3",
                                                   "x-sim-break": "closed"})
    tool: Any = {"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"]}}}
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client, \
            pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=POOL, messages=QUESTION, tools=[tool],
                                       tool_choice="required")
    assert caught.value.status_code == 502
    assert caught.value.response.headers.get("x-should-retry") != "false"
    body = caught.value.response.json()
    assert body["error"]["code"] == "answer_broken"
    counted = continued(gw)
    assert counted["refused"] == {"not_text": 1} and counted["breaks_ended"] == 1


def test_a_continued_whole_answers_cost_header_charges_both_backends(
        asgi_server: AsgiServerFactory, caplog: pytest.LogCaptureFixture) -> None:
    """A priced pool whose first backend breaks after 10 of 30 tokens: the whole answer's
    `x-hedge-cost` is the one its request log line records, and it holds the first
    stream's input and 10 tokens and the continuation's input (the request and the 10 tokens
    it resent) and 20 tokens, each at its backend's price."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    faults = {"x-sim-break-at": "10", "x-sim-break": "reset"}
    usage_profile = dataclasses.replace(PROFILE, usage=True)
    sims = [asgi_server(with_request_headers(create_sim_app(usage_profile, seed=i), faults))
            for i in range(2)]
    backends = tuple(BackendSettings(name=f"o{i}", provider="openai", base_url=sim.v1,
                                     model="m", group=f"g{i}", continuation="prefill",
                                     price=PRICES[i]) for i, sim in enumerate(sims))
    pool = PoolSettings(name=POOL, backends=backends, timeout=20.0, translate=False,
                        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=5.0)))
    gw = asgi_server.build(lambda: create_app(Settings(pools=(pool,)), seed=2))
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(model=POOL, messages=QUESTION)
    completion = raw.parse()
    assert completion.choices[0].message.content == WHOLE
    usage = completion.usage
    assert usage is not None and usage.completion_tokens == TOKENS
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    (logged,) = [json.loads(r.getMessage()) for r in caplog.records
                 if r.name == LOGGER_NAME and json.loads(r.getMessage()).get("pool") == POOL]
    (broke,) = logged["continuations"]["breaks_continued"]
    (took,) = logged["continuations"]["won"]
    first, second = PRICES[int(broke[1])], PRICES[int(took[1])]
    relayed, sent = 10, usage.prompt_tokens
    expected = (sent * first.input + relayed * first.output
                + (sent + relayed) * second.input + (TOKENS - relayed) * second.output) / 1e6
    assert logged["cost_usd"] == pytest.approx(expected, abs=1e-6)
    assert float(raw.headers["x-hedge-cost"]) == pytest.approx(expected, abs=1e-6)


def test_a_whole_answer_stalled_after_ten_tokens_is_raced_by_a_continuation(
        asgi_server: AsgiServerFactory) -> None:
    """A stall of 30 s before token 10 of a non-streaming request: the continuation started
    after the stall delay wins, the stalled upstream is closed, and the client gets the
    whole answer once, long before the stall would have ended (the SDK's timeout is 10 s)."""
    sims, gw = gateway(asgi_server, "", stall=StallSettings(min=0.2, max=1.0),
                       faults={"x-sim-stall-at": "10", "x-sim-stall-ms": "30000"})
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, timeout=10.0) as client:
        completion = client.chat.completions.create(model=POOL, messages=QUESTION)
    assert completion.choices[0].message.content == WHOLE
    assert completion.choices[0].finish_reason == "stop"
    counted = continued(gw)
    assert (counted["stalls"], counted["started"], counted["won"]) == (1, 1, 1)
    closed = [httpx.get(sim.url("/sim/stats"), timeout=5.0).json()["streams_closed_early"]
              for sim in sims]
    assert sorted(closed) == [0, 1]


@pytest.mark.parametrize("path,body", STALLED_BODIES)
def test_a_whole_answers_stall_is_raced_on_every_api(
        asgi_server: AsgiServerFactory, path: str, body: dict[str, Any]) -> None:
    """The stall race on each API, not streamed (the Responses API with `store: false`):
    the whole answer holds every token once and in order, long before the 30 s stall
    would have ended (the client's timeout is 10 s); the stall was raced and won."""
    _, gw = gateway(asgi_server, "", stall=StallSettings(min=0.2, max=1.0),
                    faults={"x-sim-stall-at": "10", "x-sim-stall-ms": "30000"})
    answer = httpx.post(gw.url(path), json={"model": POOL, **body}, timeout=10.0)
    assert answer.status_code == 200, answer.text
    assert re.findall(r"tok\d+ ", answer.text) == [f"tok{i} " for i in range(TOKENS)]
    counted = continued(gw)
    assert (counted["stalls"], counted["won"]) == (1, 1)


def test_a_client_that_leaves_a_whole_answer_being_relayed_ends_it(
        asgi_server: AsgiServerFactory) -> None:
    """A client that gives up while its whole answer is still being read (stalled for 30 s
    after ten tokens, a stall delay of 20 s): the gateway ends the relay and closes the
    stalled upstream at once (not at the stall's end), and gives back every slot (the
    automatic leak check)."""
    sims, gw = gateway(asgi_server, "", stall=StallSettings(min=20.0, max=30.0),
                       faults={"x-sim-stall-at": "10", "x-sim-stall-ms": "30000"})
    with openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, timeout=1.0) as client, \
            pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model=POOL, messages=QUESTION)
    assert wait_for(lambda: stats(gw)["pools"][POOL]["lifetime"]["requests"] == 1)
    closed = [httpx.get(sim.url("/sim/stats"), timeout=5.0).json()["streams_closed_early"]
              for sim in sims]
    assert sorted(closed) == [0, 1]
    assert continued(gw)["started"] == 0
