"""The error tree: one builder of the OpenAI error JSON, codes that are class-level facts."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from gateway.errors import AllAttemptsFailed, InvalidRequest, error_body
from gateway.relay import error_event
from gateway.routes import error_response
from gateway.server import _head_too_large_response

ROOT = Path(__file__).resolve().parents[2]
ERROR_KEYS = {"message", "type", "param", "code"}


def _error_dicts(path: Path) -> list[int]:
    """Lines of dict literals shaped like an OpenAI error object."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if keys >= ERROR_KEYS:
                lines.append(node.lineno)
    return lines


def test_one_function_builds_the_openai_error_json() -> None:
    found = {
        str(path.relative_to(ROOT)): lines
        for top in ("gateway", "providers")
        for path in sorted((ROOT / top).rglob("*.py"))
        if (lines := _error_dicts(path))
    }
    assert list(found) == ["gateway/errors.py"], found
    assert len(found["gateway/errors.py"]) == 1


def test_the_builder_and_its_callers_agree() -> None:
    assert error_body("m", type="t", code="c") == {
        "error": {"message": "m", "type": "t", "param": None, "code": "c"}
    }
    assert error_body("m", type="t", code=None, param="p", request_id="r1") == {
        "error": {"message": "m (request id r1)", "type": "t", "param": "p", "code": None}
    }
    # the relay's final in-stream event
    event = error_event("upstream stream ended", "stream_truncated", "r2")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: "):]) == error_body(
        "upstream stream ended", type="upstream_error", code="stream_truncated", request_id="r2"
    )
    # the server's 431, written before any app code runs
    raw = _head_too_large_response(100)
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert json.loads(payload) == error_body(
        "request line and headers exceed 100 bytes", type="invalid_request_error",
        code="headers_too_large",
    )


def test_routes_quote_the_request_id_only_for_server_side_failures() -> None:
    bad = error_response(InvalidRequest("no", param="n"), "r3")
    assert json.loads(bytes(bad.body)) == InvalidRequest("no", param="n").body()
    assert bad.status_code == 400
    failed = error_response(AllAttemptsFailed(["a: status 503"]), "r4")
    assert failed.status_code == 502
    assert json.loads(bytes(failed.body)) == error_body(
        "all upstream attempts failed: a: status 503", type="upstream_error",
        code="upstream_failed", request_id="r4",
    )
