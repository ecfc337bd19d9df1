"""The conversations workload's simulated policies, and `--upstream`'s pieces: plain data."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.bench.external import parse_sizes, served_models
from gateway.bench.policies import (
    INF,
    Conversation,
    Draws,
    Model,
    Objective,
    best_per_class,
    best_policies,
    format_policies,
    next_in_order,
    order_of,
    random_other,
    simulate,
    turns_of,
)

#: no noise, no stragglers: every number below follows from the prefill alone
EXACT = Model(ttft_sigma=0.0, straggler_probability=0.0)


def test_turns_grow_and_the_new_part_is_what_the_last_turn_did_not_send() -> None:
    turns = turns_of([Conversation(0, 4000, 3)], EXACT)
    assert [t.prompt for t in turns] == [5000, 9030, 13060]
    assert [t.new for t in turns] == [5000, 4030, 4030]


def test_the_home_holds_the_history_and_a_cold_copy_prefills_all_of_it() -> None:
    turns = turns_of([Conversation(0, 30_000, 2)], EXACT)
    draws = Draws(EXACT, seed=1)
    plain = simulate(turns, draws, lambda _: INF, next_in_order)
    # turn 0: 30,000 uncached (the system prompt is cached everywhere); turn 1: 30,030 new
    assert plain.ttfts == pytest.approx((0.15 + 60e-6 * 30_000, 0.15 + 60e-6 * 30_030))
    hedged = simulate(turns, draws, lambda _: 0.1, next_in_order)
    # a copy 100 ms in: on turn 0 as cold as the home, so it loses by those 100 ms; on turn 1
    # the next backend holds turn 0 (the last copy left it there): it prefills 30,030 too
    assert hedged.hedges == 2 and hedged.won == 0
    assert hedged.extra_tokens == sum(t.prompt for t in turns)
    other = simulate(turns, draws, lambda _: 0.1, random_other(1))
    assert other.hedges == 2


def test_draws_are_seeded_and_shared_by_every_policy() -> None:
    model = Model()
    a, b = Draws(model, 7), Draws(model, 7)
    assert [a.base(c, 0, 1) for c in range(20)] == [b.base(c, 0, 1) for c in range(20)]
    assert [a.base(c, 0, 1) for c in range(20)] != [Draws(model, 8).base(c, 0, 1)
                                                    for c in range(20)]
    assert order_of(3, 3)[0] == order_of(3, 3)[0] and sorted(order_of(3, 3)) == [0, 1, 2]


def test_a_policy_over_its_budget_is_never_chosen() -> None:
    turns = turns_of([Conversation(c, 200, 4) for c in range(20)], Model())
    draws = Draws(Model(), 1)
    plain = simulate(turns, draws, lambda _: INF, next_in_order)
    objective = Objective.of(plain, budget=0.05)
    everything = simulate(turns, draws, lambda _: 0.05, next_in_order)
    assert everything.hedges > 0.05 * len(turns)
    assert objective(everything) == (INF, INF)
    _, best = best_per_class(turns, draws, next_in_order, objective)
    assert best.hedges <= 0.05 * len(turns) and best.extra_share <= 0.05
    assert objective(best) <= objective(plain)


def test_classes_reach_what_one_delay_cannot() -> None:
    """Short and long turns: one delay late enough to spare the long ones never reaches the
    short ones' stragglers within the budget; a delay per class does."""
    conversations = [Conversation(c, 200 if c % 3 else 30_000, 4) for c in range(45)]
    rows = {r["policy"]: r for r in best_policies(conversations, seed=2)}
    assert set(rows) == {"no hedge", "one delay", "delay per class", "per class, key order"}
    plain, one, per = rows["no hedge"], rows["one delay"], rows["delay per class"]
    assert per["classes"]["200"]["ttft_p99_ms"] < 0.5 * plain["classes"]["200"]["ttft_p99_ms"]
    assert one["score"] >= per["score"]
    for row in rows.values():
        assert row["extra_input_share"] <= 0.12 + 1e-9
    text = format_policies(list(rows.values()),
                           {"ttft_p99_ms": 2000.0, "classes": {"200": {"ttft_p99_ms": 800.0}}},
                           {"ttft_p99_ms": 2000.0, "classes": {"200": {"ttft_p99_ms": 1600.0}}})
    assert "delay per class" in text
    assert "      200: measured 0.50 x, best simulated" in text


def test_sizes_parse() -> None:
    assert parse_sizes("200,4000") == ((200, 1.0), (4000, 1.0))
    assert parse_sizes("200:0.5, 30000:0.15") == ((200, 0.5), (30000, 0.15))
    for bad in ("", "0", "200:0", "x"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_each_server_s_model_is_its_first_listed_or_the_one_named() -> None:
    def listing(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            return httpx.Response(200, json={"data": [{"id": "llama"}, {"id": "other"}]})
        return httpx.Response(200, json={"data": []})

    async def main() -> tuple[list[str], list[str], str]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(listing)) as client:
            found = await served_models(client, ["http://a/v1"], None)
            named = await served_models(client, ["http://a/v1", "http://b/v1"], "m")
            try:
                await served_models(client, ["http://b/v1"], None)
            except ValueError as exc:
                return found, named, str(exc)
        raise AssertionError("no error for a server without models")

    found, named, error = asyncio.run(main())
    assert found == ["llama"] and named == ["m", "m"]
    assert "http://b/v1/models" in error and "--upstream-model" in error

