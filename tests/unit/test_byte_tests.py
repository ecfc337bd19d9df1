"""The request path tests bytes for a byte string with `bytes.find`, or for one byte with an
int (`10 in data`), never with `b"..." in data`.

Why: CPython 3.11's `in` on bytes first tries the needle as an integer, and for a bytes needle
raises and clears a formatted TypeError every time (`PyNumber_AsSsize_t` -> `PyErr_Format`)
before its substring search: about 2,500 instructions a test. A streamed chat answer made five
such tests per event, 13 % of its instructions under callgrind
(`python -m gateway.bench.instructions`). A source scan, since the cost is invisible from
Python: the tests give the same answers either way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: where the request path runs, per request or per event
SCANNED = ("gateway/api", "gateway/hedge", "gateway/wire", "gateway/stats", "providers")


def _bytes_in_tests(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            if (isinstance(op, ast.In | ast.NotIn) and isinstance(left, ast.Constant)
                    and isinstance(left.value, bytes)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            left = right
    return found


def test_no_bytes_literal_is_tested_with_in_on_the_request_path() -> None:
    found = [hit for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))
             for hit in _bytes_in_tests(path)]
    assert not found, "use data.find(b'...') >= 0, or an int for one byte:\n" + "\n".join(found)


def test_the_replacements_answer_as_in_did() -> None:
    for data in (b"", b"a\nb", b"a\rb", b'{"usage":null}', b"[DONE]", b"plain"):
        assert (10 in data) == (b"\n" in data)
        assert (13 in data) == (b"\r" in data)
        for needle in (b'"usage"', b"[DONE]", b'"usage":null', b""):
            assert (data.find(needle) >= 0) == (needle in data)
