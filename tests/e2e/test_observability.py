"""Observability over real sockets: /hedge/stats, /metrics, the request log and
`hedge-gateway stats`, checked against what scripted upstreams and the OpenAI SDK observed.

Every scenario uses a FIXED hedge delay, so which requests hedge is decided by the scripts
(a primary that hangs always gets a hedge; a fast one never does), not by learned latency.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
import string
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
)
from gateway.stats.requestlog import LOGGER_NAME
from gateway.stats.table import print_stats
from tests.harness import (
    SSE_HEADERS,
    AsgiServerFactory,
    Hang,
    RecordedRequest,
    RunningServer,
    Script,
    ScriptedUpstream,
    Send,
    UpstreamFactory,
    error_obj,
    error_script,
    role_chunk,
    sse,
    stream_script,
    token_chunk,
)

POOL = "chat"
#: long enough that a fast primary never misses it on a busy machine (an unplanned hedge
#: would break the exact counts below); the slow requests pay it, ten of them
DELAY = 0.6
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
#: the DDSketch relative accuracy used by gateway.hedge.latency
SKETCH_ACCURACY = 0.01
#: how much later the client may see a first token than the gateway commits it (see test)
HOP_ALLOWANCE = 0.050


def make_settings(
    upstreams: list[ScriptedUpstream], *, api_key: str | None = None, burst: float = 50.0
) -> Settings:
    backends = tuple(
        BackendSettings(
            name, "openai", "upstream-model", base_url=up.base_url, api_key=api_key, group=name
        )
        for name, up in zip("ab", upstreams, strict=False)
    )
    hedging = HedgingSettings(
        max_attempts=2,
        delay=DelaySettings(mode="fixed", value=DELAY),
        budget=BudgetSettings(burst=burst, ratio=0.5),
    )
    return Settings((PoolSettings(POOL, backends, hedging=hedging),))


def serve(asgi_server: AsgiServerFactory, settings: Settings) -> RunningServer:
    return asgi_server.build(lambda: create_app(settings, seed=7))


@contextlib.contextmanager
def sdk(running: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=running.v1, api_key="sk-client", max_retries=0, timeout=openai.Timeout(10.0)
    ) as client:
        yield client


def get_stats(running: RunningServer, requests: int | None = None) -> dict[str, Any]:
    """GET /hedge/stats; with `requests`, poll until that many requests were recorded (the
    gateway records a request after the client already read its end)."""
    deadline = time.monotonic() + 5.0
    while True:
        stats: dict[str, Any] = httpx.get(running.url("/hedge/stats"), timeout=5.0).json()
        done = stats["pools"][POOL]["lifetime"]["requests"]
        if requests is None or done >= requests or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def exact_quantile(values: list[float], q: float) -> float:
    """The rank DDSketch reports: the element at floor(q * (n - 1)) of the sorted values."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


# ---- (a) + (b): a scripted run, counted three ways ----------------------------------------


def plan() -> list[str]:
    """50 requests: `fast` (the primary answers at once), `slow` (the primary hangs: one hedge,
    which wins), `slow2` (the hedge is slow too: a second hedge is refused, max_attempts),
    `off` (x-hedge: off, so the hedge is refused as disabled; the primary answers at once)."""
    kinds = ["fast"] * 50
    for i in range(3, 50, 6):
        kinds[i] = "slow"
    for i in (10, 40):
        kinds[i] = "slow2"
    for i in (7, 17, 27, 37, 47):
        kinds[i] = "off"
    return kinds


def warm_up_sdk(upstream: ScriptedUpstream) -> None:
    """Stream once from an upstream directly: the SDK's first stream pays one-off costs (model
    classes, imports) that would otherwise land in the first request's client TTFT."""
    with openai.OpenAI(base_url=upstream.base_url, api_key="sk-client", max_retries=0) as client:
        for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
            pass


def scenario_responder() -> Any:
    """One responder for both upstreams: the first arrival of a request id is its primary."""
    seen: dict[str, int] = {}

    def respond(rec: RecordedRequest) -> Script:
        rid = rec.headers["x-request-id"]
        arrival = seen.get(rid, 0)
        seen[rid] = arrival + 1
        kind = rec.body["user"]
        if arrival == 0 and kind in ("slow", "slow2"):
            return Script(headers=SSE_HEADERS, steps=[Send(role_chunk()), Hang()])
        if kind == "slow2":  # the hedge: its token after 1.5 delays, between two hedge checks
            return stream_script(["late ", "hedge"], ttft=DELAY * 1.5)
        return stream_script(["hello ", "world"])

    return respond


def test_stats_match_upstreams_and_client_over_a_scripted_run(
    scripted_upstream: UpstreamFactory,
    asgi_server: AsgiServerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    responder = scenario_responder()
    ups = [scripted_upstream.one(responder=responder, name=n) for n in "ab"]
    running = serve(asgi_server, make_settings(ups))
    warm_up_sdk(scripted_upstream.one(name="warm-up"))
    kinds = plan()
    winners: dict[str, str] = {}  # request id -> x-hedge-backend
    attempts_header = 0
    client_ttft: dict[str, float] = {}
    with sdk(running) as client:
        for i, kind in enumerate(kinds):
            rid = f"req-{i}"
            headers = {"x-request-id": rid}
            if kind == "off":
                headers["x-hedge"] = "off"
            start = time.perf_counter()
            raw = client.chat.completions.with_raw_response.create(
                model=POOL, messages=MESSAGES, stream=True, user=kind, extra_headers=headers
            )
            text = ""
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    if not text:
                        client_ttft[rid] = time.perf_counter() - start
                    text += chunk.choices[0].delta.content
            assert text in ("hello world", "late hedge")
            winners[rid] = raw.headers["x-hedge-backend"]
            attempts_header += int(raw.headers["x-hedge-attempts"])
    stats = get_stats(running, requests=len(kinds))

    # -- what the upstreams observed -----------------------------------------------------
    records = {name: up.requests for name, up in zip("ab", ups, strict=True)}
    arrivals = sorted(
        (rec.received_at, name, rec) for name, recs in records.items() for rec in recs
    )
    primary_of: dict[str, str] = {}
    hedged: set[str] = set()
    for _, name, rec in arrivals:
        rid = rec.headers["x-client-request-id"]  # the client's `req-i` (upstream ids are UUIDs)
        if rid in primary_of:
            hedged.add(rid)
        else:
            primary_of[rid] = name
    losers = [
        rec
        for recs in records.values()
        for rec in recs
        if rec.script is not None and any(isinstance(s, Hang) for s in rec.script.steps)
    ]
    for name, up in zip("ab", ups, strict=True):
        for rec in losers:
            if rec in records[name]:
                assert up.wait_closed(rec), "a loser's upstream connection was left open"
    hedge_wins = sum(1 for rid in hedged if winners[rid] != primary_of[rid])

    # the plan, as the upstreams saw it
    assert hedged == {f"req-{i}" for i, k in enumerate(kinds) if k in ("slow", "slow2")}
    assert hedge_wins == len(hedged)

    # -- /hedge/stats equals the observations -------------------------------------------
    pool = stats["pools"][POOL]["lifetime"]
    window = stats["pools"][POOL]["window"]
    backends = stats["pools"][POOL]["backends"]
    total_attempts = sum(len(r) for r in records.values())
    assert pool["requests"] == len(kinds)
    assert pool["attempts"] == total_attempts == attempts_header
    assert pool["attempts_per_request"]["max"] == 2
    assert pool["hedges"]["started"] == len(hedged)
    assert pool["hedges"]["won"] == hedge_wins
    assert pool["hedges"]["win_rate"] == 1.0
    assert pool["hedges"]["issue_rate"] == round(len(hedged) / len(kinds), 4)
    assert pool["hedges"]["suppressed"]["disabled"] == kinds.count("off")
    assert pool["hedges"]["suppressed"]["max_attempts"] == kinds.count("slow2")
    assert sum(pool["hedges"]["suppressed"].values()) == kinds.count("off") + kinds.count("slow2")
    assert pool["failovers"] == 0 and pool["errors"] == {}
    assert pool["losers"]["cancelled"] == len(losers) == len(hedged)
    assert pool["losers"]["cancelled_before_first_token"] == 1.0
    assert pool["losers"]["close_ms"]["count"] == len(losers)
    assert pool["losers"]["events_received_after_commit"] == 0
    assert pool["latency_saved_ms"]["count"] == hedge_wins
    assert window["requests"] == pool["requests"]  # the whole run fits in the window
    for name in "ab":
        life = backends[name]["lifetime"]
        assert life["attempts"] == len(records[name])
        assert life["won"] == sum(1 for w in winners.values() if w == name)
        assert life["lost"] == sum(1 for rec in losers if rec in records[name])
        assert life["hedges"] == sum(1 for rid in hedged if primary_of[rid] != name)
        assert life["ttft_ms"]["count"] == life["won"]
        assert life["ttft_censored"] == life["lost"]
        assert backends[name]["hedge_delay_ms"] == DELAY * 1000
        assert backends[name]["hedge_delay_mode"] == "fixed"
        assert backends[name]["state"] == "ok"

    # -- the request log: one line per request, agreeing with the headers ----------------
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    assert len(lines) == len(kinds)
    by_id = {line["id"]: line for line in lines}
    assert {rid: line["winner"] for rid, line in by_id.items()} == winners
    assert all(line["outcome"] == "ok" and line["relay_end"] == "done" for line in lines)
    assert by_id["req-10"]["suppressed"] == ["max_attempts"]
    assert by_id["req-7"]["suppressed"] == ["disabled"]

    # -- (b) TTFT quantiles agree with the client's own measurements ---------------------
    # The gateway measures arrival -> commit; the client measures send -> first content
    # chunk. The client's interval contains the gateway's, so per request
    # 0 <= client - gateway <= hop, where the hop is loopback HTTP both ways, request parsing,
    # the first SSE write and the SDK's parsing: a few ms; HOP_ALLOWANCE (50 ms) leaves room
    # for a loaded CI machine without hiding a real error (the slow requests are ~300 ms).
    # Quantiles are monotone, so the same bounds hold rank by rank (one stray hop moves a
    # rank by at most one), and the sketch adds its relative error (1 %) on top.
    gateway_ttft = {line["id"]: line["ttft_ms"] / 1000 for line in lines}
    hops = sorted(client_ttft[rid] - gateway_ttft[rid] for rid in client_ttft)
    assert hops[0] >= 0  # causality: the client cannot see a token before the commit
    assert hops[len(hops) // 2] <= HOP_ALLOWANCE
    client_values = list(client_ttft.values())
    gateway_values = list(gateway_ttft.values())
    for key, q in (("p50", 0.5), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99)):
        reported = pool["ttft_ms"][key] / 1000
        # against the gateway's own per-request values: the sketch's accuracy alone
        assert reported == pytest.approx(
            exact_quantile(gateway_values, q), rel=SKETCH_ACCURACY, abs=1e-6
        )
        # against the client: the sketch's accuracy plus the hop
        seen = exact_quantile(client_values, q)
        assert seen * (1 - SKETCH_ACCURACY) - HOP_ALLOWANCE <= reported
        assert reported <= seen * (1 + SKETCH_ACCURACY)
    assert pool["ttft_ms"]["count"] == len(kinds)


# ---- (c) /metrics ---------------------------------------------------------------------------


def series(text: str) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    return {
        (sample.name, frozenset(sample.labels.items()))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_parse_and_random_models_add_no_series(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    ups = scripted_upstream(2)
    running = serve(asgi_server, make_settings(ups))
    with sdk(running) as client:
        for _ in range(5):
            reply = client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    get_stats(running, requests=5)
    response = httpx.get(running.url("/metrics"), timeout=5.0)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    before = series(response.text)
    values = {name: v for name, labels, v in _samples(response.text)}
    assert values[("hedge_gateway_requests_total", (("outcome", "ok"), ("pool", POOL)))] == 5
    assert ("hedge_gateway_budget_tokens", frozenset({("pool", POOL)})) in before
    assert any(name == "hedge_gateway_attempt_ttft_seconds_bucket" for name, _ in before)
    labels_seen = {(k, v) for _, labels in before for k, v in labels}
    assert {v for k, v in labels_seen if k == "pool"} == {POOL}
    assert {v for k, v in labels_seen if k == "backend"} == {"a", "b"}

    rng = random.Random(5)
    models = [
        "".join(rng.choices(string.ascii_letters + string.digits + "-_/.", k=12))
        for _ in range(1000)
    ]
    body = {"messages": MESSAGES, "stream": True}
    with (
        httpx.Client(base_url=running.v1, timeout=10.0) as http,
        ThreadPoolExecutor(25) as pool,  # loopback round trips are slow in some sandboxes
    ):
        replies = pool.map(
            lambda model: http.post("/chat/completions", json={**body, "model": model}),
            models,
        )
        statuses = [reply.status_code for reply in replies]
    assert statuses == [404] * len(models)
    after = series(httpx.get(running.url("/metrics"), timeout=5.0).text)
    assert after == before


def _samples(text: str) -> Iterator[tuple[tuple[str, tuple[tuple[str, str], ...]], Any, float]]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            yield key, s.labels, s.value


# ---- (d) no provider key anywhere -----------------------------------------------------------


def test_provider_key_never_reaches_stats_metrics_or_logs(
    scripted_upstream: UpstreamFactory,
    asgi_server: AsgiServerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # INFO everywhere (what an operator runs), DEBUG for the gateway's own loggers. Third-party
    # DEBUG output is out of scope: httpcore logs every upstream response header at DEBUG,
    # so that logger must stay above DEBUG (`hedge-gateway serve` sets it to WARNING).
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="hedge_gateway")
    caplog.set_level(logging.DEBUG, logger="gateway")
    caplog.set_level(logging.DEBUG, logger="providers")
    canary = "sk-CANARY-7f3a9c1e5b"

    def respond(rec: RecordedRequest) -> Script:
        echo = f"invalid key {canary} for {rec.headers.get('authorization')}"
        if isinstance(rec.body, dict) and rec.body.get("user") == "midstream":
            steps = [
                Send(role_chunk()),
                Send(token_chunk("partial")),
                Send(sse(error_obj(echo, code=canary))),
            ]
            return Script(headers=SSE_HEADERS, steps=steps)
        return error_script(500, echo)

    ups = [scripted_upstream.one(responder=respond) for _ in range(2)]
    running = serve(asgi_server, make_settings(ups, api_key=canary))
    with httpx.Client(base_url=running.v1, timeout=10.0) as http:
        for stream in (True, False, True, False):
            reply = http.post(
                "/chat/completions", json={"model": POOL, "messages": MESSAGES, "stream": stream}
            )
            assert reply.status_code == 502
            assert canary not in reply.text and canary not in str(reply.headers)
        with http.stream(
            "POST",
            "/chat/completions",
            json={"model": POOL, "messages": MESSAGES, "stream": True, "user": "midstream"},
        ) as reply:
            assert reply.status_code == 200
            body = reply.read().decode()
        assert "partial" in body  # relayed after commit as it came: the client's own
    # the canary was really in play: every upstream request carried it
    sent = [rec for up in ups for rec in up.requests]
    assert sent and all(rec.headers["authorization"] == f"Bearer {canary}" for rec in sent)
    stats = get_stats(running, requests=5)
    assert stats["pools"][POOL]["lifetime"]["errors"] == {
        "stream_upstream_error": 1,
        "upstream_failed": 4,
    }
    metrics = httpx.get(running.url("/metrics"), timeout=5.0).text
    log_lines = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert len(log_lines) == 5
    # every failed attempt is counted by its code, the same in stats, metrics and the log
    backends = stats["pools"][POOL]["backends"]
    failed = sum(b["lifetime"]["failed"] for b in backends.values())
    assert failed >= 4
    assert [b["lifetime"]["failures"] for b in backends.values()] == [
        {"server_error": b["lifetime"]["failed"]} for b in backends.values()]
    by_code = [(labels["backend"], labels["code"], v) for (name, _), labels, v
               in _samples(metrics) if name == "hedge_gateway_attempt_failures_total"]
    assert sorted(by_code) == [(name, "server_error", b["lifetime"]["failed"])
                               for name, b in sorted(backends.items())]
    logged = [(a["failure"], a["reason"]) for r in log_lines
              for a in r.hedge_request["attempts"] if a["outcome"] == "failed"]  # type: ignore[attr-defined]
    assert logged == [("server_error", "status 500")] * failed
    assert canary not in json.dumps(stats)
    assert canary not in metrics
    assert canary not in caplog.text
    for record in caplog.records:
        assert canary not in record.getMessage()
        assert canary not in json.dumps(getattr(record, "hedge_request", None))


# ---- (e) hedge-gateway stats ----------------------------------------------------------------


def test_stats_command_prints_tables_for_a_running_gateway(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    ups = scripted_upstream(2)
    running = serve(asgi_server, make_settings(ups))
    with sdk(running) as client:
        for _ in range(3):
            client.chat.completions.create(model=POOL, messages=MESSAGES)
    get_stats(running, requests=3)
    out, err = io.StringIO(), io.StringIO()
    assert print_stats(running.base_url, out, err) == 0
    text = out.getvalue()
    assert err.getvalue() == ""
    assert f"pool {POOL}:" in text
    assert "win%" in text and "ttft p99" in text and "hedge delay" in text
    assert "config: embedded, sha256 " in text and "generation 1" in text
    assert "tokens (lifetime): input " in text and "hedge cost 0 input tokens" in text
    rows = [line.split() for line in text.splitlines()]
    lifetime = next(r for r in rows if r and r[0] == "lifetime")
    assert lifetime[1] == "3"  # requests
    backend_rows = [r for r in rows if r and r[0] in ("a", "b")]
    assert len(backend_rows) == 2 and all(r[1] == "ok" for r in backend_rows)

    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "stats", running.base_url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"pool {POOL}:" in done.stdout


def test_stats_command_fails_clearly_when_unreachable() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert print_stats("http://127.0.0.1:1", out, err) == 1
    assert "cannot reach http://127.0.0.1:1/hedge/stats" in err.getvalue()
    assert out.getvalue() == ""


def adaptive_settings(upstreams: list[ScriptedUpstream]) -> Settings:
    backends = tuple(
        BackendSettings(name, "openai", "upstream-model", base_url=up.base_url, group=name)
        for name, up in zip("ab", upstreams, strict=False)
    )
    delay = DelaySettings(initial=5.0, min=0.001, min_samples=4)  # quantile: auto
    hedging = HedgingSettings(max_attempts=2, delay=delay)
    return Settings((PoolSettings(POOL, backends, hedging=hedging),))


def backend_delays(running: RunningServer) -> list[dict[str, Any]]:
    stats = get_stats(running)
    return [stats["pools"][POOL]["backends"][name] for name in "ab"]


@pytest.mark.parametrize("refresh", [0.02, 3600.0])
def test_the_delay_is_learnt_by_the_refresher_not_by_requests(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory, refresh: float
) -> None:
    """The quantile is computed off the request path. Requests only record their
    TTFT; the periodic refresher of the app turns the samples into a delay, so with a refresh
    interval of an hour the delay stays `initial` whatever the traffic."""
    ups = [
        scripted_upstream.one(responder=lambda _r: stream_script(["x"], ttft=0.01), name=n)
        for n in "ab"
    ]
    settings = adaptive_settings(ups)
    running = asgi_server.build(lambda: create_app(settings, seed=7, delay_refresh=refresh))
    with sdk(running) as client:
        for _ in range(12):
            stream = client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "x"
    get_stats(running, requests=12)
    if refresh > 60:
        for backend in backend_delays(running):
            assert (backend["hedge_delay_mode"], backend["hedge_delay_ms"]) == ("initial", 5000.0)
        return
    deadline = time.monotonic() + 5.0
    while True:
        learnt = [b for b in backend_delays(running) if b["hedge_delay_mode"] == "adaptive"]
        if learnt or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert learnt, "the refresher never turned the samples into a delay"
    for backend in learnt:
        assert backend["hedge_delay_ms"] < 1000.0  # the 10 ms TTFTs, not the 5 s initial
        # auto: the budget's q92, or later if the hedges of the 10 ms TTFTs lost
        assert backend["hedge_delay_rule"] == "auto"
        assert 0.92 <= backend["hedge_delay_quantile"] <= 0.995
