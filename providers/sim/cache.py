"""A simulated backend's prompt cache: the longest cached prefix of a request's messages. Pure.

Real servers (vLLM, SGLang, llama.cpp) and hosted APIs keep the KV state of prompts they have
prefilled and skip the prefill of a prefix they hold; the time to first token then grows only
with the uncached tail. A simulator without that would make every routing choice look alike,
so this models it at the granularity of whole messages: each prefix of the message list is one
entry (a chained hash of the messages up to it, and the tokens they hold), the longest entry
present is the cached prefix, and a request's own prefixes are stored when it is planned. The
store is bounded and least-recently-used, so a backend that sees too many conversations forgets
the oldest, as a real cache under memory pressure does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any


def message_text(message: Any) -> str:
    """A message's text: its string content, or the text parts of a list content."""
    if not isinstance(message, Mapping):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def _prefixes(messages: Sequence[Any]) -> list[tuple[bytes, int]]:
    """(chained hash, cumulative tokens) of each prefix of the messages; a token is a word,
    as in the simulator's usage numbers."""
    out: list[tuple[bytes, int]] = []
    digest, tokens = b"", 0
    for message in messages:
        text = message_text(message)
        role = message.get("role", "") if isinstance(message, Mapping) else ""
        tokens += len(text.split())
        digest = hashlib.blake2b(digest + str(role).encode() + b"\x00" + text.encode(),
                                 digest_size=16).digest()
        out.append((digest, tokens))
    return out


class PrefixCache:
    """One backend's cache of message prefixes (bounded, LRU)."""

    __slots__ = ("_entries", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup_and_store(self, body: Mapping[str, Any]) -> tuple[int, int]:
        """(prompt tokens, of which cached) for the request's messages, then store its prefixes
        (the backend now holds this prompt). A request without messages caches nothing."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or self.capacity <= 0:
            return 0, 0
        prefixes = _prefixes(messages)
        cached = 0
        for digest, tokens in reversed(prefixes):
            if digest in self._entries:
                cached = tokens
                break
        for digest, tokens in prefixes:
            self._entries[digest] = tokens
            self._entries.move_to_end(digest)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return prefixes[-1][1], cached
