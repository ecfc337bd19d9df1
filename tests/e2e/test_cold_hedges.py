"""The cold rule over real sockets: two scripted loopback upstreams that prefill what their
prefix cache lacks, the gateway under uvicorn, the official OpenAI SDK as the client.

Each upstream keeps a prefix cache of its own (the simulator's, `PrefixCache`) and answers
after `BASE + RATE x uncached words`; a request marked STRAGGLE straggles on b0 only. After
a round of teaching (hedging off per request, so every sample is whole), two requests of one
size class at their home b0 straggle alike: a short first turn, and the next turn of a long
conversation b0 holds. The short one is hedged to b1 and the hedge wins; the long one's copy
would have to prefill the whole conversation on b1, longer than b0's tail leaves it, so it is
never sent and is counted `cold`. What is asserted is what reached which upstream, and in
which order; not how fast.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from gateway.app import create_app
from gateway.hedge.affinity import rendezvous_order
from gateway.settings import DelaySettings
from providers.sim.cache import PrefixCache
from providers.sim.prompt import segments
from tests.harness import (
    DONE,
    AsgiServerFactory,
    Head,
    RecordedRequest,
    Script,
    Send,
    Sleep,
    UpstreamFactory,
    finish_chunk,
    role_chunk,
    token_chunk,
)
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import sdk as kit_sdk

sdk = functools.partial(kit_sdk, timeout=30.0)
SSE = {"content-type": "text/event-stream"}
#: every upstream: 50 ms, plus 0.25 ms per uncached word (a word of 4 bytes: one token as the
#: gateway estimates it from the body's size)
BASE, RATE = 0.05, 0.00025
#: a straggling b0 answers this much later: past its usual time, within its learnt tail
STRAGGLE, TEACH_STRAGGLE = 0.45, 0.85
MARK, TEACH_MARK = "STRAGGLE", "SLOWTEACH"
WEIGHTS = [("b0", 1.0), ("b1", 1.0)]


def words(n: int, tag: str) -> str:
    return tag + " " + "tok " * max(0, n - 1)


def prefilling(name: str) -> Callable[[RecordedRequest], Script]:
    cache = PrefixCache(4096)

    def respond(request: RecordedRequest) -> Script:
        body = request.body if isinstance(request.body, dict) else {}
        prompt, cached = cache.lookup_and_store(segments(body, "chat"))
        last = (body.get("messages") or [{}])[-1].get("content", "")
        ttft = BASE + RATE * (prompt - cached)
        if name == "b0" and last.startswith(MARK):
            ttft += STRAGGLE
        if name == "b0" and last.startswith(TEACH_MARK):
            ttft += TEACH_STRAGGLE
        return Script(headers=SSE, steps=[Head(), Send(role_chunk()), Sleep(ttft),
                                          Send(token_chunk(f"{name} answers")),
                                          Send(finish_chunk()), Send(DONE)])

    return respond


def key_homed_at(home: str, tag: str) -> str:
    """A `prompt_cache_key` whose order starts at `home`."""
    for n in range(1000):
        key = f"{tag}-{n}"
        if rendezvous_order("pck:" + key, WEIGHTS)[0] == home:
            return key
    raise AssertionError("no key found")


def turn(client: openai.OpenAI, key: str, messages: list[Any],
         teach: bool = False) -> tuple[str, dict[str, str]]:
    # teaching: a whole sample, no hedge cuts the straggler's time short
    with client.chat.completions.with_streaming_response.create(
        model=POOL, messages=messages, stream=True, extra_body={"prompt_cache_key": key},
        extra_headers={"x-hedge": "off"} if teach else None,
    ) as response:
        headers = dict(response.headers)
        text = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)
    return text, headers


def learnt(root: str) -> bool:
    backends = httpx.get(root + "/hedge/stats", timeout=5.0).json()["pools"][POOL]["backends"]
    return all(b["prefill_ms_per_1k"] is not None and "256" in b["hedge_delay_by_class_ms"]
               for b in backends.values())


def test_a_long_prompt_s_cold_hedge_is_not_sent_and_a_short_one_s_is(
    asgi_server: AsgiServerFactory, scripted_upstream: UpstreamFactory
) -> None:
    upstreams = {name: scripted_upstream.one(responder=prefilling(name), name=name)
                 for name in ("b0", "b1")}
    config = gateway_settings([upstreams["b0"].base_url, upstreams["b1"].base_url], delay=None)
    pool = config.pools[0]
    delay = DelaySettings(quantile=0.8, min=0.02, min_samples=5, initial=2.0)
    pool = dataclasses.replace(pool, hedging=dataclasses.replace(pool.hedging, delay=delay))
    server = asgi_server(create_app(dataclasses.replace(config, pools=(pool,)), seed=3,
                                    delay_refresh=0.1))
    history: list[Any] = [{"role": "user", "content": words(4000, "history")},
               {"role": "assistant", "content": "b0 answers"}]
    long_key = key_homed_at("b0", "long")
    with sdk(server.v1) as client:
        # teaching, hedging off: per backend ten short first turns (two straggling on b0: a
        # q99 of ten samples is their ninth) and five long ones, so both backends learn the
        # short class, its tail and a prefill rate
        for home in ("b0", "b1"):
            for n in range(10):
                mark = TEACH_MARK if n in (3, 7) else "short"
                turn(client, key_homed_at(home, f"s{n}"),
                     [{"role": "user", "content": words(100, f"{mark}-{home}-{n}")}],
                     teach=True)
            for n in range(5):  # (each text its own: a prefix cache holds whole messages)
                turn(client, key_homed_at(home, f"l{n}"),
                     [{"role": "user", "content": words(1200, f"long-{home}-{n}")}], teach=True)
        # the long conversation's first turn: b0 now holds its 4,000-word history
        turn(client, long_key, history[:1], teach=True)
        deadline = time.monotonic() + 10.0
        while not learnt(server.base_url):
            assert time.monotonic() < deadline, "the classes did not learn"
            time.sleep(0.05)
        sent = {name: len(u.requests) for name, u in upstreams.items()}
        # a short first turn at b0 that straggles: its copy prefills 100 words on b1
        _, short = turn(client, key_homed_at("b0", "fresh"),
                        [{"role": "user", "content": words(100, MARK)}])
        # the long conversation's next turn, as short at b0 (only 100 words are new there),
        # straggling alike: its copy would prefill all 4,100 words on b1
        text, long = turn(client, long_key,
                          [*history, {"role": "user", "content": words(100, MARK)}])
    # the short request was hedged: b0 first, then its copy on b1, which won
    assert short["x-hedge-attempts"] == "2" and short["x-hedge-backend"] == "b1"
    b0_new = upstreams["b0"].requests[sent["b0"]:]
    b1_new = upstreams["b1"].requests[sent["b1"]:]
    assert len(b1_new) == 1 and b1_new[0].received_at >= b0_new[0].received_at
    # the long one was not: nothing of it reached b1, and b0 answered, late as it was
    assert long["x-hedge-attempts"] == "1" and long["x-hedge-backend"] == "b0"
    assert text == "b0 answers"
    assert len(b0_new) == 2
    assert b0_new[1].body["messages"][-1]["content"].startswith(MARK)
    deadline = time.monotonic() + 5.0
    while True:  # a request is counted once it has fully ended
        stats = httpx.get(server.base_url + "/hedge/stats", timeout=5.0).json()
        hedges = stats["pools"][POOL]["lifetime"]["hedges"]
        if hedges["suppressed"]["cold"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert hedges["suppressed"]["cold"] >= 1
    assert hedges["started"] == 1 and hedges["won"] == 1
