"""A key's quotas as the rate-limit headers its client's SDK and tools read. Pure.

OpenAI's family (`x-ratelimit-limit-requests`, `-remaining-`, `-reset-`; resets as durations
such as `1s`, `6m0s`, `250ms`) on the OpenAI routes; Anthropic's (`anthropic-ratelimit-
requests-limit`, `-remaining`, `-reset`; resets as RFC 3339 instants) on /v1/messages. The
OpenAI family has one token limit, `tokens`, which the gateway states for input tokens (what it
knows before the answer); output tokens get `output-tokens`, named the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from gateway.tenants.limits import Quota

_OPENAI_NAMES = {"requests": "requests", "input_tokens": "tokens",
                 "output_tokens": "output-tokens"}
_ANTHROPIC_NAMES = {"requests": "requests", "input_tokens": "input-tokens",
                    "output_tokens": "output-tokens"}
#: each kind's three header names, encoded once: (limit, remaining, reset) per family
_OPENAI = {kind: (f"x-ratelimit-limit-{name}".encode(), f"x-ratelimit-remaining-{name}".encode(),
                  f"x-ratelimit-reset-{name}".encode()) for kind, name in _OPENAI_NAMES.items()}
_ANTHROPIC = {kind: (f"anthropic-ratelimit-{name}-limit".encode(),
                     f"anthropic-ratelimit-{name}-remaining".encode(),
                     f"anthropic-ratelimit-{name}-reset".encode())
              for kind, name in _ANTHROPIC_NAMES.items()}


def duration_text(seconds: float) -> str:
    """A reset as OpenAI writes it: `250ms` under a second, else `1s`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_text}s" if minutes else f"{rest_text}s"


def instant_text(wall: float) -> str:
    """A reset as Anthropic writes it: an RFC 3339 instant in UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(round(wall)))


def ratelimit_headers(quotas: Iterable[Quota], *, anthropic: bool,
                      wall: float) -> list[tuple[bytes, bytes]]:
    """The headers stating `quotas` in the family of the route (`anthropic`: /v1/messages),
    `wall` the time of day (seconds since the epoch) the resets count from."""
    headers: list[tuple[bytes, bytes]] = []
    names = _ANTHROPIC if anthropic else _OPENAI
    for kind, limit, remaining, reset in quotas:
        limit_name, remaining_name, reset_name = names[kind]
        reset_text = instant_text(wall + reset) if anthropic else duration_text(reset)
        headers += ((limit_name, b"%d" % limit), (remaining_name, b"%d" % remaining),
                    (reset_name, reset_text.encode()))
    return headers
