"""What an upstream's rate-limit headers say about its quota. Pure.

Why the gateway reads them: a backend that is about to run out of its quota answers its next
requests with 429s. Its answers say so before that happens, in headers every answer carries
(a 200 as much as a 429), so the balancer can send the next requests to a backend that still
has room instead of learning it from a refusal (`gateway.hedge.headroom`).

The two families, each with a limit, what remains of it and when it resets:

- OpenAI (and the servers that copy it): `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`,
  the reset a duration: `1s`, `6m0s`, `20ms`, `1h2m3.5s`;
- Anthropic: `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
  remaining,reset}`, the reset an RFC 3339 time: `2025-01-01T00:00:30Z`.

A reset is also taken as bare seconds (`12`, `0.5`), or as a Unix time when that number is
past 10^9 (a reset years away is no delay). Every value is the upstream's text: one that is too
long, not a number, negative or not finite is ignored, never an error, and the rest of the
answer still counts. The work per answer is bounded: a fixed set of names is looked up, and no
value longer than `MAX_VALUE` is parsed, each in one pass. The clock comes in as a parameter
(`wall`, Unix seconds, for the RFC 3339 times); what comes out is relative (seconds from now).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

#: (family, resource, the names of its limit, remaining and reset headers)
_OPENAI = tuple(
    ("openai", resource, f"x-ratelimit-limit-{resource}", f"x-ratelimit-remaining-{resource}",
     f"x-ratelimit-reset-{resource}")
    for resource in ("requests", "tokens")
)
_ANTHROPIC = tuple(
    ("anthropic", resource, f"anthropic-ratelimit-{resource}-limit",
     f"anthropic-ratelimit-{resource}-remaining", f"anthropic-ratelimit-{resource}-reset")
    for resource in ("requests", "tokens", "input-tokens", "output-tokens")
)
_FAMILIES = _OPENAI + _ANTHROPIC

#: every rate-limit header the gateway reads, and the only ones it passes to a client from the
#: attempt that won
RATE_LIMIT_HEADERS = frozenset(name for *_, limit, left, reset in _FAMILIES
                               for name in (limit, left, reset))

#: a longer value is not parsed at all (a count, a duration and a time all fit in far less)
MAX_VALUE = 64
#: a bare reset number past this is a Unix time, not seconds from now
_EPOCH_FROM = 1e9

#: ASCII digits only: `\d` alone takes every script's digits, which `float` reads as well
_COUNT = re.compile(r"\d{1,18}(?:\.\d{1,9})?", re.ASCII)
_SECONDS = re.compile(r"\d{1,12}(?:\.\d{1,9})?", re.ASCII)
#: a Go-style duration (what OpenAI sends): one or more number+unit parts, `ms` before `m`
_DURATION = re.compile(r"(?:\d{1,12}(?:\.\d{1,9})?(?:ns|us|µs|ms|s|m|h)){1,8}", re.ASCII)
_PART = re.compile(r"(\d{1,12}(?:\.\d{1,9})?)(ns|us|µs|ms|s|m|h)", re.ASCII)
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d{1,9})?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))", re.ASCII
)


@dataclass(frozen=True, slots=True)
class Quota:
    """One resource of one answer: how much is left of it, out of what, and for how long."""

    family: str
    #: `requests`, `tokens`, `input-tokens` or `output-tokens`
    resource: str
    remaining: float | None
    limit: float | None
    #: seconds from the answer until the quota resets (None: not said, or not readable)
    reset_in: float | None


def read_quotas(headers: Mapping[str, str], *, wall: float) -> tuple[Quota, ...]:
    """The quotas an answer's headers state (names lower-case, as the providers keep them);
    a resource appears when its remaining count or its limit is readable. `wall`: the Unix
    time now, to turn an RFC 3339 reset into seconds."""
    found: list[Quota] = []
    for family, resource, limit_name, left_name, reset_name in _FAMILIES:
        remaining = parse_count(headers.get(left_name))
        limit = parse_count(headers.get(limit_name))
        if remaining is None and limit is None:
            continue
        found.append(Quota(family, resource, remaining, limit,
                           parse_reset(headers.get(reset_name), wall=wall)))
    return tuple(found)


def parse_count(value: str | None) -> float | None:
    """A non-negative count (`59`, `39000`, `1.5`), or None."""
    if value is None or len(value) > MAX_VALUE:
        return None
    text = value.strip()
    return float(text) if _COUNT.fullmatch(text) else None


def parse_duration(value: str) -> float | None:
    """A Go-style duration (`1s`, `6m0s`, `20ms`, `1h2m3.5s`) in seconds, or None."""
    text = value.strip()
    if len(text) > MAX_VALUE or not _DURATION.fullmatch(text):
        return None
    return sum(float(number) * _UNIT[unit] for number, unit in _PART.findall(text))


def parse_time(value: str) -> float | None:
    """An RFC 3339 time with its offset (`2025-01-01T00:00:30Z`, `...+02:00`, fractions of a
    second) as Unix seconds, or None (no offset, no such day, out of range)."""
    match = _RFC3339.fullmatch(value.strip())
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zulu, sign, off_h, off_m = match.groups()
    if int(second) > 60:
        return None
    try:
        offset = timedelta(0) if zulu else (1 if sign == "+" else -1) * timedelta(
            hours=int(off_h), minutes=int(off_m))
        moment = datetime(int(year), int(month), int(day), int(hour), int(minute),
                          min(int(second), 59), tzinfo=timezone(offset))  # a leap second: :59
        stamp = moment.astimezone(UTC).timestamp()
    except (ValueError, OverflowError):  # no such day or hour, an offset past a day
        return None
    return stamp + (float(fraction) if fraction else 0.0)


def parse_reset(value: str | None, *, wall: float) -> float | None:
    """Seconds until a reset (never below 0): a duration, an RFC 3339 time (against `wall`),
    bare seconds, or a Unix time past 10^9. None when it is none of these."""
    if value is None or len(value) > MAX_VALUE:
        return None
    text = value.strip()
    if _SECONDS.fullmatch(text):
        number = float(text)
        seconds = number - wall if number > _EPOCH_FROM else number
    elif (duration := parse_duration(text)) is not None:
        seconds = duration
    elif (moment := parse_time(text)) is not None:
        seconds = moment - wall
    else:
        return None
    return max(0.0, seconds) if math.isfinite(seconds) else None
