"""Reload without a restart, for real: `hedge-gateway serve --config FILE` in a
subprocess, the file rewritten, SIGHUP sent.

A valid file takes effect for new requests (a new pool serves, a changed delay is in force),
a stream that started before the reload finishes on the old configuration even though its
pool was removed, and the pools and backends that keep their name keep their statistics and
their learnt hedge-delay sketch. An invalid file changes nothing and the log names its key
path. A subprocess, because signals and the CLI's wiring are the point.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_cli import (
    command,
    free_port,
    keyless_env,
    terminate,
    wait_healthy,
)

#: bound on every poll, so a broken product fails the test instead of hanging it
POLL_TIMEOUT = 10.0
FAST = ("{ttft_median: 5ms, ttft_sigma: 0.1, straggler_probability: 0, tokens: 3, "
        "inter_token: 1ms, seed: %d}")
#: the in-flight stream: 40 tokens 50 ms apart, so it outlives the reload by far
SLOW_TOKENS = 40
SLOW = ("{ttft_median: 5ms, ttft_sigma: 0.1, straggler_probability: 0, "
        f"tokens: {SLOW_TOKENS}, inter_token: 50ms, seed: 9}}")


def config(pools: str) -> str:
    return f"server: {{host: 127.0.0.1, port: 8080}}\npools:\n{pools}"


def chat_pool(initial: str, backends: list[str]) -> str:
    lines = [
        "  - name: chat\n",
        f"    hedging: {{max_attempts: 2, delay: {{initial: {initial}, min_samples: 20}}}}\n",
        "    backends:\n",
    ]
    lines += [f"      - {{name: {b}, provider: sim, sim: {FAST % i}}}\n"
              for i, b in enumerate(backends, 1)]
    return "".join(lines)


OLD = config(
    chat_pool("300ms", ["a"])
    + "  - name: slow\n    backends:\n"
    + f"      - {{name: s, provider: sim, sim: {SLOW}}}\n"
)
NEW = config(
    chat_pool("200ms", ["a", "b"])
    + "  - name: fresh\n    backends:\n"
    + f"      - {{name: f, provider: sim, sim: {FAST % 7}}}\n"
)
#: two errors with their key paths: a bad duration and an unknown key
INVALID = config(
    "  - name: chat\n    timeout: soon\n    backends:\n"
    f"      - {{name: a, provider: sim, colour: blue, sim: {FAST % 1}}}\n"
)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, Path]]:
    """`hedge-gateway serve --config FILE --port N`; killed at teardown if still running."""
    port = free_port()
    log = tmp_path / "serve.log"
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(OLD)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command(), "serve", "--config", str(cfg), "--port", str(port)],
            cwd=tmp_path, env=keyless_env(), stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        yield proc, f"http://127.0.0.1:{port}", log, cfg
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)


def stream_chat(client: httpx.Client, model: str) -> str:
    """One streaming request; the content, checked to end with [DONE] and no error event."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        return collect(response.iter_lines())


def collect(lines: Iterator[str]) -> str:
    content, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        assert "error" not in event, event
        for choice in event.get("choices", []):
            content.append(choice["delta"].get("content") or "")
    assert done, "the stream ended without [DONE]"
    return "".join(content)


def stats(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/hedge/stats")
    assert response.status_code == 200
    doc: dict[str, Any] = response.json()
    return doc


def poll(what: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT
    while not what():
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached within {POLL_TIMEOUT}s:\n{log.read_text()}")
        time.sleep(0.05)  # polling for an effect, not a timing assertion


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sighup_applies_a_new_file_keeps_learnt_state_and_finishes_inflight_streams(
    gateway: tuple[subprocess.Popen[bytes], str, Path, Path],
) -> None:
    proc, root, log, cfg = gateway
    wait_healthy(proc, root + "/healthz", log)
    old_sum = sha256(cfg)
    with httpx.Client(base_url=root, timeout=10.0, trust_env=False) as client, \
            httpx.Client(base_url=root, timeout=10.0, trust_env=False) as side:
        for _ in range(25):
            assert stream_chat(client, "chat") == "tok0 tok1 tok2 "
        # the delay is refreshed every 16 samples or each second: 25 samples >= min_samples
        poll(lambda: stats(client)["pools"]["chat"]["backends"]["a"]["hedge_delay_mode"]
             == "adaptive", proc, log)
        before = stats(client)
        assert before["config"]["sha256"] == old_sum
        assert before["config"]["source"] == "file"
        assert before["config"]["generation"] == 1
        assert before["config"]["loaded_at"].endswith("+00:00")
        chat_before = before["pools"]["chat"]
        a_before = chat_before["backends"]["a"]
        assert chat_before["lifetime"]["requests"] == 25

        body = {"model": "slow", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        with client.stream("POST", "/v1/chat/completions", json=body) as inflight:
            assert inflight.status_code == 200
            lines = inflight.iter_lines()
            first = next(line for line in lines if '"content"' in line)  # streaming now

            cfg.write_text(NEW)
            proc.send_signal(signal.SIGHUP)
            poll(lambda: stats(side)["config"]["generation"] == 2, proc, log)

            after = stats(side)
            # new requests see the new file: the new pool serves, the removed one is gone
            assert stream_chat(side, "fresh") == "tok0 tok1 tok2 "
            gone = side.post("/v1/chat/completions",
                             json={**body, "stream": False})
            assert gone.status_code == 404
            # ... while the stream that started on the removed pool runs to its end
            rest = collect(lines)
        assert json.loads(first[6:])["choices"][0]["delta"].get("content") is not None
        assert len((first + rest).split("tok")) - 1 == SLOW_TOKENS

        metrics = side.get("/metrics").text  # the metrics follow the new layout too
        assert 'pool="fresh"' in metrics and 'pool="slow"' not in metrics
        assert after["config"]["sha256"] == sha256(cfg) != old_sum
        assert set(after["pools"]) == {"chat", "fresh"}
        chat = after["pools"]["chat"]
        # the surviving pool and backend kept their counters and latency sketches ...
        assert chat["lifetime"]["requests"] == 25
        assert chat["lifetime"]["ttft_ms"]["count"] == chat_before["lifetime"]["ttft_ms"]["count"]
        assert chat["backends"]["a"]["lifetime"] == a_before["lifetime"]
        # ... and its hedge-delay sketch: still adaptive, where a fresh one would be `initial`
        assert chat["backends"]["a"]["hedge_delay_mode"] == "adaptive"
        # the new backend starts fresh, under the changed initial delay
        assert chat["backends"]["b"]["lifetime"]["attempts"] == 0
        assert chat["backends"]["b"]["hedge_delay_mode"] == "initial"
        assert chat["backends"]["b"]["hedge_delay_ms"] == 200.0

        # an invalid file changes nothing, and the log names the key paths
        cfg.write_text(INVALID)
        proc.send_signal(signal.SIGHUP)
        poll(lambda: stats(side)["config"]["failed_reloads"] == 1, proc, log)
        kept = stats(side)
        assert kept["config"]["generation"] == 2
        assert kept["config"]["sha256"] == after["config"]["sha256"]
        assert set(kept["pools"]) == {"chat", "fresh"}
        assert stream_chat(side, "fresh") == "tok0 tok1 tok2 "
        assert stream_chat(side, "chat") == "tok0 tok1 tok2 "
        poll(lambda: "pools[0].backends[0].colour" in log.read_text(), proc, log)
        output = log.read_text()
        assert "pools[0].timeout" in output
        assert "reload refused" in output

    code, output = terminate(proc, log)
    assert code == 0, output
    assert "Traceback" not in output, output


def test_sighup_without_a_config_file_keeps_serving(tmp_path: Path) -> None:
    """With the embedded default there is nothing to re-read: SIGHUP must not kill the
    gateway (its default action would)."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command(), "serve", "--port", str(port)], cwd=tmp_path, env=keyless_env(),
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        root = f"http://127.0.0.1:{port}"
        wait_healthy(proc, root + "/healthz", log)
        proc.send_signal(signal.SIGHUP)
        poll(lambda: "no configuration file to re-read" in log.read_text(), proc, log)
        with httpx.Client(base_url=root, timeout=10.0, trust_env=False) as client:
            doc = stats(client)
        assert doc["config"]["source"] == "embedded"
        assert len(doc["config"]["sha256"]) == 64
        code, output = terminate(proc, log)
        assert code == 0, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)


def keyed_config(keys: list[str], secret_url: bool = False) -> str:
    server = f"server: {{host: 127.0.0.1, port: 8080, api_keys: {json.dumps(keys)}}}\n"
    backend = ("      - {name: u, provider: openai, model: m, api_key: k, "
               "base_url: 'http://[${UPSTREAM_HOST}]/v1'}\n") if secret_url else ""
    return server + "pools:\n" + chat_pool("300ms", ["a"]) + backend


@pytest.fixture
def upstream_host_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value the served process reads from its environment (set before it starts)."""
    monkeypatch.setenv("UPSTREAM_HOST", "secret-host-value")


def test_sighup_with_new_api_keys_puts_them_in_force_and_a_bad_file_is_refused_quietly(
    upstream_host_env: None, gateway: tuple[subprocess.Popen[bytes], str, Path, Path]
) -> None:
    """Rotating a leaked key must not need a restart; a file whose error involves a value
    from the environment is refused, counted, and the value is not in the log."""
    proc, root, log, cfg = gateway
    wait_healthy(proc, root + "/healthz", log)
    cfg.write_text(keyed_config(["key-old-0001"]))
    proc.send_signal(signal.SIGHUP)

    def status(key: str) -> int:
        with httpx.Client(base_url=root, timeout=10.0, trust_env=False) as client:
            body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
            return client.post("/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {key}"}).status_code

    poll(lambda: status("nothing") == 401, proc, log)
    assert status("key-old-0001") == 200
    cfg.write_text(keyed_config(["key-new-0002"]))
    proc.send_signal(signal.SIGHUP)
    poll(lambda: status("key-new-0002") == 200, proc, log)
    assert status("key-old-0001") == 401
    assert "server.api_keys changed" in log.read_text()
    assert "key-new-0002" not in log.read_text()

    cfg.write_text(keyed_config(["key-new-0002"], secret_url=True))
    proc.send_signal(signal.SIGHUP)
    with httpx.Client(base_url=root, timeout=10.0, trust_env=False) as side:
        poll(lambda: stats(side)["config"]["failed_reloads"] == 1, proc, log)
    assert status("key-new-0002") == 200
    output = log.read_text()
    assert "reload refused" in output and "${UPSTREAM_HOST}" in output
    assert "secret-host-value" not in output and "Traceback" not in output
