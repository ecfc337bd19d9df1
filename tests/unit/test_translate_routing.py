"""Which backends a request reaches in a pool of mixed APIs, and by which translation (pure:
the plan's `routing` over stub providers, the configuration's `apis` and `translate`)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.api.request import LogicalRequest
from gateway.errors import AllAttemptsFailed, RouteNotServed, Unreadable, Untranslatable
from gateway.hedge.attempt import AttemptRecord
from gateway.hedge.budget import SuppressReason
from gateway.hedge.placement import Placement, RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import Race
from gateway.hedge.routing import routing
from gateway.hedge.runner import UpstreamRequest, attempt_runner
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    load_settings,
)
from gateway.settings.fields import ConfigError
from gateway.settings.model import PROVIDER_APIS
from gateway.wire.base import RelayOutcome, StreamEnd
from gateway.wire.chat import CHAT
from gateway.wire.messages import MESSAGES
from gateway.wire.paths import API_ENDPOINTS, Endpoint, endpoints_of
from gateway.wire.responses import RESPONSES
from gateway.wire.sse import SSEEvent
from gateway.wire.translate.chat_messages import DROPPED_CHAT, DROPPED_MESSAGES
from gateway.wire.translate.responses_chat import DROPPED_RESPONSES
from gateway.wire.translate.routes import TRANSLATIONS
from providers.anthropic import AnthropicProvider
from providers.base import UpstreamCall
from providers.bedrock import BedrockProvider
from providers.openai import OpenAIProvider
from providers.sim import SimProvider
from providers.vertex import VertexProvider
from tests.harness.virtualtime import VirtualLoop, run_virtual
from tests.unit.test_race_affinity import token


class Serving:
    """A provider stub that serves `routes` (all that routing reads of one)."""

    def __init__(self, *routes: str) -> None:
        self.serves = frozenset(routes)


PROVIDERS: dict[str, Any] = {"chat": Serving("chat/completions", "completions", "embeddings",
                                             "responses", "responses/item"),
                             "msgs": Serving("messages", "messages/count_tokens")}


def pool_of(*, translate: bool = True, chat_apis: tuple[str, ...] | None = ("chat",),
            providers: dict[str, Any] | None = None) -> PoolRuntime:
    backends = (
        BackendSettings(name="chat", provider="openai", base_url="http://127.0.0.1:9/v1",
                        apis=chat_apis),
        BackendSettings(name="msgs", provider="anthropic", base_url="http://127.0.0.1:9"),
    )
    settings = PoolSettings(name="pool", backends=backends, translate=translate)
    return PoolRuntime.build(settings, providers or PROVIDERS, global_hedging=True, now=0.0,
                             rng=random.Random(1), translations=TRANSLATIONS)


def request(endpoint: Endpoint, **body: Any) -> LogicalRequest:
    base: dict[str, Any] = {"model": "pool"} if endpoint == "responses" else {
        "model": "pool", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    protocol = {"messages": MESSAGES, "responses": RESPONSES}.get(endpoint, CHAT)
    return LogicalRequest("r", endpoint, {**base, **body}, False, {}, protocol)


def test_each_api_reaches_the_other_by_translation_and_its_own_as_it_is() -> None:
    pool = pool_of()
    chat = routing(pool, request("chat/completions"))
    assert chat.excluded == frozenset()
    assert set(chat.translated) == {"msgs"}
    translation, body = chat.translated["msgs"]
    assert translation.name == "chat->messages" and translation.backend == "messages"
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    messages = routing(pool, request("messages"))
    assert messages.excluded == frozenset() and set(messages.translated) == {"chat"}
    assert messages.translated["chat"][0].name == "messages->chat"


def test_apis_narrow_a_backend_and_translate_false_keeps_today_s_rule() -> None:
    # the Chat backend narrowed to chat: the Responses API reaches both by translation,
    # and only without stored state
    both = routing(pool_of(), request("responses", input="hi", store=False))
    assert both.excluded == frozenset()
    assert {b: t.name for b, (t, _) in both.translated.items()} == {
        "chat": "responses->chat", "msgs": "responses->messages"}
    with pytest.raises(Untranslatable) as caught:
        routing(pool_of(), request("responses", input="hi"))
    assert caught.value.param == "store"
    # a Chat backend that speaks the Responses API too: nothing is translated before the
    # race, and the race passes over the Messages backend, whose translation refuses it
    wide = routing(pool_of(chat_apis=None), request("responses", input="hi"))
    assert wide.excluded == frozenset() and not wide.translated.admits("msgs")
    assert wide.translated.admits("chat")
    with pytest.raises(RouteNotServed):
        routing(pool_of(), request("embeddings", input="hi"))
    kept = routing(pool_of(translate=False), request("chat/completions"))
    assert kept.excluded == {"msgs"} and not kept.translated


def test_a_field_one_api_cannot_carry_keeps_the_request_on_its_own_api() -> None:
    """`n: 2` cannot go to Messages: the Chat backend alone serves it; with no Chat backend,
    the refusal is the answer, naming the field."""
    mixed = routing(pool_of(), request("chat/completions", n=2))
    assert mixed.excluded == frozenset() and not mixed.translated.admits("msgs")
    only_messages = pool_of(providers={"chat": Serving("embeddings"), "msgs": PROVIDERS["msgs"]})
    with pytest.raises(Untranslatable) as caught:
        routing(only_messages, request("chat/completions", n=2))
    assert caught.value.param == "n"


def test_an_unknown_field_keeps_the_request_on_its_own_api() -> None:
    """`min_p` (a Chat server's extension) has no place in Messages: the Chat backend alone
    serves the request; with no Chat backend, the refusal names the field."""
    mixed = routing(pool_of(), request("chat/completions", min_p=0.1))
    assert mixed.excluded == frozenset() and not mixed.translated.admits("msgs")
    only_messages = pool_of(providers={"chat": Serving("embeddings"), "msgs": PROVIDERS["msgs"]})
    with pytest.raises(Untranslatable) as caught:
        routing(only_messages, request("chat/completions", min_p=0.1))
    assert caught.value.param == "min_p"


class Refusing(Serving):
    """A provider stub that keeps each call it is sent and refuses it (the test reads only
    what was sent)."""

    def __init__(self, *routes: str) -> None:
        super().__init__(*routes)
        self.calls: list[UpstreamCall] = []

    async def send(self, call: UpstreamCall) -> Any:
        self.calls.append(call)
        raise AllAttemptsFailed(["stub"])

    open = send


class Trace:
    """An attempt trace whose context header is `traceparent: t<attempt index>`."""

    def attempt_started(self, record: AttemptRecord) -> dict[str, str]:
        return {"traceparent": f"t{record.index}"}

    def attempt_ended(self, record: AttemptRecord) -> None:
        return None


@pytest.mark.parametrize("endpoint", ["chat/completions", "messages"])
def test_a_translated_attempt_is_sent_the_forwarded_headers_and_the_trace_s(
        endpoint: Endpoint) -> None:
    """Forwarded headers (the deadline's `x-slo-ttft-ms`) go to each attempt, translated or
    not, with the attempt's trace header added to them; `anthropic-beta` only to a backend
    that speaks Messages."""
    providers = {"chat": Refusing(*PROVIDERS["chat"].serves),
                 "msgs": Refusing(*PROVIDERS["msgs"].serves)}
    pool = pool_of(providers=providers)
    req = request(endpoint, stream=True)
    routed = routing(pool, req)
    forward = {"x-slo-ttft-ms": "800", "anthropic-beta": "b"}
    run = attempt_runner(pool, UpstreamRequest(
        endpoint=endpoint, body=req.body, stream=True, request_id="r", protocol=req.protocol,
        forward_headers=forward, translated=routed.translated), 1e9, lambda: 0.0, Trace())

    async def both() -> None:
        for i, backend in enumerate(("chat", "msgs")):
            with pytest.raises(AllAttemptsFailed):
                await run(backend, AttemptRecord(index=i, backend=backend, kind="primary",
                                                 started=0.0, spent_budget=False))

    asyncio.run(both())
    (to_chat,), (to_msgs,) = providers["chat"].calls, providers["msgs"].calls
    assert (to_chat.endpoint, to_msgs.endpoint) == ("chat/completions", "messages")
    assert dict(to_msgs.extra_headers) == {**forward, "traceparent": "t1"}
    expected_chat = {"x-slo-ttft-ms": "800", "traceparent": "t0"}
    if endpoint == "chat/completions":  # native: forwarded as the route gave them
        expected_chat["anthropic-beta"] = "b"
    assert dict(to_chat.extra_headers) == expected_chat


def test_provider_apis_are_what_each_adapter_serves() -> None:
    adapters: dict[str, Any] = {"openai": OpenAIProvider, "anthropic": AnthropicProvider,
                "bedrock": BedrockProvider, "vertex": VertexProvider, "sim": SimProvider}
    for provider, adapter in adapters.items():
        serves: frozenset[str] = adapter.serves
        spoken = {api for api, routes in API_ENDPOINTS.items() if routes & serves}
        assert spoken == set(PROVIDER_APIS[provider]), provider
        assert endpoints_of(PROVIDER_APIS[provider], serves) == serves, provider


def test_every_translation_joins_routes_of_two_apis() -> None:
    for (client, backend), translation in TRANSLATIONS.items():
        assert (translation.client, translation.backend) == (client, backend)
        apis = [next(a for a, r in API_ENDPOINTS.items() if e in r) for e in (client, backend)]
        assert translation.name == "->".join(apis) and apis[0] != apis[1]
    assert set(TRANSLATIONS) == {("chat/completions", "messages"), ("messages", "chat/completions"),
                                 ("responses", "chat/completions"), ("responses", "messages")}


def test_apis_in_the_configuration(tmp_path: Any) -> None:
    def load(apis: str) -> list[str]:
        path = tmp_path / "c.yaml"
        path.write_text(
            "pools:\n  - name: p\n    backends:\n"
            f"      - {{name: a, provider: anthropic, base_url: 'http://x', apis: {apis}}}\n")
        try:
            load_settings(str(path))
        except ConfigError as exc:
            return list(exc.errors)
        return []

    assert load("[messages]") == []
    assert load("[chat]") == [
        "pools[0].backends[0].apis: provider anthropic does not speak chat (it speaks "
        "messages)"]
    assert any("apis" in e for e in load("[]"))
    assert any("apis" in e for e in load("[messages, messages]"))
    assert any("apis" in e for e in load("[graphql]"))
    pool = dataclasses.replace(pool_of().settings, translate=False)
    assert pool.translate is False


@pytest.mark.parametrize("body", [b'{"content": "not blocks", "choices": "x"}',
                                  b'{"choices": [{"message": "a string"}]}', b"[1]"])
def test_a_whole_answer_of_a_shape_its_api_never_has_is_a_502(body: bytes) -> None:
    for translation in TRANSLATIONS.values():
        try:
            translation.answer(body, 0)
        except AllAttemptsFailed as exc:
            assert exc.status == 502


def test_a_stream_event_of_a_shape_its_api_never_has_ends_the_stream_as_upstream_error() -> None:
    translation = TRANSLATIONS[("chat/completions", "messages")]
    encoder = translation.encoder(0, True, CHAT.error_event)
    outcome = RelayOutcome()
    out = encoder.events([SSEEvent(b'{"type":"message_start","message":"not an object"}')],
                         "req-1", outcome)
    assert outcome.end is StreamEnd.UPSTREAM_ERROR
    assert b"upstream_error" in out and b"req-1" in out


def test_the_docs_list_every_dropped_field() -> None:
    """docs/translation.md's lists of what is dropped name every field the code drops."""
    doc = (Path(__file__).parents[2] / "docs" / "translation.md").read_text()
    sections = {"Chat Completions → Messages": DROPPED_CHAT,
                "Messages → Chat Completions": DROPPED_MESSAGES,
                "Responses API → Chat Completions": DROPPED_RESPONSES}
    for title, dropped in sections.items():
        section = doc.split(f"## Requests: {title}")[1].split("\n## ")[0]
        listed = section.split("**Dropped**")[1]
        missing = [name for name in dropped if f"`{name}`" not in listed]
        assert not missing, (title, missing)


def test_a_mixed_pool_s_routing_translates_only_for_a_backend_picked() -> None:
    """With a backend of the request's own API in the pool, routing translates nothing;
    asking whether the other API's backend admits the request translates it, once, and
    the attempt there is sent that body."""
    made: list[str] = []
    key: tuple[Endpoint, Endpoint] = ("chat/completions", "messages")
    original = TRANSLATIONS[key]

    def request_of(body: Any) -> dict[str, Any]:
        made.append("chat->messages")
        return original.request(body)

    table = {**TRANSLATIONS, key: dataclasses.replace(original, request=request_of)}
    backends = (
        BackendSettings(name="chat", provider="openai", base_url="http://127.0.0.1:9/v1",
                        apis=("chat",)),
        BackendSettings(name="msgs", provider="anthropic", base_url="http://127.0.0.1:9"))
    pool = PoolRuntime.build(PoolSettings(name="pool", backends=backends), PROVIDERS,
                             global_hedging=True, now=0.0, rng=random.Random(1),
                             translations=table)
    routed = routing(pool, request("chat/completions"))
    assert made == [] and routed.excluded == frozenset() and "msgs" in routed.translated
    assert routed.translated.admits("chat") and made == []
    assert routed.translated.admits("msgs") and made == ["chat->messages"]
    translation, body = routed.translated["msgs"]
    assert translation.name == "chat->messages" and made == ["chat->messages"]
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_the_race_passes_over_a_backend_that_does_not_admit_the_request() -> None:
    """Whichever backend the pick prefers, one that does not admit the request (its
    translation refuses it) is asked once and passed over; the other is chosen, for the
    primary and for an extra attempt alike (of the two cases, one has the preferred backend
    refuse)."""
    passed_over = 0
    for speaks in ("chat", "msgs"):
        pool = pool_of()
        asked: list[str] = []

        def admits(backend: str, speaks: str = speaks, asked: list[str] = asked) -> bool:
            asked.append(backend)
            return backend == speaks

        placement = Placement(pool, RaceOptions(60.0, pool.delays, True, admits=admits))
        assert placement.primary(0.0) == speaks
        assert asked[-1] == speaks and asked.count(speaks) == 1 and len(asked) <= 2
        if len(asked) == 2:
            passed_over += 1
            assert asked[0] in placement.options.excluded and not placement.judged
        assert placement.extra(0.0, [], [], hedge=False) == speaks
    assert passed_over == 1


def test_a_backend_whose_translation_refuses_leaves_the_pool_to_panic_on_the_others() -> None:
    """The only backend that can carry the request (n=2: no place in Messages) is paused,
    the other API's backend healthy: the refusing backend is no member of this request's
    pool, so its health does not keep the pool out of panic, and the paused backend serves
    (as when routing excluded it up front), not NoBackendAvailable."""
    pool = pool_of()
    pool.balancer.pause("chat", 30.0, 0.0)
    routes = routing(pool, request("chat/completions", n=2))
    assert "msgs" in routes.translated and "msgs" not in routes.excluded  # made lazily
    placement = Placement(pool, RaceOptions(60.0, pool.delays, True, excluded=routes.excluded,
                                            admits=routes.translated.admits))
    assert placement.primary(1.0) == "chat"
    assert placement.panic and placement.options.excluded == {"msgs"}
    assert not placement.judged and placement.max_attempts() == 1


def test_hedges_a_refusing_translation_leaves_no_backend_for_are_suppressed_once() -> None:
    """A slow primary on the one backend that carries the request: the hedge due finds the
    other backend's translation refusing; that lowers the request's attempt bound, so the
    hedge is suppressed once as `max_attempts` (no timer re-armed every delay to count
    `no_backend`), as when routing excluded the backend up front."""
    backends = (
        BackendSettings(name="chat", provider="openai", base_url="http://127.0.0.1:9/v1",
                        apis=("chat",)),
        BackendSettings(name="msgs", provider="anthropic", base_url="http://127.0.0.1:9"))
    settings = PoolSettings(name="pool", backends=backends, hedging=HedgingSettings(
        delay=DelaySettings(initial=0.05, min=0.05)))

    async def main(loop: VirtualLoop) -> tuple[list[str], list[SuppressReason]]:
        pool = PoolRuntime.build(settings, PROVIDERS, global_hedging=True, now=loop.time(),
                                 rng=random.Random(1), translations=TRANSLATIONS)
        routes = routing(pool, request("chat/completions", n=2))

        async def runner(backend: str, record: AttemptRecord) -> Prefix:
            await asyncio.sleep(1.0)  # virtual: twenty hedge delays pass first
            return token()

        options = RaceOptions(loop.time() + 5.0, pool.delays, True, excluded=routes.excluded,
                              admits=routes.translated.admits)
        race = Race(pool, runner, options, loop.time)
        try:
            await race.run()
        finally:
            await race.aclose()
        return [a.backend for a in race.attempts], list(race.suppressed)

    attempts, suppressed = run_virtual(main)
    assert attempts == ["chat"]
    assert suppressed == [SuppressReason.MAX_ATTEMPTS]


def test_a_translation_that_cannot_read_the_body_refuses_it_and_raises_nothing() -> None:
    """A translation that fails on a shape nothing named (here: any TypeError) is a refusal
    (`Unreadable`, a 400) like any other: the pick passes its backend over for the native
    one, and nothing is raised into the race that asked."""
    key: tuple[Endpoint, Endpoint] = ("chat/completions", "messages")
    original = TRANSLATIONS[key]

    def unreadable(body: Any) -> dict[str, Any]:
        return dict(body["messages"][0]["content"])  # "hi": not a mapping (a TypeError)

    table = {**TRANSLATIONS, key: dataclasses.replace(original, request=unreadable)}
    backends = (
        BackendSettings(name="chat", provider="openai", base_url="http://127.0.0.1:9/v1",
                        apis=("chat",)),
        BackendSettings(name="msgs", provider="anthropic", base_url="http://127.0.0.1:9"))
    pool = PoolRuntime.build(PoolSettings(name="pool", backends=backends), PROVIDERS,
                             global_hedging=True, now=0.0, rng=random.Random(1),
                             translations=table)
    pool.balancer.pause("chat", 30.0, 0.0)  # the pick goes to the translated backend first
    routed = routing(pool, request("chat/completions"))
    placement = Placement(pool, RaceOptions(60.0, pool.delays, True, excluded=routed.excluded,
                                            admits=routed.translated.admits))
    assert placement.primary(1.0) == "chat"
    assert not routed.translated.admits("msgs")
    with pytest.raises(Unreadable) as caught:
        routed.translated["msgs"]
    assert caught.value.status == 400 and caught.value.param == "body"
    only = PoolRuntime.build(PoolSettings(name="pool", backends=backends[1:]), PROVIDERS,
                             global_hedging=True, now=0.0, rng=random.Random(1),
                             translations=table)
    with pytest.raises(Unreadable):  # no native backend: refused before admission, a 400
        routing(only, request("chat/completions"))
