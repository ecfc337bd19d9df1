"""The two agent CLIs people point at a gateway, against `hedge-gateway serve`'s embedded demo:
OpenAI's Codex CLI (`codex exec`, the Responses API) and Anthropic's Claude Code (`claude -p`,
the Messages API), each a real subprocess (`tests.harness.agents` installs them from the npm
registry; the tests skip and say why where that cannot be done).

The gateway is the one `serve` runs (its server class, uvicorn, an ephemeral loopback port)
with the embedded default configuration, pool `demo` of simulated backends. Each CLI gets
what `docs/agents.md` tells a user to set, and a prompt; the round trip is: the CLI sends a
request that offers tools, the simulator answers with a call, the CLI runs the tool and sends
its result back, the simulator answers in text, the CLI prints it and exits 0.

What is checked, from three sides: the CLI (exit status, the final text on stdout); the
request log (one line per request, `status` 200, `reason` ok, model `demo`, for both
requests of the round trip); and the requests themselves, recorded in front of the gateway:
the first offers tools, a later one carries the tool's result under the id of the call the
simulator made, which only a CLI that ran the tool sends.

The simulator answers a request that offers tools with a call unless its last input is a
tool's result (`providers.sim.tools`), so one run of each CLI makes the whole round trip.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.settings import default_settings
from gateway.stats.requestlog import LOGGER_NAME
from tests.harness import LoopThread
from tests.harness.agents import CLAUDE_CODE, CODEX, AgentPackage, AgentUnavailable, ensure_agent
from tests.harness.limits_kit import Gateway, GatewayFactory, wait_for

POOL = "demo"
#: what the simulator's text answers are made of
SIM_TEXT = "tok0 tok1 tok2"
#: one CLI run, at most (each takes a few seconds here)
RUN_TIMEOUT = 180.0
PROMPT = "List the files in the current directory, then say what you found."


# ---- the requests, recorded in front of the gateway ---------------------------------------


@dataclass
class Exchange:
    method: str
    path: str
    body: bytes = b""
    status: int | None = None
    request_id: str | None = None

    def json(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.body) if self.body else {}
        return value


@dataclass
class Recorder:
    """An ASGI layer that keeps each HTTP request's method, path, body, status and the
    gateway's `x-request-id` (the id of its log line)."""

    app: ASGIApp
    exchanges: list[Exchange] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(scope["method"], scope["path"])
        self.exchanges.append(exchange)

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                exchange.body += message.get("body", b"")
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                for name, value in message.get("headers", []):
                    if name == b"x-request-id":
                        exchange.request_id = value.decode("latin-1")
            await send(message)

        await self.app(scope, recording_receive, recording_send)


@dataclass
class Demo:
    gateway: Gateway
    recorder: Recorder


def demo_of(loop_thread: LoopThread, apis: tuple[str, ...] | None = None) -> Demo:
    """The demo, recorded; `apis`: every demo backend narrowed to these APIs (the others
    reach it translated)."""
    holder: list[Recorder] = []

    def wrap(app: ASGIApp) -> ASGIApp:
        holder.append(Recorder(app))
        return holder[0]

    settings = default_settings()
    if apis is not None:
        pools = tuple(dataclasses.replace(pool, backends=tuple(
            dataclasses.replace(b, apis=apis) for b in pool.backends)) for pool in settings.pools)
        settings = dataclasses.replace(settings, pools=pools)
    gateway = GatewayFactory(loop_thread)(settings, wrap=wrap)
    return Demo(gateway, holder[0])


@pytest.fixture
def demo(loop_thread: LoopThread) -> Demo:
    return demo_of(loop_thread)


def agent(package: AgentPackage) -> Path:
    try:
        return ensure_agent(package)
    except AgentUnavailable as exc:
        pytest.skip(str(exc))


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: no proxy, no key, no user config of the machine's."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1"}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    exchanges: list[Exchange]


def run_round_trip(demo: Demo, command: list[str], env: dict[str, str], cwd: Path,
                   route: str, made_a_call: Callable[[list[Exchange]], bool]) -> Run:
    """Run the CLI once: it exits 0, prints the final answer, and its requests show the
    tool's result sent back for the simulator's call."""
    before = len(demo.recorder.exchanges)
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert wait_for(lambda: not demo.gateway.server.server_state.tasks)
    run = Run(done.returncode, done.stdout, done.stderr, demo.recorder.exchanges[before:])
    what = (f"exit {run.returncode}\nstdout:\n{run.stdout[-2000:]}\n"
            f"stderr:\n{run.stderr[-3000:]}")
    assert run.returncode == 0, what
    assert SIM_TEXT in run.stdout, what  # the final answer, printed
    calls = [x for x in run.exchanges if x.path == route]
    assert calls and all(x.status == 200 for x in calls), [(x.path, x.status) for x in calls]
    assert made_a_call(calls), f"no tool round trip in {len(calls)} requests\n{what}"
    return run


def logged(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    return {line["id"]: line for line in (
        json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME)}


def check_log(caplog: pytest.LogCaptureFixture, exchanges: list[Exchange], route: str) -> None:
    """Each request of the round trip has its one line: answered, model `demo`, its route."""
    lines = logged(caplog)
    for exchange in exchanges:
        assert exchange.request_id is not None
        line = lines[exchange.request_id]
        assert (line["route"], line["status"], line["reason"], line["model"], line["pool"]) == \
            (route, 200, "ok", POOL, POOL), line


# ---- Codex CLI --------------------------------------------------------------------------------


def codex_config(base_url: str) -> str:
    """What docs/agents.md gives a user: the gateway as a model provider speaking the
    Responses API, and the model `demo`; the tools an offline demo cannot serve (web search,
    image generation, sub-agents, goals) off, so the simulator's call goes to the shell or its
    companions."""
    return f'''model = "{POOL}"
model_provider = "hedge-gateway"
web_search = "disabled"

[model_providers.hedge-gateway]
name = "hedge-gateway"
base_url = "{base_url}"
env_key = "HEDGE_GATEWAY_KEY"
wire_api = "responses"

[features]
goals = false
multi_agent = false
image_generation = false
'''


def _codex_round_trip(calls: list[Exchange]) -> bool:
    """A later request carries the output of a call that it also lists as the model's."""
    for exchange in calls[1:]:
        items = exchange.json().get("input", [])
        made = {i.get("call_id") for i in items if i.get("type") == "function_call"}
        outputs = {i.get("call_id") for i in items if i.get("type") == "function_call_output"}
        if made & outputs:
            return True
    return False


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_codex_runs_a_tool_through_the_demo(
    demo: Demo, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    codex_round_trip(demo, tmp_path, caplog)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_codex_runs_a_tool_through_a_messages_only_pool(
    loop_thread: LoopThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The demo's backends narrowed to Messages (`apis: [messages]`): Codex's Responses
    requests (`store: false`, the whole input) reach them translated, and back."""
    demo = demo_of(loop_thread, ("messages",))
    run = codex_round_trip(demo, tmp_path, caplog)
    assert translated_to(demo, run) == {"responses->messages"}


def translated_to(demo: Demo, run: Run) -> set[str]:
    """The translations /hedge/stats counted for the demo pool (every request of `run` was
    one of them)."""
    stats = json.loads(httpx.get(demo.gateway.url("/hedge/stats"), timeout=5.0).text)
    counted = stats["pools"][POOL]["lifetime"]["translated"]
    calls = [x for x in run.exchanges if x.path.startswith("/v1/") and x.status == 200]
    assert sum(counted.values()) == len(calls), (counted, len(calls))
    return {name for name, count in counted.items() if count}


def codex_round_trip(demo: Demo, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Run:
    codex = agent(CODEX)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(demo.gateway.v1))
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hello from the test\n")
    env = {**base_env(tmp_path / "home"), "CODEX_HOME": str(codex_home),
           "HEDGE_GATEWAY_KEY": "demo-needs-no-key"}
    command = [str(codex), "exec", "--skip-git-repo-check", "--ephemeral",
               "--dangerously-bypass-approvals-and-sandbox", "--color", "never", PROMPT]
    run = run_round_trip(demo, command, env, work, "/v1/responses", _codex_round_trip)
    calls = [x for x in run.exchanges if x.path == "/v1/responses"]
    first = calls[0].json()
    assert first["model"] == POOL and first["stream"] is True
    assert any(t.get("name") == "exec_command" for t in first["tools"]), first["tools"]
    assert all(x.json()["model"] == POOL for x in calls)
    check_log(caplog, calls, "/v1/responses")
    return run


# ---- Claude Code ------------------------------------------------------------------------------


def claude_env(home: Path, base_url: str) -> dict[str, str]:
    """What docs/agents.md gives a user: the gateway as the Anthropic API, a token (the demo
    takes any), every model name the CLI may send set to the pool, no telemetry."""
    return {**base_env(home), "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_AUTH_TOKEN": "demo-needs-no-key", "ANTHROPIC_MODEL": POOL,
            "ANTHROPIC_SMALL_FAST_MODEL": POOL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": POOL,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": POOL, "ANTHROPIC_DEFAULT_OPUS_MODEL": POOL,
            "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def _claude_round_trip(calls: list[Exchange]) -> bool:
    """A later request's last turn answers a `tool_use` of the turn before it."""
    for exchange in calls[1:]:
        messages = exchange.json().get("messages", [])
        if len(messages) < 2:
            continue
        asked = {b.get("id") for b in _blocks(messages[-2]) if b.get("type") == "tool_use"}
        answered = {b.get("tool_use_id") for b in _blocks(messages[-1])
                    if b.get("type") == "tool_result"}
        if asked & answered:
            return True
    return False


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_claude_code_runs_a_tool_through_the_demo(
    demo: Demo, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    claude_round_trip(demo, tmp_path, caplog)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_claude_code_runs_a_tool_through_a_chat_only_pool(
    loop_thread: LoopThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The demo's backends narrowed to Chat Completions (`apis: [chat]`): Claude Code's
    Messages requests reach them translated, and its tool round trip completes."""
    demo = demo_of(loop_thread, ("chat",))
    run = claude_round_trip(demo, tmp_path, caplog)
    assert translated_to(demo, run) == {"messages->chat"}


def claude_round_trip(demo: Demo, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Run:
    claude = agent(CLAUDE_CODE)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hello from the test\n")
    env = claude_env(tmp_path / "home", demo.gateway.root)
    # root may not skip permissions: the tools are allowed by name instead
    command = [str(claude), "-p", PROMPT, "--tools", "Bash,Read",
               "--allowedTools", "Bash,Read", "--output-format", "text"]
    run = run_round_trip(demo, command, env, work, "/v1/messages", _claude_round_trip)
    calls = [x for x in run.exchanges if x.path == "/v1/messages"]
    first = calls[0].json()
    assert {t["name"] for t in first["tools"]} == {"Bash", "Read"}
    # every model name it sent is the pool's: nothing was refused as an unknown model
    assert {x.json()["model"] for x in calls} == {POOL}
    assert not [x for x in run.exchanges if x.status == 404 and x.path.startswith("/v1/")]
    check_log(caplog, calls, "/v1/messages")
    return run
