"""The configuration's secrets as values: what no log line may repeat.

A settings field that holds a secret says so once, where it is declared: `repr=False` (so
that no `repr` of the settings, and no configuration checksum built from one, shows it).
`hidden_values` walks the model and collects every string such a field holds (client and
ops keys, the response-id secret, provider keys, AWS credentials, static headers' and query
parameters' values, proxy URLs), so a new secret field is covered the day it is declared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gateway.settings.model import Settings


def hidden_values(settings: Settings) -> frozenset[str]:
    """Every non-empty string held by a `repr=False` field anywhere in `settings`."""
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
