"""The request log's line, formatted: what a client's text becomes in it (bounded, escaped,
never a key), the leading fields every line shares, the refusal line, the reasons, and which
requests the app writes a refusal line for. Pure: no sockets, no clock."""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.api.answer import REFUSAL_KEY
from gateway.api.end import LINE_KEY
from gateway.api.inference import INFERENCE_ROUTES, route_path_of
from gateway.api.refusals import MODEL_KEY, note_model, write_refusal_line
from gateway.errors import (
    Draining,
    GatewayError,
    InvalidJSON,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthorized,
    UnsupportedMediaType,
)
from gateway.hedge.attempt import AttemptRecord
from gateway.settings import BackendSettings, PoolSettings, ServerSettings, Settings
from gateway.settings.hidden import hidden_values
from gateway.settings.model import AwsSettings
from gateway.stats.loggable import (
    MODEL_CHARS,
    PATH_CHARS,
    REDACTED,
    escaped,
    loggable_model,
    loggable_path,
    looks_like_credential,
)
from gateway.stats.requestlog import LOGGER_NAME, refusal_record, request_record
from gateway.stats.summary import RequestSummary
from gateway.wire.validate import parse_body

ROOT = Path(__file__).resolve().parents[2]
LEADING = ["id", "route", "method", "model", "status", "reason", "outcome"]


# ---- a client's text in a line ----------------------------------------------------------------


@pytest.mark.parametrize(("raw", "logged"), [
    ("gpt-4o-mini", "gpt-4o-mini"),
    ("line\nbreak", "line\\x0abreak"),
    ("cr\rlf", "cr\\x0dlf"),
    ("\x1b[31mred", "\\x1b[31mred"),
    ("del\x7f", "del\\x7f"),
    ("c1\x85", "c1\\x85"),
    ("bidi\u202eevil", "bidi\\u202eevil"),
    ("zero\u200bwidth", "zero\\u200bwidth"),
    ("sep\u2028arator", "sep\\u2028arator"),
    ("lone\ud800surrogate", "lone\\ud800surrogate"),
    ("modèle-été", "modèle-été"),  # printable non-ASCII stays as it is
    ("tab\there", "tab\\x09here"),
])
def test_control_and_format_characters_are_escaped(raw: str, logged: str) -> None:
    assert escaped(raw, 100) == logged
    # and the result, whatever handler prints it, is one line of printable text
    assert escaped(raw, 100).isprintable()


def test_text_is_cut_to_its_bound_and_the_cut_is_marked() -> None:
    assert escaped("a" * 10, 10) == "a" * 10
    assert escaped("a" * 11, 10) == "a" * 10 + "…"
    assert loggable_model("m" * 10_000) == "m" * MODEL_CHARS + "…"
    # the bound counts the client's characters, before escaping
    assert escaped("\n" * 20, 5) == "\\x0a" * 5 + "…"


@pytest.mark.parametrize("model", [
    "demo", "gpt-4o-mini", "gpt-4o-mini-2024-07-18", "claude-sonnet-4-5-20250929",
    "claude-3-5-haiku-20241022", "meta-llama/Llama-3.1-8B-Instruct",
    "anthropic.claude-sonnet-4-5-20250929-v1:0", "claude-sonnet-4-5@20250929",
    "accounts/fireworks/models/llama-v3p1-8b-instruct", "o4-mini", "gpt-5-codex",
    "Qwen/Qwen2.5-Coder-32B-Instruct-GPTQ-Int4", "text-embedding-3-small",
])
def test_model_names_are_logged_as_sent(model: str) -> None:
    assert loggable_model(model) == model


@pytest.mark.parametrize("model", [
    "sk-proj-abcdefghijklmnop1234", "sk-ant-api03-abcdefghijkl", "Bearer anything",
    "bearer\tx", "AKIAIOSFODNN7EXAMPLE", "AIzaSyA1234567890abcdefghij",
    "ghp_abcdefghijklmnopqrstuvwx", "xoxb-1234", "eyJhbGciOiJIUzI1.eyJzdWIiOiIx",
    "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6", "model-with-sk-live-0123456789abcdef",
    "x-eyJhbGciOiJIUzI1.eyJzdWIiOiIx", "a.eyJhbGciOiJIUzI1.eyJzdWIiOiIx",
    "hg-" + "Ab_-" * 10 + "xyz",  # a key of this gateway's store, whatever its letters
])
def test_a_value_shaped_like_a_credential_is_redacted(model: str) -> None:
    assert looks_like_credential(model)
    assert loggable_model(model) == REDACTED


def test_the_configurations_own_secrets_are_redacted_whole_or_inside() -> None:
    hidden = frozenset({"plainsecretvalue", "tiny"})
    assert loggable_model("plainsecretvalue", hidden) == REDACTED
    assert loggable_model("x-plainsecretvalue-y", hidden) == REDACTED
    assert loggable_model("tiny", hidden) == REDACTED  # a short one, only as the whole value
    assert loggable_model("tinymodel", hidden) == "tinymodel"
    assert loggable_model("other", hidden) == "other"


def test_a_model_that_is_not_a_string_is_not_logged() -> None:
    for value in (None, 3, ["a"], {"a": 1}, True):
        assert loggable_model(value) is None


def test_an_unmatched_path_keeps_its_shape_with_token_segments_redacted() -> None:
    assert loggable_path("/chat/completions") == "/chat/completions"
    token = "resp_AQRwb29sAnMwAA9yZXNwX3Vwc3RyZWFtXzEMCAXCBy8EE6kmvZVDBgFRDFj"
    assert loggable_path(f"/responses/{token}/cancel") == f"/responses/{REDACTED}/cancel"
    assert loggable_path("/v1/x\nInjected: 1") == "/v1/x\\x0aInjected: 1"
    assert loggable_path("/" + "p" * 1000) == "/" + "p" * (PATH_CHARS - 1) + "…"


def test_a_credential_that_the_paths_cut_splits_is_still_redacted() -> None:
    key = "sk-proj-" + "abcdefghij" * 4
    logged = loggable_path("/" + "p" * (PATH_CHARS - 10) + "/" + key)
    assert key[:8] not in logged and logged.endswith("…")


def test_a_store_made_key_is_never_logged_as_sent() -> None:
    """Half of them once went through: `hg-` and 43 characters of base64url, which the long
    run of letters and digits caught only when no `-` or `_` fell in its first 32."""
    for key in ("hg-" + secrets.token_urlsafe(32) for _ in range(200)):
        assert loggable_model(key) == REDACTED
        assert REDACTED in loggable_path(f"/v1/{key}")


@pytest.mark.parametrize("hostile", [
    pytest.param(lambda n: "eyJ-" * (n // 4), id="jwt-heads"),
    pytest.param(lambda n: "eyJ" + "a" * n, id="jwt-no-dot"),
    pytest.param(lambda n: ("a" * 7 + ".") * (n // 8), id="dots"),
    pytest.param(lambda n: "Ab1_" * (n // 4), id="token-run"),
])
def test_telling_a_credential_takes_time_linear_in_the_text(
        hostile: Callable[[int], str]) -> None:
    """A client's model name is up to the body's size (4 MiB), and an upstream's rejection
    message up to 64 KiB: the shapes are told in linear time. A JWT pattern that read the rest
    of a run again from each `eyJ` in it took seconds for 256 KB of `eyJ-`. The bound below
    is tens of times what the linear check takes at the largest size, which only a quadratic
    scan crosses; the text doubles from 16 KB, so such a scan fails in seconds, not hours."""
    size = 16 * 1024
    while size <= 1024 * 1024:
        text = hostile(size)
        start = time.process_time()
        looks_like_credential(text)
        loggable_model(text)
        loggable_path("/" + text)
        assert time.process_time() - start < 2.0, size
        size *= 2


# ---- the configuration's secrets -----------------------------------------------------------


def test_every_hidden_setting_is_a_secret_and_no_other() -> None:
    settings = Settings(
        pools=(PoolSettings(name="p", backends=(
            BackendSettings(name="a", base_url="http://h/v1", api_key="backend-key-1",
                            headers=(("x-tenant-token", "header-secret-2"),),
                            query=(("api-version", "query-secret-3"),),
                            proxy="http://user:proxy-pass-4@proxy:3128"),
            BackendSettings(name="b", provider="bedrock", region="us-east-1",
                            aws=AwsSettings(access_key_id="AKIA-id-5",
                                            secret_access_key="aws-secret-6",
                                            session_token="session-7")),
        )),),
        server=ServerSettings(api_keys=("client-8", "client-9"), ops_keys=("ops-10",),
                              response_id_secret="ids-11"),
    )
    assert hidden_values(settings) == {
        "backend-key-1", "header-secret-2", "query-secret-3",
        "http://user:proxy-pass-4@proxy:3128", "AKIA-id-5", "aws-secret-6", "session-7",
        "client-8", "client-9", "ops-10", "ids-11"}
    # names are not secrets: a header's name, the pool's and backends' names
    assert not {"x-tenant-token", "api-version", "p", "a", "b"} & hidden_values(settings)


# ---- the lines -------------------------------------------------------------------------------


def test_a_refusal_line_has_the_leading_fields_and_the_path_only_when_unmatched() -> None:
    line = refusal_record("rid-1", "POST", "/v1/chat/completions", "/v1/chat/completions",
                          "m", 404, "unknown_model")
    assert list(line) == LEADING
    assert line == {"id": "rid-1", "route": "/v1/chat/completions", "method": "POST",
                    "model": "m", "status": 404, "reason": "unknown_model",
                    "outcome": "refused"}
    unmatched = refusal_record("rid-2", "GET", None, "/chat/completions\n", None, 404,
                               "unknown_route")
    assert list(unmatched) == [*LEADING, "path"]
    assert unmatched["path"] == "/chat/completions\\x0a"


def _summary(**changes: Any) -> RequestSummary:
    summary = RequestSummary("rid", "pool", "chat/completions", True, 10.0,
                             route="/v1/chat/completions", model="pool", status=200)
    for name, value in changes.items():
        setattr(summary, name, value)
    return summary


def test_a_proxied_line_starts_with_the_same_fields() -> None:
    winner = AttemptRecord(0, "a", "primary", 10.0, False, outcome="won", ttft=0.1)
    ok = _summary(attempts=[winner], winner=winner, committed_at=10.1, ended=10.5,
                  relay_end="done")
    line = request_record(ok, frozenset({"upstream_failed"}))
    assert list(line)[:len(LEADING)] == LEADING
    assert (line["route"], line["method"], line["model"], line["status"], line["reason"],
            line["outcome"]) == ("/v1/chat/completions", "POST", "pool", 200, "ok", "ok")
    failed = _summary(error="upstream_failed", status=502, reason="upstream_failed")
    assert request_record(failed, frozenset({"upstream_failed"}))["reason"] == "upstream_failed"
    # a reason finer than the error class: the class for the stats, the reason for the log
    drained = _summary(error="overloaded", status=503, reason="draining")
    line = request_record(drained, frozenset({"overloaded"}))
    assert (line["outcome"], line["reason"]) == ("overloaded", "draining")


# ---- the reasons -------------------------------------------------------------------------------


def _tree() -> list[type[GatewayError]]:
    out: list[type[GatewayError]] = []
    pending: list[type[GatewayError]] = [GatewayError]
    while pending:
        cls = pending.pop()
        out.append(cls)
        pending.extend(cls.__subclasses__())
    return out


def test_each_refusal_has_its_own_short_reason() -> None:
    assert InvalidJSON.log_reason() == "invalid_json"
    assert InvalidRequest.log_reason() == "invalid_request"
    assert ModelNotFound.log_reason() == "unknown_model"
    assert PayloadTooLarge.log_reason() == "body_too_large"
    assert UnsupportedMediaType.log_reason() == "unsupported_media_type"
    assert Unauthorized.log_reason() == "unauthorized"
    assert Overloaded.log_reason() == "overloaded"
    assert Draining.log_reason() == "draining"
    # the client still sees the codes it always saw
    assert InvalidJSON.code == InvalidRequest.code and Draining.code == Overloaded.code
    for cls in _tree():
        assert re.fullmatch(r"[a-z][a-z_]*", cls.log_reason()), cls


def test_the_body_parser_tells_broken_json_from_other_invalid_bodies() -> None:
    for raw in (b"{", b"\xff", b"[1]", b"null"):
        with pytest.raises(InvalidJSON):
            parse_body(raw)


def test_the_docs_list_every_reason() -> None:
    observability = (ROOT / "docs" / "observability.md").read_text()
    section = observability.split("### Request log reasons")[1].split("\n## ")[0]
    listed = set(re.findall(r"^\| `([a-z_]+)` \| ", section, re.MULTILINE))
    # every class the gateway raises (the base is never raised itself)
    reasons = {cls.log_reason() for cls in _tree()[1:]} | {"ok", "client_disconnected",
                                                       "unanswered"}
    assert listed == reasons


# ---- which requests get a refusal line --------------------------------------------------------


def test_every_table_path_is_found_whatever_the_id() -> None:
    for route in INFERENCE_ROUTES:
        assert route_path_of(route.path.replace("{response_id}", "resp_x")) == route.path
    for path in ("/v1/models", "/healthz", "/v1/chat/completions/x", "/chat/completions",
                 "/v1/responses//cancel", "/v1/responses/"):
        assert route_path_of(path) is None, path


def _refused(scope: dict[str, Any], caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        write_refusal_line(scope)
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]


def test_the_app_writes_a_refusal_line_once_and_only_where_the_log_covers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def scope(path: str, **state: Any) -> dict[str, Any]:
        return {"type": "http", "method": "POST", "path": path,
                "state": {"request_id": "r", **state}}

    refused = scope("/v1/messages", **{REFUSAL_KEY: (401, "unauthorized")})
    assert [(x["route"], x["status"], x["reason"]) for x in _refused(refused, caplog)] == \
        [("/v1/messages", 401, "unauthorized")]
    assert _refused(refused, caplog) == []  # written once, whoever asks again
    # the proxy took the request: its end writes the line
    assert _refused(scope("/v1/messages", **{LINE_KEY: True}), caplog) == []
    # ops reads are not covered, a 404 anywhere is
    assert _refused(scope("/healthz", **{REFUSAL_KEY: (401, "unauthorized")}), caplog) == []
    assert [x["path"] for x in _refused(
        scope("/favicon.ico", **{REFUSAL_KEY: (404, "unknown_route")}), caplog)] == \
        ["/favicon.ico"]
    # a request to a route that got no answer of ours (cancelled mid-body) still has a line
    gone = _refused(scope("/v1/chat/completions", **{MODEL_KEY: "m"}), caplog)
    assert [(x["status"], x["reason"], x["model"]) for x in gone] == [(None, "unanswered", "m")]


def test_the_noted_model_is_the_loggable_one() -> None:
    scope: dict[str, Any] = {"type": "http"}
    assert note_model(scope, {"model": "secret-of-the-gateway"},
                      frozenset({"secret-of-the-gateway"})) == REDACTED
    assert scope["state"][MODEL_KEY] == REDACTED
    assert note_model(scope, {"model": "a\nb"}, frozenset()) == "a\\x0ab"
    assert note_model(scope, {"messages": []}, frozenset()) is None
    assert scope["state"][MODEL_KEY] is None
