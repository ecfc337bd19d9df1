"""The bench's child simulator stands alone: its own flags, and no import of the command line.

The CLI imports the bench, and the bench starts `python -m gateway.bench.upstream`; a child
that imported the CLI back closed a circle and loaded the whole gateway into every simulator.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.bench.upstream import parse_args

BENCH = Path(__file__).resolve().parents[2] / "gateway" / "bench"


def test_the_child_parses_its_own_flags() -> None:
    ns = parse_args(["--port", "9123"])
    assert (ns.host, ns.port) == ("127.0.0.1", 9123)
    assert parse_args(["--port", "1", "--host", "0.0.0.0"]).host == "0.0.0.0"
    with pytest.raises(SystemExit) as missing:
        parse_args([])
    assert missing.value.code == 2


def _imported(path: Path) -> set[str]:
    """Every module a file imports, at any depth: a lazy import inside a function counts."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_bench_module_imports_the_command_line() -> None:
    offenders = {path.name: sorted(n for n in _imported(path)
                                   if n == "gateway.cli" or n.startswith("gateway.cli."))
                 for path in sorted(BENCH.glob("*.py"))}
    assert {name: found for name, found in offenders.items() if found} == {}
    # the check itself can fail: the CLI does import the bench
    cli = BENCH.parent / "cli.py"
    assert any(n.startswith("gateway.bench") for n in _imported(cli))


def test_the_child_loads_neither_the_cli_nor_the_gateway_app() -> None:
    """What a simulator child really imports, transitively (the package's own __init__
    included): not the CLI, not the app it would never serve."""
    code = ("import sys, gateway.bench.upstream; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('gateway'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                text=True).stdout.split())
    assert "gateway.bench.upstream" in loaded
    assert not loaded & {"gateway.cli", "gateway.app", "gateway.bench.run"}
