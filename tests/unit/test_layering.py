"""The architecture, checked by reading imports (no module is imported or run).

Two rules keep the tree the shape the README's architecture section draws:
- the pure cores know no event loop, HTTP client or web framework, so they stay testable with a
  plain-number clock and reusable by any shell;
- arrows point downward only: a module imports modules of its own layer or below, never above.
A new module must be placed in `LAYERS`, so it cannot slip in unplaced.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the pure modules: decisions and wire checks, no I/O
PURE = (
    "gateway.hedge.delay",
    "gateway.hedge.budget",
    "gateway.hedge.balancer",
    "gateway.hedge.latency",
    "gateway.wire.sse",
    "gateway.wire.chat",
    "gateway.wire.protocols",
    "gateway.api.stored",
    "gateway.wire.validate",
    "gateway.server.workers",
    "gateway.wire.usage",
)
FORBIDDEN_IN_PURE = ("asyncio", "anyio", "httpx", "aiohttp", "starlette", "fastapi", "uvicorn")

#: bottom to top; a module may import only from its own layer or lower ones. A name stands for
#: the module and everything below it in the package tree.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("gateway.errors", "gateway.failures", "gateway.wire.ends", "gateway.clock",
     "gateway.settings", "gateway.wire.sse", "gateway.hedge.latency", "gateway.drain", "gateway.stats.table",
     "gateway.wire.usage"),
    ("gateway.wire.chat", "gateway.wire.protocols", "gateway.api.stored", "gateway.wire.validate",
     "gateway.hedge.delay", "gateway.hedge.budget", "gateway.hedge.balancer", "gateway.server.workers"),
    ("providers",),
    ("gateway.hedge.pool", "gateway.hedge.attempt", "gateway.hedge.generation"),
    ("gateway.hedge.race", "gateway.hedge.relay", "gateway.wire.named", "gateway.api.stream"),
    ("gateway.stats", "gateway.stats.tracing"),
    ("gateway.api.proxy", "gateway.api.end"),
    ("gateway.api.routes", "gateway.api.protocols", "gateway.api.asgi", "gateway.server.serve",
     "gateway.server.connection", "gateway.dashboard"),
    ("gateway.app", "gateway.server.supervisor"),
    ("gateway.cli", "gateway.bench"),
)
#: package `__init__` modules re-export their children and sit in their children's layer
PACKAGES = ("gateway", "providers")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top in ("gateway", "providers"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module the file imports, at any depth (a lazy import in a function counts)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from gateway.bench import report` imports the submodule gateway.bench.report
            names.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULES)
    return names


def _layer(module: str) -> int | None:
    """The layer of a module: the longest matching prefix in LAYERS."""
    best: tuple[int, int] | None = None
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in MODULES if m not in ("gateway", "providers") and _layer(m) is None]
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_do_no_io(module: str) -> None:
    bad = sorted(
        name for name in _imports(MODULES[module])
        if name.split(".")[0] in FORBIDDEN_IN_PURE
    )
    assert not bad, f"{module} is a pure module but imports {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in PACKAGES))
def test_imports_point_downward(module: str) -> None:
    own = _layer(module)
    assert own is not None
    upward = []
    for name in _imports(MODULES[module]):
        if name.split(".")[0] not in ("gateway", "providers") or name in ("gateway", "providers"):
            continue
        theirs = _layer(name)
        if theirs is not None and theirs > own:
            upward.append(name)
    assert not upward, f"{module} (layer {own}) imports higher layers: {sorted(upward)}"


def test_the_checker_sees_a_violation() -> None:
    """The rule itself can fail: a pure module importing the race would be caught."""
    assert _layer("gateway.hedge.race") is not None
    assert _layer("gateway.hedge.delay") is not None
    race, policy = _layer("gateway.hedge.race"), _layer("gateway.hedge.delay")
    assert race is not None and policy is not None and race > policy
