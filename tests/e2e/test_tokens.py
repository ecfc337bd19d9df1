"""Token accounting over real sockets: two loopback simulators that send usage only
when asked (as OpenAI does), the gateway hedging their stragglers, the OpenAI SDK as client.

The gateway's counters (/hedge/stats, /metrics, the request log) must equal the usage the
simulators reported in full (their own `/sim/stats`), the hedge cost must be the prompt's
tokens once per extra attempt the simulators received, and a client that did not ask for
usage must not see the usage chunk the gateway asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    BudgetSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    Settings,
    SimProfile,
)
from gateway.stats.requestlog import LOGGER_NAME
from providers.sim.server import create_sim_app
from tests.harness import AsgiServerFactory, RunningServer

POOL = "chat"
PROMPT = "count the tokens of this prompt please"
#: the simulators count about four bytes of text a token, rounded up
PROMPT_TOKENS = -(-len(PROMPT.encode()) // 4)  # 38 bytes: 10
TOKENS = 7
#: usage only on request; a third of the requests straggle, so hedges start and win
PROFILE = SimProfile(
    ttft_median=0.03, ttft_sigma=0.3, straggler_probability=0.3, straggler_extra=0.5,
    tokens=TOKENS, inter_token=0.001, usage=False,
)
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": PROMPT}
]


def settings_for(sims: list[RunningServer]) -> Settings:
    backends = tuple(
        BackendSettings(name, "openai", "sim-model", base_url=sim.v1, group=name)
        for name, sim in zip(("a", "b"), sims, strict=True)
    )
    hedging = HedgingSettings(
        max_attempts=2, delay=DelaySettings(mode="fixed", value=0.12),
        budget=BudgetSettings(ratio=1.0, burst=100),
    )
    return Settings((PoolSettings(POOL, backends, hedging=hedging),))


def wait_for_requests(gateway: RunningServer, count: int) -> dict[str, Any]:
    deadline = time.monotonic() + 10.0
    while True:
        stats: dict[str, Any] = httpx.get(gateway.url("/hedge/stats"), timeout=5.0).json()
        if stats["pools"][POOL]["lifetime"]["requests"] >= count or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def metric_values(gateway: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(gateway.url("/metrics"), timeout=5.0).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.timeout(90)
def test_token_counters_equal_what_the_simulators_reported(
    asgi_server: AsgiServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    sims = [asgi_server.build(functools.partial(create_sim_app, PROFILE, seed=seed))
            for seed in (21, 22)]
    gateway = asgi_server.build(lambda: create_app(settings_for(sims), seed=4))
    plain, asked, whole = 12, 6, 4
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME), openai.OpenAI(
        base_url=gateway.v1, api_key="sk-none", max_retries=0, timeout=openai.Timeout(20.0)
    ) as client:
        for _ in range(plain):  # the client did not ask: it must not see a usage chunk
            chunks = list(client.chat.completions.create(
                model=POOL, messages=MESSAGES, stream=True))
            assert all(c.usage is None and c.choices for c in chunks)
            assert "".join(c.choices[0].delta.content or "" for c in chunks).count("tok") == TOKENS
        for _ in range(asked):  # the client asked: the usage chunk reaches it, as sent
            chunks = list(client.chat.completions.create(
                model=POOL, messages=MESSAGES, stream=True,
                stream_options={"include_usage": True}))
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.prompt_tokens == PROMPT_TOKENS
            assert chunks[-1].usage.completion_tokens == TOKENS
        for _ in range(whole):
            answer = client.chat.completions.create(model=POOL, messages=MESSAGES)
            assert answer.usage is not None and answer.usage.completion_tokens == TOKENS
        requests = plain + asked + whole
        stats = wait_for_requests(gateway, requests)
    sim_stats = [httpx.get(sim.url("/sim/stats"), timeout=5.0).json() for sim in sims]
    emitted_in = sum(s["usage_input_tokens"] for s in sim_stats)
    emitted_out = sum(s["usage_output_tokens"] for s in sim_stats)
    reached = sum(s["requests"] for s in sim_stats)
    assert emitted_out == requests * TOKENS  # every winner reported its usage in full
    assert reached > requests, "no hedge reached a backend: the scenario tests nothing"

    pool = stats["pools"][POOL]
    # these simulators keep no prefix cache: they report none cached (as the real APIs do),
    # a hit rate of 0, and every copy's input missed (a short prompt has no conversation key:
    # no home to be warm at)
    assert pool["lifetime"]["tokens"] == {
        "input": emitted_in,
        "output": emitted_out,
        "cached": 0,
        "cache_write": 0,
        "cache_hit_rate": 0.0,
        "hedge_input": PROMPT_TOKENS * (reached - requests),
        "hedge_input_miss": PROMPT_TOKENS * (reached - requests),
        "hedge_input_miss_share": 1.0,
    }
    for name, sim in zip(("a", "b"), sim_stats, strict=True):
        assert pool["backends"][name]["lifetime"]["tokens"] == {
            "input": sim["usage_input_tokens"], "output": sim["usage_output_tokens"]}

    metrics = metric_values(gateway)
    for name, sim in zip(("a", "b"), sim_stats, strict=True):
        for kind, key in (("input", "usage_input_tokens"), ("output", "usage_output_tokens")):
            labels = (("backend", name), ("pool", POOL), ("type", kind))
            assert metrics[("hedge_gateway_tokens_total", labels)] == sim[key]
    assert metrics[("hedge_gateway_hedge_input_tokens_total", (("pool", POOL),))] == \
        PROMPT_TOKENS * (reached - requests)

    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    assert len(lines) == requests
    assert sum(line["usage"]["input"] for line in lines) == emitted_in
    assert sum(line["usage"]["output"] for line in lines) == emitted_out
    assert sum(line["hedge_input_tokens"] for line in lines) == PROMPT_TOKENS * (reached - requests)


@pytest.mark.timeout(90)
def test_the_cached_input_counted_is_what_the_upstreams_reported(
    asgi_server: AsgiServerFactory
) -> None:
    """Simulators that prefill and keep a prefix cache report cached tokens in their usage;
    the gateway's `tokens.cached` is their sum, over chat streams and Messages alike, and
    its hit rate is cached over input."""
    cache = dataclasses.replace(PROFILE, straggler_probability=0.0, usage=True,
                                prefill_ms_per_1k=1.0)
    sims = [asgi_server.build(functools.partial(create_sim_app, cache, seed=seed))
            for seed in (31, 32)]
    backends = tuple(BackendSettings(name, "openai", "sim-model", base_url=sim.v1, group=name)
                     for name, sim in zip(("a", "b"), sims, strict=True))
    config = Settings((PoolSettings(POOL, backends, hedging=HedgingSettings(enabled=False)),))
    gateway = asgi_server.build(lambda: create_app(config, seed=5))
    reported_in = reported_cached = 0
    system = "a long system prompt " * 400  # a derived conversation key: one backend
    with openai.OpenAI(base_url=gateway.v1, api_key="sk-none", max_retries=0,
                       timeout=openai.Timeout(20.0)) as client:
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "system", "content": system}, {"role": "user", "content": PROMPT}]
        for n in range(4):
            chunks = list(client.chat.completions.create(
                model=POOL, messages=messages, stream=True,
                stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            assert usage is not None and usage.prompt_tokens_details is not None
            reported_in += usage.prompt_tokens
            reported_cached += usage.prompt_tokens_details.cached_tokens or 0
            messages = [*messages, {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": f"and then {n}?"}]
        stats = wait_for_requests(gateway, 4)
    assert reported_cached > 0  # later turns found their history in the cache
    tokens = stats["pools"][POOL]["lifetime"]["tokens"]
    assert (tokens["input"], tokens["cached"]) == (reported_in, reported_cached)
    assert tokens["cache_hit_rate"] == round(reported_cached / reported_in, 4)
    metrics = metric_values(gateway)
    cached_total = sum(metrics.get(("hedge_gateway_tokens_total", (
        ("backend", name), ("pool", POOL), ("type", "cached"))), 0.0) for name in ("a", "b"))
    assert cached_total == reported_cached
