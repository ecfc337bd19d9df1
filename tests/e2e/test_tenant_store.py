"""Keys made at run time and usage in the embedded store, over real sockets and processes:

- `/admin/keys` behind `server.admin_keys`: a key made there works at once with the SDK, is
  listed without its secret, has its usage counted, and once revoked is refused; without an
  admin key the routes answer 401, without admin keys configured 404;
- `hedge-gateway serve` stopped with SIGTERM and started again on the same file: a key made
  at run time still works and no usage was lost (`hedge-gateway keys usage` reads it);
- `hedge-gateway serve --workers 2`: a key made with `hedge-gateway keys create` is let in by
  both workers, and once `hedge-gateway keys revoke` has returned every worker refuses it;
- `hedge-gateway serve --workers 3`: a key's per-minute limit held by the three together
  (each leases slices of it from the file): a client on one connection, so one worker, has
  the whole limit, and the three never admit more than one bucket would (within 5 %).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from tests.e2e.test_cli import command, free_port, keyless_env
from tests.harness import LoopThread
from tests.harness.limits_kit import MESSAGES, Canary, GatewayFactory, verbose_logs, wait_for

ADMIN = "admin-key-0123456789abcdefghijklmnopqrstu"
WAIT = 20.0
FAST = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=4,
                  inter_token=0.0)


def eventually(probe: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll `probe` until it returns something truthy (bounded); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)  # polling a state change, not a timing assertion
    pytest.fail(f"never happened: {what}")


def chat_status(root: str, key: str) -> int:
    """One chat completion on a connection of its own: its status."""
    return httpx.post(root + "/v1/chat/completions", timeout=10.0, trust_env=False,
                      json={"model": "alpha", "messages": MESSAGES},
                      headers={"authorization": f"Bearer {key}"}).status_code


def test_admin_api_makes_lists_and_revokes_keys_and_reports_their_usage(
    loop_thread: LoopThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    verbose_logs(caplog)
    store = f"sqlite:///{tmp_path}/tenants.sqlite"
    pools = (PoolSettings("alpha", (BackendSettings("s", "sim", sim=FAST),),
                          hedging=HedgingSettings(enabled=False)),
             PoolSettings("beta", (BackendSettings("s", "sim", sim=FAST),)))
    gateway = GatewayFactory(loop_thread)(Settings(pools, server=ServerSettings(
        admin_keys=(ADMIN,), store=store)))
    admin = {"authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=gateway.root, timeout=10.0, trust_env=False) as http:
        assert chat_status(gateway.root, "anything") == 401  # no key exists yet: none passes
        assert http.get("/admin/keys").status_code == 401
        made = http.post("/admin/keys", headers=admin, json={
            "name": "team-a", "pools": ["alpha"], "limits": {"requests_per_minute": 100}})
        assert made.status_code == 201, made.text
        secret = made.json()["key"]
        assert made.json()["pools"] == ["alpha"]
        bad = http.post("/admin/keys", headers=admin, json={"name": "x", "pools": ["nope"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "pools"
        assert http.post("/admin/keys", headers=admin,
                         json={"name": "team-a"}).status_code == 409
        with openai.OpenAI(base_url=gateway.v1, api_key=secret, max_retries=0) as client:
            for _ in range(3):
                reply = client.chat.completions.with_raw_response.create(model="alpha",
                                                                         messages=MESSAGES)
                assert reply.parse().choices
            assert reply.headers["x-ratelimit-limit-requests"] == "100"
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="beta", messages=MESSAGES)
        listed = http.get("/admin/keys", headers=admin)
        assert [(k["name"], k["source"], k["revoked"]) for k in listed.json()["data"]] == [
            ("team-a", "store", None)]
        usage = http.get("/admin/keys/team-a/usage", headers=admin).json()["data"]
        assert len(usage) == 1 and usage[0]["requests"] == 3
        assert usage[0]["output_tokens"] == 3 * FAST.tokens
        assert http.delete("/admin/keys/team-a", headers=admin).json()["revoked"] is True
        assert chat_status(gateway.root, secret) == 401  # the last key: still none passes
        assert http.delete("/admin/keys/team-a", headers=admin).status_code == 404
        texts = [listed.text, json.dumps(usage)]
    Canary(secret, ADMIN).assert_absent_everywhere(gateway.root, caplog, *texts)


def test_without_admin_keys_there_is_no_admin_api(loop_thread: LoopThread, tmp_path: Path
                                                 ) -> None:
    pools = (PoolSettings("alpha", (BackendSettings("s", "sim", sim=FAST),)),)
    gateway = GatewayFactory(loop_thread)(Settings(pools, server=ServerSettings(
        store=f"sqlite:///{tmp_path}/t.sqlite")))
    reply = httpx.get(gateway.url("/admin/keys"), timeout=10.0, trust_env=False,
                      headers={"authorization": f"Bearer {ADMIN}"})
    assert reply.status_code == 404


CONFIG = """
server: {{host: 127.0.0.1, port: {port}, shutdown_grace: 2s, store: "sqlite:///{store}"}}
pools:
  - name: alpha
    hedging: {{enabled: false}}
    backends:
      - {{name: s, provider: sim, sim: {{ttft_median: 0, straggler_probability: 0, tokens: 4,
          inter_token: 0}}, price: {{input: 0, output: 1000000}}}}
"""


@contextlib.contextmanager
def serving(tmp_path: Path, *extra: str, config_text: str = CONFIG
            ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`hedge-gateway serve` on the test's config (`config_text`, formatted with `port` and
    `store`) and store, in a process group of its own; SIGTERM at the end, SIGKILL for
    whatever is left."""
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(config_text.format(port=port, store=tmp_path / "tenants.sqlite"))
    log = tmp_path / f"serve-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command(), "serve", "--config", str(config), *extra],
                                cwd=tmp_path, env=keyless_env(), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    root = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: proc.poll() is not None or _healthy(root), "serve answers")
        assert proc.poll() is None, log.read_text()
        yield proc, root
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(WAIT)
        with contextlib.suppress(ProcessLookupError):
            import os

            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5.0)


def _healthy(root: str) -> bool:
    try:
        return httpx.get(root + "/healthz", timeout=1.0, trust_env=False).status_code == 200
    except httpx.TransportError:
        return False


def keys_command(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    store = f"sqlite:///{tmp_path}/tenants.sqlite"
    return subprocess.run([*command(), "keys", "--store", store, *args], cwd=tmp_path,
                          env=keyless_env(), capture_output=True, text=True, timeout=WAIT,
                          check=False)


def test_a_key_name_outside_the_safe_set_is_a_400_naming_the_field_and_409_is_for_taken(
    loop_thread: LoopThread, tmp_path: Path
) -> None:
    """Every key the admin API makes can be revoked and read by its path: a name with `/`
    (or `%`, a space, a leading `.`, `..`) is refused as a bad request naming `name`, and
    only a name already taken is a conflict. A name of the safe set is revoked by its path."""
    store = f"sqlite:///{tmp_path}/tenants.sqlite"
    pools = (PoolSettings("alpha", (BackendSettings("s", "sim", sim=FAST),)),)
    gateway = GatewayFactory(loop_thread)(Settings(pools, server=ServerSettings(
        admin_keys=(ADMIN,), store=store)))
    admin = {"authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=gateway.root, timeout=10.0, trust_env=False) as http:
        for bad in ("team/a", "a%2Fb", "a b", ".hidden", "..", "a..b", "x" * 201):
            refused = http.post("/admin/keys", headers=admin, json={"name": bad})
            assert refused.status_code == 400, (bad, refused.text)
            error = refused.json()["error"]
            assert error["param"] == "name" and error["type"] == "invalid_request_error"
        assert http.get("/admin/keys", headers=admin).json()["data"] == []  # none was made
        made = http.post("/admin/keys", headers=admin, json={"name": "team_a-1.b:c"})
        assert made.status_code == 201, made.text
        taken = http.post("/admin/keys", headers=admin, json={"name": "team_a-1.b:c"})
        assert taken.status_code == 409
        gone = http.delete("/admin/keys/team_a-1.b:c", headers=admin)
        assert gone.status_code == 200 and gone.json()["revoked"] is True


def test_an_unreadable_store_row_is_listed_as_invalid_beside_the_others(
    loop_thread: LoopThread, tmp_path: Path
) -> None:
    """A row written by hand (or by another version) whose limits are not a key's: the admin
    list and `hedge-gateway keys list` still answer, show it as invalid and list the good
    key beside it; the good key still works and the bad row is never in force."""
    store = f"sqlite:///{tmp_path}/tenants.sqlite"
    pools = (PoolSettings("alpha", (BackendSettings("s", "sim", sim=FAST),)),)
    gateway = GatewayFactory(loop_thread)(Settings(pools, server=ServerSettings(
        admin_keys=(ADMIN,), store=store)))
    admin = {"authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=gateway.root, timeout=10.0, trust_env=False) as http:
        good = http.post("/admin/keys", headers=admin, json={"name": "team-a"})
        assert good.status_code == 201
        with contextlib.closing(sqlite3.connect(tmp_path / "tenants.sqlite")) as db, db:
            db.execute("INSERT INTO keys (name, key_sha256, pools, limits, created) "
                       "VALUES ('broken', 'ab', 'not json', '{\"in_flight\": -3}', 1.0)")
        listed = http.get("/admin/keys", headers=admin)
        assert listed.status_code == 200, listed.text
        rows = {row["name"]: row for row in listed.json()["data"]}
        assert rows["broken"]["invalid"] is True and "invalid" not in rows["team-a"]
        assert chat_status(gateway.root, good.json()["key"]) == 200
    shown = keys_command(tmp_path, "list")
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr
    lines = dict(line.split("\t")[:2] for line in shown.stdout.splitlines())
    assert lines == {"broken": "invalid", "team-a": "active"}


def test_a_limit_past_the_largest_is_refused_and_a_stored_one_keeps_no_revocation_back(
    loop_thread: LoopThread, tmp_path: Path
) -> None:
    """JSON carries any integer: a limit of 10**400 made a key whose bucket could not be built
    (a float), which a create answered with a 500 and which stopped the store's reader for
    good, so no later revocation took effect. Now the admin API refuses it (400, naming the
    field), and such a row already in the store is skipped as invalid while a revocation
    still applies."""
    store = f"sqlite:///{tmp_path}/tenants.sqlite"
    pools = (PoolSettings("alpha", (BackendSettings("s", "sim", sim=FAST),)),)
    gateway = GatewayFactory(loop_thread)(Settings(pools, server=ServerSettings(
        admin_keys=(ADMIN,), store=store)))
    admin = {"authorization": f"Bearer {ADMIN}"}
    huge = 10**400
    with httpx.Client(base_url=gateway.root, timeout=10.0, trust_env=False) as http:
        refused = http.post("/admin/keys", headers=admin, json={
            "name": "huge", "limits": {"requests_per_minute": huge}})
        assert refused.status_code == 400, refused.text
        assert "requests_per_minute" in refused.text
        good = http.post("/admin/keys", headers=admin, json={"name": "team-a"})
        assert good.status_code == 201
        secret = good.json()["key"]
        assert chat_status(gateway.root, secret) == 200
        with contextlib.closing(sqlite3.connect(tmp_path / "tenants.sqlite")) as db, db:
            db.execute("INSERT INTO keys (name, key_sha256, pools, limits, created) VALUES "
                       f"('old', '{'ab' * 32}', '[]', '{{\"in_flight\": {huge}}}', 1.0)")
            db.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")
        assert http.delete("/admin/keys/team-a", headers=admin).json()["revoked"] is True
        assert wait_for(lambda: chat_status(gateway.root, secret) == 401)
        rows = {row["name"]: row for row in http.get("/admin/keys", headers=admin).json()["data"]}
        assert rows["old"]["invalid"] is True


@pytest.mark.timeout(90)
def test_a_restart_keeps_the_keys_made_at_run_time_and_loses_no_usage(tmp_path: Path) -> None:
    made = keys_command(tmp_path, "create", "team-a", "--pool", "alpha")
    assert made.returncode == 0, made.stderr
    secret = json.loads(made.stdout)["key"]
    with serving(tmp_path) as (proc, root):
        assert [chat_status(root, secret) for _ in range(5)] == [200] * 5
        proc.send_signal(signal.SIGTERM)  # stopped before its next batch: the last is written
        assert proc.wait(WAIT) == 0
    with serving(tmp_path) as (_, root):
        assert chat_status(root, secret) == 200
        assert chat_status(root, "hg-not-a-key") == 401
    usage = keys_command(tmp_path, "usage", "team-a")
    assert usage.returncode == 0, usage.stderr
    (row,) = usage.stdout.splitlines()[1:]
    name, _day, requests, _input, output, spend = row.split("\t")
    assert (name, requests, output) == ("team-a", "6", str(6 * 4))
    assert spend == f"{6 * 4:.6f}"  # a dollar per output token: spend outlives a restart too
    assert secret not in usage.stdout + keys_command(tmp_path, "list").stdout


@pytest.mark.timeout(120)
def test_a_key_revoked_by_the_command_is_refused_by_every_worker(tmp_path: Path) -> None:
    """Two workers. A key made while they run is let in by both (each request on a
    connection of its own: the kernel spreads them); once `keys revoke` returns, the key is
    refused by the first worker to notice, and from then on by every one."""
    with serving(tmp_path, "--workers", "2") as (_, root):
        made = keys_command(tmp_path, "create", "team-a")
        assert made.returncode == 0, made.stderr
        secret = json.loads(made.stdout)["key"]
        eventually(lambda: all(chat_status(root, secret) == 200 for _ in range(20)),
                   "every worker lets the new key in")
        assert keys_command(tmp_path, "revoke", "team-a").returncode == 0
        eventually(lambda: chat_status(root, secret) == 401, "the revoked key is refused")
        # each worker polls the store twice a second: within a second all have it
        eventually(lambda: all(chat_status(root, secret) == 401 for _ in range(20)),
                   "every worker refuses the revoked key", timeout=5.0)
        assert [chat_status(root, secret) for _ in range(40)] == [401] * 40


@pytest.mark.timeout(120)
def test_three_workers_on_one_file_hold_one_per_minute_limit(tmp_path: Path) -> None:
    """60 requests a minute. On one keep-alive connection (one worker, the kernel's
    choice) the OpenAI SDK is admitted the key's whole limit, where a worker holding a third
    of it refused it at 20; then requests on connections of their own, spread by the kernel
    over the three: the total stays within 5 % of one bucket (60, plus what refilled, 1 a
    second, while the traffic ran)."""
    made = keys_command(tmp_path, "create", "team-a", "--requests-per-minute", "60")
    assert made.returncode == 0, made.stderr
    secret = json.loads(made.stdout)["key"]
    with serving(tmp_path, "--workers", "3") as (_, root):
        started = time.monotonic()
        admitted = 0
        with openai.OpenAI(base_url=root + "/v1", api_key=secret, max_retries=0) as client:
            for _ in range(300):
                try:
                    client.chat.completions.create(model="alpha", messages=MESSAGES)
                    admitted += 1
                except openai.RateLimitError as refused:  # a round pending, or none left
                    if refused.response.headers["x-ratelimit-remaining-requests"] == "0":
                        break
        one_connection = admitted
        admitted += sum(chat_status(root, secret) == 200 for _ in range(60))
        took = time.monotonic() - started
    assert one_connection >= 60 * 0.95, one_connection
    assert admitted <= (60 + took) * 1.05, (admitted, took)
