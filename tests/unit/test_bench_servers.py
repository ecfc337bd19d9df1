"""`bench --servers`: the option, the modes it adds, the command lines."""

from __future__ import annotations

import os
import subprocess
import sys
from argparse import ArgumentTypeError
from pathlib import Path

import pytest

from gateway.app import app_from_env
from gateway.bench import servers
from gateway.bench.commands import run_bench_command
from gateway.bench.run import BenchPlan, plan_modes
from gateway.bench.subject import baseline_env
from gateway.bench.workloads import WORKLOADS
from gateway.cli import build_parser
from gateway.settings import ConfigError
from gateway.settings.origin import CONFIG_ENV

OVERHEAD = next(w for w in WORKLOADS if w.name == "overhead")
STRAGGLERS = next(w for w in WORKLOADS if w.name == "stragglers")


def test_servers_are_parsed_in_order_each_once() -> None:
    assert servers.parse_servers("uvicorn,granian") == ("uvicorn", "granian")
    assert servers.parse_servers(" granian , uvicorn,granian,") == ("granian", "uvicorn")
    with pytest.raises(ArgumentTypeError, match="unknown server gunicorn"):
        servers.parse_servers("uvicorn,gunicorn")
    with pytest.raises(ArgumentTypeError, match="at least one"):
        servers.parse_servers(" , ")


def test_the_bench_option_defaults_to_uvicorn_and_refuses_unknown_names(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["bench"]).servers == ("uvicorn",)
    ns = parser.parse_args(["bench", "--workload", "overhead", "--servers", "uvicorn,granian"])
    assert ns.servers == ("uvicorn", "granian")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--servers", "nginx"])
    assert "unknown server nginx" in capsys.readouterr().err


def test_each_other_server_adds_a_mode_after_the_standard_ones() -> None:
    assert servers.extra_modes(("uvicorn", "granian", "hypercorn")) == ("granian", "hypercorn")
    assert servers.extra_modes(("uvicorn",)) == ()
    plan = BenchPlan(workloads=(OVERHEAD,), servers=("uvicorn", "granian"))
    assert plan_modes(plan, OVERHEAD) == ["direct", "hedging-off", "hedging-on", "granian"]
    with_baseline = BenchPlan(workloads=(STRAGGLERS,), servers=("granian", "hypercorn"),
                              baseline_src="/elsewhere")
    assert plan_modes(with_baseline, STRAGGLERS) == [
        "direct", "hedging-off", "hedging-on", "oracle", "baseline", "granian", "hypercorn"]
    default = BenchPlan(workloads=(OVERHEAD,))
    assert default.servers == ("uvicorn",)
    assert plan_modes(default, OVERHEAD) == ["direct", "hedging-off", "hedging-on"]


def test_command_lines_serve_the_same_config_file() -> None:
    own, env = servers.server_command("uvicorn", "/tmp/g.yaml", 8123)
    assert env is None
    assert own[:4] == [sys.executable, "-m", "gateway.cli", "serve"]
    assert own[own.index("--config") + 1] == "/tmp/g.yaml"
    assert own[own.index("--port") + 1] == "8123" and "--workers" not in own
    two, _ = servers.server_command("uvicorn", "/tmp/g.yaml", 8123, workers=2)
    assert two[two.index("--workers") + 1] == "2"
    granian, env = servers.server_command("granian", "/tmp/g.yaml", 8123)
    assert env == {CONFIG_ENV: "/tmp/g.yaml"}
    assert granian[:3] == [sys.executable, "-m", "granian"]
    assert {"--factory", "gateway.app:app_from_env"} <= set(granian)
    assert granian[granian.index("--interface") + 1] == "asgi"
    assert granian[granian.index("--port") + 1] == "8123"
    hypercorn, env = servers.server_command("hypercorn", "/tmp/g.yaml", 8123)
    assert env == {CONFIG_ENV: "/tmp/g.yaml"}
    assert hypercorn[-1] == "gateway.app:app_from_env()" and "127.0.0.1:8123" in hypercorn


def test_missing_servers_are_named() -> None:
    def installed(package: str) -> bool:
        return package == "uvicorn"

    assert servers.missing(("uvicorn", "granian", "hypercorn"), installed) == [
        "granian", "hypercorn"]
    assert servers.missing(("uvicorn",), installed) == []


def test_the_bench_refuses_a_server_that_is_not_installed_before_starting_anything(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(servers.PACKAGES, "granian", "hedge_gateway_no_such_package")
    plan = BenchPlan(workloads=(OVERHEAD,), servers=("granian",))
    assert run_bench_command(plan, out=None) == 2
    err = capsys.readouterr().err
    assert "--servers granian: not installed" in err
    assert "pip install 'hedge-gateway[granian]'" in err


def test_the_factory_needs_the_config_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError, match=CONFIG_ENV):
        app_from_env()


def test_the_baseline_child_runs_the_other_checkout_whatever_the_working_directory(
    tmp_path: Path,
) -> None:
    """`python -m` puts the working directory first on `sys.path`: with only `PYTHONPATH`, a
    bench started from this checkout ran this checkout's gateway as its `baseline`."""
    other = tmp_path / "other"
    (other / "gateway").mkdir(parents=True)
    (other / "gateway" / "__init__.py").write_text("")
    (other / "gateway" / "cli.py").write_text("print('the other checkout')\n")
    env, cwd = baseline_env(str(other))
    out = subprocess.run([sys.executable, "-m", "gateway.cli"], env={**os.environ, **env},
                         cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert out.stdout.strip() == "the other checkout"
