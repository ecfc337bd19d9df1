"""The simulated upstream's plans, and what every API's wire shares. Pure apart from sleeping.

Hedging only pays off against a latency tail, so the simulator exists to produce one on demand,
offline and without keys: a lognormal TTFT body plus rare stragglers, and injectable faults
(status codes, hangs, mid-stream errors). `SimModel.plan` makes every random choice for one
request up front; everything after it (each API's stream and body: `providers.sim.chat`,
`responses`, `messages`, `embeddings`) is a pure function of the plan plus injected sleeping,
so the in-process `SimProvider` (`providers.sim`, the embedded default pool) and the loopback
server (`providers.sim.server`) emit identical streams.

What a plan holds beyond timing comes from the request: its input tokens
(`providers.sim.prompt`), a tool call when it offers tools (`providers.sim.tools`), and the cut
its output limit makes (`max_tokens`, `max_completion_tokens`, `max_output_tokens`). Text is
deterministic (token i is ``"tok{i} "``): a test can compare what a client reads straight from
a backend with what it reads through the gateway.

Per-request TTFT override: the loopback server honours the request header ``x-sim-ttft-ms``
(and `SimProvider` the same key in `UpstreamCall.extra_headers`). It is a header, never a body
field, because bodies are forwarded unchanged to real upstreams too.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import error_body
from gateway.settings import SimProfile
from providers.base import Endpoint
from providers.sim.cache import PrefixCache
from providers.sim.prompt import (
    Api,
    api_of,
    embedding_inputs,
    prompt_tokens,
    segments,
)
from providers.sim.tools import ToolCall, plan_tool_call

Sleep = Callable[[float], Awaitable[None]]
#: an event of a protocol that names its events: (name, data)
Event = tuple[bytes, bytes]

TTFT_HEADER = "x-sim-ttft-ms"
EMBEDDING_DIMENSIONS = 8
DONE = b"[DONE]"
MIDSTREAM_ERROR: Mapping[str, Any] = error_body("simulated failure", type="server_error",
                                                code=None)
#: the routes that prefill a prompt (a token count or a stored response's read does not)
_PREFILLS = frozenset({"chat/completions", "completions", "embeddings", "responses",
                       "messages"})
#: the request field that caps each API's output, in tokens
_OUTPUT_LIMITS: Mapping[Api, tuple[str, ...]] = {
    "chat": ("max_tokens", "max_completion_tokens"), "completions": ("max_tokens",),
    "responses": ("max_output_tokens",), "messages": ("max_tokens",), "embeddings": (),
}
#: what a Responses object echoes of its request
RESPONSES_ECHO = ("instructions", "max_output_tokens", "previous_response_id", "store",
                  "tools", "tool_choice", "metadata", "temperature", "top_p")


@dataclass(frozen=True, slots=True)
class SimPlan:
    """Everything one simulated request will do, decided before its first byte."""

    status: int = 200
    ttft: float = 0.0
    inter_token: float = 0.0
    #: the output pieces, one per token: text, or a tool call's arguments in pieces
    tokens: tuple[str, ...] = ()
    #: headers and role chunk, then nothing until the reader goes away
    hang: bool = False
    #: send an in-band error event instead of token number N (0-based) and end
    midstream_error_after: int | None = None
    #: streaming: send a usage chunk (choices: []) before [DONE]
    usage: bool = True
    prompt_tokens: int = 0
    #: embeddings inputs, one string each (token lists as their JSON)
    inputs: tuple[str, ...] = ()
    #: prompt tokens found in the backend's prefix cache (None: the profile has no cache)
    cached_tokens: int | None = None
    #: the answer is this call (`tokens` are its arguments), not text
    tool_call: ToolCall | None = None
    #: the request's output limit cut the answer short
    truncated: bool = False
    #: embeddings: the vector's length, and whether it goes as base64 float32
    dimensions: int = EMBEDDING_DIMENSIONS
    base64: bool = False
    #: the request fields a Responses object repeats
    echo: Mapping[str, Any] | None = None

    @property
    def content(self) -> str:
        return "".join(self.tokens)

    def response_time(self, endpoint: Endpoint) -> float:
        """Time until a non-streaming response is complete (inf for a hang). Embeddings take
        the TTFT alone: they have no tokens to generate."""
        if self.hang:
            return math.inf
        if endpoint == "embeddings":
            return self.ttft
        return self.ttft + self.inter_token * max(0, len(self.tokens) - 1)


def retry_after_for(status: int) -> float | None:
    """The Retry-After a simulated 429/503 carries (seconds), as real overloaded APIs do."""
    return 1.0 if status in (429, 503, 529) else None


def parse_ttft_override(value: str | None) -> float | None:
    """`x-sim-ttft-ms` header value -> seconds. ValueError for garbage or a negative time."""
    if value is None:
        return None
    ms = float(value)
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"{TTFT_HEADER} must be a finite number >= 0")
    return ms / 1000.0


def output_limit(body: Mapping[str, Any], api: Api) -> int | None:
    """The fewest output tokens the request's limits allow, None when it sets none."""
    caps = [body[key] for key in _OUTPUT_LIMITS[api]
            if isinstance(body.get(key), int) and not isinstance(body[key], bool)]
    return max(0, min(caps)) if caps else None


#: the body fields that say what a request asks, in every API (its model and options aside)
_ASKED = ("messages", "system", "input", "prompt")


def request_rng(salt: bytes, body: Mapping[str, Any], endpoint: str) -> random.Random:
    """The draws of one request under `draws: request`: seeded by the backend's salt, the
    endpoint and what the request asks, so equal requests get equal draws on this backend
    whatever arrived before them, and a copy on another backend (another salt) gets its own."""
    asked = json.dumps([endpoint, *(body.get(k) for k in _ASKED)], sort_keys=True,
                       separators=(",", ":"), default=str).encode()
    digest = hashlib.blake2b(asked, key=salt, digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


class SimModel:
    """Draws plans from a profile. Each plan consumes the same number of draws from `rng`, so
    a seeded model gives the same TTFT sequence whatever the fault settings are (and whatever
    the requests: a tool call's choices are seeded by the request, not drawn from `rng`)."""

    def __init__(self, profile: SimProfile, rng: random.Random) -> None:
        self.profile = profile
        self._rng = rng
        #: `draws: request`: what, with the request's messages, seeds its draws (from `rng`,
        #: so each seeded backend has its own luck)
        self._salt = rng.getrandbits(64).to_bytes(8, "big") if profile.draws == "request" \
            else None
        #: the backend's prompt cache, when the profile models prefill
        self.cache = PrefixCache(profile.prefix_cache_entries) if profile.prefill_ms_per_1k > 0 \
            else None

    def plan(self, body: Mapping[str, Any], *, endpoint: str = "chat/completions",
             ttft_override: float | None = None) -> SimPlan:
        p = self.profile
        rng = self._rng if self._salt is None else request_rng(self._salt, body, endpoint)
        u_fault = rng.random()
        z = rng.gauss(0.0, 1.0)
        u_straggler = rng.random()
        u_after = rng.random()

        if ttft_override is not None:
            ttft = ttft_override
        else:
            ttft = p.ttft_median * math.exp(p.ttft_sigma * z) if p.ttft_median > 0 else 0.0
            if u_straggler < p.straggler_probability:
                ttft += p.straggler_extra
        api = api_of(endpoint)
        inputs = embedding_inputs(body.get("input")) if api == "embeddings" else ()
        parts = segments(body, api)
        prompt = sum(n for _, n in inputs) if inputs else prompt_tokens(parts)
        cached: int | None = None
        if self.cache is not None:
            cached = 0
            if endpoint in _PREFILLS and parts:
                prompt, cached = self.cache.lookup_and_store(parts, api)
            if ttft_override is None:  # an override is the whole TTFT, prefill included
                ttft += p.prefill_ms_per_1k * (prompt - cached) / 1e6

        call = plan_tool_call(body, api)
        natural = call.pieces if call is not None else tuple(f"tok{i} " for i in range(p.tokens))
        limit = output_limit(body, api)
        tokens = natural if limit is None else natural[:limit]
        n = len(tokens)

        status, hang, after = 200, False, None
        if u_fault < p.fail_probability:
            status = p.fail_status
        elif u_fault < p.fail_probability + p.hang_probability:
            hang = True
        elif u_fault < p.fail_probability + p.hang_probability + p.midstream_error_probability:
            after = min(n, 1 + int(u_after * max(1, n // 2)))

        options = body.get("stream_options")
        include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
        dimensions = body.get("dimensions")
        return SimPlan(
            status=status,
            ttft=ttft,
            inter_token=p.inter_token,
            tokens=tokens,
            hang=hang,
            midstream_error_after=after,
            usage=p.usage or include_usage,
            prompt_tokens=prompt,
            inputs=tuple(text for text, _ in inputs),
            cached_tokens=cached,
            tool_call=call,
            truncated=len(tokens) < len(natural),
            dimensions=dimensions if isinstance(dimensions, int) and dimensions > 0
            else EMBEDDING_DIMENSIONS,
            base64=body.get("encoding_format") == "base64",
            echo={k: body[k] for k in RESPONSES_ECHO if k in body} if api == "responses"
            else None,
        )


def wire_json(obj: Mapping[str, Any]) -> bytes:
    """JSON without spaces, as the simulated upstream sends every body and event."""
    return json.dumps(obj, separators=(",", ":")).encode()


def named_event(name: str, payload: Mapping[str, Any]) -> Event:
    """An event of the Responses or Messages API: its name, and the name again as `type`."""
    return name.encode(), wire_json({"type": name, **payload})
