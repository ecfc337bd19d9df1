"""A key's TTFT objectives counted: met and missed, hedges sent early or refused by its share,
in `/hedge/stats` (one process, and merged over workers), `/metrics` and the request log.
Only keys that sent a request with an objective appear: the names are the configured keys'."""

from __future__ import annotations

from gateway.hedge.budget import SuppressReason
from gateway.stats import Stats
from gateway.stats.merge import document, export, merge, rebuild
from gateway.stats.prometheus import Metrics
from gateway.stats.requestlog import request_record
from gateway.stats.summary import RequestSummary
from gateway.stats.view import snapshot
from tests.unit.test_stats import LAYOUT, attempt, hedge_won, plain, summary

NOW = 30.0


def keyed(s: RequestSummary, key: str | None, objective: float | None) -> RequestSummary:
    s.key, s.objective = key, objective
    return s


def early(t: float) -> RequestSummary:
    """A hedge sent early for the objective won, 0.35 s in."""
    s = hedge_won(t, primary_ran=0.35)
    s.attempts[1].deadline = True
    return s


def refused(t: float) -> RequestSummary:
    """The key's share could not pay the early hedge; the primary answered late."""
    return summary(t, [attempt(0, "a", "primary", t, "won", ttft=0.9)], client_ttft=0.9,
                   suppressed=(SuppressReason.KEY_BUDGET,))


def traffic() -> list[RequestSummary]:
    return [
        keyed(early(1.0), "team-a", 0.4),          # met, one early hedge
        keyed(plain(2.0, ttft=0.1), "team-a", 0.4),  # met without a hedge
        keyed(refused(3.0), "team-a", 0.4),          # missed, one refused
        keyed(plain(4.0, ttft=0.5), "team-b", None),  # no objective: not counted
        keyed(plain(5.0, ttft=0.5), None, 0.2),      # no named key: not counted
    ]


EXPECTED = {"team-a": {"objectives_met": 2, "objectives_missed": 1, "deadline_hedges": 1,
                       "deadline_refused": 1}}


def fed(summaries: list[RequestSummary]) -> Stats:
    stats = Stats(LAYOUT, now=0.0)
    for s in summaries:
        stats.record(s)
    return stats


def test_hedge_stats_count_each_keys_objectives_and_deadline_hedges() -> None:
    assert snapshot(fed(traffic()), {}, NOW)["keys"] == EXPECTED


def test_workers_counts_add_up() -> None:
    parts = [export(fed(part), {}, NOW, {"worker": i, "pid": i})
             for i, part in enumerate((traffic()[:2], traffic()[2:]))]
    assert document(merge(parts))["keys"] == EXPECTED
    stats, _live, _now = rebuild(merge(parts))
    assert snapshot(stats, {}, NOW)["keys"] == EXPECTED


def test_metrics_carry_them_by_key() -> None:
    stats = fed(traffic())
    text = Metrics(stats, {}, lambda: NOW).render().decode()
    for line in ('hedge_gateway_key_objectives_total{key="team-a",result="met"} 2.0',
                 'hedge_gateway_key_objectives_total{key="team-a",result="missed"} 1.0',
                 'hedge_gateway_key_deadline_hedges_total{key="team-a",result="sent"} 1.0',
                 'hedge_gateway_key_deadline_hedges_total{key="team-a",result="refused"} 1.0'):
        assert line in text
    assert 'key="team-b"' not in text


def test_the_request_log_line_says_the_objective_and_whether_it_was_met() -> None:
    line = request_record(keyed(early(1.0), "team-a", 0.4), frozenset())
    assert (line["objective_ms"], line["objective_met"], line["deadline_hedges"]) == (
        400.0, True, 1)
    line = request_record(keyed(refused(3.0), "team-a", 0.4), frozenset())
    assert (line["objective_met"], line["suppressed"]) == (False, ["key_budget"])
    assert "objective_ms" not in request_record(plain(2.0), frozenset())


def test_a_client_that_left_first_is_neither_met_nor_missed() -> None:
    s = keyed(summary(1.0, [attempt(0, "a", "primary", 1.0, "cancelled")], winner=None),
              "team-a", 0.4)
    s.status = 499
    assert s.objective_met is None
    assert snapshot(fed([s]), {}, NOW)["keys"]["team-a"]["objectives_missed"] == 0
