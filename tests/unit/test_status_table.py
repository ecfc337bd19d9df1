"""What each upstream status means is read from one table (`gateway.errors.UPSTREAM_STATUSES`):
the attempt failure, the client's verdict, the pinned answer and the pushback all agree with it."""

from __future__ import annotations

import pytest

from gateway.errors import (
    UPSTREAM_STATUSES,
    UpstreamClientError,
    UpstreamPushback,
    UpstreamRateLimited,
    UpstreamRateLimitedEverywhere,
    UpstreamServerError,
    UpstreamStatusError,
    all_attempts_failed,
    upstream_status,
)


@pytest.mark.parametrize("status", [*sorted(UPSTREAM_STATUSES), 302, 408, 418, 500, 502, 599])
def test_every_reading_of_a_status_is_its_row(status: int) -> None:
    row = upstream_status(status)
    failure = UpstreamStatusError.of(status, retry_after=2.0)
    assert type(failure) is row.failure and failure.status == status
    verdict = UpstreamClientError.of(status, "b")
    assert type(verdict) is (row.verdict or UpstreamClientError)
    if row.pushback is not None:
        assert type(UpstreamPushback.of(status, ["r"], 1.0)) is row.pushback


def test_the_table_says_what_a_429_means() -> None:
    row = upstream_status(429)
    assert row.failure is UpstreamRateLimited and row.failure.throttle
    assert row.pushback is UpstreamRateLimitedEverywhere and not row.pinned_answer
    assert upstream_status(503).pushback is UpstreamPushback
    assert upstream_status(502).failure is UpstreamServerError
    assert {s for s, r in UPSTREAM_STATUSES.items() if r.pinned_answer} == {400, 404, 409, 422}


def test_all_pushbacks_answer_with_their_common_kind() -> None:
    def failed(*statuses: int) -> type[object]:
        failures = [UpstreamStatusError.of(s, retry_after=3.0) for s in statuses]
        return type(all_attempts_failed(["r"], failures, lambda pause: pause))

    assert failed(429, 429) is UpstreamRateLimitedEverywhere
    assert failed(503, 429) is UpstreamPushback
    assert failed(503) is UpstreamPushback
