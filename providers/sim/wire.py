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

Mid-stream faults (after the first token): a stall (one long gap before a token) and a break
(`reset`: the connection drops; `closed`: the body ends without its end event; `error`: an
in-band error event, Anthropic's `overloaded_error` on Messages; `malformed`: half an event,
then the end), drawn per profile (`stall_probability`, `break_probability`) or asked for per
request by header (`x-sim-stall-at`, `x-sim-stall-ms`, `x-sim-break-at`, `x-sim-break`).
Token numbers count from the start of the whole answer. A request whose last message is the
assistant's text is answered honestly as a continuation: the answer goes on from that text
(`continue_pieces`), so ten tokens relayed plus a continuation read as the whole answer, and a
fault at token 10 is not met again by a continuation that starts there.

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
#: per-request mid-stream faults (the loopback server's headers, `SimProvider`'s extra
#: headers): a stall of `x-sim-stall-ms` before token `x-sim-stall-at`, a break of kind
#: `x-sim-break` (reset, closed, error, malformed) instead of token `x-sim-break-at`; token
#: numbers count from the start of the whole answer, so a continuation that starts past them
#: does not meet them again
STALL_AT_HEADER = "x-sim-stall-at"
STALL_MS_HEADER = "x-sim-stall-ms"
BREAK_AT_HEADER = "x-sim-break-at"
BREAK_KIND_HEADER = "x-sim-break"
BREAK_KINDS = ("reset", "closed", "error", "malformed")
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
    #: stall `stall` seconds before token number N of this stream (0-based)
    stall_at: int | None = None
    stall: float = 0.0
    #: break instead of token number N of this stream (0-based), as `break_kind` says
    #: (`error` is `midstream_error_after`)
    break_at: int | None = None
    break_kind: str = "reset"

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


class SimBreak(Exception):
    """Raised by a stream where its plan breaks it (`SimPlan.break_at`): the in-process
    provider and the loopback server each break their own wire as `kind` says."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


async def before_token(plan: SimPlan, i: int, sleep: Sleep) -> None:
    """What a stream does before its token number `i` beyond the inter-token delay: stall, or
    break (`SimBreak`)."""
    if i == plan.stall_at:
        await sleep(plan.stall)
    if i == plan.break_at:
        raise SimBreak(plan.break_kind)


@dataclass(frozen=True, slots=True)
class SimFaults:
    """Mid-stream faults asked for by one request's headers, at token numbers of the whole
    answer (see `STALL_AT_HEADER`)."""

    stall_at: int | None = None
    stall: float = 0.0
    break_at: int | None = None
    break_kind: str = "reset"


def _count(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    number = int(value)
    if number < 0:
        raise ValueError(f"{name} must be an integer >= 0")
    return number


def parse_fault_headers(headers: Mapping[str, str]) -> SimFaults | None:
    """The mid-stream faults a request's headers ask for (None: none). ValueError for a
    value that is not one (a negative or non-integer token number, an unknown kind)."""
    stall_at = _count(headers.get(STALL_AT_HEADER), STALL_AT_HEADER)
    break_at = _count(headers.get(BREAK_AT_HEADER), BREAK_AT_HEADER)
    if stall_at is None and break_at is None:
        return None
    stall = parse_ttft_override(headers.get(STALL_MS_HEADER)) if stall_at is not None else None
    kind = headers.get(BREAK_KIND_HEADER, "reset")
    if kind not in BREAK_KINDS:
        raise ValueError(f"{BREAK_KIND_HEADER} must be one of {', '.join(BREAK_KINDS)}")
    return SimFaults(stall_at, 1.0 if stall is None else stall, break_at, kind)


def continued_text(body: Mapping[str, Any], api: Api) -> str | None:
    """The text of the request's final assistant message, which the answer continues (a
    prefill, or `continue_final_message`); None when the last message is not the
    assistant's text."""
    if api in ("chat", "messages"):
        messages = body.get("messages")
    elif api == "responses":
        messages = body.get("input")
    else:
        return None
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [part.get("text") for part in content if isinstance(part, Mapping)]
    if not texts or not all(isinstance(text, str) for text in texts):
        return None
    return "".join(str(text) for text in texts)


def continue_pieces(pieces: tuple[str, ...], given: str) -> tuple[tuple[str, ...], int]:
    """The pieces of an answer that goes on from `given`, and the number of the first piece
    it emits (from which the faults count). When the whole answer starts with `given`: the
    rest of it, where a piece that `given` ends inside (a prefill stripped of its trailing
    space) gives its remainder to the next piece; otherwise the whole answer (a model that
    starts over)."""
    whole = "".join(pieces)
    if not given or not whole.startswith(given):
        return pieces, 0
    start = 0
    for i, piece in enumerate(pieces):
        end = start + len(piece)
        if end > len(given):
            head = piece[len(given) - start:]
            if head == piece or i + 1 == len(pieces):
                return (head, *pieces[i + 1:]), i
            return (head + pieces[i + 1], *pieces[i + 2:]), i + 1
        start = end
    return (), len(pieces)


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
             ttft_override: float | None = None, faults: SimFaults | None = None) -> SimPlan:
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
        first = 0
        given = continued_text(body, api) if call is None else None
        if given is not None:  # it goes on from the text it was given, honestly
            natural, first = continue_pieces(natural, given)
        limit = output_limit(body, api)
        tokens = natural if limit is None else natural[:limit]
        n = len(tokens)
        stall_at, break_at, kind = self._midstream(u_after, first + n, faults)
        stall_at = None if stall_at is None or stall_at < first else stall_at - first
        break_at = None if break_at is None or break_at < first else break_at - first
        if stall_at is not None and stall_at == 0:
            stall_at = None  # before the first token is a straggler's TTFT, not a stall

        status, hang, after = 200, False, None
        if u_fault < p.fail_probability:
            status = p.fail_status
        elif u_fault < p.fail_probability + p.hang_probability:
            hang = True
        elif u_fault < p.fail_probability + p.hang_probability + p.midstream_error_probability:
            after = min(n, 1 + int(u_after * max(1, n // 2)))

        if break_at is not None and (break_at == 0 or break_at >= n or status != 200 or hang):
            break_at = None  # a break is after the first token and before the end
        if break_at is not None and kind == "error":
            after, break_at = (break_at if after is None else after), None

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
            stall_at=stall_at,
            stall=(faults.stall if faults is not None and faults.stall_at is not None
                   else p.stall_length),
            break_at=break_at,
            break_kind=kind,
        )

    def _midstream(self, u_after: float, n: int, faults: SimFaults | None
                   ) -> tuple[int | None, int | None, str]:
        """Where the whole answer (`n` tokens) stalls and breaks: the request's headers, else
        the profile's chances. Drawn from a generator seeded by an existing draw, so a
        seeded backend's sequence of draws is the same whatever the fault settings."""
        if faults is not None:
            return faults.stall_at, faults.break_at, faults.break_kind
        p = self.profile
        if not (p.stall_probability or p.break_probability) or n < 2:
            return None, None, p.break_kind
        aux = random.Random(u_after)
        u_stall, at_stall, u_break, at_break = (aux.random() for _ in range(4))
        stall_at = 1 + int(at_stall * (n - 1)) if u_stall < p.stall_probability else None
        break_at = 1 + int(at_break * (n - 1)) if u_break < p.break_probability else None
        return stall_at, break_at, p.break_kind


def wire_json(obj: Mapping[str, Any]) -> bytes:
    """JSON without spaces, as the simulated upstream sends every body and event."""
    return json.dumps(obj, separators=(",", ":")).encode()


def named_event(name: str, payload: Mapping[str, Any]) -> Event:
    """An event of the Responses or Messages API: its name, and the name again as `type`."""
    return name.encode(), wire_json({"type": name, **payload})


#: stands for a piece of text while an event is encoded once around it: `json.dumps` writes it
#: as `"\u0000"`, which the JSON of any other string value cannot contain (a quote inside a
#: string is escaped, a backslash doubled), so the marker is found only where it was put
MARKER = "\x00"
MARKER_JSON = json.dumps(MARKER).encode()


def json_string(text: str) -> bytes:
    """`text` as `wire_json` writes a string value (ASCII, escapes and all)."""
    return json.dumps(text).encode()


def around_markers(data: bytes, count: int) -> tuple[bytes, ...]:
    """`data` cut at each of its `count` markers (`MARKER`): the `count + 1` pieces a stream
    splices its values between. Why: a zero-delay stream writes 50 tokens per request, and
    an event spliced from bytes encoded once costs a fraction of a dict built and dumped per
    token (the simulator shares a core with the bench's load client)."""
    pieces = tuple(data.split(MARKER_JSON))
    if len(pieces) != count + 1:
        raise ValueError(f"expected {count} markers, found {len(pieces) - 1}")
    return pieces
