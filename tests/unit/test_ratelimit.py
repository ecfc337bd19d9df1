"""The rate-limit header parser: every header form, garbage ignored, resets against a given
wall clock (no real time is read)."""

from __future__ import annotations

import pytest

from gateway.wire.ratelimit import (
    MAX_VALUE,
    RATE_LIMIT_HEADERS,
    Quota,
    parse_count,
    parse_duration,
    parse_reset,
    parse_time,
    read_quotas,
)

#: 2025-01-01T00:00:00Z
WALL = 1735689600.0


def test_openai_headers_give_requests_and_tokens() -> None:
    headers = {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000", "x-ratelimit-remaining-tokens": "149984",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    assert read_quotas(headers, wall=WALL) == (
        Quota("openai", "requests", 59.0, 60.0, 1.0),
        Quota("openai", "tokens", 149984.0, 150000.0, 360.0),
    )


def test_anthropic_headers_give_every_resource_with_rfc3339_resets() -> None:
    headers = {}
    for offset, resource in enumerate(("requests", "tokens", "input-tokens", "output-tokens")):
        headers[f"anthropic-ratelimit-{resource}-limit"] = "1000"
        headers[f"anthropic-ratelimit-{resource}-remaining"] = str(900 - offset)
        headers[f"anthropic-ratelimit-{resource}-reset"] = f"2025-01-01T00:00:{10 + offset:02d}Z"
    quotas = read_quotas(headers, wall=WALL)
    assert [(q.resource, q.remaining, q.limit, q.reset_in) for q in quotas] == [
        ("requests", 900.0, 1000.0, 10.0), ("tokens", 899.0, 1000.0, 11.0),
        ("input-tokens", 898.0, 1000.0, 12.0), ("output-tokens", 897.0, 1000.0, 13.0)]
    assert {q.family for q in quotas} == {"anthropic"}


def test_every_header_read_is_in_the_forwarded_set() -> None:
    assert len(RATE_LIMIT_HEADERS) == 18
    assert all(name.startswith(("x-ratelimit-", "anthropic-ratelimit-"))
               for name in RATE_LIMIT_HEADERS)


def test_a_resource_needs_a_count_and_an_answer_without_any_says_nothing() -> None:
    assert read_quotas({}, wall=WALL) == ()
    assert read_quotas({"x-ratelimit-reset-requests": "1s", "content-type": "x"},
                       wall=WALL) == ()
    (only_remaining,) = read_quotas({"x-ratelimit-remaining-tokens": "5"}, wall=WALL)
    assert (only_remaining.remaining, only_remaining.limit, only_remaining.reset_in) == (
        5.0, None, None)


@pytest.mark.parametrize(("text", "seconds"), [
    ("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1h2m3.5s", 3723.5), ("0s", 0.0),
    ("59.123s", 59.123), ("1m30s", 90.0), ("250us", 0.00025), ("250µs", 0.00025),
    ("7ns", 7e-9), (" 2s ", 2.0),
])
def test_go_style_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [
    "", "s", "1", "1x", "-1s", "1s2", "1.s", ".5s", "1e3s", "1 s", "abc", "1h1h1h1h1h1h1h1h1h",
    "9" * 13 + "s", "nan", "infs",
])
def test_malformed_durations_are_none(text: str) -> None:
    assert parse_duration(text) is None


@pytest.mark.parametrize(("text", "at"), [
    ("2025-01-01T00:00:30Z", WALL + 30), ("2025-01-01t00:00:30z", WALL + 30),
    ("2025-01-01 00:00:30Z", WALL + 30), ("2025-01-01T01:00:30+01:00", WALL + 30),
    ("2024-12-31T23:00:30-01:00", WALL + 30), ("2025-01-01T00:00:30.25Z", WALL + 30.25),
    ("2025-01-01T00:00:30.123456789Z", WALL + 30.123456789),
    ("2016-12-31T23:59:60Z", 1483228799.0),  # a leap second reads as :59
])
def test_rfc3339_times(text: str, at: float) -> None:
    assert parse_time(text) == pytest.approx(at)


@pytest.mark.parametrize("text", [
    "2025-01-01T00:00:30",  # no offset: whose clock?
    "2025-02-30T00:00:00Z", "2025-13-01T00:00:00Z", "2025-01-01T24:00:00Z",
    "2025-01-01T00:00:61Z", "2025-01-01T00:00:00+24:00", "0000-01-01T00:00:00Z",
    "2025-01-01", "yesterday", "2025-01-01T00:00:00ZZ",
    "\uff11\uff12\uff13\uff14-01-01T00:00:00Z",  # fullwidth digits
])
def test_malformed_times_are_none(text: str) -> None:
    assert parse_time(text) is None


@pytest.mark.parametrize(("text", "seconds"), [
    ("1s", 1.0), ("2025-01-01T00:00:30Z", 30.0), ("12", 12.0), ("0.5", 0.5),
    (str(int(WALL + 45)), 45.0),  # a Unix time
    ("2024-12-31T23:59:00Z", 0.0),  # a reset in the past: now
    (str(int(WALL - 5)), 0.0),
])
def test_resets_are_seconds_from_the_wall_clock_given(text: str, seconds: float) -> None:
    assert parse_reset(text, wall=WALL) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [None, "", "soon", "-3", "1e9", "inf", "NaN", "0x10",
                                  "1" * (MAX_VALUE + 1)])
def test_malformed_resets_are_none(text: str | None) -> None:
    assert parse_reset(text, wall=WALL) is None


@pytest.mark.parametrize("text", ["-1", "1e3", "abc", "", " ", "1,000", "\u0661\u0662", "inf",
                                  "nan", "0x1f", "9" * 19, "1" * (MAX_VALUE + 1), "3.", ".3"])
def test_malformed_counts_are_none(text: str) -> None:
    assert parse_count(text) is None


def test_counts() -> None:
    assert parse_count("0") == 0.0
    assert parse_count(" 42 ") == 42.0
    assert parse_count("12.5") == 12.5
    assert parse_count(None) is None


def test_garbage_in_one_header_leaves_the_others_read() -> None:
    headers = {
        "x-ratelimit-limit-requests": "sixty", "x-ratelimit-remaining-requests": "-1",
        "x-ratelimit-reset-requests": "\x00\xff",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "10",
        "x-ratelimit-reset-tokens": "never",
        "anthropic-ratelimit-requests-limit": "\u2713", "anthropic-ratelimit-requests-remaining":
            "5", "anthropic-ratelimit-requests-reset": "2025-99-99T00:00:00Z",
    }
    assert read_quotas(headers, wall=WALL) == (
        Quota("openai", "tokens", 10.0, 1000.0, None),
        Quota("anthropic", "requests", 5.0, None, None),
    )


def test_hostile_values_are_refused_by_their_length_or_one_pass() -> None:
    """The work is bounded: a value past `MAX_VALUE` is never parsed, and the patterns that
    check the shorter ones have no nested repetition to backtrack over."""
    long_ones = ["1" * 10_000, "1s" * 5_000, "2025-01-01T00:00:00Z" + " " * MAX_VALUE]
    near_misses = ["9" * 63 + "x", "1h" * 31 + "x", "1.1" * 20 + "s", "2025-01-01T00:00:00" +
                   "0" * 40]
    for value in long_ones + near_misses:
        headers = {name: value for name in RATE_LIMIT_HEADERS}
        assert read_quotas(headers, wall=WALL) == ()
        assert parse_reset(value, wall=WALL) is None
