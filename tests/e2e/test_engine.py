"""The gateway in front of a real inference engine: two llama-cpp-python servers (SmolLM2-135M,
one thread each) in one pool, driven by the official SDKs, over real sockets.

What only a real engine shows: its own validation (it answers 400 to a request id that is not
a UUID), its own stream shapes (a role chunk without content, finish-only chunks, sometimes a
turn with no text at all), and what happens to a hedge the gateway cancels on a server that
is still generating. Answers are whatever the model says: the tests require a 200, a
finish_reason and a backend of the pool, and accept an empty text (a complete answer without
text is an answer). Each test ends with the leak check.

The engine is built once into a cache outside the repository (`tests.harness.engine`): 9 to 17
minutes of compiling the first time on two cores (at most 10 minutes a run; a cut build goes
on in the next), nothing after; where it cannot be built, these tests skip and say why.
llama-cpp-python's server has no Anthropic Messages API (`/v1/messages`), so the Anthropic SDK
is checked only for the gateway's answer to a pool that cannot serve it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import anthropic
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    Settings,
)
from tests.harness import AsgiServerFactory, LeakBaseline, RunningServer
from tests.harness.engine import (
    MODEL_ALIAS,
    EngineServer,
    EngineUnavailable,
    engine_servers,
    ensure_engine,
)
from tests.harness.limits_kit import stats_of, wait_for

pytestmark = pytest.mark.timeout(120)  # a loaded two-core machine; nothing here is timed

POOL = "smol"
PROMPT: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Say hello."}
]
#: short answers: the tests are about the wire, not the prose
MAX_TOKENS = 12
FINISH_REASONS = ("stop", "length")


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineServer]]:
    """Two engine servers for the whole module (each loads the model once), or a skip that
    says why the engine cannot be had here."""
    try:
        engine = ensure_engine()
    except EngineUnavailable as exc:
        pytest.skip(f"real engine unavailable: {exc}")
    with engine_servers(engine, 2) as servers:
        yield servers


def pool_settings(servers: list[EngineServer], *, translate: bool = True) -> Settings:
    """One pool of the two engines, hedging on with a short fixed delay, so that a hedge
    (and the cancelling of its loser on a real server) happens whenever the engine is slower
    than the delay; whether it does is the engine's business, and nothing asserts on it.
    `translate`: the pool's rule for Messages requests (translated to Chat, or a 404)."""
    backends = tuple(
        BackendSettings(name=server.name, provider="openai", model=MODEL_ALIAS,
                        base_url=server.base_url, group=f"zone-{server.name}")
        for server in servers
    )
    hedging = HedgingSettings(delay=DelaySettings(mode="fixed", value=0.05))
    return Settings(pools=(PoolSettings(name=POOL, backends=backends, timeout=60.0,
                                        hedging=hedging, translate=translate),))


@pytest.fixture
def gateway(engines: list[EngineServer], asgi_server: AsgiServerFactory) -> RunningServer:
    return asgi_server.build(lambda: create_app(pool_settings(engines), seed=5))


def backend_names(engines: list[EngineServer]) -> set[str]:
    return {server.name for server in engines}


def read_stream(chunks: Iterable[ChatCompletionChunk]) -> tuple[str, str]:
    """A streamed chat read to its end: (text, the last finish_reason; "" when none came)."""
    text, finish = "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_streamed_chat_through_the_sync_sdk(
    gateway: RunningServer, engines: list[EngineServer], leak_check: LeakBaseline
) -> None:
    seen: list[tuple[str, str, str]] = []
    with openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0,
                       timeout=60.0) as client:
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model=POOL, messages=PROMPT, stream=True, max_tokens=MAX_TOKENS,
                temperature=0, extra_headers={"x-request-id": f"engine-stream-{turn}"})
            text, finish = read_stream(raw.parse())
            assert raw.headers["x-request-id"] == f"engine-stream-{turn}"
            seen.append((raw.headers["x-hedge-backend"], finish, text))
            assert raw.http_response.status_code == 200
    for backend, finish, text in seen:
        assert backend in backend_names(engines)
        assert finish in FINISH_REASONS
        assert isinstance(text, str)  # may be empty: a complete answer without text
    leak_check.check_live()


async def _stream_async(v1: str, turns: int) -> list[tuple[int, str, str, str]]:
    """`turns` streamed chats, one after the other, through `AsyncOpenAI`: (status, backend,
    finish_reason, text) of each."""
    seen: list[tuple[int, str, str, str]] = []
    async with openai.AsyncOpenAI(base_url=v1, api_key="unused", max_retries=0,
                                  timeout=60.0) as client:
        for _ in range(turns):
            raw = await client.chat.completions.with_raw_response.create(
                model=POOL, messages=PROMPT, stream=True, max_tokens=MAX_TOKENS,
                temperature=0)
            text, finish = "", ""
            async for chunk in raw.parse():
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            seen.append((raw.http_response.status_code, raw.headers["x-hedge-backend"],
                         finish, text))
    return seen


def test_streamed_chat_through_the_async_sdk(
    gateway: RunningServer, engines: list[EngineServer], leak_check: LeakBaseline
) -> None:
    for status, backend, finish, _text in asyncio.run(_stream_async(gateway.v1, 3)):
        assert (status, finish in FINISH_REASONS) == (200, True)
        assert backend in backend_names(engines)
    leak_check.check_live()


def test_non_streaming_chat(
    gateway: RunningServer, engines: list[EngineServer], leak_check: LeakBaseline
) -> None:
    with openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0,
                       timeout=60.0) as client:
        # a request id the engine itself would refuse (it takes UUIDs only): the gateway
        # sends it a UUID and gives the client its own id back
        raw = client.chat.completions.with_raw_response.create(
            model=POOL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            extra_headers={"x-request-id": "engine-turn-1"})
        completion = raw.parse()
    assert raw.http_response.status_code == 200
    assert raw.headers["x-request-id"] == "engine-turn-1"
    assert raw.headers["x-hedge-backend"] in backend_names(engines)
    (choice,) = completion.choices
    assert choice.finish_reason in FINISH_REASONS
    assert isinstance(choice.message.content, str)
    assert completion.usage is not None and completion.usage.completion_tokens >= 1
    leak_check.check_live()


def test_a_complete_answer_without_text_is_relayed(
    gateway: RunningServer, engines: list[EngineServer], leak_check: LeakBaseline
) -> None:
    """The engine makes an empty turn on demand: a stop sequence that is the answer's first
    word ends the turn before any text (role chunk, finish_reason stop, [DONE]; as a whole
    body, content ""). That is an answer, relayed with a 200, not a failed attempt."""
    with openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0,
                       timeout=60.0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=POOL, messages=PROMPT, stream=True, max_tokens=MAX_TOKENS, temperature=0,
            stop=["Hello"])
        text, finish = read_stream(raw.parse())
        whole = client.chat.completions.with_raw_response.create(
            model=POOL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=["Hello"])
        completion = whole.parse()
    assert (raw.http_response.status_code, finish, text) == (200, "stop", "")
    assert raw.headers["x-hedge-backend"] in backend_names(engines)
    (choice,) = completion.choices
    assert (whole.http_response.status_code, choice.finish_reason) == (200, "stop")
    assert not choice.message.content
    leak_check.check_live()


def test_the_anthropic_sdk_gets_a_404_from_a_pool_without_messages(
    asgi_server: AsgiServerFactory, engines: list[EngineServer], leak_check: LeakBaseline
) -> None:
    """llama-cpp-python's server serves no `/v1/messages` (its own route list says so), so a
    pool of such engines that does not translate (`translate: false`) has no backend for the
    route: the Anthropic SDK gets a 404 in Anthropic's shape naming it, never a 500 and never
    a request to an engine."""
    gateway = asgi_server.build(
        lambda: create_app(pool_settings(engines, translate=False), seed=5))
    with httpx.Client(timeout=10.0, trust_env=False) as http:
        paths = http.get(f"{engines[0].root_url}/openapi.json").json()["paths"]
    assert "/v1/chat/completions" in paths and "/v1/messages" not in paths
    with anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0,
                             timeout=30.0) as client, pytest.raises(
            anthropic.NotFoundError) as caught:
        client.messages.create(model=POOL, max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 404
    assert "messages" in str(caught.value.body)
    leak_check.check_live()


def test_the_anthropic_sdk_is_answered_by_engines_that_speak_only_chat(
    gateway: RunningServer, leak_check: LeakBaseline
) -> None:
    """The same pool translating (its default): the Messages request goes to the engines as
    Chat Completions, and a real model's answer comes back in Anthropic's shape, streamed
    and whole."""
    with anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0,
                             timeout=60.0) as client:
        raw = client.messages.with_raw_response.create(
            model=POOL, max_tokens=8, messages=[{"role": "user", "content": "Say hi."}])
        with client.messages.stream(model=POOL, max_tokens=8, messages=[
                {"role": "user", "content": "Say hi."}]) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
            streamed_via = stream.response.headers["x-hedge-translated"]
    assert raw.headers["x-hedge-translated"] == streamed_via == "messages->chat"
    whole = raw.parse()
    assert whole.type == "message" and whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    # llama-cpp-python reports no usage in a stream: the translated stream says 0
    assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text"
    leak_check.check_live()


def test_a_short_conversation_stays_on_the_engine_that_holds_it(
    engines: list[EngineServer], asgi_server: AsgiServerFactory, leak_check: LeakBaseline
) -> None:
    """Conversations far under 1,024 tokens, no key from the client, the pool on its default
    affinity: the engines cache any prefix, so every turn is keyed from its conversation's
    opening and goes to the engine that prefilled the turns before it (hedging off, so the
    backend that answers is the one the turn was placed on)."""
    backends = tuple(BackendSettings(name=s.name, provider="openai", model=MODEL_ALIAS,
                                     base_url=s.base_url) for s in engines)
    settings = Settings(pools=(PoolSettings(name=POOL, backends=backends, timeout=60.0,
                                            hedging=HedgingSettings(enabled=False)),))
    gateway = asgi_server.build(lambda: create_app(settings, seed=5))
    system = "You are a terse assistant who answers in one short sentence. " * 8
    seen: list[list[str]] = []
    with openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0,
                       timeout=60.0) as client:
        for number in range(3):
            messages: list[openai.types.chat.ChatCompletionMessageParam] = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Name a colour ({number})."}]
            landed = []
            for turn in range(3):
                raw = client.chat.completions.with_raw_response.create(
                    model=POOL, messages=messages, stream=True, max_tokens=MAX_TOKENS,
                    temperature=0)
                text, _ = read_stream(raw.parse())
                assert raw.http_response.status_code == 200
                landed.append(raw.headers["x-hedge-backend"])
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": f"And another ({turn})?"}]
            seen.append(landed)
    assert all(len(set(landed)) == 1 for landed in seen), seen

    def affinity() -> dict[str, float]:
        counts: dict[str, float] = stats_of(gateway.base_url)["pools"][POOL]["lifetime"][
            "affinity"]
        return counts

    # every turn got a key and its key's first engine (a request is counted once it ended)
    wait_for(lambda: affinity()["hits"] + affinity()["misses"] >= 9)
    assert affinity() == {"hits": 9, "spills": 0, "misses": 0, "hit_rate": 1.0}
    leak_check.check_live()
