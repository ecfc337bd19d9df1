"""The error tree: one builder of the OpenAI error JSON, codes that are class-level facts."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import aiohttp
import pytest

from gateway.api.answer import error_response
from gateway.errors import (
    AllAttemptsFailed,
    GatewayPoolFull,
    HeadersTooLarge,
    InvalidRequest,
    UpstreamClientError,
    UpstreamError,
    UpstreamRejectedRequest,
    UpstreamStatusError,
    error_body,
    failure_codes,
)
from gateway.server.connection import raw_error_response
from gateway.wire.base import ERROR_ENDS
from gateway.wire.chat import CHAT
from gateway.wire.chat import openai_error_event as error_event
from providers.http import UpstreamClient, translate

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
    # the one other: the Responses API's own flat error event (`{"type": "error", "code",
    # "message", "param"}`), a different shape, built once in `gateway.wire.responses`
    assert list(found) == ["gateway/errors.py", "gateway/wire/responses.py"], found
    assert len(found["gateway/errors.py"]) == 1
    assert len(found["gateway/wire/responses.py"]) == 1


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
    raw = raw_error_response(HeadersTooLarge("request line and headers exceed 100 bytes"))
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert json.loads(payload) == error_body(
        "request line and headers exceed 100 bytes", type="invalid_request_error",
        code="headers_too_large",
    )


def test_routes_quote_the_request_id_only_for_server_side_failures() -> None:
    bad = error_response(InvalidRequest("no", param="n"), "r3", CHAT)
    assert json.loads(bytes(bad.body)) == InvalidRequest("no", param="n").body()
    assert bad.status_code == 400
    failed = error_response(AllAttemptsFailed(["a: status 503"]), "r4", CHAT)
    assert failed.status_code == 502
    assert json.loads(bytes(failed.body)) == error_body(
        "all upstream attempts failed: a: status 503", type="upstream_error",
        code="upstream_failed", request_id="r4",
    )


# -- failure codes ---------------------------------------------------------------------------

STATUS_CODES = {
    400: "request_rejected", 413: "request_rejected", 422: "request_rejected",
    401: "auth_failed", 403: "auth_failed", 404: "not_found", 429: "rate_limited",
    503: "unavailable", 500: "server_error", 502: "server_error", 504: "server_error",
    599: "server_error", 302: "bad_status", 408: "bad_status", 418: "bad_status",
    201: "bad_status",
}


def _tree(root: type[Exception]) -> list[type[Exception]]:
    out, pending = [], [root]
    while pending:
        cls = pending.pop()
        out.append(cls)
        pending.extend(cls.__subclasses__())
    return out


def test_a_status_error_is_the_class_of_what_the_status_means() -> None:
    for status, code in STATUS_CODES.items():
        exc = UpstreamStatusError.of(status, retry_after=2.0)
        assert (exc.code, exc.status, exc.reason, exc.retry_after) == (
            code, status, f"status {status}", 2.0)
        assert exc.replaceable == (code != "request_rejected")
        assert isinstance(exc, UpstreamRejectedRequest) == (code == "request_rejected")


def test_class_facts_are_never_overwritten_on_an_instance() -> None:
    """`code`, `replaceable` and `status` of an error class are the class's; an instance only
    adds its own detail (reason, retry_after, the upstream's status)."""
    upstream = [UpstreamStatusError.of(s) for s in STATUS_CODES]
    client = [UpstreamClientError.of(s, "b") for s in (400, 413, 422)]
    for exc in [*upstream, *client]:
        assert not {"code", "replaceable", "type"} & set(vars(exc)), type(exc)
    for sent in client:
        assert "status" not in vars(sent)
    assert [e.status for e in client] == [400, 413, 422]
    assert "status 413 (backend b)" in UpstreamClientError.of(413, "b").message


def test_failure_codes_are_one_per_class_and_bounded() -> None:
    classes = _tree(UpstreamError)
    codes = [cls.code for cls in classes]  # type: ignore[attr-defined]
    assert len(codes) == len(set(codes)), codes
    assert failure_codes() == set(codes)
    assert all(code.isidentifier() and code.islower() for code in codes)


def test_the_docs_list_every_failure_code_and_stream_end() -> None:
    observability = (ROOT / "docs" / "observability.md").read_text()
    section = observability.split("### Attempt failure codes")[1].split("\n## ")[0]
    listed = set(re.findall(r"^\| `([a-z_]+)` \| ", section, re.MULTILINE))
    assert listed == failure_codes()
    errors_row = next(line for line in observability.splitlines()
                      if line.startswith("| `<scope>.errors.<class>`"))
    for end in ERROR_ENDS:
        assert f"`stream_{end}`" in errors_row, end


def test_transport_errors_translate_to_their_classes() -> None:
    """aiohttp's exceptions as it raises them (the messages are aiohttp's own: a payload
    error says whether the connection was lost with an error only in its text)."""
    key = aiohttp.client_reqrep.ConnectionKey("h", 80, False, True, None, None, None)
    cases: dict[str, tuple[aiohttp.ClientError | TimeoutError, str, str]] = {
        "connect-timeout": (aiohttp.ConnectionTimeoutError("x"), "connect_timeout", "connect"),
        "refused": (aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "x")),
                    "connect_error", "connect error"),
        "read-timeout": (aiohttp.SocketTimeoutError("x"), "read_timeout", "read timeout"),
        "timeout": (TimeoutError(), "read_timeout", "read timeout"),
        "reset-mid-body": (aiohttp.ClientPayloadError(
            "Response payload is not completed: <TransferEncodingError: 400, message='Not "
            "enough data to satisfy transfer length header.'>. ConnectionResetError(104, "
            "'Connection reset by peer')"), "connection_reset", "reset"),
        "close-mid-body": (aiohttp.ClientPayloadError(
            "Response payload is not completed: <TransferEncodingError: 400, message='Not "
            "enough data to satisfy transfer length header.'>"), "connection_reset", "closed"),
        "close-before-head": (aiohttp.ServerDisconnectedError(), "connection_reset", "closed"),
        "reset-before-head": (aiohttp.ClientOSError(104, "reset"), "connection_reset", "reset"),
        "bad-head": (aiohttp.ClientResponseError(None, (), status=400),  # type: ignore[arg-type]
                     "protocol_error", "malformed"),
        "other": (aiohttp.InvalidURL("x"), "protocol_error", "transport error"),
    }
    got = {name: (translate(exc).code, words in translate(exc).reason)
           for name, (exc, _, words) in cases.items()}
    assert got == {name: (code, True) for name, (_, code, _) in cases.items()}


async def test_our_pool_full_is_gateway_pool_full() -> None:
    """Every slot of the gateway's own client is taken: the next request waits
    `pool_timeout`, then fails as ours (not the backend's), without touching the network."""
    client = UpstreamClient(max_connections=1)
    await client._slots.acquire()  # one response open elsewhere
    with pytest.raises(GatewayPoolFull) as info:
        await client.request("POST", "http://127.0.0.1:9/v1/x", content=b"{}", headers={},
                             timeout=aiohttp.ClientTimeout(), pool_timeout=0.01)
    assert info.value.code == "gateway_pool_full" and not info.value.backend_fault
    assert client.in_use == 0
    await client.aclose()
