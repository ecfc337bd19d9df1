"""What a prompt's size says about its time to first token. Pure.

Most of a long prompt's time to first token is prefill: the backend reads every input token it
does not hold in its prompt cache, at a rate of its own (tens of ms per 1,000 tokens on a GPU).
A delay learnt over all requests mixes 200-token turns that answer in 200 ms with 30,000-token
ones that need two seconds, so it is too early for the long ones (their hedges start while
the primary is still prefilling normally) and too late for the short ones. This module holds
the small pieces the size-aware rules share:

- the input is *estimated* from the body's size, `bytes / 4` (JSON of text runs about four
  bytes a token): the gateway has the body in hand, and parsing the messages again to count
  them, let alone tokenizing them, would cost more than the decision is worth;
- a size class is the log2 bucket of that estimate: a prompt twice as long is a class up,
  which spreads 200 to 200,000 tokens over ten classes, few enough to learn each;
- `PrefillFit`: time to first token as a line, `base + rate x tokens`, fitted per backend to
  the median of each class (medians, so that stragglers do not tilt the line): what lets a
  sparse class borrow from its neighbours, and what prices a copy that must prefill cold;
- `cold_hedge`: the rule that keeps a hedge from being sent where its copy cannot win;
- `ConversationMemory`: how much of a conversation its home backend has already seen.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.hedge.affinity import BYTES_PER_TOKEN

#: every prompt under 2**MIN_CLASS tokens is one class: there prefill is lost in the noise
MIN_CLASS = 8
#: and every prompt of 2**MAX_CLASS tokens (two million) or more is one class
MAX_CLASS = 21
#: conversations a pool remembers the last size of (least recently seen forgotten first)
MEMORY_KEYS = 16384
#: sizes remembered per key: the streams that share one key (an agent's main loop and its
#: sub-agents, parallel calls of one session) each keep their own last size, up to this many
MEMORY_SIZES = 4
#: bytes of the digest a key is remembered by, whatever the key's own length
KEY_DIGEST_BYTES = 16


def estimate_tokens(body_bytes: int) -> int:
    """Input tokens estimated from the body's size (bytes / 4)."""
    return max(0, body_bytes) // BYTES_PER_TOKEN


def size_class(tokens: int) -> int:
    """The log2 bucket of `tokens`: class c holds [2**c, 2**(c+1)) tokens, clamped to
    [MIN_CLASS, MAX_CLASS]."""
    if tokens < 2**MIN_CLASS:
        return MIN_CLASS
    return min(MAX_CLASS, tokens.bit_length() - 1)


def class_label(c: int) -> str:
    """The class as stats show it: its lower bound in tokens ("256" holds everything below
    512, the smallest class everything below that too)."""
    return str(2**c)


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """Time to first token as `base + rate x tokens` (seconds; rate per token)."""

    base: float
    rate: float

    @property
    def ms_per_1k(self) -> float:
        return self.rate * 1e6

    def ttft(self, tokens: int) -> float:
        """The expected TTFT of a prompt of `tokens` uncached tokens."""
        return self.base + self.rate * max(0, tokens)

    @classmethod
    def of(cls, points: Sequence[tuple[float, float, float]]) -> PrefillFit | None:
        """The weighted least-squares line through (tokens, seconds, weight) points, or None
        without two distinct token counts. The line is kept physical: a negative slope (the
        sample says nothing about prefill) becomes flat, a negative base a line through 0."""
        total = sum(w for _, _, w in points)
        if total <= 0:
            return None
        mx = sum(x * w for x, _, w in points) / total
        my = sum(y * w for _, y, w in points) / total
        sxx = sum(w * (x - mx) ** 2 for x, _, w in points)
        if sxx <= 0 or len({x for x, _, _ in points}) < 2:
            return None
        sxy = sum(w * (x - mx) * (y - my) for x, y, w in points)
        rate = max(0.0, sxy / sxx)
        base = my - rate * mx
        if base < 0:
            through_zero = sum(w * x * x for x, _, w in points)
            rate = max(0.0, sum(w * x * y for x, y, w in points) / through_zero)
            base = 0.0
        return cls(base, rate)


def cold_hedge(*, elapsed: float, primary_tail: float, cold_prefill: float) -> bool:
    """Whether a hedge is cold: its copy must prefill the whole input where nothing is cached,
    and that prefill alone outlasts what the primary very likely still needs.

    `elapsed`: how long the primary has run; `primary_tail`: the primary's TTFT tail (the
    q99 of its backend at its size: by then it has almost surely answered), so it likely
    needs `primary_tail - elapsed` more; `cold_prefill`: the copy's prefill time (the fitted
    rate times its input). The copy's base time (what even an empty prompt takes) is left
    out on purpose: it is the margin that keeps the rule stable once hedges work. A hedge
    that wins cuts its primary's sample short at its own finish (a censored lower bound), so
    the tail learnt from a class whose hedges win sits at about `delay + a copy's TTFT`; a
    rule comparing the copy's whole TTFT with it would be a coin toss for exactly the hedges
    that pay, while the prefill alone stays a base time below it.

    A primary past its tail is beyond anything its class showed (a hang, an outage): how
    long it still needs is unknown, so the hedge is sent. (At its tail, as when a narrow
    distribution's q92 and q99 coincide, it is about to answer: not past it.)"""
    if elapsed > primary_tail:
        return False
    return cold_prefill > primary_tail - elapsed


def new_tokens(tokens: int, previous: int | None) -> int:
    """The input its conversation's home backend has not seen: what grew since the last turn
    it was sent (the history behind it is in that backend's prefix cache). A turn no longer
    than the last one is no continuation (an edit, a new branch, another conversation with
    the same opening): nothing is assumed cached."""
    if previous is None or tokens <= previous:
        return tokens
    return tokens - previous


def key_digest(key: str) -> bytes:
    """The fixed-size digest a conversation key is remembered by: a key is what a client
    sends (a `prompt_cache_key` may be megabytes), and the memory must be bounded in bytes,
    not in keys only. Lone surrogates (valid in JSON) are hashed as they came."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"),
                           digest_size=KEY_DIGEST_BYTES).digest()


class ConversationMemory:
    """The last input sizes (estimated tokens) of each recent conversation key of one pool:
    bounded, least recently seen forgotten first. Holds a fixed-size digest of each key and
    at most `MEMORY_SIZES` sizes under it, never a key or text: the bytes held are bounded
    by `capacity` alone (a few hundred bytes a key), however long the clients' keys are.

    Why several sizes a key: one key can name several streams at once (Claude Code sends its
    session in `metadata.user_id` and its session header for its main loop and its
    sub-agents alike). With one size a key, a 5,000-token sub-agent turn between two main
    turns of 50,000 and 50,400 tokens made the second look like 45,400 new tokens. Each turn
    continues the largest remembered size not above its own (the stream it most likely
    extends), which it then replaces; a turn below every remembered size starts a stream of
    its own, and past `MEMORY_SIZES` streams the least recently seen is forgotten."""

    __slots__ = ("_sizes", "capacity")

    def __init__(self, capacity: int = MEMORY_KEYS) -> None:
        self.capacity = capacity
        self._sizes: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sizes)

    def turn(self, key: str, tokens: int) -> int | None:
        """Record this turn's size; the size of the stream it continues under its key (the
        largest remembered size not above `tokens`; None: nothing remembered fits)."""
        digest = key_digest(key)
        sizes = self._sizes.pop(digest, ())
        previous = max((size for size in sizes if size <= tokens), default=None)
        kept = [size for size in sizes if size != previous]
        kept.append(tokens)
        self._sizes[digest] = tuple(kept[-MEMORY_SIZES:])
        while len(self._sizes) > self.capacity:
            self._sizes.popitem(last=False)
        return previous
