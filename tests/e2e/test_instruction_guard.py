"""The hot path's guard catches what it is for: a change that adds about 20 % to a request's
instructions fails it, and the same code measured twice passes against itself.

The addition is made without touching the product: a `sitecustomize` on the gateway's
`PYTHONPATH` wraps the ASGI app's entry with a fixed loop, once per HTTP request, sized to
about a fifth of a streamed chat request's instructions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.bench.instructions import judge, measure

#: loop turns that cost about 20 % of a streamed chat completion's instructions (Python 3.11)
BURN_ITERATIONS = 6_000

BURN = f'''"""Every HTTP request through the gateway runs a fixed extra loop first."""
import importlib.abc
import importlib.util
import sys

TARGET = "gateway.api.asgi"


class Burn(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            call = module.GatewayAPI.__call__

            async def burning(self, scope, receive, send):
                if scope["type"] == "http":
                    for _ in range({BURN_ITERATIONS}):
                        pass
                await call(self, scope, receive, send)

            module.GatewayAPI.__call__ = burning

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Burn())
'''

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("valgrind") is None,
                       reason="valgrind is not installed (.ci/run installs Debian's package)"),
]


@pytest.mark.timeout(600)
def test_the_guard_fails_on_a_deliberate_20_percent_addition_and_passes_unchanged_code(
    tmp_path: Path,
) -> None:
    plain_dir, burn_dir, site = tmp_path / "plain", tmp_path / "burn", tmp_path / "site"
    for folder in (plain_dir, burn_dir, site):
        folder.mkdir()
    (site / "sitecustomize.py").write_text(BURN)

    plain = measure(plain_dir)
    burnt = measure(burn_dir, extra_env={"PYTHONPATH": str(site)})

    added = burnt["chat_stream"] / plain["chat_stream"]
    assert 1.16 <= added <= 1.4, f"the burn added x{added:.3f}, not about 20 %"
    assert [v.kind for v in judge(burnt, plain) if v.over], "the guard missed the addition"
    assert not [v.kind for v in judge(plain, plain) if v.over]
    # and the numbers are real: a streamed request costs millions of instructions
    assert all(count > 1_000_000 for count in plain.values()), plain
