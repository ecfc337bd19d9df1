"""The real-engine harness's refusals and its cut builds, without building anything.

Why: an engine test that skips must say the true reason, and a build cut at its deadline
must leave no compiler running (ninja starts each one in a process group of its own).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import engine


def test_never_building_names_the_missing_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEDGE_GATEWAY_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("HEDGE_GATEWAY_ENGINE_BUILD", "never")
    with pytest.raises(engine.EngineUnavailable, match="HEDGE_GATEWAY_ENGINE_BUILD=never") as e:
        engine.ensure_engine()
    assert str(engine.build_dir()) in str(e.value)
    assert engine.build_dir().parent == tmp_path


def test_no_compiler_is_said_before_anything_is_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEDGE_GATEWAY_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv("HEDGE_GATEWAY_ENGINE_BUILD", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(engine.EngineUnavailable, match=re.escape("no C/C++ compiler on PATH")):
        engine.ensure_engine()
    assert not (engine.build_dir() / "venv").exists()


def test_a_failed_step_says_why_from_its_own_output_only(tmp_path: Path) -> None:
    log_path = tmp_path / "build.log"
    with open(log_path, "w") as log:
        log.write("ERROR: an older run's compile error\n")
        code = ("print('WARNING: Retrying after connection broken');"
                "print('Failed to establish a new connection: [Errno 101] Network is unreachable');"
                "raise SystemExit(1)")
        with pytest.raises(engine.EngineUnavailable) as caught:
            engine._run_step("install it", [sys.executable, "-c", code], log, log_path, {},
                             deadline=float("inf"), timeout=60)
    assert "the package registry could not be reached" in str(caught.value)
    assert "older run" not in str(caught.value)


def test_a_step_past_its_deadline_is_cut_and_says_so(tmp_path: Path) -> None:
    log_path = tmp_path / "build.log"
    with open(log_path, "w") as log, pytest.raises(
            engine.EngineUnavailable, match=r"did not finish within 1 s.*cut during: compile"):
        engine._run_step("compile", ["sleep", "60"], log, log_path, {},
                         deadline=time.monotonic() + 0.2, timeout=1)


def test_the_cut_kills_the_whole_session(tmp_path: Path) -> None:
    """The step's child starts a grandchild in a process group of its own, as ninja does with
    each compiler: killing the step's process group would miss it, its session does not."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, time;"
            "p = subprocess.Popen(['sleep', '60'], process_group=0);"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid));"
            "time.sleep(60)")
    step = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    for _ in range(300):  # until the grandchild exists: polling, not a timing assertion
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert grandchild in engine._session_members(step.pid)
    engine._kill_session(step)
    assert engine._session_members(step.pid) == []
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (dead) parent to be reaped by init."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
