"""The simulator's prefix cache and prefill time, with plain data."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.settings import SimProfile
from providers.sim.cache import PrefixCache
from providers.sim.wire import SimModel, sim_payloads, sim_response


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def body(*contents: str) -> dict[str, Any]:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]}


def test_the_longest_cached_prefix_counts() -> None:
    cache = PrefixCache(100)
    assert cache.lookup_and_store(body(words(10, "s"), words(100, "u"))) == (110, 0)
    turn2 = body(words(10, "s"), words(100, "u"), words(5, "a"), words(20, "v"))
    assert cache.lookup_and_store(turn2) == (135, 110)
    assert cache.lookup_and_store(turn2) == (135, 135)
    other = body(words(10, "s"), words(100, "x"))  # same system prompt, another question
    assert cache.lookup_and_store(other) == (110, 10)


def test_the_cache_is_bounded_and_forgets_the_least_recently_used() -> None:
    cache = PrefixCache(4)
    first = body("a", "b")
    cache.lookup_and_store(first)  # 2 entries
    cache.lookup_and_store(body("c", "d"))  # 4 entries
    cache.lookup_and_store(first)  # first's entries are the most recent now
    cache.lookup_and_store(body("e", "f"))  # evicts c, d
    assert len(cache) == 4
    assert cache.lookup_and_store(body("c", "d"))[1] == 0
    assert cache.lookup_and_store(body("e", "f"))[1] == 2


def test_requests_without_messages_cache_nothing() -> None:
    cache = PrefixCache(10)
    assert cache.lookup_and_store({"prompt": "hi"}) == (0, 0)
    assert len(cache) == 0


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


def test_without_prefill_there_is_no_cache_and_usage_is_unchanged() -> None:
    sim = model(0.0)
    plan = sim.plan(body("s", "u"))
    assert sim.cache is None and plan.cached_tokens is None
    assert "prompt_tokens_details" not in sim_response(plan, "chat/completions", "m", "r")["usage"]


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
    from providers.sim.protocols import messages_body, response_object

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
    whole = response_object(plan, "m", "resp_1", status="completed", created=0)["usage"]
    assert whole["input_tokens_details"] == {"cached_tokens": plan.cached_tokens}
    # a profile without prefill has no cache: the usage is as it always was
    plain = model(0.0).plan(body("s", "u"))
    assert set(messages_body(plain, "m", "msg_2")["usage"]) == {"input_tokens", "output_tokens"}
