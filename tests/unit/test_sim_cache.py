"""The simulator's prefix cache and prefill time, with plain data."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.settings import SimProfile
from providers.sim.cache import PrefixCache
from providers.sim.chat import sim_payloads, sim_response
from providers.sim.prompt import segments
from providers.sim.wire import SimModel


def words(n: int, tag: str) -> str:
    """`n` tokens of text (four bytes each) that its tag tells apart."""
    return f"{tag[:3]:<3} " + "tok " * (n - 1)


def body(*contents: str) -> dict[str, Any]:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]}


def store(cache: PrefixCache, request: dict[str, Any]) -> tuple[int, int]:
    return cache.lookup_and_store(segments(request, "chat"))


def test_the_longest_cached_prefix_counts() -> None:
    cache = PrefixCache(100)
    assert store(cache, body(words(10, "s"), words(100, "u"))) == (110, 0)
    turn2 = body(words(10, "s"), words(100, "u"), words(5, "a"), words(20, "v"))
    assert store(cache, turn2) == (135, 110)
    assert store(cache, turn2) == (135, 135)
    other = body(words(10, "s"), words(100, "x"))  # same system prompt, another question
    assert store(cache, other) == (110, 10)


def test_the_cache_is_bounded_and_forgets_the_least_recently_used() -> None:
    cache = PrefixCache(4)
    first = body("a", "b")
    store(cache, first)  # 2 entries
    store(cache, body("c", "d"))  # 4 entries
    store(cache, first)  # first's entries are the most recent now
    store(cache, body("e", "f"))  # evicts c, d
    assert len(cache) == 4
    assert store(cache, body("c", "d"))[1] == 0
    assert store(cache, body("e", "f"))[1] == 2


def test_an_empty_prompt_caches_nothing() -> None:
    cache = PrefixCache(10)
    assert store(cache, {"prompt": "hi"}) == (0, 0)  # chat reads no `prompt`
    assert cache.lookup_and_store([]) == (0, 0)
    assert len(cache) == 0


def test_every_api_caches_its_own_prompt_shape() -> None:
    """A conversation's next turn finds its prefix cached whichever API carries it: the
    Responses API's `instructions` and input items, Messages' `system` and blocks, the tool
    listing first in each."""
    tools = [{"name": "t", "input_schema": {"type": "object"}}]
    turn1 = {"system": words(10, "s"), "tools": tools,
             "messages": [{"role": "user", "content": [{"type": "text", "text": words(8, "u")}]}]}
    turn2 = {**turn1, "messages": [*turn1["messages"],
                                   {"role": "assistant", "content": words(3, "a")},
                                   {"role": "user", "content": words(4, "v")}]}
    cache = PrefixCache(10)
    first = cache.lookup_and_store(segments(turn1, "messages"))
    second = cache.lookup_and_store(segments(turn2, "messages"))
    assert second == (first[0] + 7, first[0])
    responses = {"instructions": words(10, "s"), "input": [
        {"role": "user", "content": [{"type": "input_text", "text": words(8, "u")}]}]}
    later = {**responses, "input": [*responses["input"],
                                    {"type": "function_call", "call_id": "c", "name": "t",
                                     "arguments": "{}"},
                                    {"type": "function_call_output", "call_id": "c",
                                     "output": words(5, "o")}]}
    assert cache.lookup_and_store(segments(responses, "responses")) == (18, 0)
    assert cache.lookup_and_store(segments(later, "responses")) == (18 + 1 + 5, 18)
    # each API renders its own prompt: the same segments under another API's scope miss
    assert cache.lookup_and_store(segments(later, "responses"), "chat") == (24, 0)


def model(prefill_ms: float) -> SimModel:
    profile = SimProfile(ttft_median=0.1, ttft_sigma=0.0, straggler_probability=0.0,
                         prefill_ms_per_1k=prefill_ms)
    return SimModel(profile, random.Random(1))


def test_prefill_grows_with_the_uncached_input_only() -> None:
    sim = model(60.0)
    turn1 = body(words(10, "s"), words(2000, "u"))
    turn2 = body(words(10, "s"), words(2000, "u"), words(40, "a"), words(950, "v"))
    cold = sim.plan(turn1)
    warm = sim.plan(turn2)
    assert cold.ttft == pytest.approx(0.1 + 0.060 * 2010 / 1000)
    assert warm.ttft == pytest.approx(0.1 + 0.060 * 990 / 1000)
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 2010)
    other_backend = model(60.0)  # a backend that never saw turn 1 prefills all of turn 2
    assert other_backend.plan(turn2).ttft == pytest.approx(0.1 + 0.060 * 3000 / 1000)


def test_without_prefill_there_is_no_cache_and_nothing_is_cached() -> None:
    sim = model(0.0)
    plan = sim.plan(body("s", "u"))
    assert sim.cache is None and plan.cached_tokens is None
    usage = sim_response(plan, "chat/completions", "m", "r")["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # as OpenAI always reports
    assert "prompt_tokens_details" not in sim_response(plan, "completions", "m", "r")["usage"]


async def test_cached_tokens_are_reported_in_usage() -> None:
    sim = model(10.0)
    sim.plan(body("s", "u"))
    plan = sim.plan(body("s", "u", "a", "v"))

    async def no_sleep(_: float) -> None:
        return None

    events = [e async for e in sim_payloads(plan, endpoint="chat/completions", model="m",
                                            request_id="r", sleep=no_sleep)]
    usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert usage["prompt_tokens"] == 4
    whole = sim_response(plan, "chat/completions", "m", "r")["usage"]
    assert whole["prompt_tokens_details"] == {"cached_tokens": 2}


def test_the_messages_and_responses_usage_report_the_cache_as_those_apis_do() -> None:
    from gateway.wire.usage import usage_of
    from providers.sim.messages import messages_body
    from providers.sim.responses import response_object

    sim = model(10.0)
    sim.plan(body("s", "u"))
    plan = sim.plan(body("s", "u", "a", "v"))
    # Anthropic: cache reads beside input_tokens, which counts the rest only
    usage = messages_body(plan, "m", "msg_1")["usage"]
    assert usage["cache_read_input_tokens"] == 2 and usage["cache_creation_input_tokens"] == 0
    assert usage["input_tokens"] == plan.prompt_tokens - 2
    read = usage_of({"usage": usage})
    assert read is not None and (read.input, read.cached) == (plan.prompt_tokens, 2)
    # Responses: cached tokens within input_tokens
    whole = response_object(plan, "m", "resp_1", created=0, done=True)["usage"]
    assert whole["input_tokens_details"] == {"cached_tokens": plan.cached_tokens}
    # a profile without prefill has no cache: it reports none cached, as the real APIs do
    plain = model(0.0).plan(body("s", "u"))
    assert messages_body(plain, "m", "msg_2")["usage"]["cache_read_input_tokens"] == 0
