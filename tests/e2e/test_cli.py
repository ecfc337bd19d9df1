"""The README newcomer path, for real: `hedge-gateway serve` in a subprocess with no config and
no keys in its environment serves the embedded `demo` pool, the official SDK
streams a chat completion from it, and SIGTERM stops it cleanly.

A subprocess, not the in-process harness, because this is about what a newcomer runs: the
console script, the argument parsing, uvicorn's own signal handling and exit status.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import openai
import pytest

#: bounds on each wait, so a broken product fails the test instead of hanging it
START_TIMEOUT = 8.0
STOP_TIMEOUT = 8.0
#: the demo backends' deterministic content: 30 tokens, token i is "tok{i} "
DEMO_CONTENT = "".join(f"tok{i} " for i in range(30))


CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def command() -> list[str]:
    """The `hedge-gateway` console script of the interpreter running the tests, if
    installed next to it; else the same entry point through `-m`."""
    script = Path(sys.executable).with_name("hedge-gateway")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "gateway.cli"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def keyless_env() -> dict[str, str]:
    """The test's environment minus anything that looks like a key or a config path."""
    env = {
        name: value
        for name, value in os.environ.items()
        if "API_KEY" not in name.upper() and not name.upper().startswith(("OPENAI_", "GATEWAY"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url, timeout=0.5, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # polling for start-up, not a timing assertion
    pytest.fail(f"serve did not answer {url} within {START_TIMEOUT}s:\n{log.read_text()}")


@contextlib.contextmanager
def serving(
    tmp_path: Path,
    *,
    preexec_fn: Callable[[], None] | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`hedge-gateway serve --port N [args]`, run from an empty directory (no config file
    nearby) with the keyless environment plus `env`; killed at the end if the test did not
    stop it."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command(), "serve", "--port", str(port), *args],
            cwd=tmp_path,
            env={**keyless_env(), **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    with serving(tmp_path) as started:
        yield started


def test_serve_with_no_config_streams_the_demo_pool_and_stops_on_sigterm(
    served: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    proc, root, log = served
    wait_healthy(proc, root + "/healthz", log)

    models = httpx.get(root + "/v1/models", timeout=5.0, trust_env=False).json()
    assert [m["id"] for m in models["data"]] == ["demo"]

    # The gateway needs no key; the SDK insists on some string, and it must not matter.
    with openai.OpenAI(
        base_url=root + "/v1", api_key="unused", max_retries=0, timeout=openai.Timeout(8.0)
    ) as client:
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hello"}], stream=True
        )
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == DEMO_CONTENT
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"

    code, output = terminate(proc, log)
    # a graceful stop: uvicorn drained and ran the app's shutdown (which closes the upstream
    # client); the exit status itself is checked by the next test
    assert code in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output, output
    assert "Traceback" not in output, output
    assert "pool 'demo'" in output  # the banner says what is served


def test_serve_exits_with_status_0_after_a_graceful_sigterm(
    served: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    proc, root, log = served
    wait_healthy(proc, root + "/healthz", log)
    code, output = terminate(proc, log)
    assert "Application shutdown complete" in output, output
    assert code == 0, output


#: the soft open-file limit many systems start a service with is 1024; lower still here
LOW_SOFT_LIMIT = 256


def _lower_open_file_limit() -> None:
    """Runs in the child before `exec`: a small soft limit under the unchanged hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_SOFT_LIMIT, hard))


def open_file_limits(pid: int) -> tuple[str, str]:
    """(soft, hard) open-file limits of a running process, as the kernel reports them."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError(f"no open-file limit for process {pid}")


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="needs Linux /proc")
def test_serve_raises_its_open_file_soft_limit_to_the_hard_limit(tmp_path: Path) -> None:
    """1,000 streams hold 2,000 sockets: a gateway left at a 1024 soft limit would fail to
    accept or connect long before `max_connections`."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= LOW_SOFT_LIMIT:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise to")
    with serving(tmp_path, preexec_fn=_lower_open_file_limit) as (proc, root, log):
        wait_healthy(proc, root + "/healthz", log)
        soft_now, hard_now = open_file_limits(proc.pid)
        assert soft_now == hard_now, log.read_text()
        assert int(soft_now) > LOW_SOFT_LIMIT
        code, output = terminate(proc, log)
    assert f"open-file limit {soft_now} (raised from {LOW_SOFT_LIMIT})" in output
    assert code == 0, output


def terminate(proc: subprocess.Popen[bytes], log: Path) -> tuple[int, str]:
    """SIGTERM, then the exit status and the whole log, within a bound."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve ignored SIGTERM for {STOP_TIMEOUT}s:\n{log.read_text()}")
    return code, log.read_text()


def test_check_config_command_exit_codes_and_messages(tmp_path: Path) -> None:
    """The real `hedge-gateway check-config`: 0 on a good file, non-zero on a broken one with
    the key path and the missing variable named on stderr."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("API_KEY")}
    env.pop("NOT_SET_ANYWHERE", None)
    good = subprocess.run(
        [*command(), "check-config", str(CONFIG_DIR / "demo.yaml")],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert good.returncode == 0, good.stderr
    assert "demo" in good.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "pools:\n"
        "  - name: p\n"
        "    backends:\n"
        "      - {name: a, provider: openai, model: m, base_url: 'ftp://x'}\n"
        "      - {name: b, provider: openai, model: m, base_url: 'http://127.0.0.1:1/v1',\n"
        "         api_key: '${NOT_SET_ANYWHERE}'}\n"
    )
    bad = subprocess.run(
        [*command(), "check-config", str(broken)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert bad.returncode != 0
    assert "pools[0].backends[0].base_url" in bad.stderr
    assert "NOT_SET_ANYWHERE" in bad.stderr
    assert "pools[0].backends[1].api_key" in bad.stderr


def test_output_piped_into_a_reader_that_stops_is_not_a_traceback() -> None:
    """`hedge-gateway schema | head -c 10`: the reader closes the pipe early (here before the
    command has even started writing); the command ends quietly instead of printing a
    BrokenPipeError traceback."""
    schema = subprocess.Popen([*command(), "schema"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert schema.stdout is not None and schema.stderr is not None
    schema.stdout.close()
    err = schema.stderr.read().decode()
    assert schema.wait(timeout=60) == 0
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_serve_off_loopback_without_client_keys_logs_one_warning_at_start(
    tmp_path: Path,
) -> None:
    """The image's `--host 0.0.0.0` with no keys serves anyone who reaches the port: serve
    says so once, before it listens. Only 127.0.0.1 is ever sent to."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command(), "serve", "--host", "0.0.0.0", "--port", str(port)],
            cwd=tmp_path, env=keyless_env(), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/healthz", log)
        code, text = terminate(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)
    assert code == 0, text
    warnings = [line for line in text.splitlines() if "without client keys" in line]
    assert len(warnings) == 1, text
    assert "WARNING hedge_gateway.config" in warnings[0]
