"""Conversation affinity: the key, the rendezvous order and the bounded-load choice, with plain
data (no clock, no I/O)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from gateway.hedge.affinity import (
    AffinityRoute,
    body_size,
    conversation_key,
    prefix_key,
    rendezvous_order,
    route_for,
)
from gateway.settings import AffinitySettings, BackendSettings, PoolSettings, SimProfile

KEYS = [f"conversation-{i}" for i in range(4000)]
EVEN = {"a": 1.0, "b": 1.0, "c": 1.0}


def firsts(weights: dict[str, float]) -> dict[str, str]:
    return {key: rendezvous_order(key, weights.items())[0] for key in KEYS}


# --------------------------------------------------------------------------- the order


def test_order_is_a_pure_function_of_key_and_names() -> None:
    order = rendezvous_order("k", EVEN.items())
    assert sorted(order) == ["a", "b", "c"]
    assert rendezvous_order("k", reversed(list(EVEN.items()))) == order


def test_removing_a_backend_moves_only_its_share() -> None:
    before = firsts({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0})
    after = firsts({"a": 1.0, "b": 1.0, "c": 1.0})
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == "d" for k in moved)
    assert sum(1 for k in KEYS if before[k] == "d") == len(moved)


def test_adding_a_backend_takes_only_its_share() -> None:
    before = firsts(EVEN)
    after = firsts({**EVEN, "d": 1.0})
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved)
    assert abs(len(moved) / len(KEYS) - 0.25) < 0.03  # a quarter: the newcomer's share


def test_the_second_choice_is_where_a_removed_first_choice_sends_its_keys() -> None:
    """The order's tail is what survives a removal: hedges to the second backend go where the
    conversation would move if its first backend went away."""
    for key in KEYS[:200]:
        order = rendezvous_order(key, EVEN.items())
        rest = {n: w for n, w in EVEN.items() if n != order[0]}
        assert rendezvous_order(key, rest.items()) == order[1:]


def test_weights_are_respected() -> None:
    counts = Counter(firsts({"a": 1.0, "b": 2.0, "c": 1.0}).values())
    assert abs(counts["b"] / len(KEYS) - 0.5) < 0.03
    assert abs(counts["a"] / len(KEYS) - 0.25) < 0.03
    zero = Counter(firsts({"a": 1.0, "b": 0.0}).values())
    assert zero == {"a": len(KEYS)}


def test_even_weights_spread_evenly() -> None:
    counts = Counter(firsts(EVEN).values())
    assert all(abs(n / len(KEYS) - 1 / 3) < 0.03 for n in counts.values())


# --------------------------------------------------------------------------- the choice


def route(key: str = "k", weights: dict[str, float] = EVEN, c: float = 1.25) -> AffinityRoute:
    return AffinityRoute.of(key, weights, c)


def test_idle_pool_takes_the_first_in_order() -> None:
    r = route()
    chosen = r.choose(set(EVEN), {}, members=EVEN)
    assert chosen == r.order[0]
    assert r.outcome(chosen, EVEN) == "hit"


def test_bounded_load_spills_to_the_next_in_order() -> None:
    r = route()
    first, second, _ = r.order
    # 3 in flight, all on the first: with this request 4, a third of it x 1.25 is 1.67 -> 2
    inflight = {first: 3}
    assert r.capacity(first, inflight, EVEN) == 2
    chosen = r.choose(set(EVEN), inflight, members=EVEN)
    assert chosen == second
    assert r.outcome(chosen, EVEN) == "spill"
    # at its bound minus one it still takes the request
    assert r.choose(set(EVEN), {first: 1, second: 1}, members=EVEN) == first


def test_bounded_load_keeps_every_backend_within_its_bound() -> None:
    """Many requests of one key arriving together: each backend stays at or under
    ceil(c x its share of the load), and the first in order takes the most."""
    r = route()
    inflight: dict[str, int] = {}
    for _ in range(30):
        chosen = r.choose(set(EVEN), inflight, members=EVEN)
        assert chosen is not None
        assert inflight.get(chosen, 0) < r.capacity(chosen, inflight, EVEN)
        inflight[chosen] = inflight.get(chosen, 0) + 1
    assert max(inflight.values()) <= -(-1.25 * 30 // 3)
    assert inflight[r.order[0]] == max(inflight.values())


def test_unusable_or_excluded_backends_are_skipped_in_order() -> None:
    r = route()
    first, second, third = r.order
    assert r.choose({second, third}, {}, members=EVEN) == second
    assert r.outcome(second, EVEN) == "spill"
    assert r.choose(set(EVEN), {}, members=EVEN, exclude={first}) == second  # a hedge
    assert r.choose(set(EVEN), {}, members=EVEN, exclude={first, second}) == third
    assert r.choose(set(EVEN), {}, members=EVEN, exclude=set(EVEN)) is None
    assert r.choose(set(), {}, members=EVEN) is None


def test_everyone_loaded_falls_back_to_the_first_usable() -> None:
    r = route(c=1.0)
    inflight = dict.fromkeys(EVEN, 5)
    assert r.choose(set(EVEN), inflight, members=EVEN, exclude={r.order[0]}) == r.order[1]


def test_other_groups_are_preferred_when_one_qualifies() -> None:
    r = route()
    first, second, third = r.order
    groups = {first: "z1", second: "z1", third: "z2"}
    assert r.choose(set(EVEN), {}, members=EVEN, exclude={first}, avoid_groups={"z1"},
                    groups=groups) == third
    same = dict.fromkeys(EVEN, "z1")
    assert r.choose(set(EVEN), {}, members=EVEN, exclude={first}, avoid_groups={"z1"},
                    groups=same) == second


def test_hit_is_judged_among_the_requests_own_backends() -> None:
    r = route()
    first, second, _ = r.order
    members = [n for n in EVEN if n != first]  # the first does not serve the route
    assert r.outcome(second, members) == "hit"


# --------------------------------------------------------------------------- the key


LONG = "x" * 5000  # ~1,250 tokens at 4 bytes a token


def chat(system: str, *turns: str, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages, **extra}


def key_of(body: dict[str, Any], headers: dict[str, str] | None = None,
           size: int | None = None, minimum: int = 1024) -> str | None:
    return conversation_key(body, headers or {}, min_input_tokens=minimum, body_bytes=size)


def test_explicit_keys_in_order_of_precedence() -> None:
    body = chat("s", "hi", prompt_cache_key="pck", metadata={"user_id": "u"})
    headers = {"x-claude-code-session-id": "cc", "x-session-id": "xs"}
    assert key_of(body, headers) == "pck:pck"
    del body["prompt_cache_key"]
    assert key_of(body, headers) == "user:u"
    del body["metadata"]
    assert key_of(body, headers) == "session:cc"
    assert key_of(body, {"x-session-id": "xs", "session_id": "codex"}) == "session:codex"
    assert key_of(body, {"x-session-id": "xs"}) == "session:xs"


def test_explicit_keys_count_however_short_the_request() -> None:
    assert key_of(chat("s", "hi", prompt_cache_key="p"), size=10) == "pck:p"
    assert key_of(chat("s", "hi"), {"session-id": "s1"}, size=10) == "session:s1"


def test_short_requests_get_no_derived_key() -> None:
    assert key_of(chat("s", "hi"), size=4095) is None
    assert key_of(chat("s", "hi"), size=4096) is not None
    assert key_of(chat("s", "hi"), size=40, minimum=0) is not None


def test_without_a_size_the_text_is_measured_only_up_to_the_threshold() -> None:
    assert key_of(chat("s", "hi")) is None
    assert key_of(chat(LONG, "hi")) is not None
    assert key_of(chat("s", "a", "b", LONG)) is not None  # history counts towards the size


def test_body_size_reads_the_content_length() -> None:
    assert body_size({"content-length": "123"}) == 123
    assert body_size({}) is None
    assert body_size({"content-length": "x"}) is None


def test_prefix_hash_is_stable_across_the_turns_of_one_conversation() -> None:
    turns = [chat(LONG, "first question")]
    for n in range(1, 6):
        history = ["first question"] + [f"turn {i}" for i in range(2 * n)]
        turns.append(chat(LONG, *history))
    assert len({prefix_key(t) for t in turns}) == 1


def test_prefix_hash_differs_between_conversations() -> None:
    keys = {prefix_key(chat(LONG, f"question {i}", "answer")) for i in range(200)}
    assert len(keys) == 200
    assert prefix_key(chat("other system", "q")) != prefix_key(chat(LONG, "q"))
    tools = [{"type": "function", "function": {"name": "t"}}]
    assert prefix_key(chat(LONG, "q", tools=tools)) != prefix_key(chat(LONG, "q"))


def test_prefix_hash_reads_bounded_bytes() -> None:
    """Two first messages that differ only past the bound hash alike: the key never reads a
    whole 30,000-token message (and such conversations share their cached prefix anyway)."""
    a = chat("s", "y" * 200_000 + "a")
    b = chat("s", "y" * 200_000 + "b")
    assert prefix_key(a) == prefix_key(b)


@pytest.mark.parametrize("shape", ["anthropic", "responses", "responses-string"])
def test_prefix_hash_of_other_apis(shape: str) -> None:
    def body(history: list[str]) -> dict[str, Any]:
        if shape == "anthropic":
            return {"system": LONG, "messages": [{"role": "user", "content": h} for h in history]}
        if shape == "responses":
            return {"instructions": LONG,
                    "input": [{"role": "user", "content": h} for h in history]}
        return {"instructions": LONG, "input": history[0]}

    first, later = body(["q1"]), body(["q1", "a1", "q2"])
    other = body(["another"])
    if shape != "responses-string":
        assert prefix_key(first) == prefix_key(later)
    assert prefix_key(first) != prefix_key(other)


def test_route_for_orders_the_pool_by_the_key() -> None:
    body = chat("s", "hi", prompt_cache_key="p")
    r = route_for(body, {}, [("a", 1.0), ("b", 1.0)], min_input_tokens=1024, load_factor=1.25)
    assert r is not None and r.key == "pck:p"
    assert r.order == tuple(rendezvous_order("pck:p", [("a", 1.0), ("b", 1.0)]))
    assert route_for(chat("s", "hi"), {"content-length": "50"}, [("a", 1.0)],
                     min_input_tokens=1024, load_factor=1.25) is None


def test_a_stream_still_closing_does_not_spill_the_next_turn() -> None:
    """At low load the proportional bound is 1; the floor keeps a conversation's next turn on
    its backend while the last turn's stream still holds its slot."""
    r = route()
    assert r.choose(set(EVEN), {r.order[0]: 1}, members=EVEN) == r.order[0]
    assert r.choose(set(EVEN), {r.order[0]: 2}, members=EVEN) == r.order[1]


# --------------------------------------------------------------------------- the threshold


def pool_of(*backends: BackendSettings, **affinity: Any) -> PoolSettings:
    return PoolSettings("m", backends, affinity=AffinitySettings(**affinity))


def openai_at(name: str, url: str) -> BackendSettings:
    return BackendSettings(name, "openai", base_url=url)


def test_the_threshold_follows_what_the_backend_caches() -> None:
    """Hosted APIs cache nothing under 1,024 tokens; a self-hosted engine (an openai backend
    anywhere else, a sim that models a prefix cache) caches any prefix."""
    hosted = [openai_at("o", "https://api.openai.com/v1"),
              openai_at("z", "https://my-east.openai.azure.com/openai/v1"),
              BackendSettings("a", "anthropic", base_url="https://api.anthropic.com"),
              BackendSettings("b", "bedrock", region="us-east-1"),
              BackendSettings("v", "vertex", region="global", project="p"),
              BackendSettings("s", "sim")]  # the default profile caches nothing
    engines = [openai_at("l", "http://127.0.0.1:8000/v1"), openai_at("k", "http://vllm:8000/v1"),
               openai_at("d", "https://llm.example.org/v1"),
               openai_at("n", "https://notopenai.com/v1"),  # not a subdomain of openai.com
               BackendSettings("c", "sim", sim=SimProfile(prefill_ms_per_1k=60.0))]
    assert {b.name: b.min_keyed_tokens() for b in hosted} == {b.name: 1024 for b in hosted}
    assert {b.name: b.min_keyed_tokens() for b in engines} == {b.name: 64 for b in engines}
    assert pool_of(*hosted).affinity.min_input_tokens == 1024
    assert pool_of(*engines).affinity.min_input_tokens == 64
    # a pool that mixes them keys from the smallest: the engines' caches pay for it
    assert pool_of(hosted[0], engines[0]).affinity.min_input_tokens == 64
    # a value set by hand is kept, whatever the backends
    assert pool_of(*engines, min_input_tokens=1024).affinity.min_input_tokens == 1024
    assert pool_of(*hosted, min_input_tokens=0).affinity.min_input_tokens == 0


def test_a_short_conversation_is_keyed_on_engines_and_spread_by_load_on_hosted_apis() -> None:
    """Every turn of a conversation under 1,024 tokens (a 100-token system prompt) gets the
    same key with an engine pool's default, so its turns go to one backend; with the hosted
    default (which every pool had before) it gets none and is spread by load."""
    system = "You are a terse assistant. " * 15  # about 100 tokens
    turns = [chat(system, "first question"),
             chat(system, "first question", "an answer", "second question"),
             chat(system, "first question", "an answer", "second question", "another",
                  "third")]
    backends = [("e0", 1.0), ("e1", 1.0)]
    engines = pool_of(openai_at("e0", "http://127.0.0.1:8001/v1"),
                      openai_at("e1", "http://127.0.0.1:8002/v1"))
    hosted = pool_of(openai_at("e0", "https://api.openai.com/v1"),
                     openai_at("e1", "https://api.openai.com/v1"))
    for pool, keyed in ((engines, True), (hosted, False)):
        minimum = pool.affinity.min_input_tokens
        assert minimum is not None
        routes = [route_for(body, {}, backends, min_input_tokens=minimum, load_factor=1.25,
                            body_bytes=len(json.dumps(body))) for body in turns]
        if keyed:
            assert all(r is not None for r in routes)
            assert len({r.key for r in routes if r}) == 1
            assert len({r.order for r in routes if r}) == 1
        else:
            assert routes == [None, None, None]
    # a bare greeting is no conversation: load alone places it, even on engines
    hi = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert route_for(hi, {}, backends, min_input_tokens=64, load_factor=1.25,
                     body_bytes=len(json.dumps(hi))) is None
