"""Two agent CLIs for the tests, installed from the npm registry: OpenAI's Codex CLI
(`@openai/codex`, run as `codex exec`) and Anthropic's Claude Code (`@anthropic-ai/claude-code`,
run as `claude -p`).

Why: an agent is the client that leans on every part of a gateway at once (streamed tool
calls, the tool's result sent back, its own headers and model names, a probe or two of its
own), and these two are the ones people point at a gateway. Each is pinned to the version
the tests were written against and installed once into a cache outside the repository,
`$HEDGE_GATEWAY_AGENTS_CACHE` (default `~/.cache/hedge-gateway/agents`), one folder per
package and version, with `npm install --prefix`. Both packages carry their native binary in
a platform package of the registry (an optional dependency), so nothing else is fetched.

An install is bounded by `$HEDGE_GATEWAY_AGENTS_INSTALL_TIMEOUT` seconds (default 300; about
15 s measured here). Where npm is missing, the registry unreachable, the install fails or the
binary does not run, `ensure_agent` raises `AgentUnavailable` saying why, which the tests turn
into a skip. `$HEDGE_GATEWAY_AGENTS_INSTALL=never` uses only what is already installed.

Also a command: `python -m tests.harness.agents install` installs both (or finds them) and
prints where they are.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AgentPackage:
    #: what the tests call it
    name: str
    package: str
    version: str
    #: the command the package puts in node_modules/.bin
    command: str


CODEX = AgentPackage("codex", "@openai/codex", "0.171.0", "codex")
CLAUDE_CODE = AgentPackage("claude-code", "@anthropic-ai/claude-code", "2.1.197", "claude")
AGENTS = (CODEX, CLAUDE_CODE)
DEFAULT_INSTALL_TIMEOUT = 300.0


class AgentUnavailable(Exception):
    """The agent cannot be had on this machine; the message says why (a test skips with it)."""


def cache_root() -> Path:
    configured = os.environ.get("HEDGE_GATEWAY_AGENTS_CACHE")
    root = Path(configured) if configured else Path.home() / ".cache" / "hedge-gateway" / "agents"
    return root.expanduser()


def install_dir(agent: AgentPackage) -> Path:
    return cache_root() / f"{agent.name}-{agent.version}"


def _binary(agent: AgentPackage) -> Path:
    return install_dir(agent) / "node_modules" / ".bin" / agent.command


def _install_timeout() -> float:
    raw = os.environ.get("HEDGE_GATEWAY_AGENTS_INSTALL_TIMEOUT", "")
    try:
        return float(raw) if raw else DEFAULT_INSTALL_TIMEOUT
    except ValueError:
        return DEFAULT_INSTALL_TIMEOUT


def _version_of(binary: Path, timeout: float = 30.0) -> str:
    """What `--version` prints, or AgentUnavailable when the binary does not run."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL,
                              env={**os.environ, "HOME": str(install_dir_home(binary))})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AgentUnavailable(f"{binary} does not run: {exc}") from None
    if done.returncode != 0:
        raise AgentUnavailable(f"{binary} --version exited {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()[-300:]}")
    return done.stdout.strip()


def install_dir_home(binary: Path) -> Path:
    """A HOME for version probes that is not the user's (the CLIs write state under it)."""
    home = binary.parents[2] / "home"
    home.mkdir(parents=True, exist_ok=True)
    return home


def find_agent(agent: AgentPackage) -> Path | None:
    """The installed binary when it runs and is the pinned version, else None."""
    binary = _binary(agent)
    if not binary.exists():
        return None
    try:
        version = _version_of(binary)
    except AgentUnavailable:
        return None
    return binary if agent.version in version else None


def ensure_agent(agent: AgentPackage) -> Path:
    """The agent's binary, installed first when missing (bounded; see the module docstring)."""
    found = find_agent(agent)
    if found is not None:
        return found
    if os.environ.get("HEDGE_GATEWAY_AGENTS_INSTALL", "auto") == "never":
        raise AgentUnavailable(f"{agent.package}@{agent.version} is not installed under "
                               f"{install_dir(agent)} and HEDGE_GATEWAY_AGENTS_INSTALL=never")
    npm = shutil.which("npm")
    if npm is None:
        raise AgentUnavailable("npm is not installed (the agent CLIs come from the npm "
                               "registry)")
    folder = install_dir(agent)
    folder.mkdir(parents=True, exist_ok=True)
    timeout = _install_timeout()
    with _lock(folder, time.monotonic() + timeout):
        found = find_agent(agent)  # another run may have installed it meanwhile
        if found is not None:
            return found
        _npm_install(npm, agent, folder, timeout)
    binary = _binary(agent)
    if not binary.exists():
        raise AgentUnavailable(f"npm installed {agent.package} but {binary} is missing")
    version = _version_of(binary)
    if agent.version not in version:
        raise AgentUnavailable(f"{binary} says {version!r}, not {agent.version}")
    return binary


def _npm_install(npm: str, agent: AgentPackage, folder: Path, timeout: float) -> None:
    log = folder / "npm-install.log"
    command = [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund",
               "--no-save", "--loglevel=error", f"{agent.package}@{agent.version}"]
    with open(log, "w") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout, cwd=folder)
        except subprocess.TimeoutExpired:
            raise AgentUnavailable(f"npm install {agent.package}@{agent.version} took longer "
                                   f"than {timeout:g} s (HEDGE_GATEWAY_AGENTS_INSTALL_TIMEOUT)"
                                   ) from None
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip()[-500:]
        raise AgentUnavailable(f"npm install {agent.package}@{agent.version} failed "
                               f"({done.returncode}): {tail}")


@contextlib.contextmanager
def _lock(folder: Path, deadline: float) -> Iterator[None]:
    """One installer per folder (parallel runs of the suite share the cache)."""
    with open(folder / ".lock", "w") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AgentUnavailable(f"another install holds {folder}/.lock") from None
                time.sleep(0.5)  # waiting for another installer, not a timing assertion
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: Sequence[str]) -> int:
    if list(argv) != ["install"]:
        print("usage: python -m tests.harness.agents install", file=sys.stderr)
        return 2
    code = 0
    for agent in AGENTS:
        try:
            print(f"{agent.package}@{agent.version}: {ensure_agent(agent)}")
        except AgentUnavailable as exc:
            print(f"{agent.package}@{agent.version}: unavailable: {exc}", file=sys.stderr)
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
