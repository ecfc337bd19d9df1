"""Named client keys over real sockets: the gateway under its own server, simulated and
scripted upstreams, the official `openai` and `anthropic` SDKs as clients.

- a key may use only its pools: another pool is answered as an unknown model, in the route's
  shape (OpenAI's 404 on the OpenAI routes, Anthropic's on /v1/messages), and the model list
  shows it only its own; `server.api_keys` keep working as keys without rules;
- over a limit, 429 with Retry-After and the key's rate-limit headers (OpenAI's family, or
  Anthropic's on /v1/messages); every answer, an upstream's failure included, carries them;
- the SDK's own retry honours the advice: a key at its in-flight limit is refused, the held
  request ends, and the SDK's retry (after the advised pause) is let in;
- output tokens are charged from the upstream's usage once a stream has ended;
- a reload that removes a key refuses it from the next request; the key never appears in an
  answer, the stats, the metrics or a log line.

Each test ends with the leak check.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

import gateway.hedge.relay as relay_module
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
)
from gateway.settings.load import load_settings
from gateway.settings.tenants import TenantHedging, TenantKeySettings, TenantLimits
from tests.e2e.test_stored_responses import stored_upstream
from tests.harness import (
    DONE,
    SSE_HEADERS,
    Gate,
    Head,
    LoopThread,
    RecordedRequest,
    Script,
    Send,
    Step,
    UpstreamFactory,
    Wait,
    chat_completion_obj,
    finish_chunk,
    json_script,
    role_chunk,
    stream_script,
    token_chunk,
    usage_chunk,
)
from tests.harness.limits_kit import (
    MESSAGES,
    Canary,
    GatewayFactory,
    data_lines,
    holding,
    verbose_logs,
    wait_for,
)
from tests.harness.protocol_wire import messages_script

TEAM_A = "team-a-key-0123456789abcdefghijklmnop"
TEAM_B = "team-b-key-0123456789abcdefghijklmnop"
LEGACY = "legacy-key-0123456789abcdefghijklmnop"
FAST = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=3,
                  inter_token=0.0)
NO_HEDGES = HedgingSettings(enabled=False)


@pytest.fixture(autouse=True)
def store_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's embedded store in its own folder (`server.store: null` names a file under
    `$XDG_STATE_HOME`), never the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "hedge-gateway" / "tenants.sqlite"


def sim_pool(name: str, profile: SimProfile = FAST) -> PoolSettings:
    return PoolSettings(name, (BackendSettings("s", "sim", sim=profile),), hedging=NO_HEDGES)


def keyed(*keys: TenantKeySettings, pools: tuple[PoolSettings, ...] = ()) -> Settings:
    return Settings(pools or (sim_pool("alpha"), sim_pool("beta")),
                    server=ServerSettings(api_keys=(LEGACY,)), keys=keys)


def openai_client(root: str, key: str, *, retries: int = 0,
                  http: openai.DefaultHttpxClient | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=retries,
                         timeout=10.0, http_client=http)


def anthropic_client(root: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=10.0)


def test_a_key_uses_only_its_pools_and_sees_only_them(
    loop_thread: LoopThread, caplog: pytest.LogCaptureFixture
) -> None:
    verbose_logs(caplog)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, pools=("alpha",))))
    answers: list[str] = []
    with openai_client(gateway.root, TEAM_A) as team_a, \
            openai_client(gateway.root, LEGACY) as legacy:
        reply = team_a.chat.completions.with_raw_response.create(model="alpha",
                                                                 messages=MESSAGES)
        answers.append(reply.text)
        assert reply.parse().choices
        with pytest.raises(openai.NotFoundError) as other_pool:
            team_a.chat.completions.create(model="beta", messages=MESSAGES)
        with pytest.raises(openai.NotFoundError) as no_pool:
            team_a.chat.completions.create(model="gamma", messages=MESSAGES)
        # told exactly what a pool that does not exist is told
        assert other_pool.value.body == no_pool.value.body
        assert other_pool.value.code == "model_not_found"
        answers.append(other_pool.value.response.text)
        assert [m.id for m in team_a.models.list()] == ["alpha"]
        assert [m.id for m in legacy.models.list()] == ["alpha", "beta"]
        assert legacy.chat.completions.create(model="beta", messages=MESSAGES).choices
        with openai_client(gateway.root, "not-a-key") as stranger, \
                pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model="alpha", messages=MESSAGES)
        with pytest.raises(openai.NotFoundError):  # the Responses route checks it too
            team_a.responses.create(model="beta", input="hi", store=False)
    with anthropic_client(gateway.root, TEAM_A) as claude:
        message = claude.messages.create(model="alpha", max_tokens=8,
                                         messages=[{"role": "user", "content": "hi"}])
        assert message.content
        with pytest.raises(anthropic.NotFoundError) as refused:
            claude.messages.create(model="beta", max_tokens=8,
                                   messages=[{"role": "user", "content": "hi"}])
        assert refused.value.body["type"] == "error"  # type: ignore[index]
        assert refused.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        answers.append(refused.value.response.text)
    lines = [line for line in (getattr(r, "hedge_request", None) for r in caplog.records
                               if r.name == "hedge_gateway.requests") if line and line.get("pool")]
    assert {(line["pool"], line.get("key")) for line in lines} == {
        ("alpha", "team-a"), ("beta", None)}  # the name of a named key; none for the others
    Canary(TEAM_A, LEGACY).assert_absent_everywhere(gateway.root, caplog, *answers)


def ratelimit(headers: Mapping[str, str], family: str = "x-ratelimit") -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith(family)}


def test_over_a_limit_the_answer_is_429_with_the_headers_of_the_routes_family(
    loop_thread: LoopThread, caplog: pytest.LogCaptureFixture
) -> None:
    """Two requests a minute: the first two answers say 1 and then 0 remain, the third is
    refused with the pause that lets the next one in; an upstream's failure carries the
    headers too. On /v1/messages the same in Anthropic's family and error shape."""
    verbose_logs(caplog)
    broken = sim_pool("broken", SimProfile(fail_probability=1.0, fail_status=500))
    two = TenantLimits(requests_per_minute=2)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, limits=two),
        TenantKeySettings("team-b", key=TEAM_B, limits=two),
        pools=(sim_pool("alpha"), broken)))
    answers = []
    with openai_client(gateway.root, TEAM_A) as team_a:
        seen = []
        for _ in range(2):
            reply = team_a.chat.completions.with_raw_response.create(model="alpha",
                                                                     messages=MESSAGES)
            seen.append(ratelimit(reply.headers))
        assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["1", "0"]
        assert {h["x-ratelimit-limit-requests"] for h in seen} == {"2"}
        assert all(re.fullmatch(r"\d+(\.\d+)?s", h["x-ratelimit-reset-requests"]) for h in seen)
        with pytest.raises(openai.NotFoundError) as unknown:  # refused before admission
            team_a.chat.completions.create(model="nope", messages=MESSAGES)
        assert ratelimit(unknown.value.response.headers)[
            "x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as over:
            team_a.chat.completions.create(model="alpha", messages=MESSAGES)
        response = over.value.response
        assert response.status_code == 429
        assert over.value.code == "rate_limit_exceeded"
        assert over.value.type == "rate_limit_error"
        assert "team-a" in over.value.message and "requests" in over.value.message
        assert 0 < float(response.headers["retry-after-ms"]) <= 30_000
        assert 1 <= int(response.headers["retry-after"]) <= 30
        assert "x-should-retry" not in response.headers  # a retry later can pass
        assert ratelimit(response.headers)["x-ratelimit-remaining-requests"] == "0"
        answers.append(response.text)
    with anthropic_client(gateway.root, TEAM_B) as claude:
        first = claude.messages.with_raw_response.create(
            model="alpha", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        family = ratelimit(first.headers, "anthropic-ratelimit")
        assert family["anthropic-ratelimit-requests-limit"] == "2"
        assert family["anthropic-ratelimit-requests-remaining"] == "1"
        assert family["anthropic-ratelimit-requests-reset"].endswith("Z")
        assert not ratelimit(first.headers)  # not OpenAI's family on Anthropic's route
        with pytest.raises(anthropic.NotFoundError) as unknown_model:
            claude.messages.create(model="nope", max_tokens=8,
                                   messages=[{"role": "user", "content": "hi"}])
        assert ratelimit(unknown_model.value.response.headers, "anthropic-ratelimit")[
            "anthropic-ratelimit-requests-remaining"] == "1"
        with pytest.raises(anthropic.InternalServerError) as failed:  # after admission
            claude.messages.create(model="broken", max_tokens=8,
                                   messages=[{"role": "user", "content": "hi"}])
        assert ratelimit(failed.value.response.headers, "anthropic-ratelimit")[
            "anthropic-ratelimit-requests-remaining"] == "0"
        with pytest.raises(anthropic.RateLimitError) as refused:
            claude.messages.create(model="alpha", max_tokens=8,
                                   messages=[{"role": "user", "content": "hi"}])
        assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        assert "retry-after" in refused.value.response.headers
        answers.append(refused.value.response.text)
    Canary(TEAM_A, TEAM_B).assert_absent_everywhere(gateway.root, caplog, *answers)


def test_the_sdks_retry_is_let_in_once_the_request_holding_the_slot_has_ended(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """In flight 1: a stream holds the key's one slot. A second request is refused with
    429 and Retry-After; on seeing it the test lets the held stream end. The SDK waits the
    advised pause, sends the request again, and it passes: refused only while the slot was
    held, and never sent upstream while refused."""
    gate = Gate()
    (upstream,) = scripted_upstream(1, responder=holding(
        gate, json_script(chat_completion_obj("ok"))))
    pool = PoolSettings("held", (BackendSettings("u", "openai", "m", upstream.base_url),),
                        hedging=NO_HEDGES)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, limits=TenantLimits(in_flight=1)),
        pools=(pool,)))
    statuses: list[int] = []
    released: list[int] = []  # how many answers the client had seen when the slot was freed

    def on_response(response: Any) -> None:  # the SDK's own HTTP client calls it
        statuses.append(response.status_code)
        if response.status_code == 429 and not released:
            assert response.headers["retry-after-ms"] == "1000"
            released.append(len(statuses))
            gate.open()

    body = {"model": "held", "messages": MESSAGES, "stream": True, "user": "held"}
    with httpx.Client(base_url=gateway.root, timeout=10.0) as raw, \
            raw.stream("POST", "/v1/chat/completions", json=body,
                       headers={"authorization": f"Bearer {TEAM_A}"}) as held:
        lines = held.iter_lines()
        assert any("first" in line for line in lines)  # the slot is held from here
        with openai.DefaultHttpxClient(event_hooks={"response": [on_response]}) as hooked, \
                openai_client(gateway.root, TEAM_A, retries=3, http=hooked) as client:
            answer = client.chat.completions.create(model="held", messages=MESSAGES)
        assert answer.choices[0].message.content == "ok"
        assert "[DONE]" in "".join(lines)  # the held stream ended properly
    assert statuses[0] == 429 and released == [1] and statuses[-1] == 200
    assert len(upstream.requests) == 2  # the held one and the retry that passed


def test_a_client_that_leaves_mid_stream_gives_its_keys_slot_back(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """In flight 1: a client leaves a stream after its first token; the gateway closes the
    upstream, the request ends, and the key's slot is free again (the next request passes
    once the upstream has seen the close), never held for ever."""
    gate = Gate()
    (upstream,) = scripted_upstream(1, responder=holding(
        gate, json_script(chat_completion_obj("ok"))))
    pool = PoolSettings("held", (BackendSettings("u", "openai", "m", upstream.base_url),),
                        hedging=NO_HEDGES)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, limits=TenantLimits(in_flight=1)),
        pools=(pool,)))
    body = {"model": "held", "messages": MESSAGES, "stream": True, "user": "held"}
    auth = {"authorization": f"Bearer {TEAM_A}"}
    try:
        with httpx.Client(base_url=gateway.root, timeout=10.0) as raw:
            with raw.stream("POST", "/v1/chat/completions", json=body, headers=auth) as held:
                lines = held.iter_lines()  # kept: a dropped iterator closes the connection
                assert any("first" in line for line in lines)
                second = raw.post("/v1/chat/completions", headers=auth,
                                  json={"model": "held", "messages": MESSAGES})
                assert second.status_code == 429  # the slot is held
            # the client has left: the upstream is closed and the request ends
            (first,) = upstream.requests[:1]
            assert upstream.wait_closed(first)
        with openai_client(gateway.root, TEAM_A, retries=3) as client:
            assert client.chat.completions.create(model="held", messages=MESSAGES).choices
    finally:
        gate.open()


def test_a_keys_headers_replace_the_upstreams_on_its_answers(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """The upstream states its own quota; a key with limits reads one value of each header,
    its key's, and a key without rules still reads the upstream's."""
    upstream_quota = {"x-ratelimit-limit-requests": "1000",
                      "x-ratelimit-remaining-requests": "999"}
    (upstream,) = scripted_upstream(1, responder=lambda _request: json_script(
        chat_completion_obj("ok"), headers=upstream_quota))
    pool = PoolSettings("alpha", (BackendSettings("u", "openai", "m", upstream.base_url),),
                        hedging=NO_HEDGES)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A,
                          limits=TenantLimits(requests_per_minute=5)), pools=(pool,)))

    def raw_headers(key: str) -> list[tuple[str, str]]:
        reply = httpx.post(gateway.url("/v1/chat/completions"), timeout=10.0,
                           json={"model": "alpha", "messages": MESSAGES},
                           headers={"authorization": f"Bearer {key}"})
        assert reply.status_code == 200
        return [(k, v) for k, v in reply.headers.multi_items() if k.startswith("x-ratelimit")]

    assert sorted(raw_headers(TEAM_A)) == [
        ("x-ratelimit-limit-requests", "5"), ("x-ratelimit-remaining-requests", "4"),
        ("x-ratelimit-reset-requests", "12s")]
    assert sorted(raw_headers(LEGACY)) == sorted(upstream_quota.items())


def test_output_tokens_are_charged_from_the_usage_once_the_stream_has_ended(
    loop_thread: LoopThread
) -> None:
    """Ten output tokens a minute: a stream of thirty is let in (the bucket is not in debt),
    its usage is charged when it ends, and the next request is refused for output tokens."""
    profile = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0,
                         tokens=30, inter_token=0.0, usage=True)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A,
                          limits=TenantLimits(output_tokens_per_minute=10)),
        pools=(sim_pool("alpha", profile),)))
    with openai_client(gateway.root, TEAM_A) as client:
        with client.chat.completions.with_streaming_response.create(
                model="alpha", messages=MESSAGES, stream=True) as response:
            assert response.headers["x-ratelimit-remaining-output-tokens"] == "10"
            chunks = list(response.parse())
        assert chunks
        with pytest.raises(openai.RateLimitError) as over:
            client.chat.completions.create(model="alpha", messages=MESSAGES)
    assert "output tokens" in over.value.message
    assert over.value.response.headers["x-ratelimit-remaining-output-tokens"] == "0"


def key_limits_as_sent(picked: Callable[[Any], bool], seen: list[tuple[int, float]]
                       ) -> Callable[[Any], Any]:
    """A layer in front of the app (`GatewayFactory`'s `wrap`) that notes TEAM_A's requests
    in flight and its output bucket's level as the server is handed each body message that
    `picked` takes: what a client reading that message, and asking again at once, would
    meet."""

    def recorder(app: Any) -> Any:
        async def front(scope: Any, receive: Any, send: Any) -> None:
            async def recording(message: Any) -> None:
                if message["type"] == "http.response.body" and picked(message):
                    limits = app.state.tenant_gate.tenants.find(TEAM_A).limits
                    seen.append((limits.in_flight, limits.output.level))
                await send(message)

            await app(scope, receive, recording)

        return front

    return recorder


#: each inference route of a key, streamed and not: the request's body (with `stream`)
CHARGED_ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "alpha", "messages": MESSAGES},
    "/v1/messages": {"model": "alpha", "max_tokens": 64, "messages": MESSAGES},
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", sorted(CHARGED_ROUTES))
def test_a_keys_charge_is_made_before_the_answers_last_byte_goes_out(
    loop_thread: LoopThread, route: str, stream: bool
) -> None:
    """A client may send its next request as soon as it reads the end of an answer (the SDKs
    do, on the same connection or another): so the key's slot and the answer's tokens are
    settled before that end goes out, and the next request meets them. Read by a layer in
    front of the app as the server is handed the answer's last body message: the key holds
    no request in flight and its output bucket has the thirty tokens taken."""
    profile = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0,
                         tokens=30, inter_token=0.0, usage=True)
    settings = keyed(TenantKeySettings("team-a", key=TEAM_A,
                                       limits=TenantLimits(output_tokens_per_minute=100)),
                     pools=(sim_pool("alpha", profile),))
    at_last_byte: list[tuple[int, float]] = []
    gateway = GatewayFactory(loop_thread)(settings, wrap=key_limits_as_sent(
        lambda message: not message.get("more_body", False), at_last_byte))
    body = {**CHARGED_ROUTES[route], "stream": stream}
    with httpx.Client(base_url=gateway.root, timeout=10.0) as client:
        answer = client.post(route, json=body, headers={"authorization": f"Bearer {TEAM_A}"})
    assert answer.status_code == 200, answer.text
    ((in_flight, output_left),) = at_last_byte
    assert in_flight == 0
    assert output_left <= 100 - 30 + 1  # charged (the bucket refills a little meanwhile)


def test_a_stream_cut_short_charges_before_the_error_event_that_ends_it(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """An upstream body that ends without `[DONE]`: the client's answer ends with our
    `stream_truncated` event (the SDKs raise there, and the application may send its next
    request at once), so the key's slot and the thirty relayed tokens are settled before
    that event goes out (read by a layer in front of the app as the server is handed it)."""
    steps: list[Step] = [Head(), Send(role_chunk()),
                         *[Send(token_chunk(f"t{i} ")) for i in range(30)]]
    (upstream,) = scripted_upstream(1, responder=lambda _request: Script(
        headers=SSE_HEADERS, steps=steps))
    pool = PoolSettings("alpha", (BackendSettings("u", "openai", "m", upstream.base_url),),
                        hedging=NO_HEDGES)
    settings = keyed(TenantKeySettings("team-a", key=TEAM_A, limits=TenantLimits(
        output_tokens_per_minute=100, in_flight=1)), pools=(pool,))
    at_error: list[tuple[int, float]] = []
    gateway = GatewayFactory(loop_thread)(settings, wrap=key_limits_as_sent(
        lambda message: b"stream_truncated" in message.get("body", b""), at_error))
    with httpx.Client(base_url=gateway.root, timeout=10.0) as client:
        answer = client.post("/v1/chat/completions",
                             headers={"authorization": f"Bearer {TEAM_A}"},
                             json={"model": "alpha", "messages": MESSAGES, "stream": True})
    assert b"stream_truncated" in answer.content, answer.text
    ((in_flight, output_left),) = at_error
    assert in_flight == 0
    assert output_left <= 100 - 30 + 1  # charged (the bucket refills a little meanwhile)


def held_after_done(gate: Gate) -> list[Step]:
    """A stream of thirty tokens with their usage and `[DONE]`, whose body then stays open
    until `gate` opens (the relay reads on after `[DONE]`, briefly, for the body's end)."""
    steps: list[Step] = [Head(), Send(role_chunk())]
    steps += [Send(token_chunk(f"tok{i} ")) for i in range(30)]
    return [*steps, Send(finish_chunk()), Send(usage_chunk(5, 30)), Send(DONE), Wait(gate)]


@pytest.mark.parametrize("drain", [None, 2.0], ids=["drain-as-set", "drain-2s"])
def test_a_request_sent_as_the_client_reads_done_meets_the_charge(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    monkeypatch: pytest.MonkeyPatch, drain: float | None,
) -> None:
    """`[DONE]` is the end of the answer for a client (the OpenAI SDK closes the response
    there): one that sends its next request as it reads it meets the key's charge, even
    while the relay still waits on the upstream's last bytes (here for as long as the relay
    reads after `[DONE]`, its bound widened to 2 s in the second case)."""
    if drain is not None:
        monkeypatch.setattr(relay_module, "DRAIN_TIMEOUT", drain)
    gate = Gate()
    (upstream,) = scripted_upstream(1, responder=lambda request: Script(
        headers=SSE_HEADERS, steps=held_after_done(gate)) if request.body.get("stream")
        else json_script(chat_completion_obj()))
    gateway = GatewayFactory(loop_thread)(output_limited(upstream.base_url))
    body = {"model": "alpha", "messages": MESSAGES, "stream": True}
    auth = {"authorization": f"Bearer {TEAM_A}"}
    try:
        with httpx.Client(base_url=gateway.root, timeout=10.0) as first, \
                httpx.Client(base_url=gateway.root, timeout=10.0) as second, \
                first.stream("POST", "/v1/chat/completions", json=body, headers=auth) as held:
            lines = held.iter_lines()
            data_lines(lines, "[DONE]")
            following = second.post("/v1/chat/completions", headers=auth,
                                    json={"model": "alpha", "messages": MESSAGES})
            gate.open()
            for _ in lines:
                pass
    finally:
        gate.open()
    assert following.status_code == 429, following.text
    assert "output tokens" in following.text


def test_the_openai_sdks_next_request_meets_the_charge_of_its_stream(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """The official SDK ends a stream at `[DONE]` and sends its next request at once, while
    the upstream's body is still open: the next request is refused for the thirty output
    tokens the stream reported."""
    gate = Gate()
    (upstream,) = scripted_upstream(1, responder=lambda request: Script(
        headers=SSE_HEADERS, steps=held_after_done(gate)) if request.body.get("stream")
        else json_script(chat_completion_obj()))
    gateway = GatewayFactory(loop_thread)(output_limited(upstream.base_url))
    try:
        with openai_client(gateway.root, TEAM_A) as client:
            chunks = list(client.chat.completions.create(
                model="alpha", messages=MESSAGES, stream=True,
                stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            assert usage is not None and usage.completion_tokens == 30
            with pytest.raises(openai.RateLimitError) as over:
                client.chat.completions.create(model="alpha", messages=MESSAGES)
    finally:
        gate.open()
    assert "output tokens" in over.value.message


def output_limited(upstream_url: str) -> Settings:
    """A key of ten output tokens a minute on one scripted upstream, with nothing hedged."""
    pool = PoolSettings("alpha", (BackendSettings("u", "openai", "m", upstream_url),),
                        hedging=NO_HEDGES)
    return keyed(TenantKeySettings("team-a", key=TEAM_A,
                                   limits=TenantLimits(output_tokens_per_minute=10)),
                 pools=(pool,))


def test_a_stream_without_usage_is_charged_the_output_it_relayed(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """A backend that reports no usage in a stream (as llama-cpp-python): the thirty tokens
    the client was sent are charged all the same, so the next request is refused for output
    tokens, and the key's usage counts them."""
    (upstream,) = scripted_upstream(1, responder=lambda _request: stream_script(
        [f"tok{i} " for i in range(30)]))
    gateway = GatewayFactory(loop_thread)(output_limited(upstream.base_url))
    with openai_client(gateway.root, TEAM_A) as client:
        chunks = list(client.chat.completions.create(model="alpha", messages=MESSAGES,
                                                     stream=True))
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 30
        with pytest.raises(openai.RateLimitError) as over:
            client.chat.completions.create(model="alpha", messages=MESSAGES)
    assert "output tokens" in over.value.message
    counted = gateway.app.state.tenant_gate
    usage = {**counted.usage, **counted.sending}["team-a"]
    assert usage[2] >= 30  # requests, input, output, spend: the thirty relayed tokens
    assert usage[1] > 0  # the admission's estimate of the input


def test_a_client_that_leaves_a_stream_before_its_usage_is_charged_what_it_read(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """The upstream would report its usage at the end; the client reads twelve tokens and
    leaves before it. The tokens relayed are charged: the next request is refused for
    output tokens (leaving early does not skip the key's output limit)."""
    gate = Gate()
    steps: list[Step] = [Head(), Send(role_chunk())]
    steps += [Send(token_chunk(f"tok{i} ")) for i in range(12)]
    steps += [Wait(gate), Send(finish_chunk()), Send(usage_chunk(5, 500)), Send(DONE)]
    (upstream,) = scripted_upstream(1, responder=lambda _request: Script(
        headers=SSE_HEADERS, steps=steps))
    gateway = GatewayFactory(loop_thread)(output_limited(upstream.base_url))
    body = {"model": "alpha", "messages": MESSAGES, "stream": True}
    auth = {"authorization": f"Bearer {TEAM_A}"}
    try:
        with httpx.Client(base_url=gateway.root, timeout=10.0) as raw:
            with raw.stream("POST", "/v1/chat/completions", json=body, headers=auth) as held:
                lines = held.iter_lines()  # kept: a dropped iterator closes the connection
                assert "tok11" in data_lines(lines, "tok11")[-1]  # then it leaves
            (first,) = upstream.requests[:1]
            assert upstream.wait_closed(first)  # the client left: the request ends
            assert wait_for(lambda: gateway.app.state.tenant_gate.tenants.find(TEAM_A)
                            .limits.in_flight == 0)
            refused = raw.post("/v1/chat/completions", headers=auth,
                               json={"model": "alpha", "messages": MESSAGES})
        assert refused.status_code == 429, refused.text
        assert "output tokens" in refused.json()["error"]["message"]
    finally:
        gate.open()


def test_a_request_the_gateway_refuses_before_any_upstream_takes_nothing_of_the_key(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Two requests a minute, a pool of an Anthropic backend the chat route reaches by
    translation: a chat request that cannot be translated (400) and an embeddings request no
    backend serves (404) are refused before any upstream sees them, so the key keeps both
    requests of its minute, its headers say so, and no usage is counted for it."""
    (upstream,) = scripted_upstream(1, responder=lambda _request: json_script({}))
    pool = PoolSettings("claude", (BackendSettings("c", "anthropic", "claude-x",
                                                   upstream.base_url, api_key="x"),),
                        hedging=NO_HEDGES, translate=True)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, limits=TenantLimits(requests_per_minute=2)),
        pools=(pool,)))
    remaining = []
    with openai_client(gateway.root, TEAM_A) as client:
        for _ in range(3):
            with pytest.raises(openai.BadRequestError) as untranslatable:
                client.chat.completions.create(model="claude", messages=MESSAGES,
                                               logprobs=True)
            remaining.append(
                untranslatable.value.response.headers["x-ratelimit-remaining-requests"])
        with pytest.raises(openai.APIStatusError) as unserved:
            client.embeddings.create(model="claude", input="hi")
        assert unserved.value.status_code in (400, 404)
        remaining.append(unserved.value.response.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "2", "2", "2"]
    assert upstream.requests == []  # refused by the gateway itself
    counted = gateway.app.state.tenant_gate
    assert "team-a" not in {**counted.usage, **counted.sending}


def stored_pools(upstream_url: str) -> tuple[PoolSettings, ...]:
    """Two pools on one upstream that holds a stored response (`stored_upstream`)."""
    return tuple(PoolSettings(name, (BackendSettings("u", "openai", "m", upstream_url),),
                              hedging=NO_HEDGES) for name in ("alpha", "beta"))


def test_stored_response_operations_are_requests_of_the_key_within_its_limits(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """Three requests a minute: creating a response, reading it and listing its input items
    take them (each answer states the key's quota, and each is counted in its usage); the
    cancel after them is refused with 429 and reaches no backend."""
    (upstream,) = scripted_upstream(1, responder=stored_upstream)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, limits=TenantLimits(requests_per_minute=3)),
        pools=stored_pools(upstream.base_url)))
    remaining = []
    with openai_client(gateway.root, TEAM_A) as client:
        made = client.responses.with_raw_response.create(model="alpha", input="hi")
        remaining.append(made.headers["x-ratelimit-remaining-requests"])
        made_id = made.parse().id
        read = client.responses.with_raw_response.retrieve(made_id)
        remaining.append(read.headers["x-ratelimit-remaining-requests"])
        listed = client.responses.input_items.with_raw_response.list(made_id)
        remaining.append(listed.headers["x-ratelimit-remaining-requests"])
        with pytest.raises(openai.RateLimitError) as over:
            client.responses.cancel(made_id)
    assert remaining == ["2", "1", "0"]
    assert "requests" in over.value.message
    assert [r.method for r in upstream.requests] == ["POST", "GET", "GET"]
    counted = gateway.app.state.tenant_gate
    assert wait_for(lambda: {**counted.usage, **counted.sending}.get("team-a", [0])[0] == 3)


def test_a_stored_response_in_a_pool_its_key_may_no_longer_use_is_not_found(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """A key makes a response in `beta`; a reload narrows it to `alpha`. Reading, cancelling
    or deleting that response is answered as for a response that does not exist, and no
    backend is asked."""
    (upstream,) = scripted_upstream(1, responder=stored_upstream)
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, pools=("alpha", "beta")),
        pools=stored_pools(upstream.base_url)))
    with openai_client(gateway.root, TEAM_A) as client:
        made = client.responses.create(model="beta", input="hi")
        gate = gateway.app.state.tenant_gate

        async def narrow() -> None:  # what a reload of `keys:` does
            gate.replace([TenantKeySettings("team-a", key=TEAM_A, pools=("alpha",))])

        loop_thread.run(narrow())
        for attempt in (lambda: client.responses.retrieve(made.id),
                        lambda: client.responses.cancel(made.id),
                        lambda: client.responses.input_items.list(made.id),
                        lambda: client.responses.delete(made.id)):
            with pytest.raises(openai.NotFoundError) as caught:
                attempt()
            assert caught.value.code == "response_not_found"
    assert [r.method for r in upstream.requests] == ["POST"]


@pytest.fixture
def config_file(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "gateway.yaml"


def keys_yaml(*names: str) -> str:
    lines = ["pools:", "  - name: alpha", "    hedging: {enabled: false}",
             "    backends: [{name: s, provider: sim, sim: {ttft_median: 0, tokens: 2}}]",
             "keys:" if names else "keys: []"]
    for name in names:
        digest = hashlib.sha256({"team-a": TEAM_A, "team-b": TEAM_B}[name].encode()).hexdigest()
        lines.append(f"  - {{name: {name}, key_sha256: {digest}, limits: {{in_flight: 4}}}}")
    return "\n".join(lines) + "\n"


def test_a_reload_that_removes_a_key_refuses_it_from_the_next_request(
    loop_thread: LoopThread, config_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    verbose_logs(caplog)
    config_file.write_text(keys_yaml("team-a", "team-b"))
    gateway = GatewayFactory(loop_thread)(load_settings(config_file))

    def status(key: str) -> int:
        return httpx.post(gateway.url("/v1/chat/completions"), timeout=10.0,
                          json={"model": "alpha", "messages": MESSAGES},
                          headers={"authorization": f"Bearer {key}"}).status_code

    assert (status(TEAM_A), status(TEAM_B)) == (200, 200)
    config_file.write_text(keys_yaml("team-b"))
    reloader = gateway.app.state.reloader
    assert loop_thread.run(reloader.reload(str(config_file)))
    assert (status(TEAM_A), status(TEAM_B)) == (401, 200)
    assert "keys changed (1 named key)" in caplog.text
    Canary(TEAM_A, TEAM_B).assert_absent_everywhere(gateway.root, caplog)


def test_a_key_with_hedging_off_is_never_hedged_and_another_key_is(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture
) -> None:
    """Two upstreams whose first token comes 300 ms in, a fixed hedge delay of 50 ms. A key
    with `hedging: {enabled: false}`: its plan refuses hedges (`disabled`), one attempt; the
    key without rules: the hedge goes out after the delay, two attempts."""
    verbose_logs(caplog)
    ups = scripted_upstream(2, responder=lambda _request: stream_script(["ok"], ttft=0.3))
    pool = PoolSettings("slow", tuple(
        BackendSettings(f"u{k}", "openai", "m", up.base_url, group=f"g{k}")
        for k, up in enumerate(ups)), hedging=HedgingSettings(
            delay=DelaySettings(mode="fixed", value=0.05)))
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, hedging=TenantHedging(enabled=False)),
        pools=(pool,)))
    attempts = {}
    for key in (TEAM_A, LEGACY):
        with openai_client(gateway.root, key) as client, \
                client.chat.completions.with_streaming_response.create(
                    model="slow", messages=MESSAGES, stream=True) as response:
            attempts[key] = response.headers["x-hedge-attempts"]
            list(response.parse())
    assert attempts == {TEAM_A: "1", LEGACY: "2"}
    lines = [line for line in (getattr(r, "hedge_request", None) for r in caplog.records
                               if r.name == "hedge_gateway.requests") if line]
    keyed_line = next(line for line in lines if line.get("key") == "team-a")
    assert keyed_line["suppressed"] == ["disabled"] and keyed_line["hedges"] == 0


def test_a_key_with_a_ttft_objective_hedges_before_the_pools_delay_and_meets_it(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture
) -> None:
    """Two upstreams on which a request's first attempt is slow (its token 0.8 s in) and any
    later one fast; the pool's fixed hedge delay is 3 s, longer than the slow attempt. Once
    both backends have learnt that (warm-up by a key without an objective), a key with a
    400 ms objective has its hedge sent before its primary's token (the primary is cancelled
    before it, so before the pool's delay), and its requests meet the objective; the key
    without one is never hedged. The objective goes upstream as `x-slo-ttft-ms`; the per-key
    counts are in /hedge/stats, /metrics and the request log."""
    verbose_logs(caplog)
    seen: set[str] = set()

    def first_slow(request: RecordedRequest) -> Script:
        rid = request.headers.get("x-client-request-id") or request.headers["x-request-id"]
        first = rid not in seen
        seen.add(rid)
        return stream_script(["ok"], ttft=0.8 if first else 0.0)

    ups = scripted_upstream(2, responder=first_slow)
    pool = PoolSettings("slow", tuple(
        BackendSettings(f"u{k}", "openai", "m", up.base_url, group=f"g{k}")
        for k, up in enumerate(ups)), hedging=HedgingSettings(
            delay=DelaySettings(mode="fixed", value=3.0, min_samples=1)))
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, ttft_objective=0.4),
        TenantKeySettings("team-b", key=TEAM_B), pools=(pool,)))

    def attempts_of(key: str) -> str:
        with openai_client(gateway.root, key) as client, \
                client.chat.completions.with_streaming_response.create(
                    model="slow", messages=MESSAGES, stream=True) as response:
            list(response.parse())
            return response.headers["x-hedge-attempts"]

    def learnt() -> bool:
        backends = httpx.get(gateway.root + "/hedge/stats").json()["pools"]["slow"]["backends"]
        return all(b["hedge_delay_by_class_ms"] for b in backends.values())

    # team-b warms both backends up (slow first attempts, never hedged); the balancer tries a
    # backend with no TTFT yet first, so two requests teach both (`min_samples: 1`). Six, so
    # each backend holds slow samples enough that team-a's fast hedges (each a sample of the
    # backend that won) cannot pull its tail under the objective when the delays refresh
    # (once a second) between team-a's requests: with one slow sample each they could
    for _ in range(6):
        assert attempts_of(TEAM_B) == "1"
    assert wait_for(learnt, timeout=3.0)
    before = [len(up.requests) for up in ups]
    assert [attempts_of(TEAM_A) for _ in range(3)] == ["2"] * 3
    assert [attempts_of(TEAM_B) for _ in range(2)] == ["1"] * 2
    sent = [r for up, n in zip(ups, before, strict=True) for r in up.requests[n:]]
    keyed_requests = [r for r in sent if "x-slo-ttft-ms" in r.headers]
    assert len(keyed_requests) == 6 and len(sent) == 8  # team-a: two attempts each
    assert {r.headers["x-slo-ttft-ms"] for r in keyed_requests} == {"400"}
    primaries = [r for r in keyed_requests if r.events_written <= 1]
    assert len(primaries) == 3  # each closed before its token: the hedge came first
    stats = httpx.get(gateway.root + "/hedge/stats").json()
    assert stats["keys"] == {"team-a": {"objectives_met": 3, "objectives_missed": 0,
                                        "deadline_hedges": 3, "deadline_refused": 0}}
    metrics = httpx.get(gateway.root + "/metrics").text
    assert 'hedge_gateway_key_deadline_hedges_total{key="team-a",result="sent"} 3.0' in metrics
    assert 'key="team-b"' not in metrics
    lines = [line for line in (getattr(r, "hedge_request", None) for r in caplog.records
                               if r.name == "hedge_gateway.requests") if line]
    team_a = [line for line in lines if line.get("key") == "team-a"]
    assert [(x["objective_ms"], x["objective_met"], x["deadline_hedges"]) for x in team_a] \
        == [(400.0, True, 1)] * 3
    Canary(TEAM_A, TEAM_B).assert_absent_everywhere(gateway.root, caplog)


def test_the_objective_in_force_goes_upstream_a_header_only_tightening_the_keys(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    """`x-slo-ttft-ms` reaches the upstream as the objective in force: the header's when it
    is tighter than the key's, the key's otherwise (a looser or malformed header changes
    nothing); a key without rules forwards the client's header; no objective, no header. The
    OpenAI SDK on /v1/chat/completions, the Anthropic SDK on /v1/messages."""
    up = scripted_upstream(1)[0]
    ant = scripted_upstream(1, responder=lambda _request: messages_script(["ok"]))[0]
    pools = (PoolSettings("one", (BackendSettings("u", "openai", "m", up.base_url),),
                          hedging=NO_HEDGES),
             PoolSettings("claude", (BackendSettings("a", "anthropic", "claude-x", ant.root_url,
                                                     api_key="sk-ant-0"),), hedging=NO_HEDGES))
    gateway = GatewayFactory(loop_thread)(keyed(
        TenantKeySettings("team-a", key=TEAM_A, ttft_objective=0.4), pools=pools))
    cases = [(TEAM_A, "250", "250"), (TEAM_A, "900", "400"), (TEAM_A, "soon", "400"),
             (TEAM_A, None, "400"), (LEGACY, "300", "300"), (LEGACY, None, None)]
    for key, header, _ in cases:
        with openai_client(gateway.root, key) as client:
            list(client.chat.completions.create(
                model="one", messages=MESSAGES, stream=True,
                extra_headers={} if header is None else {"x-slo-ttft-ms": header}))
    with anthropic_client(gateway.root, TEAM_A) as claude:  # /v1/messages too
        list(claude.messages.create(model="claude", max_tokens=8, stream=True, extra_headers={
            "x-slo-ttft-ms": "150"}, messages=[{"role": "user", "content": "hi"}]))
    assert up.wait_requests(len(cases)) and ant.wait_requests(1)
    assert [r.headers.get("x-slo-ttft-ms") for r in up.requests] == [
        sent for _, _, sent in cases]
    assert ant.requests[0].headers.get("x-slo-ttft-ms") == "150"
