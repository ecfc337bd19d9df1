"""The configuration's secrets as values: what no log line may repeat.

A settings field that holds a secret says so once, where it is declared: `repr=False` (so
that no `repr` of the settings, and no configuration checksum built from one, shows it).
`hidden_values` walks the model and collects every string such a field holds (client and
ops keys, the response-id secret, provider keys, AWS credentials, static headers' and query
parameters' values, proxy URLs), so a new secret field is covered the day it is declared.

And what text looks like a secret whatever its value (`looks_like_credential`), for text the
gateway shows or logs but did not write: a model name a client sent, an upstream's words.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from typing import Any

#: a secret shorter than this is matched only as the whole value, never inside one (a short
#: string inside a model name is likelier a coincidence than a leak)
MIN_SECRET_CHARS = 8

_CREDENTIAL = re.compile(
    r"(?i:\b(?:bearer|basic)\s)"                    # an Authorization header's value
    r"|\b(?:sk|pk|rk)-[A-Za-z0-9_-]{12,}"           # OpenAI, Anthropic (sk-ant-), and alike
    r"|\bA(?:KIA|SIA)[0-9A-Z]{16}\b"                # an AWS access key id
    r"|\bAIza[0-9A-Za-z_-]{20,}"                    # a Google API key
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}"                # a GitHub token
    r"|\bxox[abprs]-"                               # a Slack token
    r"|\bhg-[A-Za-z0-9_-]{20,}"                     # a key this gateway's store made
)
#: a JWT (base64 of `{"`, a dot, more): `eyJ`, 8 or more of the alphabet, a dot, 8 more. Found
#: in two steps, each linear: a run of the alphabet ending in a dot with 8 more after it,
#: matched only from where a run starts (so no run is read twice), then `eyJ` with 8 after it
#: inside that run. One pattern (`\beyJ[...]{8,}\.`) read the rest of the run again from
#: every `eyJ` in it, quadratic in a text of many (a model name a client sends is up to the
#: body's size).
_JWT_RUN = re.compile(r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]++\.(?=[A-Za-z0-9_-]{8})")
_JWT_HEAD = re.compile(r"\beyJ[A-Za-z0-9_-]{8}")
#: a run this long of letters and digits with no separator holds both kinds in keys, not in
#: model names (`claude-sonnet-4-5-20250929`, `meta-llama/Llama-3.1-8B-Instruct` have dashes)
_TOKEN_RUN = re.compile(r"[A-Za-z0-9]{32,}")


def looks_like_credential(text: str) -> bool:
    """True for text shaped like a key or token: an Authorization scheme, a vendor key's
    prefix (`sk-`, `AKIA`, `AIza`, `ghp_`, `xoxb-`), a key this gateway's store made (`hg-`),
    a JWT, or a long run of letters and digits that holds both. In time linear in `text`."""
    if _CREDENTIAL.search(text):
        return True
    if any(_JWT_HEAD.search(run.group()) for run in _JWT_RUN.finditer(text)):
        return True
    return any(_mixed(run.group()) for run in _TOKEN_RUN.finditer(text))


def _mixed(run: str) -> bool:
    return any(c.isdigit() for c in run) and any(c.isalpha() for c in run)


def holds_secret(text: str, hidden: Collection[str]) -> bool:
    """True when `text` is one of `hidden` or contains one of its longer values."""
    if text in hidden:
        return True
    return any(len(s) >= MIN_SECRET_CHARS and s in text for s in hidden)


def hidden_values(settings: object) -> frozenset[str]:
    """Every non-empty string held by a `repr=False` field anywhere in `settings` (the whole
    configuration, or one part of it such as a backend's)."""
    found: set[str] = set()
    _walk(settings, found)
    return frozenset(found)


def _walk(obj: Any, found: set[str]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not f.repr:
            _strings(value, found)
        elif dataclasses.is_dataclass(value):
            _walk(value, found)
        elif isinstance(value, tuple):
            for item in value:
                if dataclasses.is_dataclass(item):
                    _walk(item, found)


def _strings(value: object, found: set[str]) -> None:
    """The secret strings of a hidden field: a string, strings, or (name, value) pairs,
    whose names are not secret."""
    if isinstance(value, str):
        if value:
            found.add(value)
    elif isinstance(value, tuple):
        for item in value:
            if isinstance(item, tuple) and len(item) == 2:
                _strings(item[1], found)
            else:
                _strings(item, found)
