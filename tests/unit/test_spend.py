"""Spend: a request's cost with its losing attempts in it (pure), and where it is shown
(the log line, `/hedge/stats`, `/metrics`). Hand-made summaries; plain numbers as clocks."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from gateway.hedge.attempt import AttemptRecord, ContinuationCounts, ContinuationLeg, Outcome
from gateway.hedge.losers import output_sent
from gateway.hedge.sizing import RequestSize
from gateway.settings import BackendSettings, ConfigError
from gateway.settings.load import check_config
from gateway.settings.model import PriceSettings
from gateway.stats import RequestSummary, Stats
from gateway.stats.merge import document, export, merge
from gateway.stats.prometheus import GatewayCollector
from gateway.stats.requestlog import request_record
from gateway.stats.spend import charges, summary_cost
from gateway.stats.table import render
from gateway.stats.view import snapshot
from gateway.tenants.spend import Charge, charge_cost, cost_text, request_cost
from gateway.wire.sse import SSEEvent
from gateway.wire.usage import Usage

#: $2 per million input, $1 cached, $8 output on a; b unpriced unless a test says so
A = PriceSettings(input=2.0, cached_input=1.0, output=8.0)
PRICES = {"a": A, "b": PriceSettings(input=4.0, output=16.0)}


def test_one_attempt_costs_its_tokens_at_its_backends_price() -> None:
    # 1,000 input of which 400 cached, 500 output: 600*2 + 400*1 + 500*8 per million
    assert math.isclose(charge_cost(Charge("a", 1000, 400, 500), A), 5600 / 1e6)
    # no cached price: cached input is priced as input
    assert math.isclose(charge_cost(Charge("b", 1000, 400, 0), PRICES["b"]), 4000 / 1e6)


def test_a_request_costs_the_sum_of_its_priced_attempts_and_none_without_a_price() -> None:
    both = [Charge("a", 100, 0, 10), Charge("b", 100, 0, 0)]
    assert math.isclose(request_cost(both, PRICES) or 0, (200 + 80 + 400) / 1e6)
    assert request_cost(both, {"a": A}) is not None  # b unpriced: a's part only
    assert request_cost(both, {}) is None  # nothing priced: no cost, not zero
    assert cost_text(0.0001234567) == "0.000123"


def _summary(attempts: list[AttemptRecord], winner: int | None, usage: Usage | None,
             size: RequestSize | None = None) -> RequestSummary:
    s = RequestSummary("req", "chat", "chat/completions", True, 0.0, key="team-a")
    s.attempts = attempts
    s.winner = None if winner is None else attempts[winner]
    s.usage, s.size, s.ended = usage, size, 1.0
    return s


def test_a_hedged_request_pays_the_losers_input_and_what_they_sent() -> None:
    primary = AttemptRecord(0, "a", "primary", 0.0, False, outcome="lost", output_sent=3)
    hedge = AttemptRecord(1, "b", "hedge", 0.2, True, outcome="won")
    s = _summary([primary, hedge], 1, Usage(1000, 50))
    assert charges(s) == [Charge("a", 1000, 0, 3), Charge("b", 1000, 0, 50)]
    expected = (1000 * 2 + 3 * 8 + 1000 * 4 + 50 * 16) / 1e6
    assert math.isclose(summary_cost(s, PRICES) or 0, expected)
    # without the losing primary the request would have cost only the winner's part
    s.metered = False  # a read of stored state generates nothing: no cost
    assert summary_cost(s, PRICES) is None
    alone = summary_cost(_summary([hedge], 0, Usage(1000, 50)), PRICES)
    assert alone is not None and math.isclose(alone, (1000 * 4 + 50 * 16) / 1e6)


def test_a_loser_at_the_conversations_home_pays_its_cached_input_at_the_cached_price() -> None:
    home = AttemptRecord(0, "a", "primary", 0.0, False, outcome="cancelled")
    away = AttemptRecord(1, "b", "hedge", 0.2, True, outcome="won")
    size = RequestSize(tokens=1000, new=100, home="a")  # the home has seen 900 of them
    s = _summary([home, away], 1, Usage(1000, 10))
    s.size = size
    assert charges(s)[0] == Charge("a", 1000, 900, 0)


def test_failures_cost_only_when_the_upstream_had_taken_the_request() -> None:
    refused = AttemptRecord(0, "a", "primary", 0.0, False, outcome="failed",
                            failure="unavailable")
    unreached = AttemptRecord(1, "a", "failover", 0.1, True, outcome="failed",
                              failure="connect_error")
    timed_out = AttemptRecord(2, "a", "failover", 0.2, True, outcome="failed",
                              failure="read_timeout")
    s = _summary([refused, unreached, timed_out], None, None, RequestSize(300, 300))
    # no answer, no usage: the estimate of the input is what the timed-out attempt was sent
    assert charges(s) == [Charge("a", 300, 0, 0)]
    assert math.isclose(summary_cost(s, PRICES) or 0, 600 / 1e6)


def test_a_losers_output_is_its_upstreams_count_or_one_per_event() -> None:
    body = b'{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":9,' \
           b'"completion_tokens":7}}'
    assert output_sent([SSEEvent(body)]) == 7
    chunks = [SSEEvent(b'{"choices":[{"delta":{"content":"x"}}]}') for _ in range(3)]
    assert output_sent(chunks) == 3


def test_spend_is_shown_in_the_log_line_the_stats_and_the_metrics_per_key_and_pool() -> None:
    s = _summary([AttemptRecord(0, "a", "primary", 0.0, False, outcome="won")], 0,
                 Usage(1000, 100))
    s.cost = summary_cost(s, PRICES)
    assert request_record(s, frozenset())["cost_usd"] == 0.0028
    stats = Stats({"chat": ["a", "b"]}, now=0.0)
    stats.record(s)
    stats.record(s)
    spend = snapshot(stats, {}, 1.0)["pools"]["chat"]["lifetime"]["spend"]
    assert spend == {"usd": 0.0056, "keys": {"team-a": 0.0056}}
    other = Stats({"chat": ["a", "b"]}, now=0.0)
    other.record(s)  # another worker: the workers' documents merge into the server's
    merged = document(merge([export(stats, {}, 1.0, {"worker": 0, "pid": 1}),
                             export(other, {}, 1.0, {"worker": 1, "pid": 2})]))
    assert merged["pools"]["chat"]["lifetime"]["spend"] == {"usd": 0.0084,
                                                            "keys": {"team-a": 0.0084}}
    printed = io.StringIO()
    render(snapshot(stats, {}, 1.0), printed)  # `hedge-gateway stats URL`
    assert "spend 0.005600 USD" in printed.getvalue()
    metrics = {m.name: m for m in GatewayCollector(lambda: (stats, {})).collect()}
    assert [(x.labels, x.value) for x in metrics["hedge_gateway_key_spend_usd"].samples
            if x.name.endswith("_total")] == [({"pool": "chat", "key": "team-a"}, 0.0056)]


def test_a_price_is_checked_and_a_budget_nothing_can_reach_is_warned_about(
    tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as caught:
        BackendSettings("s", "sim", price=PriceSettings(input=-1.0))
    assert "input: must be in [0, inf)" in str(caught.value)
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "pools:\n"
        "  - {name: priced, backends: [{name: s, provider: sim, price: {input: 1, output: 2}}]}\n"
        "  - {name: free, backends: [{name: s, provider: sim}]}\n"
        "keys:\n"
        "  - {name: team-a, key_sha256: " + "a" * 64 + ", pools: [free], budget: {usd: 5}}\n"
        "  - {name: team-b, key_sha256: " + "b" * 64 + ", budget: {usd: 5}}\n")
    out, err = io.StringIO(), io.StringIO()
    assert check_config(str(config), out, err) == 0
    warnings = err.getvalue().splitlines()
    assert len(warnings) == 1 and "keys[0] (team-a): budget set, but no backend" in warnings[0]
    assert "not enforced" not in err.getvalue()  # a budget is enforced now


def _continued(legs: list[ContinuationLeg]) -> RequestSummary:
    """A stream on a that broke or stalled and went on as `legs` say; the client's usage is
    the answer's (1,000 input, 30 output), as the splice reports it."""
    s = _summary([AttemptRecord(0, "a", "primary", 0.0, False, outcome="won")], 0,
                 Usage(1000, 30))
    s.continuations = ContinuationCounts(legs=legs)
    return s


def _leg(backend: str, relayed: int, outcome: Outcome, failure: str | None = None,
         taken: bool = False, output: int = 0) -> ContinuationLeg:
    record = AttemptRecord(0, backend, "continuation", 1.0, False, outcome=outcome,
                           failure=failure)
    return ContinuationLeg(record, relayed, taken=taken, output=output)


def test_a_continued_stream_and_its_continuation_share_the_answer() -> None:
    """Broken after 10 tokens, continued on b: a is charged the input and its 10 tokens; b
    the input plus the 10 it resent, and the other 20."""
    s = _continued([_leg("b", 10, "won", taken=True)])
    assert charges(s) == [Charge("a", 1000, 0, 10), Charge("b", 1010, 0, 20)]
    assert math.isclose(summary_cost(s, PRICES) or 0,
                        (1000 * 2 + 10 * 8 + 1010 * 4 + 20 * 16) / 1e6)


def test_a_continuation_that_lost_its_stall_race_pays_its_input_and_what_it_sent() -> None:
    """A stall at 10 tokens: the continuation on b yielded 2 events but the stalled stream
    came back first and finished the answer: a keeps the whole output."""
    s = _continued([_leg("b", 10, "won", output=2)])
    assert charges(s) == [Charge("a", 1000, 0, 30), Charge("b", 1010, 0, 2)]


def test_two_continuations_each_pay_what_the_client_read_from_them() -> None:
    """a broke at 10; b took over and stalled at 25; a failed continuation (refused with a
    status: never charged) and a broken one (charged its input) on the way; c finished."""
    s = _continued([_leg("b", 10, "won", taken=True),
                    _leg("d", 25, "failed", failure="server_error"),
                    _leg("e", 25, "failed", failure="connection_reset"),
                    _leg("c", 25, "won", taken=True)])
    assert charges(s) == [Charge("a", 1000, 0, 10), Charge("b", 1010, 0, 15),
                          Charge("e", 1025, 0, 0), Charge("c", 1025, 0, 5)]
