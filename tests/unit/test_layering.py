"""The architecture, checked by reading imports (no module is imported or run).

Four rules keep the tree the shape `docs/architecture.md` draws:
- the pure cores know no event loop, HTTP client or web framework, so they stay testable with a
  plain-number clock and reusable by any shell;
- arrows point downward only: a module imports modules of its own layer or below, never above;
- the one-way contracts between roles (`FORBIDDEN`): the server takes nothing from the API
  layer or the race, the API layer no provider type, the race nothing from the API layer or
  stats, wire rules and providers nothing from the race, the bench nothing from the app;
- no two modules import each other, directly or round a circle, type-only imports included.
A new module must be placed in `LAYERS`, so it cannot slip in unplaced.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the pure modules: decisions and wire rules, no I/O
PURE = (
    "gateway.hedge.delay",
    "gateway.hedge.translated",
    "gateway.hedge.budget",
    "gateway.hedge.deadline",
    "gateway.hedge.balancer",
    "gateway.hedge.headroom",
    "gateway.hedge.affinity",
    "gateway.hedge.prefill",
    "gateway.hedge.classes",
    "gateway.hedge.sizing",
    "gateway.hedge.latency",
    "gateway.hedge.gaps",
    "gateway.wire.base",
    "gateway.wire.explain",
    "gateway.wire.ratelimit",
    "gateway.wire.sse",
    "gateway.wire.chat",
    "gateway.wire.responses",
    "gateway.wire.messages",
    "gateway.wire.named",
    "gateway.wire.paths",
    "gateway.wire.validate",
    "gateway.wire.usage",
    "gateway.wire.resume",
    "gateway.api.stored",
    "gateway.server.workers",
    "gateway.server.extensions",
    "gateway.stats.loggable",
    "gateway.settings.hidden",
    "gateway.tenants.lease",
    "gateway.tenants.limits",
    "gateway.tenants.headers",
    "gateway.tenants.registry",
    "gateway.tenants.spend",
    "providers.sim.cache",
    "providers.sim.prompt",
    "providers.sim.schema",
    "providers.sim.tools",
    "providers.sim.validate",
)
FORBIDDEN_IN_PURE = ("asyncio", "anyio", "httpx", "aiohttp", "starlette", "fastapi", "uvicorn")

#: bottom to top; a module may import only from its own layer or lower ones. A name stands for
#: the module and everything below it in the package tree; the longest matching name wins.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("gateway.errors", "gateway.clock", "gateway.drain", "gateway.argtypes", "gateway.settings",
     "gateway.wire.sse", "gateway.wire.explain",
     "gateway.wire.usage", "gateway.hedge.latency", "gateway.stats.table",
     "gateway.server.extensions"),
    ("gateway.wire", "gateway.hedge.delay", "gateway.hedge.budget", "gateway.hedge.deadline",
     "gateway.hedge.balancer",
     "gateway.hedge.headroom", "gateway.hedge.affinity", "gateway.hedge.prefill",
     "gateway.hedge.classes", "gateway.hedge.sizing", "gateway.hedge.gaps",
     "gateway.hedge.translated",
     "gateway.server.workers",
     "gateway.api.stored", "gateway.tenants"),
    ("providers",),
    ("gateway.hedge.pool", "gateway.hedge.prefix", "gateway.hedge.attempt",
     "gateway.hedge.generation"),
    ("gateway.hedge", "gateway.api.stream"),
    ("gateway.stats",),
    ("gateway.api.proxy", "gateway.api.end", "gateway.api.request", "gateway.api.answer",
     "gateway.api.admission"),
    ("gateway.api", "gateway.server", "gateway.dashboard"),
    ("gateway.app",),
    ("gateway.cli", "gateway.bench"),
)
#: (importer, imported): no module under the first imports one under the second, whatever the
#: layers say. What the server needs of the app's contracts lives in `gateway.server.extensions`
#: and `gateway.wire.paths`; the supervisor's `ConfigOrigin` and the bench's `CONFIG_ENV` in
#: `gateway.settings.origin`; what an attempt sends (`UpstreamCall`) is built by the race's
#: runner (`gateway.hedge.runner`), and the routes' names are `gateway.wire.paths.Endpoint`.
#: The race and the relay take each request's protocol as an argument (`gateway.wire.base`),
#: so no module of `gateway.hedge` reads one API's wire module.
FORBIDDEN: tuple[tuple[str, str], ...] = (
    ("gateway.server", "gateway.api"),
    ("gateway.server", "gateway.hedge"),
    ("gateway.api", "providers"),
    ("gateway.bench", "gateway.app"),
    ("gateway.hedge", "gateway.api"),
    ("gateway.hedge", "gateway.stats"),
    ("gateway.wire", "gateway.hedge"),
    ("providers", "gateway.hedge"),
    # the race holds no rule of one API: the route's `WireProtocol` is handed to it
    ("gateway.hedge", "gateway.wire.chat"),
    ("gateway.hedge", "gateway.wire.responses"),
    ("gateway.hedge", "gateway.wire.messages"),
    ("gateway.hedge", "gateway.wire.named"),
    # nor a translation between APIs: the pool is handed the table (`Translation` is data)
    ("gateway.hedge", "gateway.wire.translate"),
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


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _forbidden(module: str, imports: set[str]) -> list[str]:
    """The imports of `module` that break a one-way rule of `FORBIDDEN`."""
    return sorted(
        f"{module} -> {name}" for name in imports for source, target in FORBIDDEN
        if _under(module, source) and _under(name, target)
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_one_way_contracts_hold(module: str) -> None:
    broken = _forbidden(module, _imports(MODULES[module]))
    assert not broken, f"imports against the one-way rules: {broken}"


def test_the_one_way_check_sees_each_arrow() -> None:
    """Each forbidden arrow is caught, and so is a lazy import: the rule itself can fail."""
    for source, target in FORBIDDEN:
        assert _forbidden(source + ".x", {target + ".y"}) == [f"{source}.x -> {target}.y"]
    tree = "def f():\n    from gateway.api.stream import SSEResponse\n"
    found = {n.module for n in ast.walk(ast.parse(tree)) if isinstance(n, ast.ImportFrom)}
    assert _forbidden("gateway.server.connection", {m for m in found if m}) != []
    assert _forbidden("gateway.api.proxy", {"gateway.hedge.runner"}) == []
    assert _forbidden("gateway.apiary", {"providers.base"}) == []


def test_the_checker_sees_a_violation() -> None:
    """The rule itself can fail: a pure module importing the race would be caught."""
    assert _layer("gateway.hedge.race") is not None
    assert _layer("gateway.hedge.delay") is not None
    race, policy = _layer("gateway.hedge.race"), _layer("gateway.hedge.delay")
    assert race is not None and policy is not None and race > policy


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (every import: lazy and type-only ones too)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        graph[module] = {name for name in _imports(path) if name in MODULES and name != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's `__init__` that re-exports a child is not a circle with that child: the
    edges into a package stand for the children it re-exports."""
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    resolved: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out: set[str] = set()
        for target in targets:
            if target in packages and not module.startswith(target + "."):
                out |= {t for t in graph[target] if t.startswith(target + ".")} or {target}
            elif target not in packages:
                out.add(target)
        resolved[module] = out
    return {m: t for m, t in resolved.items() if m not in packages}


def test_no_import_circles() -> None:
    circles = _circles(_without_packages(_graph()))
    assert not circles, f"import circles: {circles}"


def test_the_circle_check_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
