"""The soak's verdict on one request (pure): how a request ended decides whether the run is
clean, so a silent truncation or a hang must never pass as an explicit error."""

from __future__ import annotations

import pytest

from gateway.bench.load import Sample
from gateway.bench.soak import outcome


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("status 502", ("explicit", "status_502")),
        ("status 429", ("explicit", "status_429")),
        ("error event after the first token", ("explicit", "error_event")),
        ("error event before the first token", ("explicit", "error_event")),
        ("truncated (no [DONE])", ("silent", "truncated")),
        ("no token", ("silent", "done_without_content")),
        ("malformed body", ("silent", "malformed_body")),
        ("transport: RemoteProtocolError", ("silent", "RemoteProtocolError")),
        ("transport: ReadTimeout", ("hung", "ReadTimeout")),
        ("hung", ("hung", "hung")),
    ],
)
def test_outcome_classes(error: str, expected: tuple[str, str]) -> None:
    assert outcome(Sample(1, False, None, 0.1, error)) == expected


def test_ok_is_ok() -> None:
    assert outcome(Sample(1, True, 0.05, 0.1)) == ("ok", "ok")
