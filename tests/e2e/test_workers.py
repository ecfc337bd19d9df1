"""`hedge-gateway serve --workers 2` for real: the console entry point in a
subprocess on an ephemeral port, simulated backends in the workers, the official SDK and plain
HTTP as clients. Each request opens its own connection, so the kernel spreads them over the
workers.

And `hedge-gateway stats URL URL` over two single-process gateways in this process.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import BackendSettings, PoolSettings, Settings, SimProfile
from gateway.stats.replicas import merged_document
from tests.e2e.test_cli import command, free_port, keyless_env
from tests.harness import LoopThread
from tests.harness.limits_kit import GatewayFactory

#: bounds on each wait, so a broken product fails the test instead of hanging it
WAIT = 20.0
CONFIG = """
server: {{host: 127.0.0.1, port: {port}, shutdown_grace: 10s}}
pools:
  - name: quick
    backends:
      - {{name: a, provider: sim, sim: {{ttft_median: 10ms, straggler_probability: 0,
          tokens: 5, inter_token: 1ms, seed: 1}}}}
      - {{name: b, provider: sim, sim: {{ttft_median: 10ms, straggler_probability: 0,
          tokens: 5, inter_token: 1ms, seed: 2}}}}
  - name: slow
    hedging: {{enabled: false}}
    backends:
      - {{name: s, provider: sim, sim: {{ttft_median: 10ms, straggler_probability: 0,
          tokens: 20, inter_token: 100ms}}}}
"""
QUICK_CONTENT = "".join(f"tok{i} " for i in range(5))


def eventually(probe: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll `probe` until it returns something truthy (bounded); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)  # polling a state change, not a timing assertion
    pytest.fail(f"never happened: {what}")


def stats(root: str) -> dict[str, Any]:
    reply = httpx.get(root + "/hedge/stats", timeout=5.0, trust_env=False)
    assert reply.status_code == 200
    doc: dict[str, Any] = reply.json()
    return doc


def chat(root: str, model: str = "quick") -> str:
    """One streamed chat completion on a connection of its own; the content."""
    with openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0,
                       timeout=openai.Timeout(15.0)) as client:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def requests_of(root: str) -> int:
    count: int = stats(root)["pools"]["quick"]["lifetime"]["requests"]
    return count


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`hedge-gateway serve --config F --workers 2` from an empty directory, in a process group
    of its own, with its own temporary directory (`tmp_path/tmp`, where the supervisor makes
    the workers' stats directory); at teardown it gets SIGTERM, then the group SIGKILL if it
    has not stopped (any worker left included)."""
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(CONFIG.format(port=port))
    log = tmp_path / "serve.log"
    (tmp_path / "tmp").mkdir()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command(), "serve", "--config", str(config), "--workers", "2"],
            cwd=tmp_path, env={**keyless_env(), "TMPDIR": str(tmp_path / "tmp")},
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    root = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: proc.poll() is not None or _healthy(root), "serve answers /healthz")
        assert proc.poll() is None, log.read_text()
        # both workers up and publishing: the whole-server view lists two processes
        eventually(lambda: len(stats(root)["workers"]) == 2, "two workers in the stats")
        yield proc, root, log
    finally:  # the supervisor's process group: its workers too, even if it is gone
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(WAIT)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5.0)


def _healthy(root: str) -> bool:
    try:
        return httpx.get(root + "/healthz", timeout=1.0, trust_env=False).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.timeout(90)
def test_two_workers_serve_one_address_and_report_as_one_server(
    two_workers: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    proc, root, log = two_workers
    sent = 24
    with ThreadPoolExecutor(6) as pool:
        contents = list(pool.map(lambda _: chat(root), range(sent)))
    assert contents == [QUICK_CONTENT] * sent

    def counted() -> dict[str, Any] | None:
        doc = stats(root)
        return doc if doc["pools"]["quick"]["lifetime"]["requests"] == sent else None

    # whichever worker answers, the requests of both are summed (each publishes every 0.5 s)
    doc = eventually(counted, f"the whole server counts {sent} requests")
    quick = doc["pools"]["quick"]
    per_worker = {w["pid"]: w["requests"] for w in quick["workers"]}
    assert len(per_worker) == 2 and sum(per_worker.values()) == sent
    assert all(n > 0 for n in per_worker.values()), per_worker  # both workers served
    assert quick["lifetime"]["ttft_ms"]["count"] == sent  # the sketches merged
    assert all(w["age_s"] <= 2.0 for w in doc["workers"])
    # the budget composes: each worker's bucket holds ceil(burst / 2), the host's is listed
    assert [w["budget"]["burst"] for w in quick["workers"]] == [math.ceil(10 / 2)] * 2
    assert quick["budget"]["burst"] == 10
    # /metrics too, from any worker (which may see its peer's numbers up to 0.5 s later)
    def metrics_total() -> bool:
        text = httpx.get(root + "/metrics", timeout=5.0, trust_env=False).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("hedge_gateway_requests_total{")
                   and 'pool="quick"' in line) == sent

    eventually(metrics_total, f"/metrics counts {sent} requests")
    assert proc.poll() is None, log.read_text()

    # `hedge-gateway stats URL` on a multi-worker server: one table for the whole server
    table = subprocess.run([*command(), "stats", root], capture_output=True, text=True,
                           timeout=60, env=keyless_env())
    assert table.returncode == 0 and "processes: 2 (" in table.stdout, table.stderr

    # SO_REUSEPORT must not let a second gateway on the same port take half the connections
    port = root.rsplit(":", 1)[1]
    second = subprocess.run([*command(), "serve", "--port", port, "--workers", "2"],
                            capture_output=True, text=True, timeout=60, env=keyless_env())
    assert second.returncode == 3, second.stderr
    assert "Address already in use" in second.stderr
    assert "Started server process" not in second.stderr  # refused before any worker forked


@pytest.mark.timeout(120)
def test_a_killed_worker_is_replaced_and_sigterm_drains_every_worker(
    two_workers: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    proc, root, log = two_workers
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: chat(root), range(8))) == [QUICK_CONTENT] * 8
    victim, survivor = sorted(w["pid"] for w in stats(root)["workers"])

    def complete_without_victim() -> bool:
        """The survivor counts all 8: the victim's published numbers hold all of its own
        (a worker's file trails its live numbers by up to one publish interval)."""
        doc = stats(root)
        return bool(doc["answered_by"]["pid"] != victim
                    and doc["pools"]["quick"]["lifetime"]["requests"] == 8)

    eventually(complete_without_victim, "the other worker counts all 8 requests")

    def survivor_series(total: int) -> Callable[[], bool]:
        def probe() -> bool:
            """The survivor's series (the whole server's) counts `total` requests: the
            victim's once (not again when its lifetime is retired), the new worker's from 0."""
            doc = get_json(root, "/hedge/series")
            points = doc["pools"].get("quick", [])
            assert all(p[key] >= 0 for p in points for key in ("requests", "tokens_output"))
            return bool(doc["answered_by"]["pid"] == survivor and series_requests(doc) == total)
        return probe

    eventually(survivor_series(8), "the survivor's series counts 8 requests")
    os.kill(victim, signal.SIGKILL)

    def replaced() -> set[int] | None:
        try:
            pids = {w["pid"] for w in stats(root)["workers"]}
        except httpx.TransportError:  # a connection the victim's socket had queued: reset
            return None
        return pids if len(pids) == 2 and victim not in pids else None

    after = eventually(replaced, "the killed worker replaced by a new one")
    assert not alive(victim)
    # the dead worker's lifetime counts stay in the whole server's (counters never go down)
    assert requests_of(root) == 8
    assert [chat(root) for _ in range(6)] == [QUICK_CONTENT] * 6  # serving continues
    eventually(lambda: requests_of(root) == 14, "14 requests counted")
    assert f"(pid {victim}) exited with status -9" in log.read_text()

    eventually(survivor_series(14), "the survivor's series counts 14 requests")

    # a stream in flight when SIGTERM arrives finishes within the grace
    with httpx.Client(timeout=30.0, trust_env=False) as http, http.stream(
            "POST", root + "/v1/chat/completions",
            json={"model": "slow", "stream": True,
                  "messages": [{"role": "user", "content": "hi"}]}) as live:
        lines = live.iter_lines()
        first = next(line for line in lines if "tok0" in line)
        assert first.startswith("data:")
        proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert any("tok19" in line for line in rest), rest
    assert "data: [DONE]" in rest, rest
    try:
        code = proc.wait(WAIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve --workers ignored SIGTERM:\n{log.read_text()}")
    output = log.read_text()
    assert code == 0, output
    assert output.count("Application shutdown complete") >= 2, output
    assert "Traceback" not in output, output
    assert not any(alive(pid) for pid in after)
    with pytest.raises(httpx.ConnectError):
        httpx.get(root + "/healthz", timeout=2.0, trust_env=False)
    # the workers' private stats directory went with them
    assert not list((log.parent / "tmp").glob("hedge-gateway-stats-*"))


@pytest.mark.timeout(60)
def test_workers_do_not_outlive_a_killed_supervisor(
    two_workers: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    proc, root, log = two_workers
    pids = [w["pid"] for w in stats(root)["workers"]]
    proc.kill()  # the supervisor only: its workers are left without it
    proc.wait(5.0)
    eventually(lambda: not any(alive(pid) for pid in pids), "the orphaned workers exit")
    assert log.read_text().count("Application shutdown complete") == 2  # they drained


@pytest.mark.timeout(90)
def test_sighup_to_the_supervisor_reloads_every_worker(
    two_workers: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    """Reload under workers: one SIGHUP to the supervisor, every worker on the new file, each
    budget split again (burst 30 over 2 workers: 15 each)."""
    proc, root, log = two_workers
    config = log.parent / "gateway.yaml"
    config.write_text(config.read_text() + _EXTRA_POOL)
    proc.send_signal(signal.SIGHUP)

    def reloaded() -> dict[str, Any] | None:
        doc = stats(root)
        extra = doc["pools"].get("extra")
        if extra is None or len(extra.get("workers", [])) != 2:
            return None
        generations = {w["config"]["generation"] for w in doc["workers"]}
        return doc if generations == {2} else None

    doc = eventually(reloaded, "both workers on the reloaded file")
    extra = doc["pools"]["extra"]
    assert [w["budget"]["burst"] for w in extra["workers"]] == [15.0, 15.0]
    assert extra["budget"]["burst"] == 30.0
    assert chat(root, model="extra") == QUICK_CONTENT
    assert proc.poll() is None and "exited with status" not in log.read_text()


_EXTRA_POOL = """
  - name: extra
    hedging: {budget: {burst: 30}}
    backends:
      - {name: e, provider: sim, sim: {ttft_median: 10ms, straggler_probability: 0,
          tokens: 5, inter_token: 1ms}}
"""


def sim_settings(seed: int) -> Settings:
    profile = SimProfile(ttft_median=0.005, straggler_probability=0.0, tokens=3,
                         inter_token=0.0, seed=seed)
    backends = (BackendSettings("a", provider="sim", sim=profile),
                BackendSettings("b", provider="sim", sim=profile))
    return Settings(pools=(PoolSettings("quick", backends),))


def test_stats_command_merges_two_replicas(loop_thread: LoopThread) -> None:
    factory = GatewayFactory(loop_thread)
    one, two = factory(sim_settings(1)), factory(sim_settings(2))
    for _ in range(3):
        chat(one.root)
    for _ in range(4):
        chat(two.root)
    doc = merged_document([one.root, two.root])
    quick = doc["pools"]["quick"]
    assert quick["lifetime"]["requests"] == 7
    assert quick["lifetime"]["ttft_ms"]["count"] == 7
    assert sorted(w["requests"] for w in quick["workers"]) == [3, 4]
    assert {w["replica"] for w in doc["workers"]} == {one.root, two.root}
    assert quick["budget"]["burst"] == 20  # two replicas, two whole buckets

    result = subprocess.run([*command(), "stats", one.root, two.root], capture_output=True,
                            text=True, timeout=60, env=keyless_env())
    assert result.returncode == 0, result.stderr
    assert "merged 2 replicas, 2 processes" in result.stdout
    lifetime = next(line for line in result.stdout.splitlines() if line.startswith("lifetime"))
    assert lifetime.split()[1] == "7", result.stdout

    # a replica that cannot be read is an error naming it, not a silent under-count
    gone = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run([*command(), "stats", one.root, gone], capture_output=True,
                            text=True, timeout=60, env=keyless_env())
    assert result.returncode == 1 and gone in result.stderr, result.stderr


def get_json(root: str, path: str) -> dict[str, Any]:
    reply = httpx.get(root + path, timeout=5.0, trust_env=False)
    assert reply.status_code == 200, reply.text
    doc: dict[str, Any] = reply.json()
    return doc


def series_requests(doc: dict[str, Any]) -> int:
    """The requests a `/hedge/series` answer counts over its window: each point's rate times
    the seconds since the point before it (the first point is the baseline, rate 0)."""
    points = doc["pools"].get("quick", [])
    counted: float = sum(p["requests"] * (p["t"] - q["t"]) for q, p in itertools.pairwise(points))
    return round(counted)


def both_answer(root: str, path: str, whole: Callable[[dict[str, Any]], bool],
                what: str) -> dict[int, dict[str, Any]]:
    """Fetch `path` (a connection each) until each worker has answered with `whole` true
    (a worker sees its peer's numbers up to 2 s late); those answers, by the answering pid."""
    answers: dict[int, dict[str, Any]] = {}

    def probe() -> bool:
        doc = get_json(root, path)
        if whole(doc):
            answers.setdefault(doc["answered_by"]["pid"], doc)
        return len(answers) == 2

    eventually(probe, f"both workers answer {path} with {what}")
    return answers


@pytest.mark.timeout(120)
def test_the_dashboard_data_covers_every_worker(
    two_workers: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    """Under workers, `/hedge/series` and `/hedge/races` show the whole server, whichever
    worker answers (their peers' numbers reach them within 2 s, so the waits poll)."""
    _proc, root, _log = two_workers
    sent = 24
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(lambda _: chat(root), range(sent))) == [QUICK_CONTENT] * sent

    def counted() -> dict[str, Any] | None:
        doc = stats(root)
        return doc if doc["pools"]["quick"]["lifetime"]["requests"] == sent else None

    doc = eventually(counted, f"the whole server counts {sent} requests")
    served = {w["pid"]: w["requests"] for w in doc["pools"]["quick"]["workers"]}
    assert len(served) == 2 and all(n > 0 for n in served.values()), served  # both served

    # the series: the requests of both workers, once each, from either worker
    series = both_answer(root, "/hedge/series", lambda d: series_requests(d) == sent,
                         f"{sent} requests in the series")
    assert set(series) == set(served)
    for answer in series.values():  # one time axis: the same seconds in both workers
        assert all(p["t"] == pytest.approx(p["seq"] - 1, abs=0.5)
                   for p in answer["pools"]["quick"]), answer

    # the races: every request, served by either worker, newest last
    def quick_races(doc: dict[str, Any]) -> list[dict[str, Any]]:
        return [r for r in doc["races"] if r["pool"] == "quick"]

    races = both_answer(root, "/hedge/races", lambda d: len(quick_races(d)) == sent,
                        f"all {sent} races")
    for answer in races.values():
        listed = quick_races(answer)
        assert len({r["id"] for r in listed}) == sent, listed
        assert {r["pid"] for r in listed} == set(served), listed  # races of both workers
        assert [r["t"] for r in listed] == sorted(r["t"] for r in listed)


@pytest.mark.timeout(90)
def test_every_worker_finds_a_stored_response_and_continues_it(
    two_workers: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    """A stored response is made by one worker; every later request opens its own connection,
    so the kernel spreads them over both workers, and each one finds it."""
    _, root, _ = two_workers

    def client() -> openai.OpenAI:
        return openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0,
                             timeout=openai.Timeout(15.0))

    with client() as first:
        made = first.responses.create(model="quick", input="hi")
        with first.responses.create(model="quick", input="hi", stream=True) as stream:
            ids = {e.response.id for e in stream if e.type in (
                "response.created", "response.in_progress", "response.completed")}
    assert len(ids) == 1 and made.id not in ids  # every event names the one response
    streamed = ids.pop()
    for response_id in [made.id, streamed] * 8:
        with client() as other:
            assert other.responses.retrieve(response_id).id == response_id
    for _ in range(8):
        with client() as other:
            follow = other.responses.create(model="quick", input="more",
                                            previous_response_id=made.id)
            assert follow.output_text == QUICK_CONTENT
