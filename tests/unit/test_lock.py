"""requirements.lock matches pyproject.toml: every runtime dependency of `hedge-gateway[all]`
is pinned there, inside its range, with hashes; the container image installs from it; and
where the code leans on a library's private API the range has an upper bound.

`bash .ci/lock` rewrites the file; this test fails when pyproject.toml changed and the lock
was not refreshed (a range the pinned version falls outside, a dependency missing)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
#: the environment the lock is made for (the container image's): Linux, CPython 3.11
TARGET: dict[str, str] = {**{k: str(v) for k, v in default_environment().items()},
                          "sys_platform": "linux", "platform_system": "Linux",
                          "python_version": "3.11", "implementation_name": "cpython",
                          "extra": ""}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def project() -> dict[str, object]:
    data: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return data


def runtime_requirements() -> list[Requirement]:
    """The core dependencies and those of every provider's extra, for the target."""
    extras = project()["optional-dependencies"]
    assert isinstance(extras, dict)
    core = project()["dependencies"]
    assert isinstance(core, list)
    found = [Requirement(line) for line in [*core, *extras["all"]]]
    return [r for r in found if r.marker is None or r.marker.evaluate(TARGET)]


def pinned() -> dict[str, tuple[str, int]]:
    """Package -> (version, number of hashes) as the lock file pins them."""
    pins: dict[str, tuple[str, int]] = {}
    current: str | None = None
    for line in LOCK.read_text().splitlines():
        match = PIN.match(line)
        if match:
            current = canonicalize_name(match[1])
            pins[current] = (match[2], 0)
        elif current is not None and line.strip().startswith("--hash=sha256:"):
            version, hashes = pins[current]
            pins[current] = (version, hashes + 1)
        elif not line.startswith((" ", "#")):
            current = None
    return pins


def test_every_runtime_dependency_is_pinned_in_its_range() -> None:
    pins = pinned()
    for requirement in runtime_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in requirements.lock: run bash .ci/lock"
        version = pins[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"requirements.lock pins {name}=={version}, outside {requirement}: "
            "run bash .ci/lock")


def test_every_pin_is_exact_and_carries_a_hash() -> None:
    pins = pinned()
    assert len(pins) >= len(runtime_requirements())
    assert all(hashes > 0 for _, hashes in pins.values()), \
        [name for name, (_, hashes) in pins.items() if hashes == 0]
    # nothing but pins, their hashes and comments: no URL, no editable, no index option
    for line in LOCK.read_text().splitlines():
        stripped = line.strip()
        assert (not stripped or stripped.startswith(("#", "--hash=sha256:"))
                or PIN.match(stripped)), line


def test_the_all_extra_is_every_provider_extra_and_the_shared_stores_driver() -> None:
    extras = project()["optional-dependencies"]
    assert isinstance(extras, dict)
    assert sorted(extras["all"]) == sorted([*extras["bedrock"], *extras["vertex"],
                                            *extras["postgres"]])


def test_the_container_image_installs_from_the_lock_with_hashes() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "--require-hashes --no-deps \\\n       -r /src/requirements.lock" in dockerfile
    assert "COPY pyproject.toml README.md requirements.lock ./" in dockerfile


@pytest.mark.parametrize("library", ["uvicorn", "aiohttp"])
def test_a_library_whose_private_api_we_use_has_an_upper_bound(library: str) -> None:
    """gateway/server/connection.py subclasses uvicorn's HttpToolsProtocol, providers/http.py
    overrides aiohttp's TCPConnector.connect: a release may change them without notice, so
    the range stops at the newest release tested."""
    core = project()["dependencies"]
    assert isinstance(core, list)
    requirement = next(Requirement(r) for r in core if Requirement(r).name == library)
    assert any(spec.operator in ("<", "<=", "~=", "==") for spec in requirement.specifier), \
        requirement
