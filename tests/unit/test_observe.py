"""The pure parts: reading usage, asking for it, dropping the chunk the client did not
ask for, the hedge cost, the per-second series, the races timeline, and the tracing switch.
Plain numbers as the clock; no sockets."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest

from gateway.hedge.attempt import CANCELLED_BEFORE_TOKEN
from gateway.hedge.sizing import RequestSize
from gateway.settings import TracingSettings
from gateway.stats import Stats
from gateway.stats.races import RecentRaces
from gateway.stats.record import PoolStats, hedge_input_tokens
from gateway.stats.series import Series, own_reading
from gateway.stats.tracing import TracingUnavailable, build_tracing, exporter_name
from gateway.stats.view import live_view, snapshot
from gateway.wire.base import RelayOutcome, StreamEnd
from gateway.wire.chat import _encode_batch, _encode_events
from gateway.wire.sse import SSEDecoder, SSEEvent
from gateway.wire.usage import Usage, ask_for_usage, body_usage, read_usage, usage_of
from tests.unit.test_stats import LAYOUT, attempt, hedge_won, plain, pool_runtime, summary

USAGE_CHUNK = b'{"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}'
TOKEN_CHUNK = b'{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}'


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}, Usage(3, 4)),
        ({"type": "response.completed",
          "response": {"usage": {"input_tokens": 7, "output_tokens": 2}}}, Usage(7, 2)),
        ({"type": "message_start", "message": {"usage": {"input_tokens": 11}}}, Usage(11, 0)),
        ({"type": "message_delta", "usage": {"output_tokens": 6}}, Usage(0, 6)),
        ({"usage": None}, None),
        ({"usage": {"prompt_tokens": "3"}}, None),
        ({"usage": {"prompt_tokens": -1, "completion_tokens": True}}, None),
        ([1, 2], None),
    ],
    ids=["chat", "responses", "messages-start", "messages-delta", "null", "text", "bogus",
         "list"],
)
def test_usage_of_reads_each_protocols_shape(payload: object, expected: Usage | None) -> None:
    assert usage_of(payload) == expected


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"usage": {"prompt_tokens": 3000, "completion_tokens": 4,
                    "prompt_tokens_details": {"cached_tokens": 2048}}}, Usage(3000, 4, 2048)),
        ({"type": "response.completed",
          "response": {"usage": {"input_tokens": 7000, "output_tokens": 2,
                                 "input_tokens_details": {"cached_tokens": 6000}}}},
         Usage(7000, 2, 6000)),
        # Anthropic counts cache reads and writes beside its input_tokens: all of it is input
        ({"type": "message_start", "message": {"usage": {
            "input_tokens": 11, "cache_read_input_tokens": 5000,
            "cache_creation_input_tokens": 300, "output_tokens": 1}}},
         Usage(5311, 1, 5000, 300)),
        ({"usage": {"prompt_tokens": 3, "completion_tokens": 4,
                    "prompt_tokens_details": {"cached_tokens": None}}}, Usage(3, 4)),
    ],
    ids=["chat", "responses", "messages", "chat-null-cached"],
)
def test_usage_of_reads_the_cached_input(payload: object, expected: Usage | None) -> None:
    assert usage_of(payload) == expected


def test_a_stream_s_reports_of_the_cache_merge() -> None:
    start = Usage(5311, 1, 5000, 300)
    assert start.merge(Usage(0, 60)) == Usage(5311, 60, 5000, 300)
    assert Usage(0, 60).merge(start) == Usage(5311, 60, 5000, 300)
    assert Usage(10, 1).merge(Usage(10, 2)) == Usage(10, 2)  # no cache said: none assumed


def test_read_usage_parses_only_a_usage_object() -> None:
    assert read_usage(USAGE_CHUNK) == (Usage(5, 9), True)
    assert read_usage(TOKEN_CHUNK) is None  # `"usage":null` in every chunk: no parse
    assert read_usage(b'{"choices":[],"usage" : {"prompt_tokens":1}}') == (Usage(1, 0), True)
    with_choice = b'{"choices":[{"delta":{}}],"usage":{"prompt_tokens":1,"completion_tokens":2}}'
    assert read_usage(with_choice) == (Usage(1, 2), False)
    # the word inside content is escaped, so it is no key
    assert read_usage(b'{"choices":[{"delta":{"content":"\\"usage\\":{}"}}]}') is None
    assert read_usage(b'{"usage":{broken') is None


def test_body_usage() -> None:
    assert body_usage(b'{"usage":{"prompt_tokens":2,"completion_tokens":1}}') == Usage(2, 1)
    assert body_usage(b'{"choices":[]}') is None
    assert body_usage(b"not json, \"usage\"") is None


def test_ask_for_usage_only_on_streaming_chat_that_did_not_ask() -> None:
    body = {"model": "m", "stream": True, "stream_options": {"other": 1}}
    sent, strip = ask_for_usage("chat/completions", True, body)
    assert sent == {"model": "m", "stream": True,
                    "stream_options": {"other": 1, "include_usage": True}}
    assert strip and body["stream_options"] == {"other": 1}  # the client's body is untouched
    asked = {"stream_options": {"include_usage": True}}
    assert ask_for_usage("chat/completions", True, asked) == (asked, False)
    assert ask_for_usage("chat/completions", False, {"a": 1}) == ({"a": 1}, False)
    assert ask_for_usage("completions", True, {"a": 1}) == ({"a": 1}, False)


def batch(*datas: bytes) -> list[SSEEvent]:
    return [SSEEvent(d) for d in datas]


def test_relay_drops_the_usage_chunk_it_asked_for_and_keeps_its_numbers() -> None:
    events = batch(TOKEN_CHUNK, USAGE_CHUNK, b"[DONE]")
    stripped = RelayOutcome(strip_usage=True)
    out = _encode_events(events, "r", stripped)
    assert out == b"data: " + TOKEN_CHUNK + b"\n\ndata: [DONE]\n\n"
    assert stripped.usage == Usage(5, 9) and stripped.end == StreamEnd.DONE
    kept = RelayOutcome(strip_usage=False)
    out = _encode_events(events, "r", kept)
    assert USAGE_CHUNK in out and kept.usage == Usage(5, 9)
    # usage riding on a chunk with a choice is never dropped
    mixed = b'{"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":1}}'
    assert mixed in _encode_events(batch(mixed), "r", RelayOutcome(strip_usage=True))


def test_relay_reads_usage_in_a_read_that_could_pass_as_it_arrived() -> None:
    """A plain read (the pass-through path) holding the usage chunk still has its usage
    counted and, when the gateway asked for it, stripped; `"usage":null` chunks pass as is."""
    nulls = b'{"choices":[{"delta":{"content":"x"}}],"usage":null}'
    decoder = SSEDecoder()
    decoder.feed(b"data: " + nulls + b"\n\n")  # the first read may hold a BOM: decoded
    plain = decoder.feed_batch(b"data: " + nulls + b"\n\ndata: " + USAGE_CHUNK + b"\n\n")
    assert plain is not None and plain.raw is not None
    stripped = RelayOutcome(strip_usage=True)
    assert _encode_batch(plain, "r", stripped) == b"data: " + nulls + b"\n\n"
    assert stripped.usage == Usage(5, 9)
    only_nulls = decoder.feed_batch(b"data: " + nulls + b"\n\n")
    assert only_nulls is not None and only_nulls.raw is not None
    assert _encode_batch(only_nulls, "r", RelayOutcome(strip_usage=True)) is only_nulls.raw


def test_relay_merges_anthropic_style_usage_reports() -> None:
    start = b'{"type":"message_start","message":{"usage":{"input_tokens":12,"output_tokens":1}}}'
    delta = b'{"type":"message_delta","usage":{"output_tokens":30}}'
    outcome = RelayOutcome()
    _encode_events(batch(start), "r", outcome)
    _encode_events(batch(delta), "r", outcome)
    assert outcome.usage == Usage(12, 30)


def test_hedge_cost_counts_extra_attempts_that_reached_a_backend() -> None:
    s = hedge_won(0.0)
    s.usage = Usage(40, 10)
    assert hedge_input_tokens(s) == 40
    s.attempts = [*s.attempts, attempt(2, "a", "failover", 0.4, "failed",
                                       failure="connect_error")]
    assert hedge_input_tokens(s) == 40  # never connected: no prefill paid
    one = plain(0.0)
    one.usage = Usage(40, 10)
    assert hedge_input_tokens(one) == 0
    one.usage = None
    assert hedge_input_tokens(one) == 0


def test_stats_count_tokens_per_pool_and_winning_backend() -> None:
    stats = Stats(LAYOUT, now=0.0)
    won = hedge_won(1.0)
    won.usage = Usage(40, 10)
    stats.record(won)
    served = plain(2.0)
    served.usage = Usage(5, 7)
    stats.record(served)
    stats.record(plain(3.0))  # no usage reported: nothing counted
    doc = snapshot(stats, {}, 10.0)["pools"]["chat"]
    # no upstream reported its cache: no hit rate, and the hedge's input counts as a miss
    assert doc["lifetime"]["tokens"] == {
        "input": 45, "output": 17, "cached": 0, "cache_write": 0, "cache_hit_rate": None,
        "hedge_input": 40, "hedge_input_miss": 40, "hedge_input_miss_share": 1.0}
    assert doc["backends"]["a"]["lifetime"]["tokens"] == {"input": 5, "output": 7}
    assert doc["backends"]["b"]["lifetime"]["tokens"] == {"input": 40, "output": 10}


def test_stats_count_cached_input_and_the_hedge_cost_s_cache_misses() -> None:
    stats = Stats(LAYOUT, now=0.0)
    # a conversation's turn of 10,000 tokens, 2,000 of them new since its last turn at its
    # home `a`; the primary went to `a` and lost, the hedge on `b` won and reports no cache
    won = hedge_won(1.0)
    won.size = RequestSize(10_000, 2_000, home="a")
    won.usage = Usage(10_000, 10, cached=0)
    stats.record(won)
    # the primary on `b` (a spill) won, the hedge went home to `a`: a losing copy reports
    # nothing, so its misses are the estimate, what `a` had not seen
    spilled = summary(2.0, [attempt(0, "b", "primary", 2.0, "won", ttft=0.2),
                            attempt(1, "a", "hedge", 2.1, "lost", ttft=0.1)])
    spilled.size = RequestSize(10_000, 2_000, home="a")
    spilled.usage = Usage(10_000, 10, cached=0)
    stats.record(spilled)
    # a turn served at home: 8,000 of 10,000 tokens from the cache; one whose upstream says
    # nothing of its cache is left out of the hit rate
    served = plain(3.0)
    served.usage = Usage(10_000, 10, cached=8_000)
    stats.record(served)
    silent = plain(4.0)
    silent.usage = Usage(30_000, 10)
    stats.record(silent)
    anthropic = plain(5.0)
    anthropic.usage = Usage(5_311, 10, cached=5_000, cache_write=300)
    stats.record(anthropic)
    tokens = snapshot(stats, {}, 10.0)["pools"]["chat"]["lifetime"]["tokens"]
    assert tokens["cached"] == 13_000 and tokens["cache_write"] == 300
    assert tokens["cache_hit_rate"] == round(13_000 / 35_311, 4)
    assert tokens["hedge_input"] == 20_000
    assert tokens["hedge_input_miss"] == 10_000 + 2_000
    assert tokens["hedge_input_miss_share"] == 0.6


def test_series_one_point_per_sample_with_rates_and_a_bound() -> None:
    stats = Stats(LAYOUT, now=0.0)
    runtime = pool_runtime()
    series = Series(0.0, capacity=3)

    def sample(now: float) -> None:
        series.sample(own_reading(stats, live_view({"chat": runtime}, now), now, 7), now)

    sample(1.0)
    for t in (1.2, 1.5):
        stats.record(hedge_won(t))
    sample(3.0)  # two requests, two hedges started and won over two seconds
    (first, second) = series.view()["pools"]["chat"]
    assert first["requests"] == 0.0 and first["seq"] == 2 and first["t"] == 1.0
    assert (second["requests"], second["hedges_started"], second["hedges_won"]) == (1, 1, 1)
    assert second["client_ttft_ms"]["p50"] == pytest.approx(500, rel=0.02)
    assert second["backends"]["b"]["ttft_ms"]["p50"] == pytest.approx(200, rel=0.02)
    assert second["backends"]["a"]["state"] == "ok"
    assert second["budget_tokens"] == pytest.approx(runtime.budget.tokens(3.0), abs=1e-3)
    assert series.view(since=2)["pools"]["chat"] == [second]
    sample(3.2)  # within the tick of the last point: no point (the next one covers it)
    for t in (4.0, 5.0, 6.0):
        sample(t)
    kept = series.view()["pools"]["chat"]
    assert [p["seq"] for p in kept] == [5, 6, 7]  # bounded: the oldest went
    json.dumps(series.view())  # plain JSON


def test_races_keep_the_last_ones_with_bars_from_start_to_token_or_end() -> None:
    stats = Stats(LAYOUT, now=0.0)
    stats.races = RecentRaces(0.0, capacity=2)
    stats.record(plain(1.0))
    failed = summary(2.0, [
        attempt(0, "a", "primary", 2.0, "failed", failure="unavailable"),
        attempt(1, "b", "failover", 2.05, "won", ttft=0.1),
    ], winner=1)
    failed.attempts[0].ended = 2.04
    stats.record(failed)
    stats.record(hedge_won(3.0))
    races = stats.races.view()["races"]
    assert [r["t"] for r in races] == [2.0, 3.0]
    (primary, failover) = races[0]["attempts"]
    assert (primary["start_ms"], primary["end_ms"]) == (0.0, 40.0)
    assert (failover["start_ms"], failover["end_ms"]) == (50.0, 150.0)
    assert races[0]["winner"] == 1
    lost, won = races[1]["attempts"]
    assert lost["reason"] == CANCELLED_BEFORE_TOKEN and lost["end_ms"] == 500.0
    assert (won["start_ms"], won["end_ms"], races[1]["winner"]) == (300.0, 500.0, 1)


def test_tracing_is_off_unless_configured() -> None:
    off = TracingSettings()
    assert exporter_name(off, {}) == "none"
    assert build_tracing(off, {}) is None
    assert build_tracing(off, {"OTEL_TRACES_EXPORTER": "none"}) is None
    assert exporter_name(off, {"OTEL_TRACES_EXPORTER": "otlp,console"}) == "otlp"
    assert exporter_name(TracingSettings(exporter="none"), {"OTEL_TRACES_EXPORTER": "otlp"}) \
        == "none"
    with pytest.raises(TracingUnavailable, match="zipkin"):
        exporter_name(off, {"OTEL_TRACES_EXPORTER": "zipkin"})
    tracing = build_tracing(TracingSettings(exporter="console", service_name="gw"), {})
    assert tracing is not None
    try:
        resource = tracing.provider.resource.attributes
        assert resource["service.name"] == "gw"
    finally:
        tracing.shutdown()


def test_every_dashboard_file_ships_as_package_data() -> None:
    """A wheel (non-editable install) must carry the page, script and style: each file under
    gateway/dashboard/static matches a package-data glob, and subpackages are found too."""
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["packages"]["find"]["include"] == ["gateway*", "providers*"]
    globs = config["package-data"]["gateway.dashboard"]
    static = root / "gateway" / "dashboard" / "static"
    files = sorted(p.relative_to(static.parent).as_posix() for p in static.iterdir())
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files)


def test_series_follows_the_pools_the_stats_hold() -> None:
    """After a reload the stats hold other pools: a new one starts its series, a removed
    one's is dropped (never a series for a pool that no longer exists)."""
    stats = Stats({"chat": ["a"], "old": ["x"]}, now=0.0)
    series = Series(0.0)
    series.sample(own_reading(stats, {}, 1.0, 7), 1.0)
    assert set(series.view()["pools"]) == {"chat", "old"}
    del stats.pools["old"]
    stats.pools["new"] = PoolStats(["y"], stats.window)
    series.sample(own_reading(stats, {}, 2.0, 7), 2.0)
    pools = series.view()["pools"]
    assert set(pools) == {"chat", "new"}
    assert [p["seq"] for p in pools["new"]] == [3] and len(pools["chat"]) == 2


def test_named_protocols_read_usage_from_their_end_events() -> None:
    """Responses: `response.completed`; Messages: `message_start` and `message_delta`."""
    from gateway.wire.messages import MESSAGES
    from gateway.wire.named import named_encoder
    from gateway.wire.responses import RESPONSES

    outcome = RelayOutcome()
    encode = named_encoder(MESSAGES)
    encode([SSEEvent(b'{"type":"message_start","message":{"usage":{"input_tokens":9,'
                     b'"output_tokens":1}}}', b"message_start")], "r", outcome)
    encode([SSEEvent(b'{"type":"message_delta","usage":{"output_tokens":21}}',
                     b"message_delta")], "r", outcome)
    assert outcome.usage == Usage(9, 21)
    outcome = RelayOutcome()
    named_encoder(RESPONSES)([SSEEvent(
        b'{"type":"response.completed","response":{"usage":{"input_tokens":4,'
        b'"output_tokens":6}}}', b"response.completed")], "r", outcome)
    assert outcome.usage == Usage(4, 6)
