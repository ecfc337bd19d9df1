"""A simulated backend's prompt cache: the longest cached prefix of a request's prompt. Pure.

Real servers (vLLM, SGLang, llama.cpp) and hosted APIs keep the KV state of prompts they have
prefilled and skip the prefill of a prefix they hold; the time to first token then grows only
with the uncached tail. A simulator without that would make every routing choice look alike,
so this models it at the granularity of whole messages: each prefix of the prompt's segments
(`providers.sim.prompt`: the tool listing, the system prompt, each message) is one entry (a
chained hash of the segments up to it, and the tokens they hold), the longest entry
present is the cached prefix, and a request's own prefixes are stored when it is planned. The
store is bounded and least-recently-used, so a backend that sees too many conversations forgets
the oldest, as a real cache under memory pressure does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from providers.sim.prompt import Segment, prompt_tokens


def _prefixes(parts: Sequence[Segment]) -> list[tuple[bytes, int]]:
    """(chained hash, cumulative tokens) of each prefix of the segments, tokens counted as
    the usage numbers count them (`providers.sim.prompt`)."""
    out: list[tuple[bytes, int]] = []
    digest, tokens = b"", 0
    for part in parts:
        tokens += part.tokens
        digest = hashlib.blake2b(digest + part.role.encode("utf-8", "surrogatepass") + b"\x00" +
                                 part.text.encode("utf-8", "surrogatepass"),
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

    def lookup_and_store(self, parts: Sequence[Segment]) -> tuple[int, int]:
        """(prompt tokens, of which cached) for a request's prompt segments, then store its
        prefixes (the backend now holds this prompt). An empty prompt caches nothing."""
        if not parts or self.capacity <= 0:
            return prompt_tokens(parts), 0
        prefixes = _prefixes(parts)
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
