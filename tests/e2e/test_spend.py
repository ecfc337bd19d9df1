"""Spend with the hedges in it, over real sockets: the gateway under its own server, scripted
and simulated upstreams, the official `openai` and `anthropic` SDKs as clients.

- a hedged non-streamed answer's `x-hedge-cost` counts the losing primary's input besides the
  winner's usage, and the request log line states the same figure; a streamed answer has no
  header (its cost is known only at its end) but its line has the cost;
- a key past its budget is refused with 429 `budget_exceeded` and `x-should-retry: false` in
  the route's shape, and neither SDK sends the request again;
- the spend reaches the store's usage rows (`/admin/keys/{name}/usage`); a key made at run
  time (`POST /admin/keys`, `keys create`) may have a budget too;
- under `serve --workers 2`, what one worker's request spent reaches the other through the
  store's batches: once it is written, every worker refuses the key.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.settings import (
    BackendSettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
)
from gateway.settings.model import PriceSettings
from gateway.settings.tenants import TenantBudget, TenantKeySettings
from tests.e2e.test_tenant_store import chat_status, eventually, keys_command, serving
from tests.harness import (
    DONE,
    SSE_HEADERS,
    Gate,
    Head,
    LoopThread,
    RecordedRequest,
    Script,
    ScriptedUpstream,
    Send,
    UpstreamFactory,
    Wait,
    chat_completion_obj,
    json_script,
    role_chunk,
    stream_script,
)
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import MESSAGES, GatewayFactory, verbose_logs, wait_for

TEAM_A = "team-a-key-0123456789abcdefghijklmnop"
ADMIN = {"authorization": "Bearer admin-key-0123456789abcdefghijklmnopqrstu"}
#: a thousandth of a dollar per input token, two per output token: round figures
PRICE = PriceSettings(input=1000.0, output=2000.0)
FAST = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=3,
                  inter_token=0.0)


@pytest.fixture(autouse=True)
def store_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's embedded store in its own folder, never the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def priced(settings: Settings) -> Settings:
    pool = settings.pools[0]
    backends = tuple(dataclasses.replace(b, price=PRICE) for b in pool.backends)
    return dataclasses.replace(settings, pools=(dataclasses.replace(pool, backends=backends),))


def trapped_primary(winner: Script) -> tuple[Gate, list[RecordedRequest], Any]:
    """A responder whose first request waits on a gate (the primary: the hedge wins) and
    whose second gets `winner`."""
    gate = Gate()
    arrivals: list[RecordedRequest] = []
    lock = threading.Lock()

    def responder(request: RecordedRequest) -> Script:
        with lock:
            arrivals.append(request)
            first = len(arrivals) == 1
        if not first:
            return winner
        return Script(headers=SSE_HEADERS if request.body.get("stream") else
                      {"content-type": "application/json"},
                      steps=[Head(), Send(role_chunk()), Wait(gate), Send(DONE)])

    return gate, arrivals, responder


def owner(upstreams: list[ScriptedUpstream], request: RecordedRequest) -> ScriptedUpstream:
    return next(u for u in upstreams if any(r is request for r in u.requests))


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [line for line in (getattr(r, "hedge_request", None) for r in caplog.records
                              if r.name == "hedge_gateway.requests") if line]


def test_a_hedged_answers_cost_counts_the_losing_primarys_input(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture
) -> None:
    """The primary takes the request and never answers; the hedge (50 ms later) answers
    with 1,000 input and 10 output tokens. Both were sent the input: 1.00 + 1.00 + 0.02."""
    verbose_logs(caplog)
    body = chat_completion_obj("hedge")
    body["usage"] = {"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010}
    gate, arrivals, responder = trapped_primary(json_script(body))
    upstreams = scripted_upstream(2, responder=responder)
    gateway = GatewayFactory(loop_thread)(priced(gateway_settings(
        [u.base_url for u in upstreams], delay=0.05)))
    try:
        with openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0,
                           timeout=10.0) as client:
            reply = client.chat.completions.with_raw_response.create(model=POOL,
                                                                     messages=MESSAGES)
    finally:
        gate.open()
    assert reply.parse().choices[0].message.content == "hedge"
    assert reply.headers["x-hedge-attempts"] == "2"
    assert reply.headers["x-hedge-cost"] == "2.020000"  # the winner alone: 1.020000
    primary, _ = arrivals
    assert owner(upstreams, primary).wait_closed(primary)  # the loser was closed, then...
    assert wait_for(lambda: any(line["pool"] == POOL for line in request_lines(caplog)))
    (line,) = [line for line in request_lines(caplog) if line["pool"] == POOL]
    assert line["cost_usd"] == 2.02  # ...the line written with the same figure
    assert [a["outcome"] for a in line["attempts"]] == ["lost", "won"]


def test_a_streams_cost_is_in_its_log_line_not_in_a_header(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture
) -> None:
    verbose_logs(caplog)
    gate, _, responder = trapped_primary(stream_script(["hedge"], usage=True))
    upstreams = scripted_upstream(2, responder=responder)
    gateway = GatewayFactory(loop_thread)(priced(gateway_settings(
        [u.base_url for u in upstreams], delay=0.05)))
    try:
        with openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0,
                           timeout=10.0) as client, \
                client.chat.completions.with_streaming_response.create(
                    model=POOL, messages=MESSAGES, stream=True) as response:
            assert "x-hedge-cost" not in response.headers
            list(response.parse())
    finally:
        gate.open()
    # a stream's end (its line) runs as its last byte goes out: wait for it, not a time
    assert wait_for(lambda: any(line["pool"] == POOL for line in request_lines(caplog)))
    (line,) = [line for line in request_lines(caplog) if line["pool"] == POOL]
    usage = line["usage"]
    # the winner's usage, plus the losing primary's input (the same count: one body sent)
    expected = (2 * usage["input"] * 1000 + usage["output"] * 2000) / 1e6
    assert line["cost_usd"] == pytest.approx(expected)
    assert line["hedges"] == 1


def budgeted_gateway(loop_thread: LoopThread, tmp_path: Path, usd: float) -> Any:
    pools = (PoolSettings("alpha", (BackendSettings("s", "sim", sim=FAST, price=PRICE),),
                          hedging=HedgingSettings(enabled=False)),)
    return GatewayFactory(loop_thread)(Settings(pools, server=ServerSettings(
        admin_keys=("admin-key-0123456789abcdefghijklmnopqrstu",)), keys=(
        TenantKeySettings("team-a", key=TEAM_A, budget=TenantBudget(usd=usd, period="day")),)))


def recorder() -> tuple[dict[str, list[Any]], list[str]]:
    """Event hooks for an SDK's own HTTP client that record every request it sends."""
    sent: list[str] = []
    return {"request": [lambda r: sent.append(r.url.path)]}, sent


def usage_rows(gateway: Any) -> list[dict[str, Any]]:
    """The key's usage rows, this process's latest batch written first."""
    rows: list[dict[str, Any]] = httpx.get(
        gateway.url("/admin/keys/team-a/usage"), headers=ADMIN, timeout=10.0,
        trust_env=False).json()["data"]
    return rows


def test_a_key_past_its_budget_is_refused_and_neither_sdk_retries(
    loop_thread: LoopThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each answer costs at least 3 output tokens at 0.002: past 0.001 after the first.
    Once the first request has ended (its spend counted: a cost is known at a request's
    end), the next is refused. The SDKs would retry a 429 three times; `x-should-retry:
    false` stops them."""
    verbose_logs(caplog)
    gateway = budgeted_gateway(loop_thread, tmp_path, usd=0.001)
    hooks, sent = recorder()
    with openai.OpenAI(base_url=gateway.v1, api_key=TEAM_A, max_retries=3,
                       http_client=openai.DefaultHttpxClient(event_hooks=hooks)) as client:
        first = client.chat.completions.with_raw_response.create(model="alpha",
                                                                 messages=MESSAGES)
        assert float(first.headers["x-hedge-cost"]) > 0.001
        assert wait_for(lambda: [row["requests"] for row in usage_rows(gateway)] == [1])
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="alpha", messages=MESSAGES)
    assert sent == ["/v1/chat/completions"] * 2  # the refusal was not sent again
    assert refused.value.code == "budget_exceeded"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "team-a" in refused.value.message and TEAM_A not in refused.value.message
    hooks, sent = recorder()
    claude = anthropic.Anthropic(base_url=gateway.root, api_key=TEAM_A, max_retries=3,
                                 http_client=anthropic.DefaultHttpxClient(event_hooks=hooks))
    with claude, pytest.raises(anthropic.RateLimitError) as refused_too:
        claude.messages.create(model="alpha", max_tokens=16,
                               messages=[{"role": "user", "content": "hi"}])
    assert sent == ["/v1/messages"]
    assert refused_too.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    def refusals() -> list[tuple[int, str]]:
        return [(line["status"], line["reason"]) for line in request_lines(caplog)
                if line["reason"] != "ok"]

    # a refusal's log line is written once its answer is out: read them as they come
    assert wait_for(lambda: len(refusals()) >= 2), refusals()
    assert refusals() == [(429, "budget_exceeded")] * 2
    (row,) = usage_rows(gateway)
    assert row["requests"] == 1  # the refusals took nothing
    assert row["spend_usd"] == float(first.headers["x-hedge-cost"])


WORKERS_CONFIG = """
server: {{host: 127.0.0.1, port: {port}, shutdown_grace: 2s, store: "sqlite:///{store}"}}
pools:
  - name: alpha
    hedging: {{enabled: false}}
    backends:
      - {{name: s, provider: sim, sim: {{ttft_median: 0, straggler_probability: 0, tokens: 4,
          inter_token: 0}}, price: {{input: 0, output: 1000000}}}}
keys:
  - {{name: team-a, key: "KEY", budget: {{usd: 1, period: month}}}}
""".replace("KEY", TEAM_A)


@pytest.mark.timeout(120)
def test_workers_share_a_keys_spend_through_the_store(tmp_path: Path) -> None:
    """Two workers, a key with a budget of 1 USD, a dollar per output token: the first
    answer (4 tokens) spends it whole. Once its worker's batch is written, each request, on
    a connection of its own (the kernel spreads them over both workers), is refused."""
    with serving(tmp_path, "--workers", "2", config_text=WORKERS_CONFIG) as (_, root):
        assert chat_status(root, TEAM_A) == 200
        eventually(lambda: all(chat_status(root, TEAM_A) == 429 for _ in range(20)),
                   "every worker refuses the key past its budget")


def test_a_key_made_at_run_time_with_a_budget_is_held_to_it(
    loop_thread: LoopThread, tmp_path: Path
) -> None:
    """`POST /admin/keys` with a budget: the key's first answer spends it, and once that
    request has ended the next is refused; `keys create --budget-usd` stores one too."""
    pools = (PoolSettings("alpha", (BackendSettings("s", "sim", sim=FAST, price=PRICE),),
                          hedging=HedgingSettings(enabled=False)),)
    store = f"sqlite:///{tmp_path}/tenants.sqlite"
    gateway = GatewayFactory(loop_thread)(Settings(pools, server=ServerSettings(
        admin_keys=("admin-key-0123456789abcdefghijklmnopqrstu",), store=store)))
    with httpx.Client(base_url=gateway.root, timeout=10.0, trust_env=False) as http:
        bad = http.post("/admin/keys", headers=ADMIN,
                        json={"name": "x", "budget": {"usd": -1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "budget"
        made = http.post("/admin/keys", headers=ADMIN, json={
            "name": "team-a", "budget": {"usd": 0.001, "period": "day"}})
        assert made.status_code == 201, made.text
        assert made.json()["budget"] == {"usd": 0.001, "period": "day"}
        secret = made.json()["key"]
        listed = http.get("/admin/keys", headers=ADMIN).json()["data"]
        assert [k["budget"] for k in listed] == [{"usd": 0.001, "period": "day"}]
    with openai.OpenAI(base_url=gateway.v1, api_key=secret, max_retries=0) as client:
        client.chat.completions.create(model="alpha", messages=MESSAGES)
        assert wait_for(lambda: [row["requests"] for row in usage_rows(gateway)] == [1])
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="alpha", messages=MESSAGES)
    assert refused.value.code == "budget_exceeded"
    made_by_command = keys_command(tmp_path, "create", "team-b", "--budget-usd", "2.5",
                                   "--budget-period", "day")
    assert made_by_command.returncode == 0, made_by_command.stderr
    listing = keys_command(tmp_path, "list").stdout
    assert "budget=2.5/day" in listing and "budget=0.001/day" in listing
