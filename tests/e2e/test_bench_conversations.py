"""`bench --workload conversations --upstream URL` end to end: the workload played against
servers the bench did not start (here two simulators on loopback, standing in for the user's
own), directly and through a gateway child process, every turn accounted for."""

from __future__ import annotations

import functools
import tempfile

import httpx
import pytest

from gateway.bench.conversations import ConversationPlan, run_conversations
from gateway.settings import SimProfile
from providers.sim.server import create_sim_app
from tests.harness import AsgiServerFactory, UpstreamFactory

#: fast, and with a prefix cache, so the usage reports cached tokens
PROFILE = SimProfile(ttft_median=0.01, ttft_sigma=0.1, straggler_probability=0.0,
                     tokens=3, inter_token=0.001, prefill_ms_per_1k=1.0)


@pytest.mark.timeout(120)
def test_conversations_run_against_servers_the_bench_did_not_start(
    asgi_server: AsgiServerFactory,
) -> None:
    sims = [asgi_server.build(functools.partial(create_sim_app, PROFILE, seed=seed))
            for seed in (41, 42)]
    plan = ConversationPlan(conversations=6, turns=3, stagger=0.2,
                            modes=("sticky", "hedging-on"), sizes=((40, 1.0),),
                            # short prompts, as against real servers, keyed from 64 tokens;
                            # two conversations at a time, as one per server
                            system_tokens=100, min_input_tokens=64, concurrency=2,
                            upstreams=tuple(s.v1 + "/" for s in sims))
    with tempfile.TemporaryDirectory(prefix="hedge-conversations-test-"):
        rows = run_conversations(plan)
    assert [row["mode"] for row in rows] == ["sticky", "hedging-on"]
    for row in rows:
        assert row["turns"] == 18 and row["errors"] == 0
    # later turns found their own history in the server's cache (the sticky client always;
    # through the gateway, every turn that did not spill off a busy backend)
    assert rows[0]["cache_hit_rate"] == 1.0
    assert rows[1]["cache_hit_rate"] >= 0.5
    # every turn reached the servers, the gateway's through the gateway (which counted them)
    received = sum(httpx.get(s.url("/sim/stats"), timeout=5.0).json()["requests"]
                   for s in sims)
    assert received >= 2 * 18
    affinity = rows[1]["affinity"]
    assert affinity["hits"] + affinity["spills"] == 18 and affinity["hits"] >= 9
    # the modes do not share prefixes: each opened with a system prompt of its own
    first_turns = [t for t in rows[1]["turns_detail"] if t[1] == 0]
    assert first_turns and first_turns[0][5] < 100


PHASES = ("warmup-sticky", "system-sticky", "warmup-hedging-on", "system-hedging-on")


@pytest.mark.timeout(120)
def test_each_mode_warms_up_then_the_modes_measure_round_by_round(
    scripted_upstream: UpstreamFactory,
) -> None:
    """Against the user's own servers every mode, sticky included, first plays its warm-up
    conversations (system prompts of their own, homes spread over both servers); then the
    measured conversations are played in rounds of `concurrency`, each round in every mode
    in turn, so the modes meet the servers at the same time. The warm-up's turns are neither
    in a mode's turns nor in the gateway counters it reports, and every turn is greedy."""
    servers = scripted_upstream(2)
    plan = ConversationPlan(conversations=3, turns=2, modes=("sticky", "hedging-on"),
                            sizes=((40, 1.0),), system_tokens=100, concurrency=2, warmup=4,
                            model="m", upstreams=tuple(s.base_url for s in servers))
    rows = run_conversations(plan)
    for row in rows:
        assert row["turns"] == 6 and row["errors"] == 0
        assert row["warmup_turns"] == 8 and row["warmup_errors"] == 0
    assert rows[1]["affinity"]["hits"] + rows[1]["affinity"]["spills"] == 6
    assert rows[1]["later_vs_sticky"]["turns"] == 3  # the second turn of each conversation

    def phase(body: object) -> str:
        assert isinstance(body, dict)
        # the measured openings may carry a number after the mode (`system-hedging-on.3`)
        return str(body["messages"][0]["content"]).split()[0].split(".")[0]

    posts = sorted((r for s in servers for r in s.requests if r.method == "POST"),
                   key=lambda r: r.received_at)
    assert all(isinstance(r.body, dict) and r.body["temperature"] == 0 for r in posts)
    phases = [phase(r.body) for r in posts]
    assert [phases.count(p) for p in PHASES] == [8, 6, 8, 6]
    # both warm-ups, then round one (conversations 0 and 1: 4 turns) in each mode, then
    # round two (conversation 2: 2 turns) in each mode, opening with the next mode
    runs = [p for k, p in enumerate(phases) if k == 0 or phases[k - 1] != p]
    assert runs == ["warmup-sticky", "warmup-hedging-on", "system-sticky",
                    "system-hedging-on", "system-sticky"]
    # the measured turns: 4 and 4 (round one), then 2 and 2 (round two)
    measured = [p for p in phases if p.startswith("system-")]
    assert measured == ["system-sticky"] * 4 + ["system-hedging-on"] * 6 + ["system-sticky"] * 2
    # the warm-up reached both servers in both modes: each one's delay learns
    for mode in ("warmup-sticky", "warmup-hedging-on"):
        assert all(any(phase(r.body) == mode for r in s.requests if r.method == "POST")
                   for s in servers)
