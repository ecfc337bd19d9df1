"""Helpers shared by the failure, security and lifecycle tests (tests/test_failures.py,
tests/test_security.py, tests/test_lifecycle.py).

- `GatewayFactory`: the gateway under `gateway.server.serve.GatewayServer` (what `hedge-gateway
  serve` runs: bounded request heads, the abort hook for stuck clients, the drain) in the
  test's loop thread, stopped at teardown like the harness's servers.
- raw HTTP/1.1 over a socket, for what the SDKs cannot do (lie about lengths, never read).
- `Canary`: one secret string and a scan of every place it must never appear.
- `held_stream`/`data_lines`: a stream that waits on a gate after its first token, and a
  reader of its SSE lines; `wait_for` polls for a condition within a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from starlette.types import ASGIApp

from gateway.app import create_app
from gateway.server.serve import GatewayServer, build_server
from gateway.settings import Settings
from tests.harness import (
    DONE,
    SSE_HEADERS,
    Gate,
    Head,
    LoopThread,
    RecordedRequest,
    Script,
    Send,
    Step,
    Wait,
    finish_chunk,
    role_chunk,
    token_chunk,
)
from tests.harness.builders import POOL
from tests.harness.leaks import gateway_in_use

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


# ---- the gateway under its own server class, in the loop thread ------------------------------


@dataclass(frozen=True)
class Gateway:
    app: FastAPI
    server: GatewayServer
    port: int

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return self.root + "/v1"

    def url(self, path: str) -> str:
        return self.root + path


class GatewayFactory:
    """`factory(settings) -> Gateway`: `create_app` + `build_server`, listening on an
    ephemeral loopback port; stopped (gracefully, then by force) at teardown."""

    def __init__(self, loop_thread: LoopThread) -> None:
        self._lt = loop_thread

    def __call__(self, settings: Settings, *, seed: int = 7,
                 wrap: Callable[[ASGIApp], ASGIApp] | None = None) -> Gateway:
        """`wrap`: an ASGI layer the server runs in front of the app (a test's recorder)."""

        async def start() -> tuple[Gateway, asyncio.Task[None], socket.socket]:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            sock.setblocking(False)
            port: int = sock.getsockname()[1]
            app = create_app(settings, seed=seed)
            front = app if wrap is None else wrap(app)
            server = build_server(front, settings.server, app.state.drain, log_config=None)
            task = asyncio.create_task(server.serve(sockets=[sock]), name=f"gateway-{port}")
            deadline = asyncio.get_running_loop().time() + 10.0
            while not server.started and not task.done():
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError("gateway did not start")
                await asyncio.sleep(0.01)
            if task.done():
                task.result()
            return Gateway(app, server, port), task, sock

        gateway, task, sock = self._lt.run(start(), 15.0)

        async def stop() -> None:
            if not task.done():
                gateway.server.should_exit = True
                await asyncio.wait({task}, timeout=10.0)
            if not task.done():
                gateway.server.force_exit = True
                task.cancel()
                await asyncio.wait({task}, timeout=2.0)
            sock.close()

        self._lt.add_cleanup(stop)
        self._lt.add_live_check(lambda: gateway_in_use(gateway.app))
        return gateway


@contextlib.contextmanager
def sdk(base_url: str, *, api_key: str = "sk-client",
        timeout: float = 10.0) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=openai.Timeout(timeout)
    ) as client:
        yield client


def stream_content(client: openai.OpenAI, **extra: Any) -> tuple[str, dict[str, str]]:
    """A streamed chat completion of the pool `POOL`: its content and response headers."""
    with client.chat.completions.with_streaming_response.create(
        model=POOL, messages=MESSAGES, stream=True, **extra
    ) as response:
        headers = dict(response.headers)
        text = ""
        for chunk in response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    return text, headers


def stats_of(root: str) -> dict[str, Any]:
    reply: dict[str, Any] = httpx.get(root + "/hedge/stats", timeout=5.0).json()
    return reply


def pool_errors(root: str, pool: str, *, settle: Mapping[str, int] | None = None) -> dict[str, int]:
    """The pool's lifetime error classes; with `settle`, poll until at least those counts are
    reached (a request is recorded only once it has fully ended)."""
    deadline = time.monotonic() + 5.0
    while True:
        errors: dict[str, int] = stats_of(root)["pools"][pool]["lifetime"]["errors"]
        if settle is None or all(errors.get(k, 0) >= v for k, v in settle.items()):
            return errors
        if time.monotonic() > deadline:
            return errors
        time.sleep(0.02)  # polling, not a timing assertion


def pool_errors_now(loop_thread: LoopThread, app: FastAPI, pool: str, *,
                    settle: Mapping[str, int]) -> dict[str, int]:
    """`pool_errors` read in the gateway's loop as of now, not from `/hedge/stats` (built at
    most once a second): for a test that must see a count the moment it is reached, before
    a client's retry after its pause can add to it."""
    deadline = time.monotonic() + 5.0
    while True:
        doc = loop_thread.call(app.state.stats_source.document)
        errors: dict[str, int] = doc["pools"][pool]["lifetime"]["errors"]
        if all(errors.get(k, 0) >= v for k, v in settle.items()) or time.monotonic() > deadline:
            return errors
        time.sleep(0.01)  # polling, not a timing assertion


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll until `predicate()` holds; False if it did not within `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)  # polling, not a timing assertion
    return True


# ---- held streams -----------------------------------------------------------------------------


def held_stream(gate: Gate) -> Script:
    """A stream that sends its first token, then waits for `gate`, then ends properly."""
    steps: list[Step] = [Head(), Send(role_chunk()), Send(token_chunk("first")), Wait(gate),
                         Send(token_chunk(" second")), Send(finish_chunk()), Send(DONE)]
    return Script(headers=SSE_HEADERS, steps=steps)


def holding(gate: Gate, otherwise: Script) -> Callable[[RecordedRequest], Script]:
    """A responder: a request with `"user": "held"` gets `held_stream(gate)`, any other
    `otherwise` (the tests that hold one slot or connection and send a second)."""

    def respond(request: RecordedRequest) -> Script:
        return held_stream(gate) if request.body.get("user") == "held" else otherwise

    return respond


def data_lines(lines: Iterator[str], until: str) -> list[str]:
    """Read SSE `data:` lines up to and including the first that contains `until`."""
    seen = []
    for line in lines:
        if line.startswith("data:"):
            seen.append(line)
            if until in line:
                return seen
    raise AssertionError(f"stream ended before {until!r}: {seen}")


# ---- raw HTTP/1.1 -----------------------------------------------------------------------------


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(port: int, *, timeout: float = 5.0, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the window is small from the handshake on
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    return sock


def request_head(
    path: str, headers: Mapping[str, str], *, method: str = "POST"
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: localhost"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def read_response(sock: socket.socket) -> RawResponse:
    """One response with a Content-Length body (what the gateway's JSON errors use)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"connection closed before a full head: {buf!r}")
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        data = sock.recv(65536)
        if not data:
            break
        rest += data
    return RawResponse(int(status_line.split()[1]), headers, rest[:length])


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True once the other side closed (EOF or reset); reads and drops anything pending."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


# ---- canary scans -----------------------------------------------------------------------------


class Canary:
    """A secret that must never leave where it was put: responses, headers, logs, stats and
    metrics are scanned for it (and for anything else listed in `also`)."""

    def __init__(self, value: str, *also: str) -> None:
        self.value = value
        self.needles = (value, *also)

    def assert_absent(self, where: str, text: str) -> None:
        for needle in self.needles:
            assert needle not in text, f"{needle!r} leaked into {where}"

    def assert_absent_everywhere(
        self, root: str, caplog: pytest.LogCaptureFixture, *responses: str
    ) -> None:
        for i, text in enumerate(responses):
            self.assert_absent(f"response {i}", text)
        self.assert_absent("/hedge/stats", httpx.get(root + "/hedge/stats", timeout=5.0).text)
        self.assert_absent("/metrics", httpx.get(root + "/metrics", timeout=5.0).text)
        self.assert_absent("logs", caplog.text)
        for record in caplog.records:
            self.assert_absent(f"log record {record.name}", record.getMessage())
            self.assert_absent(
                f"log record {record.name} (structured)",
                json.dumps(getattr(record, "hedge_request", None)),
            )


def verbose_logs(caplog: pytest.LogCaptureFixture) -> None:
    """What an operator runs: INFO everywhere, DEBUG for the gateway's own loggers."""
    caplog.set_level(logging.INFO)
    for name in ("hedge_gateway", "gateway", "providers"):
        caplog.set_level(logging.DEBUG, logger=name)


def error_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log lines that would alarm an operator: errors, and any traceback at all."""
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.ERROR or r.exc_info is not None
    ]
