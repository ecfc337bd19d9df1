"""Configuration errors never show a value taken from the environment: not in the message,
not in a traceback (a URL library's own error repeats the host), not in the reload log. They
name the key path and the variable instead."""

from __future__ import annotations

import io
import logging
import random
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from gateway.api.keys import KeyRing
from gateway.app import Reloader, build_pools
from gateway.cli import start_warnings
from gateway.hedge.generation import Generation, Live
from gateway.settings import ConfigError, ServerSettings, Settings, load_settings
from gateway.settings.load import MIN_SECRET_CHARS, check_config, weak_secrets
from gateway.settings.origin import ConfigOrigin
from gateway.stats import Stats
from providers.http import UpstreamClient
from tests.unit.test_generation import pool

SECRET = "s3cr3t-value-9f8e7d"
ENV = {"UPSTREAM_HOST": SECRET}
BAD_URLS = ["http://[${UPSTREAM_HOST}]/v1", "http://[::1${UPSTREAM_HOST}]/v1",
            "http://h:${UPSTREAM_HOST}/v1", "https://${UPSTREAM_HOST}@h/v1",
            "${UPSTREAM_HOST}", "http://[${UPSTREAM_HOST}/v1"]


def config_with(tmp_path: Path, base_url: str, tls: str = "") -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text("pools:\n  - name: p\n    backends:\n      - name: b\n"
                    "        provider: openai\n        model: m\n"
                    f"        base_url: '{base_url}'\n        api_key: k\n{tls}")
    return path


@pytest.mark.parametrize("url", BAD_URLS)
def test_an_invalid_url_from_the_environment_names_the_key_and_variable_not_the_value(
    tmp_path: Path, url: str
) -> None:
    path = config_with(tmp_path, url)
    with pytest.raises(ConfigError) as info:
        load_settings(path, env=ENV)
    shown = "\n".join(info.value.errors) + "".join(traceback.format_exception(info.value))
    assert SECRET not in shown
    (error,) = info.value.errors
    assert "pools[0].backends[0].base_url" in error and "${UPSTREAM_HOST}" in error


@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_check_config_and_serve_refuse_it_without_printing_the_value(
    tmp_path: Path, command: str
) -> None:
    path = config_with(tmp_path, BAD_URLS[0])
    args = [str(path)] if command == "check-config" else ["--config", str(path), "--port", "0"]
    done = subprocess.run([sys.executable, "-m", "gateway.cli", command, *args],
                          capture_output=True, text=True, timeout=60,
                          env={"UPSTREAM_HOST": SECRET, "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0
    assert SECRET not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "base_url" in done.stdout + done.stderr


def test_a_ca_file_that_is_not_a_certificate_is_a_config_error_with_its_key_path(
    tmp_path: Path
) -> None:
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("this is not a certificate\n")
    path = config_with(tmp_path, "https://h/v1", f"        tls: {{ca_file: '{not_pem}'}}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    (error,) = info.value.errors
    assert error.startswith("pools[0].backends[0].tls.ca_file: ")


def test_a_reload_that_fails_in_any_way_is_logged_as_refused_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(pools=(pool("p", "a"),))
    client = UpstreamClient(max_connections=8)
    pools = build_pools(settings, client, lambda: 0.0, random.Random(1))
    live = Live(Generation(settings, pools, ConfigOrigin.embedded(settings, now=0.0)))
    reloader = Reloader(live, Stats.for_pools(pools, now=0.0), client, lambda: 1.0,
                        random.Random(2))
    before = live.current
    monkeypatch.setenv("UPSTREAM_HOST", SECRET)
    caplog.set_level(logging.INFO)
    assert not reloader.reload_file(str(config_with(tmp_path, BAD_URLS[0])))
    assert live.failed_reloads == 1 and "reload refused" in caplog.text
    assert "base_url" in caplog.text and SECRET not in caplog.text

    def broken(*args: object, **kwargs: object) -> object:
        raise ValueError(f"cannot build {SECRET}")

    monkeypatch.setattr("gateway.app.build_pools", broken)
    good = config_with(tmp_path, "http://127.0.0.1:9/v1")
    assert not reloader.reload_file(str(good))
    assert live.failed_reloads == 2 and caplog.text.count("reload refused") == 2
    assert SECRET not in caplog.text
    assert live.current is before


# ---- keys short enough to guess, and a listener open to other machines ----------------------

SHORT = "k-0123"
LONG = "k" * MIN_SECRET_CHARS


def test_short_keys_and_secrets_are_warned_about_by_place_never_by_value() -> None:
    server = ServerSettings(api_keys=(LONG, SHORT), ops_keys=(SHORT,),
                            response_id_secret=SHORT)
    lines = weak_secrets(server)
    assert [line.split(" ")[0] for line in lines] == [
        "server.api_keys[1]", "server.ops_keys[0]", "server.response_id_secret"]
    assert not any(SHORT in line for line in lines)
    assert weak_secrets(ServerSettings(api_keys=(LONG,), ops_keys=(LONG,),
                                       response_id_secret=LONG)) == []


def test_check_config_prints_the_short_key_warnings_and_still_passes(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(f"server:\n  api_keys: ['{SHORT}']\n  ops_keys: ['{LONG}']\n"
                    "pools:\n  - name: p\n    backends:\n      - name: b\n"
                    "        provider: openai\n        model: m\n"
                    "        base_url: 'http://127.0.0.1:1/v1'\n        api_key: k\n")
    out, err = io.StringIO(), io.StringIO()
    assert check_config(str(path), out, err) == 0
    assert "warning: server.api_keys[0] is shorter than 32" in err.getvalue()
    assert "ops_keys" not in err.getvalue() and SHORT not in out.getvalue() + err.getvalue()


def test_serve_warns_at_start_about_short_keys_and_an_open_listener_without_keys() -> None:
    assert start_warnings(ServerSettings()) == []  # loopback, no keys: the local default
    assert start_warnings(ServerSettings(host="0.0.0.0", api_keys=(LONG,))) == []
    (open_listener,) = start_warnings(ServerSettings(host="0.0.0.0"))
    assert "0.0.0.0" in open_listener and "without client keys" in open_listener
    (short,) = start_warnings(ServerSettings(host="10.0.0.5", api_keys=(SHORT,)))
    assert short.startswith("server.api_keys[0] is shorter")


def test_a_reload_that_swaps_in_a_short_key_warns_by_place(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(pools=(pool("p", "a"),))
    client = UpstreamClient(max_connections=8)
    pools = build_pools(settings, client, lambda: 0.0, random.Random(1))
    live = Live(Generation(settings, pools, ConfigOrigin.embedded(settings, now=0.0)))
    rings = {"api_keys": KeyRing(), "ops_keys": KeyRing()}
    reloader = Reloader(live, Stats.for_pools(pools, now=0.0), client, lambda: 1.0,
                        random.Random(2), keys=rings)
    path = config_with(tmp_path, "http://127.0.0.1:9/v1")
    path.write_text(f"server:\n  api_keys: ['{SHORT}']\n" + path.read_text())
    caplog.set_level(logging.INFO)
    assert reloader.reload_file(str(path))
    assert "configuration reload: server.api_keys[0] is shorter than 32" in caplog.text
    assert SHORT not in caplog.text
