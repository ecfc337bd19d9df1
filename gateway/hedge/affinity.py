"""Conversation affinity: which backends a conversation's requests go to, in which order. Pure.

Most of a long prompt's time to first token is prefill, and a backend that holds the
conversation's prefix in its prompt cache skips most of it. Load-based selection spreads a
conversation's turns over the pool, so each turn mostly lands on a cold backend. Here each
request gets a conversation key, and the key orders the pool's backends:

- the key is what the client says the conversation is (`prompt_cache_key`, Anthropic's
  `metadata.user_id`, an agent CLI's session header), else a hash of the conversation's stable
  prefix (system prompt or instructions, tools, the first user message), which every turn of
  one conversation repeats while its history grows behind it. Only a bounded number of bytes
  of that prefix is read, never the whole body. A request too short to be worth caching gets
  no derived key (balance matters more than a cache there); an explicit key always counts.
- the order is rendezvous hashing (highest random weight), weighted by `weight`: it is a pure
  function of the key and the backend names, so it needs no table, survives restarts and
  reloads, is the same in every worker, and adding or removing a backend moves only the keys
  whose first choice it is or was.
- the primary is the first backend in that order that is usable and not overloaded (bounded
  load, as in consistent hashing with bounded loads): a hot conversation set cannot pile onto
  one backend; it spills to the next backend in its order, which is also where its hedges go.
  Nothing re-pins on a win: the order never changes with traffic.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

#: bytes of each part of the stable prefix (system, tools, first user message) that the
#: derived key reads: enough to tell conversations apart, bounded whatever the body's size
PART_BYTES = 4096
#: session headers, most specific first: Claude Code's, Codex's (new and old spellings),
#: OpenCode's, and the generic ones several tools and proxies send
SESSION_HEADERS = (
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "conversation_id",
    "x-opencode-session",
    "x-session-affinity",
    "x-session-id",
)
#: the bound never falls below this many attempts in flight: at low load the proportional bound
#: is 1, and a conversation's next turn, sent while its last stream is still being closed (its
#: slot not yet given back), would spill to a cold backend for nothing
MIN_CAPACITY = 2
#: the rough bytes of JSON per token used to estimate a request's input from its size
BYTES_PER_TOKEN = 4

#: how one request's primary was chosen, for the stats: "hit" (the first backend of its key's
#: order), "spill" (a later one: the first was overloaded or unusable), "miss" (no key)
Outcome = Literal["hit", "spill", "miss"]


# --------------------------------------------------------------------------- the key


def conversation_key(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    min_input_tokens: int,
    body_bytes: int | None = None,
) -> str | None:
    """The request's conversation key, or None when it has none worth routing by.

    Precedence: `prompt_cache_key` (the client names its cache), `metadata.user_id` (Anthropic
    clients; Claude Code puts its session in it), a session header (`SESSION_HEADERS`, header
    names lower-cased), then the stable-prefix hash, which only applies when the estimated
    input (`body_bytes` / 4, the request's size on the wire; measured in bounded steps when
    unknown) reaches `min_input_tokens`."""
    explicit = _explicit_key(body, headers)
    if explicit is not None:
        return explicit
    threshold = min_input_tokens * BYTES_PER_TOKEN
    size = body_bytes if body_bytes is not None else _bounded_size(body, threshold)
    if size < threshold:
        return None
    return prefix_key(body)


def _explicit_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        return "pck:" + cache_key
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        user = metadata.get("user_id")
        if isinstance(user, str) and user:
            return "user:" + user
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return "session:" + value
    return None


def body_size(headers: Mapping[str, str]) -> int | None:
    """The body's size from its `content-length`, None when absent or not a number (chunked):
    the size the gateway already knows, so estimating the input costs no walk of the body."""
    raw = headers.get("content-length")
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


def _bounded_size(value: Any, limit: int) -> int:
    """The bytes of text in `value`, counted only until `limit` is reached (a lower bound of
    its JSON size): deciding "long enough" never walks more than `limit` bytes of text."""
    total = 0
    stack = [value]
    while stack and total < limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def prefix_key(body: Mapping[str, Any]) -> str:
    """A hash of the conversation's stable prefix: what every turn of one conversation sends
    first, unchanged, while its history grows behind it. Chat: the system/developer messages
    before the first user message and that message; Anthropic: `system` and the first message;
    Responses: `instructions` and the first input item; with `tools` in each. Each part
    contributes at most `PART_BYTES` bytes of text."""
    digest = hashlib.blake2b(digest_size=16)
    for part in _stable_parts(body):
        _feed(digest, part, PART_BYTES)
        digest.update(b"\x1e")
    return "prefix:" + digest.hexdigest()


def _stable_parts(body: Mapping[str, Any]) -> list[Any]:
    """System (or instructions), tools and the first user message, as separate parts so that
    a long system prompt shared by many conversations cannot use up the bound of the first
    user message that tells them apart."""
    system: list[Any] = [body.get("system"), body.get("instructions")]
    first: Any = None
    for field in ("messages", "input"):
        items = body.get(field)
        if isinstance(items, str):  # Responses: a bare string input is the first message
            first = items
        elif isinstance(items, list):
            leading, first = _split_first_user(items)
            system.extend(leading)
    prompt = body.get("prompt")  # legacy completions: the prompt's own start
    if isinstance(prompt, str):
        first = prompt
    return [system, body.get("tools"), first]


def _split_first_user(items: list[Any]) -> tuple[list[Any], Any]:
    """The messages before the first user message, and that message (the first item of a
    list that has none)."""
    for index, item in enumerate(items):
        if isinstance(item, Mapping) and item.get("role") == "user":
            return items[:index], item
    return [], items[0] if items else None


def _feed(digest: Any, value: Any, budget: int) -> int:
    """Feed `value`'s structure and text into `digest`, at most `budget` bytes of text;
    returns the budget left. Mapping keys are fed sorted, so key order does not matter."""
    if budget <= 0:
        return 0
    if isinstance(value, str):
        chunk = value[:budget].encode("utf-8", "surrogatepass")
        digest.update(b"s" + chunk)
        return budget - len(chunk)
    if isinstance(value, Mapping):
        digest.update(b"{")
        for key in sorted(k for k in value if isinstance(k, str)):
            digest.update(b"k" + key.encode("utf-8", "surrogatepass"))
            budget = _feed(digest, value[key], budget)
            if budget <= 0:
                break
        digest.update(b"}")
        return budget
    if isinstance(value, list | tuple):
        digest.update(b"[")
        for item in value:
            budget = _feed(digest, item, budget)
            if budget <= 0:
                break
        digest.update(b"]")
        return budget
    digest.update(b"v" + repr(value).encode()[:64])
    return budget


# --------------------------------------------------------------------------- the order


def _unit(key: str, name: str) -> float:
    """A uniform number in (0, 1) from the pair: the same everywhere, for ever. A key is what
    a client sent, and JSON may carry a lone surrogate (`"\\ud800"`): it is hashed as it came
    (`surrogatepass`, as `_feed` does), never refused."""
    raw = hashlib.blake2b(f"{key}\x00{name}".encode("utf-8", "surrogatepass"),
                          digest_size=8).digest()
    return (int.from_bytes(raw, "big") + 0.5) / 2.0**64


def rendezvous_order(key: str, weights: Iterable[tuple[str, float]]) -> list[str]:
    """The backends ordered for `key`, best first (weighted rendezvous hashing).

    A backend's score is `-weight / ln(u)` with `u` uniform in (0, 1) from (key, name): the
    first place then falls to each backend with probability weight / total weight, and removing
    a backend only moves the keys it held first. Weight 0 comes last (in name order)."""
    scored = []
    for name, weight in weights:
        score = -weight / math.log(_unit(key, name)) if weight > 0 else 0.0
        scored.append((-score, name))
    scored.sort()
    return [name for _, name in scored]


# --------------------------------------------------------------------------- the choice


@dataclass(frozen=True, slots=True)
class AffinityRoute:
    """One request's key and its order over the pool, with the rule that picks from it."""

    key: str
    order: tuple[str, ...]
    weights: Mapping[str, float]
    load_factor: float

    @classmethod
    def of(cls, key: str, weights: Mapping[str, float], load_factor: float) -> AffinityRoute:
        return cls(key, tuple(rendezvous_order(key, weights.items())), weights, load_factor)

    def capacity(self, name: str, inflight: Mapping[str, int], members: Collection[str]) -> int:
        """The in-flight attempts `name` may hold and still take this request: `load_factor`
        times its weighted share of the members' in-flight attempts counting this one, rounded
        up, as in consistent hashing with bounded loads; never below `MIN_CAPACITY` for a
        backend with weight."""
        total_weight = sum(self.weights.get(m, 0.0) for m in members)
        weight = self.weights.get(name, 0.0)
        share = weight / total_weight if total_weight > 0 else 1.0 / max(1, len(members))
        load = sum(inflight.get(m, 0) for m in members) + 1
        bound = math.ceil(self.load_factor * load * share)
        return max(bound, MIN_CAPACITY) if weight > 0 or total_weight <= 0 else bound

    def choose(
        self,
        usable: Collection[str],
        inflight: Mapping[str, int],
        *,
        members: Collection[str],
        exclude: Collection[str] = (),
        avoid_groups: Collection[str] = (),
        groups: Mapping[str, str] | None = None,
    ) -> str | None:
        """The first backend in the order that is usable, not excluded and under its bounded
        load; failing that (every candidate is loaded), the first usable one in the order.

        `members`: the backends whose load is averaged (the pool's backends this request may
        use). `avoid_groups`: prefer backends outside these groups (a hedge to another zone)
        when one in the order qualifies; `groups` maps backends to their group. None when no
        candidate is usable (the caller falls back to its own rule, e.g. panic routing)."""
        candidates = [n for n in self.order if n in usable and n not in exclude]
        if groups is not None and avoid_groups:
            elsewhere = [n for n in candidates if groups.get(n, "") not in avoid_groups]
            candidates = elsewhere or candidates
        for name in candidates:
            if inflight.get(name, 0) < self.capacity(name, inflight, members):
                return name
        return candidates[0] if candidates else None

    def outcome(self, chosen: str, members: Collection[str]) -> Outcome:
        """"hit" when `chosen` is the first of the order among `members`, else "spill"."""
        first = next((n for n in self.order if n in members), None)
        return "hit" if chosen == first else "spill"


def route_for(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    backends: Sequence[tuple[str, float]],
    *,
    min_input_tokens: int,
    load_factor: float,
    body_bytes: int | None = None,
) -> AffinityRoute | None:
    """The request's route over `backends` ((name, weight) pairs), or None without a key.
    `body_bytes`: the body's size as received; else its `content-length`."""
    size = body_bytes if body_bytes is not None else body_size(headers)
    key = conversation_key(body, headers, min_input_tokens=min_input_tokens, body_bytes=size)
    if key is None:
        return None
    return AffinityRoute.of(key, dict(backends), load_factor)
