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
    if seconds < 0.0005:  # a bucket full, or all but full: most answers
        return "0ms"
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_text}s" if minutes else f"{rest_text}s"


def instant_text(wall: float) -> str:
    """A reset as Anthropic writes it: an RFC 3339 instant in UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(round(wall)))


class Instants:
    """RFC 3339 instants already written, by the second (`instant_text` formats a whole
    date: a key's requests within one second share its resets' texts). Bounded: emptied
    past `SIZE` seconds held."""

    SIZE = 64
    __slots__ = ("texts",)

    def __init__(self) -> None:
        self.texts: dict[int, bytes] = {}

    def text(self, wall: float) -> bytes:
        second = round(wall)
        found = self.texts.get(second)
        if found is None:
            if len(self.texts) >= self.SIZE:
                self.texts.clear()
            found = self.texts[second] = instant_text(second).encode()
        return found


def ratelimit_headers(quotas: Iterable[Quota], *, anthropic: bool, wall: float,
                      instants: Instants | None = None) -> list[tuple[bytes, bytes]]:
    """The headers stating `quotas` in the family of the route (`anthropic`: /v1/messages),
    `wall` the time of day (seconds since the epoch) the resets count from; `instants`: the
    texts of Anthropic's resets already written (else each is written anew)."""
    headers: list[tuple[bytes, bytes]] = []
    if anthropic:
        for kind, limit, remaining, reset in quotas:
            limit_name, remaining_name, reset_name = _ANTHROPIC[kind]
            reset_text = instant_text(wall + reset).encode() if instants is None \
                else instants.text(wall + reset)
            headers += ((limit_name, b"%d" % limit), (remaining_name, b"%d" % remaining),
                        (reset_name, reset_text))
        return headers
    for kind, limit, remaining, reset in quotas:
        limit_name, remaining_name, reset_name = _OPENAI[kind]
        headers += ((limit_name, b"%d" % limit), (remaining_name, b"%d" % remaining),
                    (reset_name, duration_text(reset).encode()))
    return headers
