"""`bench --upstream URL`: a workload against the user's own OpenAI-compatible servers.

The simulators answer what the bench asks of them; a real inference server (vLLM, SGLang,
llama.cpp, a hosted API) is what the gateway will actually front, with its own prefill, its
own prefix cache and its own tail. `--upstream URL` (repeated, one per server; the base URL
as the OpenAI SDK takes it, `http://host:8000/v1`) runs the conversations workload against
those servers instead of starting simulators: the sticky client goes to them directly, the
gateway's modes through a gateway whose backends they are.

What differs from the simulated run, and why:
- the model each server serves is read from its `GET /models` (the first listed) unless
  `--upstream-model` names one for all;
- the servers keep their prefix caches from one mode to the next, so each mode's
  conversations open with a system prompt of their own: no mode reuses another's prefix.
  Every conversation's first user message carries a two-digit number (`c3t0.07`), the
  sticky client's `00`, the gateway's modes the first that makes the gateway's key put the
  conversation on the server where the sticky client keeps it, so every mode has the same
  conversations on the same servers, and within a mode they share one system prompt, so
  each first turn meets that prompt cached as the sticky client's do
  (`conversations.first_messages`);
- every mode, sticky included, first plays unmeasured warm-up conversations of their own
  (`--warmup`, default 6 per server at 4 turns), so the gateway's hedge delays have learnt
  each server's TTFT before the first measured turn (`conversations.warmup_conversations`);
- prompts are smaller by default (a 100-token system prompt, new messages of 20, 100 and 300
  tokens: `--sizes` changes them) and answers are capped at 30 tokens, so that a small
  model's context holds every turn;
- conversations run as many at once as there are servers (`--concurrency` changes it): a
  server that answers one request at a time (llama.cpp's) would otherwise measure its queue,
  not where the turns landed;
- the gateway runs on its default `affinity.min_input_tokens`, which for servers that are not
  at a hosted API is 64 (`gateway.settings.caching`: an engine caches any prefix), so these
  short conversations are keyed as any user's would be; `--upstream` at a hosted API keys
  them from 1,024 tokens, as the gateway would;
- each mode waits until every server answers `GET /models` (up to 180 s), so none starts
  while a server still works through the last mode's cancelled requests;
- no policy simulation: its model is the simulators', which says nothing of these servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx

#: new-message sizes (tokens) and their shares against real servers, and their system prompt
UPSTREAM_SIZES: tuple[tuple[int, float], ...] = ((20, 0.5), (100, 0.35), (300, 0.15))
UPSTREAM_SYSTEM_TOKENS = 100
#: the answer's length against real servers (the simulators answer 30 tokens by themselves)
MAX_TOKENS = 30


def base_url(url: str) -> str:
    """The base URL as given, without a trailing slash."""
    return url.rstrip("/")


#: how long a mode waits for the servers to answer `GET /models` before it starts: a server
#: that answers one request at a time may still be finishing the last mode's cancelled work
SETTLE_SECONDS = 180.0


async def settle(client: httpx.AsyncClient, bases: Sequence[str],
                 timeout: float = SETTLE_SECONDS) -> None:
    """Wait until every server answers `GET /models` (any status), so that no mode starts
    while a server is too busy with the previous mode's requests to answer at all.
    ValueError naming a server that does not answer within `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    for base in bases:
        while True:
            try:
                await client.get(base + "/models", timeout=10.0)  # any answer will do
                break
            except httpx.TransportError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise ValueError(f"{base}/models did not answer within {timeout:.0f} s "
                                     f"({type(exc).__name__})") from None
                await asyncio.sleep(1.0)


async def served_models(client: httpx.AsyncClient, bases: Sequence[str],
                        model: str | None) -> list[str]:
    """The model to ask each server for: `model` when given, else the first its `GET /models`
    lists. ValueError naming the server when it lists none or cannot be read."""
    if model is not None:
        return [model for _ in bases]
    found = []
    for base in bases:
        try:
            response = await client.get(base + "/models", timeout=10.0)
            data = response.json().get("data") or []
            name = data[0]["id"] if data and isinstance(data[0], dict) else None
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as exc:
            raise ValueError(f"{base}/models could not be read ({type(exc).__name__}); "
                             "name the model with --upstream-model") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{base}/models lists no model; name one with --upstream-model")
        found.append(name)
    return found


def parse_sizes(text: str) -> tuple[tuple[int, float], ...]:
    """`--sizes 200,4000,30000` (new-message tokens, equal shares) or with shares,
    `200:0.5,4000:0.35,30000:0.15`. ValueError on anything else."""
    out: list[tuple[int, float]] = []
    parts = [p.strip() for p in text.split(",") if p.strip()]
    for part in parts:
        size, _, share = part.partition(":")
        tokens = int(size)
        weight = float(share) if share else 1.0
        if tokens < 1 or not weight > 0:
            raise ValueError(f"size {part!r}: tokens >= 1 and a share > 0")
        out.append((tokens, weight))
    if not out:
        raise ValueError("no sizes given")
    return tuple(out)
