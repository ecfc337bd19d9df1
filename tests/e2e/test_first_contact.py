"""First contact: a provider's library never stops the gateway, a config that needs a missing
extra is refused naming it, and the start-up lines tell a newcomer what works.

The suite's virtualenv has every extra installed, so the cloud providers' libraries are taken
away here the way a lean install lacks them: a `sitecustomize` on the child's `PYTHONPATH`
makes importing `botocore` or `google` fail as a missing module does. `.ci/run` also runs the
README's own command in a virtualenv that really lacks them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import openai
import pytest

from gateway.cli import startup_lines
from gateway.settings import default_settings, load_settings
from tests.e2e.test_cli import (
    CONFIG_DIR,
    DEMO_CONTENT,
    command,
    keyless_env,
    serving,
    terminate,
    wait_healthy,
)

#: the libraries of the `bedrock` and `vertex` extras, by top-level module
EXTRA_MODULES = ("botocore", "google")

BLOCKER = f'''"""Imports of the cloud providers' libraries fail as if they were not installed."""
import sys

ABSENT = {EXTRA_MODULES!r}


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Absent())
'''

#: the variables config/claude-everywhere.yaml reads, with dummy values
CLOUD_ENV = {"GATEWAY_KEY": "k" * 40, "ANTHROPIC_API_KEY": "unused-anthropic-key"}
CLOUD_CONFIG = str(CONFIG_DIR / "claude-everywhere.yaml")


def without_extras(tmp_path: Path) -> dict[str, str]:
    """The environment additions that hide the extras' libraries from a child process."""
    site = tmp_path / "no-extras"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command(), *args], env={**keyless_env(), **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_blocker_hides_the_libraries(tmp_path: Path) -> None:
    """The tests below mean something: under the blocker the libraries cannot be imported."""
    import sys

    for module in EXTRA_MODULES:
        result = subprocess.run([sys.executable, "-c", f"import {module}"],
                                env={**os.environ, **without_extras(tmp_path)},
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, module


def test_serve_starts_and_streams_without_the_cloud_providers_libraries(tmp_path: Path) -> None:
    with serving(tmp_path, env=without_extras(tmp_path)) as (proc, root, log):
        wait_healthy(proc, root + "/healthz", log)
        with openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0,
                           timeout=openai.Timeout(8.0)) as client:
            chunks = list(client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "hi"}], stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
            == DEMO_CONTENT
        code, output = terminate(proc, log)
    assert code == 0, output
    assert "Traceback" not in output, output


def test_check_config_names_the_extra_a_provider_needs(tmp_path: Path) -> None:
    missing = run_cli(["check-config", CLOUD_CONFIG], {**CLOUD_ENV, **without_extras(tmp_path)},
                      tmp_path)
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert "pools[0].backends[1].provider: provider 'bedrock' needs the extra 'bedrock'" \
        in missing.stderr, missing.stderr
    assert "pip install 'hedge-gateway[bedrock]'" in missing.stderr
    assert "pip install 'hedge-gateway[vertex]'" in missing.stderr
    assert "Traceback" not in missing.stderr
    # the same file with the libraries installed is valid: the extra was the only problem
    present = run_cli(["check-config", CLOUD_CONFIG], CLOUD_ENV, tmp_path)
    assert present.returncode == 0, present.stderr


def test_serve_refuses_a_config_whose_extra_is_missing_naming_it(tmp_path: Path) -> None:
    result = run_cli(["serve", "--config", CLOUD_CONFIG, "--port", "0"],
                     {**CLOUD_ENV, **without_extras(tmp_path)}, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "invalid configuration" in result.stderr
    assert "pip install 'hedge-gateway[vertex]'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_curl_line_serve_prints_streams_an_answer(tmp_path: Path) -> None:
    with serving(tmp_path) as (proc, root, log):
        wait_healthy(proc, root + "/healthz", log)
        lines = [line for line in log.read_text().splitlines() if "try: curl " in line]
        assert len(lines) == 1, log.read_text()
        curl = lines[0].split("try: ", 1)[1]
        answer = subprocess.run(["bash", "-c", f"{curl} --max-time 20 --silent --show-error"],
                                capture_output=True, text=True, timeout=30, check=False)
        terminate(proc, log)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.rstrip().endswith("data: [DONE]"), answer.stdout
    assert "tok0" in answer.stdout


# ---- the start-up lines, as data ------------------------------------------------------------


def test_startup_lines_name_the_url_pools_dashboard_and_a_working_request() -> None:
    lines = startup_lines(default_settings(), "embedded default")
    text = "\n".join(lines)
    assert "on http://127.0.0.1:8080/v1" in lines[0]
    assert "pool 'demo': 3 backends (sim)" in text
    assert "dashboard http://127.0.0.1:8080/dashboard" in text
    assert "curl -N http://127.0.0.1:8080/v1/chat/completions" in text
    assert '"model":"demo"' in text
    assert "WARNING" not in text  # loopback: nobody else can reach it


def test_a_listener_beyond_loopback_gets_a_reachable_curl_line_and_a_keyed_one() -> None:
    from dataclasses import replace

    settings = default_settings()
    open_settings = replace(settings, server=replace(settings.server, host="0.0.0.0"))
    lines = startup_lines(open_settings, "x")
    assert "on http://0.0.0.0:8080/v1" in lines[0]
    # the curl line targets an address this machine can reach
    assert any("curl -N http://127.0.0.1:8080/" in line for line in lines)
    keyed = replace(open_settings, server=replace(open_settings.server, api_keys=("k" * 40,)))
    assert any('-H "authorization: Bearer $KEY"' in line for line in
               startup_lines(keyed, "x"))


def test_a_pool_of_messages_backends_gets_a_messages_request(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    for name, value in CLOUD_ENV.items():
        monkeypatch.setenv(name, value)
    lines = startup_lines(load_settings(CLOUD_CONFIG), "x")
    curl = next(line for line in lines if "try: curl" in line)
    assert "/v1/messages" in curl and '"max_tokens"' in curl
    assert '"model":"claude-sonnet-4-5"' in curl
