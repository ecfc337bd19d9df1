"""Every inference route where features meet: route x streamed/whole x after a reload x with
client keys, through the real gateway (`GatewayServer`, what `serve` runs, under uvicorn)
with loopback simulators as its upstreams (OpenAI- and Anthropic-shaped backends).

The cases are generated from the route table (`gateway.api.inference.INFERENCE_ROUTES`): a
route added there is tried here in every combination. Each case checks the answer (status,
the protocol's end of stream or body), that a request without the key is refused in the
route's shape, and that nothing stays admitted afterwards; `max_concurrent_requests` is
small, so a request that kept its slot would turn the next ones into 503s. The reload is
the SIGHUP path (`Reloader.reload_file`) with the file unchanged, in the gateway's loop.

The two-workers dimension is `test_every_route_under_two_workers_and_a_sighup`: the same
checks against `hedge-gateway serve --workers 2` in a subprocess, SIGHUP sent for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api.inference import INFERENCE_ROUTES, InferenceRoute
from gateway.api.inference import route as route_of
from gateway.settings import SimProfile, load_settings
from providers.sim.server import create_sim_app
from tests.e2e.test_cli import command, free_port, keyless_env
from tests.harness import AsgiServerFactory, LoopThread, RunningServer
from tests.harness.bodies import smallest_body
from tests.harness.limits_kit import Gateway, GatewayFactory

POOL = "pool"
KEY = "client-key"
#: small, so a request that kept its admission slot shows as 503s within a few cases
MAX_CONCURRENT = 4
#: how each upstream route's whole answer says it is one (a new route: status and JSON only)
WHOLE_ANSWERS: dict[tuple[str, str], tuple[str, Any]] = {
    ("chat/completions", ""): ("object", "chat.completion"),
    ("completions", ""): ("object", "text_completion"),
    ("embeddings", ""): ("object", "list"),
    ("responses", ""): ("object", "response"),
    ("responses/item", "GET"): ("object", "response"),
    ("responses/item", "DELETE"): ("deleted", True),
    ("responses/item", "POST"): ("object", "response"),
    ("responses/item", "GET/input_items"): ("object", "list"),
    ("messages", ""): ("type", "message"),
    ("messages/count_tokens", ""): ("input_tokens", 1),
}
#: the event that ends each streamed route's answer
STREAM_ENDS = {"chat/completions": "data: [DONE]", "completions": "data: [DONE]",
               "responses": "event: response.completed", "messages": "event: message_stop"}

CASES = [
    pytest.param(r, stream, reloaded, keyed,
                 id=f"{r.method} {r.path} {'stream' if stream else 'whole'}"
                    f"{' reloaded' if reloaded else ''}{' keyed' if keyed else ''}")
    for r in INFERENCE_ROUTES
    for stream in ((False, True) if r.streams else (False,))
    for reloaded in (False, True)
    for keyed in (False, True)
]


def config(backends: str, *, keyed: bool, port: int = 0) -> str:
    keys = f", api_keys: [{KEY}]" if keyed else ""
    return (f"server: {{host: 127.0.0.1, port: {port}, max_concurrent_requests: "
            f"{MAX_CONCURRENT}{keys}}}\n"
            f"pools:\n  - name: {POOL}\n"
            "    hedging: {delay: {mode: fixed, value: 300ms}}\n"
            f"    backends:\n{backends}")


def loopback_backends(sims: list[RunningServer]) -> str:
    lines = []
    for i, sim in enumerate(sims):
        lines.append(f"      - {{name: o{i}, provider: openai, base_url: '{sim.v1}', "
                     f"model: m, group: g{i}}}\n")
        lines.append(f"      - {{name: a{i}, provider: anthropic, base_url: "
                     f"'{sim.base_url}', model: m, group: g{i}}}\n")
    return "".join(lines)


SIM_BACKENDS = "".join(
    f"      - {{name: s{i}, provider: sim, model: m, group: g{i}, sim: {{ttft_median: 5ms, "
    f"ttft_sigma: 0.1, straggler_probability: 0, tokens: 3, inter_token: 1ms, seed: {i}}}}}\n"
    for i in range(2))


# ---- one request of a route, and what its answer must be -------------------------------------


def credentials(route: InferenceRoute, key: str | None) -> dict[str, str]:
    if key is None:
        return {}
    return {"x-api-key": key} if route.x_api_key else {"authorization": f"Bearer {key}"}


def body_for(route: InferenceRoute, stream: bool) -> dict[str, Any] | None:
    return smallest_body(route, POOL, stream)


def stored_response(client: httpx.Client, key: str | None) -> str:
    """A response the gateway stored (and remembers the backend of): its id."""
    made = client.post("/v1/responses", json={"model": POOL, "input": "hi"},
                       headers=credentials(route_of("POST", "/v1/responses"), key))
    assert made.status_code == 200, made.text
    response_id: str = made.json()["id"]
    return response_id


def send(client: httpx.Client, route: InferenceRoute, stream: bool,
         key: str | None) -> httpx.Response:
    path = route.path
    if route.stored:
        path = path.replace("{response_id}", stored_response(client, key))
    body = body_for(route, stream)
    with client.stream(route.method, path, json=body, headers=credentials(route, key)) as r:
        r.read()
    return r


def check_answer(route: InferenceRoute, stream: bool, response: httpx.Response) -> None:
    what = f"{route.method} {route.path} stream={stream}: {response.text[:300]}"
    assert response.status_code == 200, what
    if stream:
        assert response.headers["content-type"].startswith("text/event-stream"), what
        blocks = [b for b in response.text.replace("\r\n", "\n").split("\n\n") if b.strip()]
        assert STREAM_ENDS[route.endpoint] in blocks[-1], what
        for block in blocks:
            assert not block.startswith("event: error"), what
            data = block.split("data: ", 1)[-1]
            if data.startswith("{") and STREAM_ENDS[route.endpoint].startswith("data:"):
                assert "error" not in json.loads(data), what
        return
    assert response.headers["content-type"].startswith("application/json"), what
    answer = response.json()
    suffix = route.path.rsplit("}", 1)[-1] if route.stored else ""
    expected = WHOLE_ANSWERS.get(
        (route.endpoint, f"{route.method}{suffix}" if route.stored else ""))
    if expected is not None:
        field, value = expected
        assert answer.get(field) == value, what


def check_refused(route: InferenceRoute, response: httpx.Response) -> None:
    """Without the key: 401, in the route's shape."""
    assert response.status_code == 401, response.text
    body = response.json()
    if route.errors == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["code"] == "invalid_api_key", body


def exercise(client: httpx.Client, route: InferenceRoute, stream: bool,
             keyed: bool) -> None:
    """The route answered correctly, more times than there are admission slots."""
    key = KEY if keyed else None
    for _ in range(MAX_CONCURRENT + 1):
        check_answer(route, stream, send(client, route, stream, key))
    if keyed:
        path = route.path.replace("{response_id}", "resp_unknown")
        with client.stream(route.method, path, json=body_for(route, stream)) as refused:
            refused.read()
        check_refused(route, refused)


# ---- in this process: the gateway and its simulators in the loop thread ------------------------


@pytest.fixture
def sims(asgi_server: AsgiServerFactory) -> list[RunningServer]:
    profile = SimProfile(ttft_median=0.005, ttft_sigma=0.1, straggler_probability=0.0,
                         tokens=3, inter_token=0.001)
    return [asgi_server(create_sim_app(profile, seed=i)) for i in range(2)]


def reload(loop_thread: LoopThread, gateway: Gateway, path: Path) -> None:
    """What SIGHUP does, on the gateway's loop: re-read the (unchanged) file and swap."""

    async def sighup() -> bool:
        reloaded: bool = gateway.app.state.reloader.reload_file(str(path))
        return reloaded

    assert loop_thread.run(sighup())
    assert gateway.app.state.live.current.number == 2


def _admitted(gateway: Gateway) -> int:
    active: int = gateway.app.state.proxy.admission.active
    return active


@pytest.mark.parametrize(("route", "stream", "reloaded", "keyed"), CASES)
def test_every_route_answers_in_every_combination(
    route: InferenceRoute, stream: bool, reloaded: bool, keyed: bool,
    sims: list[RunningServer], loop_thread: LoopThread, tmp_path: Path,
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(config(loopback_backends(sims), keyed=keyed))
    gateway = GatewayFactory(loop_thread)(load_settings(str(path)))
    if reloaded:
        reload(loop_thread, gateway, path)
    with httpx.Client(base_url=gateway.root, timeout=10.0, trust_env=False) as client:
        exercise(client, route, stream, keyed)
    deadline = time.monotonic() + 5.0
    while _admitted(gateway) and time.monotonic() < deadline:  # ends run after answers
        time.sleep(0.01)
    assert _admitted(gateway) == 0
    for pool in gateway.app.state.live.current.pools.values():
        assert pool.inflight_requests == 0


# ---- under `serve --workers 2`, SIGHUP sent for real --------------------------------------------


@pytest.fixture(params=[False, True], ids=["keyless", "keyed"])
def two_workers(request: pytest.FixtureRequest,
                tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, bool]]:
    keyed: bool = request.param
    port = free_port()
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(config(SIM_BACKENDS, keyed=keyed, port=port))
    log = tmp_path / "serve.log"
    (tmp_path / "tmp").mkdir()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command(), "serve", "--config", str(cfg), "--workers", "2"],
            cwd=tmp_path, env={**keyless_env(), "TMPDIR": str(tmp_path / "tmp")},
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    root = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: proc.poll() is not None or len(_workers(root)) == 2, proc, log)
        yield proc, root, log, keyed
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15.0)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5.0)


def _workers(root: str) -> list[Any]:
    try:
        doc = httpx.get(root + "/hedge/stats", timeout=2.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return []
    workers: list[Any] = doc.get("workers", [])
    return workers


def _generations(root: str) -> set[int]:
    """The configuration generation each worker reports (a fresh connection each time, so
    the kernel spreads the probes over both)."""
    seen = set()
    for _ in range(12):
        doc = httpx.get(root + "/hedge/stats", timeout=2.0, trust_env=False,
                        headers={"connection": "close"}).json()
        seen.add(doc["config"]["generation"])
    return seen


def _until(probe: Any, proc: subprocess.Popen[bytes], log: Path, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while not probe():
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {bound}s:\n{log.read_text()}")
        time.sleep(0.1)  # polling for an effect, not a timing assertion


@pytest.mark.timeout(120)
def test_every_route_under_two_workers_and_a_sighup(
    two_workers: tuple[subprocess.Popen[bytes], str, Path, bool],
) -> None:
    """Each request on a connection of its own, so both workers serve, and a stored-response
    operation meets the worker that made the response or the other one, whichever the kernel
    picks. Either must answer it: the response's id carries its pool, backend and upstream
    id, signed with the secret the supervisor gives every worker, so no worker needs to have
    seen it; a 404 here is a broken lookup, never "made by the other worker"."""
    proc, root, log, keyed = two_workers
    for reloaded in (False, True):
        if reloaded:
            proc.send_signal(signal.SIGHUP)
            _until(lambda: _generations(root) == {2}, proc, log)
        for route in INFERENCE_ROUTES:
            for stream in ((False, True) if route.streams else (False,)):
                with httpx.Client(base_url=root, timeout=10.0, trust_env=False,
                                  headers={"connection": "close"}) as client:
                    exercise(client, route, stream, keyed)
    code = proc.poll()
    assert code is None, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()

