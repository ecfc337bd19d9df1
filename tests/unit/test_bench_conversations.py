"""The conversations workload's plan, config and report, with plain data (no processes)."""

from __future__ import annotations

import json

import yaml

from gateway.bench.conversations import (
    ConversationPlan,
    ModeResult,
    Turn,
    backend_names,
    default_warmup,
    first_messages,
    format_table,
    gateway_yaml,
    paired,
    rounds,
    size_classes,
    stats_delta,
    sticky_backend,
    summarize,
    turn_body,
    warmup_conversations,
    words,
)
from gateway.hedge.affinity import route_for
from gateway.settings import DelaySettings, parse_settings


def test_sizes_are_seeded_and_mixed() -> None:
    plan = ConversationPlan(conversations=200, seed=3)
    sizes = size_classes(plan)
    assert sizes == size_classes(plan)
    assert set(sizes) == {200, 4000, 30000}
    assert sizes != size_classes(ConversationPlan(conversations=200, seed=4))


def test_a_token_is_four_bytes_and_a_word() -> None:
    text = words(1000, "c1t0")
    assert len(text.split()) == 1000
    assert abs(len(text) / 4 - 1000) < 5


def test_the_sticky_client_keeps_a_conversation_on_one_backend_and_spreads_them() -> None:
    plan = ConversationPlan()
    assert sticky_backend(plan, 5, 200, 3) == sticky_backend(plan, 5, 200, 3)
    assert {sticky_backend(plan, n, 200, 3) for n in range(30)} == {0, 1, 2}


def test_the_sticky_client_keeps_a_conversation_where_the_gateway_puts_it_first() -> None:
    """Same backend, same draws: the sticky client's backend for a conversation is the first
    of the gateway's order for the key the gateway derives from the same body."""
    plan = ConversationPlan()
    names = backend_names(3)
    for number in range(12):
        body = {"model": "bench", "messages": first_messages(plan, number, 200, "sticky"),
                "stream": True}  # as the gateway receives it: the pool for a model
        route = route_for(body, {}, [(n, 1.0) for n in names], min_input_tokens=1024,
                          load_factor=1.25, body_bytes=len(json.dumps(body)))
        assert route is not None
        assert names[sticky_backend(plan, number, 200, 3)] == route.order[0]


def test_the_gateway_config_loads() -> None:
    for affinity in (True, False):
        tree = yaml.safe_load(gateway_yaml(8080, [9001, 9002, 9003], hedging=True,
                                           affinity=affinity))
        pool = parse_settings(tree, {}).pools[0]
        assert pool.backends[0].base_url == "http://127.0.0.1:9001/v1"
        assert pool.affinity.enabled is affinity
        # the default threshold of engines (not hosted APIs): they cache any prefix
        assert pool.affinity.min_input_tokens == 64
    tree = yaml.safe_load(gateway_yaml(8080, [9001], hedging=True, min_input_tokens=64))
    assert parse_settings(tree, {}).pools[0].affinity.min_input_tokens == 64


def test_summary_counts_hits_on_later_turns_and_the_extra_tokens() -> None:
    turns = [Turn(0, 0, 200, 0.1, 1000, 0), Turn(0, 1, 200, 0.05, 1300, 1000,
                                                 previous_prompt=1000),
             Turn(1, 0, 200, 0.1, 1000, 0),
             Turn(1, 1, 200, 0.2, 1300, 500, previous_prompt=1000),  # the system prompt only
             Turn(2, 0, 4000, None, 0, 0, error="status 502")]
    result = ModeResult("hedging-on", turns, {"tokens": {"hedge_input": 460},
                                              "hedges": {"started": 1, "won": 0},
                                              "affinity": {"hits": 4, "spills": 0,
                                                           "misses": 0}})
    row = summarize(result)
    assert row["errors"] == 1
    assert row["cache_hit_rate"] == 0.5
    assert row["input_tokens"] == 4600 and row["extra_input_share"] == 0.1
    assert row["classes"]["200"]["turns"] == 4
    assert row["classes"]["4000"]["turns"] == 0
    table = format_table([row])
    assert "hedging-on" in table and "4/0/0" in table


def test_the_warm_up_teaches_every_backend_its_delay_on_prefixes_of_its_own() -> None:
    """By default each backend is the home of enough warm-up conversations for its delay to
    reach `min_samples`; the homes are spread evenly; none opens like a measured one."""
    for upstreams, backends in (((), 3), (("http://a/v1", "http://b/v1"), 2)):
        plan = ConversationPlan(upstreams=upstreams, system_tokens=100)
        for mode in ("sticky", "hedging-on"):
            warm = warmup_conversations(plan, mode, backends)
            assert len(warm) == default_warmup(plan, backends)
            for k in range(backends):
                homes = [n for n, _, home in warm if home == k]
                assert len(homes) * plan.turns >= DelaySettings().min_samples + plan.turns
            for number, size, home in warm:
                assert sticky_backend(plan, number, size, backends, mode=mode,
                                      warmup=True) == home
                opening = first_messages(plan, number, size, mode, warmup=True)
                assert opening[0]["content"].split()[0].startswith("warmup")
                assert opening != first_messages(plan, number, size, mode)
    odd = ConversationPlan(warmup=5)
    assert sorted(home for *_, home in warmup_conversations(odd, "sticky", 2)) == [0, 0, 0, 1, 1]
    assert warmup_conversations(ConversationPlan(warmup=0), "sticky", 2) == []


def test_the_warm_up_is_taken_out_of_the_counters() -> None:
    before = {"requests": 24, "hedges": {"started": 20, "won": 5},
              "affinity": {"hits": 22, "spills": 2, "misses": 0, "hit_rate": 0.9167}}
    after = {"requests": 40, "hedges": {"started": 21, "won": 5},
             "affinity": {"hits": 38, "spills": 2, "misses": 0, "hit_rate": 0.95}}
    assert stats_delta(after, before) == {
        "requests": 16, "hedges": {"started": 1, "won": 0},
        "affinity": {"hits": 16, "spills": 0, "misses": 0, "hit_rate": 1.0}}
    assert stats_delta(after, {}) == after


def test_against_servers_every_mode_puts_a_conversation_on_the_sticky_clients_server() -> None:
    """Each mode opens with prompts of its own (the servers keep their caches), yet the
    gateway's key puts each conversation first on the backend the sticky client keeps it on:
    the modes differ by what the gateway does, not by where the hash drew the homes."""
    plan = ConversationPlan(conversations=24, upstreams=("http://a/v1", "http://b/v1"),
                            system_tokens=100, sizes=((20, 0.5), (100, 0.35), (300, 0.15)))
    names = backend_names(2)
    sticky = [sticky_backend(plan, n, size, 2) for n, size in enumerate(size_classes(plan))]
    for mode in ("hedging-off", "hedging-on", "no-affinity"):
        openings = set()
        for number, size in enumerate(size_classes(plan)):
            messages = first_messages(plan, number, size, mode)
            openings.add(messages[0]["content"])
            assert messages[0]["content"] != first_messages(plan, number, size,
                                                            "sticky")[0]["content"]
            body = {"model": "bench", "messages": messages, "stream": True,
                    "stream_options": {"include_usage": True}, "max_tokens": 30}
            route = route_for(body, {}, [(n, 1.0) for n in names], min_input_tokens=64,
                              load_factor=1.25, body_bytes=len(json.dumps(body)))
            assert route is not None and route.order[0] == names[sticky[number]]
        assert all(text.startswith(f"system-{mode}") for text in openings)


def _shared_words(a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    """The words two openings share from their start: the prefix a server that ran one holds
    cached for the other (a word is the bench's token)."""
    left = [w for m in a for w in m["content"].split()]
    right = [w for m in b for w in m["content"].split()]
    shared = 0
    for x, y in zip(left, right, strict=False):
        if x != y:
            break
        shared += 1
    return shared


def test_against_servers_every_mode_opens_its_conversations_on_the_same_cache() -> None:
    """At one conversation at a time, each conversation follows another on its server; what it
    finds cached there is the prefix it shares with that one. That prefix, and the length of
    what follows it, is the same in every mode, conversation by conversation: the modes' first
    turns prefill the same tokens, and differ by what the gateway does. (A gateway mode that
    numbered its system prompts per conversation prefilled the whole system prompt whenever
    the number changed, which the sticky client's first turns never did.)"""
    plan = ConversationPlan(conversations=24, upstreams=("http://a/v1", "http://b/v1"),
                            system_tokens=100, sizes=((20, 0.5), (100, 0.35), (300, 0.15)),
                            concurrency=1, warmup=6)
    sizes = size_classes(plan)
    seen: dict[str, list[tuple[int, int, int, int]]] = {}
    for mode in ("sticky", "hedging-off", "hedging-on", "no-affinity"):
        last: dict[int, list[dict[str, str]]] = {}
        for number, size, home in warmup_conversations(plan, mode, 2):
            last[home] = first_messages(plan, number, size, mode, warmup=True)
        assert set(last) == {0, 1}
        rows = []
        for number, size in enumerate(sizes):
            home = sticky_backend(plan, number, size, 2, mode="sticky")
            opening = first_messages(plan, number, size, mode)
            shared = _shared_words(last[home], opening)
            total = sum(len(m["content"].split()) for m in opening)
            rows.append((home, shared, total - shared, len(opening[1]["content"])))
            last[home] = opening
        seen[mode] = rows
    assert any(shared > 0 for _, shared, _, _ in seen["sticky"])
    for mode in ("hedging-off", "hedging-on", "no-affinity"):
        assert seen[mode] == seen["sticky"], mode


def test_rounds_cover_every_conversation_once_in_order() -> None:
    assert [list(r) for r in rounds(5, 2)] == [[0, 1], [2, 3], [4]]
    assert [list(r) for r in rounds(3, None)] == [[0, 1, 2]]
    assert rounds(0, 2) == []


def test_paired_compares_each_later_turn_with_the_sticky_clients_same_turn() -> None:
    def row(mode: str, ttfts: dict[tuple[int, int], float | None],
            errors: frozenset[tuple[int, int]] = frozenset()) -> dict[str, object]:
        return {"mode": mode, "turns_detail": [
            [c, t, 40, ms, 0, 0, "a", "status 500" if (c, t) in errors else None, 1]
            for (c, t), ms in ttfts.items()]}

    sticky = row("sticky", {(0, 0): 900.0, (0, 1): 100.0, (1, 1): 200.0, (2, 1): 300.0})
    # first turns are left out; a turn the sticky client lost, or one with an error, too
    gateway = row("hedging-on", {(0, 0): 5.0, (0, 1): 110.0, (1, 1): 190.0, (2, 1): 330.0,
                                 (3, 1): 1.0}, errors=frozenset({(2, 1)}))
    rows = paired([sticky, gateway])
    assert rows[0]["later_vs_sticky"] is None
    pair = rows[1]["later_vs_sticky"]
    assert pair["turns"] == 2
    # over the same two turns: the gateway's 110 and 190 against the sticky client's 100 and
    # 200 (the report's quantile: the lower of two)
    assert (pair["p50_ms"], pair["sticky_p50_ms"]) == (110.0, 100.0)
    assert pair["p50_ratio"] == 1.1
    assert pair["median_added_ms"] in (10.0, -10.0)
    assert pair["slower_turns"] == 1  # 110 against 100; 190 against 200 was faster
    assert "later turns" in format_table([{**r, "classes": {}, "turns": 0, "errors": 0,
                                           "ttft_p50_ms": None, "ttft_p99_ms": None,
                                           "cache_hit_rate": None, "affinity": None,
                                           "input_tokens": 0, "extra_input_tokens": 0,
                                           "extra_input_share": None, "hedges_started": 0,
                                           "hedges_won": 0, "cached_token_share": None,
                                           "seconds": 0.0} for r in rows])


def test_turns_against_real_servers_are_capped_and_greedy() -> None:
    body = turn_body(ConversationPlan(upstreams=("http://a/v1",)), "m", [])
    assert body["temperature"] == 0 and body["max_tokens"] > 0
    assert "temperature" not in turn_body(ConversationPlan(), "m", [])
