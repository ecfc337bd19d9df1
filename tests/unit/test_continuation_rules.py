"""The continuation of a broken answer as the relay asks for it (`Continuations`), against
in-process simulators, in virtual time: where it goes, what it sends, and each refusal
counted (the budget, the bound, an answer that is not text)."""

from __future__ import annotations

import json
import random
from typing import Any

from gateway.hedge.continuation import Continuations
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.runner import UpstreamRequest
from gateway.settings import (
    BackendSettings,
    BudgetSettings,
    HedgingSettings,
    PoolSettings,
    SimProfile,
    StallSettings,
)
from gateway.wire.chat import CHAT
from gateway.wire.sse import SSEEvent
from providers.sim import SimProvider
from tests.harness.virtualtime import VirtualLoop, run_virtual

PROFILE = SimProfile(ttft_median=0.05, ttft_sigma=0.0, straggler_probability=0.0, tokens=30,
                     inter_token=0.0)
FIRST_TEN = "".join(f"tok{i} " for i in range(10))


def relayed() -> list[SSEEvent]:
    head = {"id": "chatcmpl-1", "created": 1, "model": "m"}
    events = [SSEEvent(json.dumps({**head, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
                                  ).encode())]
    for i in range(10):
        events.append(SSEEvent(json.dumps({**head, "choices": [
            {"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]}).encode()))
    return events


def continuations(loop: VirtualLoop, *, budget: BudgetSettings | None = None,
                  stall: StallSettings | None = None) -> Continuations:
    backends = tuple(BackendSettings(name=f"s{i}", provider="sim", model="m", sim=PROFILE)
                     for i in range(3))
    settings = PoolSettings("p", backends, hedging=HedgingSettings(
        budget=budget or BudgetSettings(), stall=stall or StallSettings()))
    providers = {b.name: SimProvider(b, rng=random.Random(i)) for i, b in enumerate(backends)}
    pool = PoolRuntime.build(settings, providers, global_hedging=True, now=loop.time(),
                             rng=random.Random(1))
    body: dict[str, Any] = {"model": "p", "stream": True,
                            "messages": [{"role": "user", "content": "hello there"}]}
    req = UpstreamRequest("chat/completions", body, True, "r", CHAT)
    options = RaceOptions(loop.time() + 30.0, pool.delays, hedging=False)
    return Continuations(pool, req, options, loop.time)


def test_a_break_is_continued_on_another_backend_with_the_text_so_far() -> None:
    async def main(loop: VirtualLoop) -> None:
        cont = continuations(loop)
        continued = await cont(relayed(), "s0")
        assert continued is not None and continued.backend != "s0"
        text = ""
        for event in continued.splice.events(continued.prefix.buffered):
            for choice in json.loads(event.data).get("choices", []):
                text += choice["delta"].get("content") or ""
        assert text == "tok10 "  # the continuation goes on where the client stopped
        await continued.prefix.aclose()
        await cont.aclose()
        assert dict(cont.counts.started) == dict(cont.counts.won) == {continued.backend: 1}
        assert dict(cont.counts.breaks_continued) == {"s0": 1}
        assert [r.kind for r in cont.counts.records] == ["continuation"]
        assert cont.counts.input_tokens == 10  # no estimate of the input here: the relayed
        assert cont.pool.budget.extra_in_flight == 0  # the grant was given back

    run_virtual(main)


def test_refusals_are_counted_and_end_the_answer() -> None:
    async def main(loop: VirtualLoop) -> None:
        broke = continuations(loop, budget=BudgetSettings(ratio=0.0, burst=1.0,
                                                          min_per_second=0.0))
        broke.pool.budget.try_spend(loop.time(), inflight_requests=1, hedge=False)
        assert await broke(relayed(), "s0") is None
        assert dict(broke.counts.refused) == {"budget": 1}
        assert dict(broke.counts.breaks_ended) == {"s0": 1} and not broke.counts.started

        bounded = continuations(loop, stall=StallSettings(max_continuations=1))
        first = await bounded(relayed(), "s0")
        assert first is not None
        assert await bounded(relayed(), first.backend) is None  # the bound: one
        assert dict(bounded.counts.refused) == {"max_continuations": 1}
        await first.prefix.aclose()
        await bounded.aclose()

        call = {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
        tool = [*relayed(), SSEEvent(json.dumps({"id": "chatcmpl-1", "choices": [
            {"index": 0, "delta": call, "finish_reason": None}]}).encode())]
        texts = continuations(loop)
        assert await texts(tool, "s0") is None
        assert dict(texts.counts.refused) == {"not_text": 1}

        stalled = continuations(loop, budget=BudgetSettings(ratio=0.0, burst=1.0,
                                                            min_per_second=0.0))
        stalled.pool.budget.try_spend(loop.time(), inflight_requests=1, hedge=False)
        assert await stalled(relayed(), "s0", True) is None
        # a stall that is not continued waits: counted as a stall, not as a broken answer
        assert dict(stalled.counts.stalls) == {"s0": 1} and not stalled.counts.breaks_ended

    run_virtual(main)
