"""The simulated OpenAI-compatible upstream's plans and wire content. Pure apart from sleeping.

Hedging only pays off against a latency tail, so the simulator exists to produce one on demand,
offline and without keys: a lognormal TTFT body plus rare stragglers, and injectable faults
(status codes, hangs, mid-stream errors). `SimModel.plan` makes every random choice for one
request up front; everything after it (`sim_payloads`, `sim_events`, `sim_response`) is a pure
function of the plan plus injected sleeping, so the in-process `SimProvider` (`providers.sim`,
the embedded default pool) and the loopback server (`providers.sim.server`) emit identical
streams.

Content is deterministic (token i is ``"tok{i} "``): a test can compare what a client reads
straight from a backend with what it reads through the gateway.

Per-request TTFT override: the loopback server honours the request header ``x-sim-ttft-ms``
(and `SimProvider` the same key in `UpstreamCall.extra_headers`). It is a header, never a body
field, because bodies are forwarded unchanged to real upstreams too.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from gateway.errors import error_body
from gateway.settings import SimProfile
from gateway.wire.sse import encode_event
from providers.base import Endpoint
from providers.sim.cache import PrefixCache

Sleep = Callable[[float], Awaitable[None]]

TTFT_HEADER = "x-sim-ttft-ms"
EMBEDDING_DIMENSIONS = 8
DONE = b"[DONE]"
MIDSTREAM_ERROR: Mapping[str, Any] = error_body("simulated failure", type="server_error",
                                                code=None)


@dataclass(frozen=True, slots=True)
class SimPlan:
    """Everything one simulated request will do, decided before its first byte."""

    status: int = 200
    ttft: float = 0.0
    inter_token: float = 0.0
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
    return 1.0 if status in (429, 503) else None


def parse_ttft_override(value: str | None) -> float | None:
    """`x-sim-ttft-ms` header value -> seconds. ValueError for garbage or a negative time."""
    if value is None:
        return None
    ms = float(value)
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"{TTFT_HEADER} must be a finite number >= 0")
    return ms / 1000.0


class SimModel:
    """Draws plans from a profile. Each plan consumes the same number of draws from `rng`, so
    a seeded model gives the same TTFT sequence whatever the fault settings are."""

    def __init__(self, profile: SimProfile, rng: random.Random) -> None:
        self.profile = profile
        self._rng = rng
        #: the backend's prompt cache, when the profile models prefill
        self.cache = PrefixCache(profile.prefix_cache_entries) if profile.prefill_ms_per_1k > 0 \
            else None

    def plan(self, body: Mapping[str, Any], *, ttft_override: float | None = None) -> SimPlan:
        p = self.profile
        u_fault = self._rng.random()
        z = self._rng.gauss(0.0, 1.0)
        u_straggler = self._rng.random()
        u_after = self._rng.random()

        if ttft_override is not None:
            ttft = ttft_override
        else:
            ttft = p.ttft_median * math.exp(p.ttft_sigma * z) if p.ttft_median > 0 else 0.0
            if u_straggler < p.straggler_probability:
                ttft += p.straggler_extra
        cached: int | None = None
        if self.cache is not None:
            prompt, cached = self.cache.lookup_and_store(body)
            if ttft_override is None:  # an override is the whole TTFT, prefill included
                ttft += p.prefill_ms_per_1k * (prompt - cached) / 1e6

        n = p.tokens
        for key in ("max_tokens", "max_completion_tokens"):
            cap = body.get(key)
            if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
                n = min(n, cap)
        tokens = tuple(f"tok{i} " for i in range(n))

        status, hang, after = 200, False, None
        if u_fault < p.fail_probability:
            status = p.fail_status
        elif u_fault < p.fail_probability + p.hang_probability:
            hang = True
        elif u_fault < p.fail_probability + p.hang_probability + p.midstream_error_probability:
            after = min(n, 1 + int(u_after * max(1, n // 2)))

        options = body.get("stream_options")
        include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
        return SimPlan(
            status=status,
            ttft=ttft,
            inter_token=p.inter_token,
            tokens=tokens,
            hang=hang,
            midstream_error_after=after,
            usage=p.usage or include_usage,
            prompt_tokens=_prompt_words(body),
            inputs=_embedding_inputs(body.get("input")),
            cached_tokens=cached,
        )


def _prompt_words(body: Mapping[str, Any]) -> int:
    """A rough prompt token count (words) for the usage numbers."""
    texts: list[str] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        texts.extend(p for p in prompt if isinstance(p, str))
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(
                part["text"]
                for part in content
                if isinstance(part, Mapping) and isinstance(part.get("text"), str)
            )
    return sum(len(t.split()) for t in texts)


def _embedding_inputs(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return (json.dumps(value),)  # one input given as token ids
        return tuple(v if isinstance(v, str) else json.dumps(v) for v in value)
    return ()


def wire_json(obj: Mapping[str, Any]) -> bytes:
    """JSON without spaces, as the simulated upstream sends every body and event."""
    return json.dumps(obj, separators=(",", ":")).encode()


_MARKER = "\x00"
_MARKER_JSON = json.dumps(_MARKER).encode()


def _usage(plan: SimPlan, completion_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": plan.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": plan.prompt_tokens + completion_tokens,
    }
    if plan.cached_tokens is not None:  # as OpenAI reports its prompt cache
        usage["prompt_tokens_details"] = {"cached_tokens": plan.cached_tokens}
    return usage


async def sim_payloads(
    plan: SimPlan,
    *,
    endpoint: Endpoint,
    model: str,
    request_id: str,
    sleep: Sleep,
    created: int | None = None,
) -> AsyncGenerator[bytes, None]:
    """The `data` of each event of a streaming response, in order, with the plan's delays.

    Chat: role-only chunk at once, tokens (the first after `ttft`, then one per `inter_token`),
    a finish-only chunk, a usage chunk if the plan says so, `[DONE]`. Legacy completions have
    no role chunk and carry `choices[].text`. A hang sleeps forever after the role chunk.
    """
    chat = endpoint != "completions"
    head: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-sim-{request_id}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
    }

    def chunk(piece: str | None, finish: str | None) -> bytes:
        if chat:
            delta: dict[str, str] = {} if piece is None else {"content": piece}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            text = "" if piece is None else piece
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return wire_json({**head, "choices": [choice]})

    # A token chunk is the same JSON but for its text: encode it once around a marker and
    # splice each token's JSON string in (byte for byte `chunk(piece, None)`, a fraction of
    # its cost, which a zero-delay stream pays 50 times per request). rpartition: the marker
    # is the last string in the chunk, and the model name echoed before it may hold anything.
    prefix, _, suffix = chunk(_MARKER, None).rpartition(_MARKER_JSON)

    def token(piece: str) -> bytes:
        return prefix + json.dumps(piece).encode() + suffix

    if chat:
        role = {"role": "assistant", "content": ""}
        yield wire_json({**head, "choices": [{"index": 0, "delta": role, "finish_reason": None}]})
    if plan.hang:
        await sleep(math.inf)
        return
    delay = plan.ttft
    for i, piece in enumerate(plan.tokens):
        await sleep(delay)
        if i == plan.midstream_error_after:
            yield wire_json(MIDSTREAM_ERROR)
            return
        yield token(piece)
        delay = plan.inter_token
    if plan.midstream_error_after is not None:  # at or past the last token
        await sleep(delay)
        yield wire_json(MIDSTREAM_ERROR)
        return
    if not plan.tokens:
        await sleep(delay)
    yield chunk(None, "stop")
    if plan.usage:
        yield wire_json({**head, "choices": [], "usage": _usage(plan, len(plan.tokens))})
    yield DONE


async def sim_events(
    plan: SimPlan,
    *,
    endpoint: Endpoint,
    model: str,
    request_id: str,
    sleep: Sleep,
    created: int | None = None,
) -> AsyncGenerator[bytes, None]:
    """`sim_payloads` encoded as SSE wire bytes (`data: ...\\n\\n`), one item per event."""
    payloads = sim_payloads(
        plan, endpoint=endpoint, model=model, request_id=request_id, sleep=sleep, created=created
    )
    async with aclosing(payloads):
        async for data in payloads:
            yield encode_event(data)


def embedding_vector(text: str) -> list[float]:
    """A deterministic unit vector for one input (a hash, not a meaning)."""
    digest = hashlib.sha256(text.encode()).digest()[:EMBEDDING_DIMENSIONS]
    raw = [b / 127.5 - 1.0 for b in digest]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def sim_response(
    plan: SimPlan, endpoint: Endpoint, model: str, request_id: str, created: int | None = None
) -> dict[str, Any]:
    """The complete non-streaming body for `plan`, with the same content as the stream."""
    stamp = int(time.time()) if created is None else created
    if endpoint == "embeddings":
        words = sum(len(text.split()) for text in plan.inputs)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": embedding_vector(text)}
                for i, text in enumerate(plan.inputs)
            ],
            "model": model,
            "usage": {"prompt_tokens": words, "total_tokens": words},
        }
    choice: dict[str, Any]
    if endpoint == "completions":
        obj, ident = "text_completion", f"cmpl-sim-{request_id}"
        choice = {"index": 0, "text": plan.content, "logprobs": None, "finish_reason": "stop"}
    else:
        obj, ident = "chat.completion", f"chatcmpl-sim-{request_id}"
        message = {"role": "assistant", "content": plan.content}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
    return {
        "id": ident,
        "object": obj,
        "created": stamp,
        "model": model,
        "choices": [choice],
        "usage": _usage(plan, len(plan.tokens)),
    }

