"""`hedge-gateway bench --workload conversations`: multi-turn conversations against simulated
backends that prefill and cache prefixes.

Why a workload of its own: real time to first token is mostly prefill of the input a backend
has not cached, and a conversation resends its whole history every turn. Whether the gateway
helps or hurts then depends on where each turn lands, which the single-request workloads
cannot show. Every mode starts three fresh simulators (`hedge-gateway sim` with
`--prefill-ms-per-1k`, so their prefix caches start empty) and plays the same seeded
conversations:

- `sticky`: no gateway; each conversation goes to one backend chosen by a hash of its id. The
  anchor: what a client that keeps its conversations together gets.
- `hedging-off`: through the gateway, hedging off (affinity on, as by default);
- `hedging-on`: through the gateway with the default adaptive hedging;
- `no-affinity`: hedging on, affinity off: the load-only selection the gateway had before,
  for comparison.

Each mode first plays unmeasured warm-up conversations (`warmup`, `--warmup N`), the same in
every mode, sticky included: each backend's hedge delay learns from `min_samples` (20) TTFTs
and waits `initial` (0.5 s) until then, so a measurement from a cold gateway is mostly that
learning period (on two llama-cpp-python servers whose TTFT is about 1 s, more than half of
a 48-turn run's turns were hedged before their delays had learnt). The other benches warm up
before they measure for the same reason (`gateway.bench.clouds`). The warm-up conversations
open with system prompts of their own, so no measured turn finds its prefix cached by them,
and they are chosen so that their homes (the first backend of the gateway's order, where the
sticky client sends them too) are spread evenly over the backends: every backend then gets
enough turns to learn, not only the ones that the hash happens to favour. What `/hedge/stats`
counted for the warm-up is left out of the mode's figures.

Each conversation has a size class (the tokens of each new user message: 200, 4,000 or
30,000, a mix), a system prompt of `SYSTEM_TOKENS` and `turns` turns; each turn appends the
assistant's answer and a new user message. A token is a 4-byte word ("tok "), so the body's
size over 4 is its token count, as the gateway estimates it and the simulator counts it.
Per size class: TTFT p50 and p99 as the client sees them, the cache hit rate (later turns whose
usage reports the whole previous turn's prompt as cached: the conversation's own prefix, not
only the system prompt that every conversation shares), and per mode the extra input tokens
that hedges sent. After the modes, the best policies of a simulation of the same workload
(`gateway.bench.policies`) and the measured hedging-on row's distance to them.

`--upstream URL` (repeated) plays the same workload against the user's own servers instead of
simulators (`gateway.bench.external`). There the modes share the servers, so they are
interleaved: every mode warms up, then each round of `concurrency` conversations is played in
every mode in turn, with greedy answers, and each gateway mode's later turns are compared
with the sticky client's same turns (`later_vs_sticky`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from gateway.bench import servers
from gateway.bench.external import MAX_TOKENS, base_url, served_models, settle
from gateway.bench.policies import Conversation, Model, best_policies
from gateway.bench.procs import Children, free_port, wait_ready
from gateway.hedge.affinity import route_for
from gateway.settings import AffinitySettings, DelaySettings
from gateway.settings.caching import min_keyed_tokens

POOL = "bench"
MODES = ("sticky", "hedging-off", "hedging-on", "no-affinity")
#: new-message sizes (tokens) and their shares of the conversations
SIZES: tuple[tuple[int, float], ...] = ((200, 0.5), (4000, 0.35), (30000, 0.15))
SYSTEM_TOKENS = 1000
BACKENDS = 3
#: warm-up candidates tried per warm-up conversation wanted, to spread their homes evenly (the
#: hash puts a candidate on a given one of two backends half the time; this many misses in a
#: row are as good as impossible)
WARMUP_CANDIDATES = 50
#: seconds between the warm-up and the measured turns: past the delays' refresh (every second)
WARMUP_SETTLE = 1.2
#: numbers tried per conversation to give it the sticky client's home in a gateway mode (one in
#: two on two servers; this many misses in a row are as good as impossible); two digits each
ALIGN_TRIES = 64
#: the simulators' profile: the stragglers workload plus 60 ms of prefill per 1k uncached tokens
SIM_ARGS = ("--ttft-median-ms", "150", "--ttft-sigma", "0.25", "--straggler-probability",
            "0.03", "--straggler-extra-ms", "1500", "--tokens", "30", "--inter-token-ms", "5",
            "--prefill-ms-per-1k", "60", "--draws", "request")


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    conversations: int = 48
    turns: int = 4
    seed: int = 1
    #: seconds between the starts of two conversations (they then run concurrently)
    stagger: float = 0.05
    modes: tuple[str, ...] = MODES
    #: new-message sizes (tokens) and their shares
    sizes: tuple[tuple[int, float], ...] = SIZES
    system_tokens: int = SYSTEM_TOKENS
    #: the user's own servers (`--upstream`, base URLs); empty: start simulators
    upstreams: tuple[str, ...] = ()
    #: the model to ask them for (None: each one's first listed model)
    model: str | None = None
    #: conversations in flight at once (None: all of them, each started `stagger` after the
    #: last); a conversation holds its slot for all its turns
    concurrency: int | None = None
    #: the gateway's `affinity.min_input_tokens` (None: its default)
    min_input_tokens: int | None = None
    #: unmeasured warm-up conversations per mode, before the measured ones (None: enough for
    #: every backend's delay to learn, `default_warmup`; 0: none)
    warmup: int | None = None


@dataclass(slots=True)
class Turn:
    conversation: int
    index: int
    size: int
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: the usage reported a prompt cache at all (a real server may not)
    cache_reported: bool = True
    backend: str = ""
    #: attempts the gateway started for it (`x-hedge-attempts`; 1 without a gateway)
    attempts: int = 1
    error: str | None = None
    #: the prompt tokens of this conversation's previous turn (0 for its first)
    previous_prompt: int = 0

    @property
    def hit(self) -> bool:
        """A later turn whose backend held the whole previous turn's prompt: the
        conversation's own prefix, not only the system prompt every conversation shares."""
        return self.index > 0 and self.previous_prompt > 0 and \
            self.cached_tokens >= self.previous_prompt


@dataclass(slots=True)
class ModeResult:
    mode: str
    turns: list[Turn] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    #: the warm-up's turns (not measured, not in `turns` or `stats`) and how many failed
    warmup_turns: int = 0
    warmup_errors: int = 0


def words(n: int, tag: str) -> str:
    """`n` tokens of text whose first word tells messages apart."""
    return tag + " " + "tok " * max(0, n - 1)


def size_classes(plan: ConversationPlan) -> list[int]:
    """Each conversation's new-message size, seeded."""
    rng = random.Random(plan.seed)
    sizes, weights = zip(*plan.sizes, strict=True)
    return [rng.choices(sizes, weights=weights)[0] for _ in range(plan.conversations)]


def backend_names(count: int) -> list[str]:
    """The backends' names, in the gateway's pool and as the sticky client labels them."""
    return [f"sim-{chr(97 + k)}" for k in range(count)]


def first_messages(plan: ConversationPlan, number: int, size: int,
                   mode: str, *, warmup: bool = False) -> list[dict[str, str]]:
    """A conversation's opening messages. Against real servers (which keep their caches from
    mode to mode) the system prompt names the mode, so no mode reuses another's prefix; a
    warm-up conversation's names the warm-up, so no measured turn reuses a warm-up's.

    Within a mode every measured conversation opens with the same system prompt, as an
    application's conversations do: a server that ran the last conversation holds that prompt
    in its cache, and the next conversation there prefills only its own message. That holds
    in every mode alike, so the modes' first turns meet the same cache.

    A measured conversation's home is the same in every mode: its first user message carries
    a two-digit number (`c3t0.07`), `00` for the sticky client, and the gateway's modes take
    the first number for which the gateway's own key puts the conversation first on the
    backend where the sticky client keeps it. The number is in the user message, not the
    system prompt: a system prompt numbered per conversation made a gateway mode's first
    turns prefill the whole system prompt whenever the number differed from the last
    conversation's on that server, which the sticky client's never did. It is two digits in
    every mode, so each mode's user messages are equally long. Otherwise each mode's hash
    would place its conversations anew, and with a dozen conversations on two servers one
    mode's luck (9 of 12 on one server) decided more than the gateway did. On simulators
    every mode sends the same prompts, so the homes agree anyway."""
    kind = "warmup" if warmup else "system"
    if not plan.upstreams:
        return _opening(plan, number, size, kind, warmup)
    own = _opening(plan, number, size, f"{kind}-{mode}", warmup, salt=0)
    if warmup or mode == "sticky":
        return own
    backends = len(plan.upstreams)
    home = _home(plan, _opening(plan, number, size, "system-sticky", False, salt=0), backends)
    if home is None:
        return own
    for salt in range(ALIGN_TRIES):
        messages = _opening(plan, number, size, f"{kind}-{mode}", warmup, salt=salt)
        if _home(plan, messages, backends) == home:
            return messages
    return own


def _opening(plan: ConversationPlan, number: int, size: int, tag: str,
             warmup: bool, salt: int | None = None) -> list[dict[str, str]]:
    """The system prompt tagged `tag` and the first user message, numbered `salt` (two
    digits) when given."""
    first = f"{'w' if warmup else 'c'}{number}t0" + ("" if salt is None else f".{salt:02d}")
    return [{"role": "system", "content": words(plan.system_tokens, tag)},
            {"role": "user", "content": words(size, first)}]


def _home(plan: ConversationPlan, messages: list[dict[str, str]], backends: int) -> int | None:
    """The index of the first backend of the gateway's order for a conversation opening with
    `messages` (`gateway.hedge.affinity`), or None when it is too short for a key."""
    body = turn_body(plan, "sim", messages)
    names = backend_names(backends)
    route = route_for(body, {}, [(name, 1.0) for name in names],
                      min_input_tokens=key_threshold(plan),
                      load_factor=AffinitySettings().load_factor,
                      body_bytes=len(json.dumps(body).encode()))
    return None if route is None else names.index(route.order[0])


def turn_body(plan: ConversationPlan, model: str,
              messages: list[dict[str, str]]) -> dict[str, Any]:
    """One turn's request: streamed with usage; against real servers, its answer capped and
    greedy."""
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}}
    if plan.upstreams:
        # capped and greedy: every mode gets the same answers to the same turns (their
        # system prompts differ only by the mode's name), so a turn's prompt, and the
        # prefill it costs, is the same whichever mode sends it
        body["max_tokens"] = MAX_TOKENS
        body["temperature"] = 0
    return body


def sticky_backend(plan: ConversationPlan, number: int, size: int, backends: int, *,
                   mode: str = "sticky", warmup: bool = False) -> int:
    """The one backend the sticky client keeps conversation `number` on: its home by the
    gateway's own key and order (`gateway.hedge.affinity`). On simulators (whose prompts are
    the same in every mode) both place a turn on the same backend, where `--draws request`
    gives it the same luck: the modes then differ by what the gateway does, not by the draws.
    Against real servers each mode's system prompt is its own, and each conversation's first
    user message is numbered so that the gateway's modes put it first on the same backend
    (`first_messages`). A
    conversation too short for a key goes by a hash of its number. A warm-up conversation's
    home is read from its own opening messages in `mode` (`warmup_conversations`)."""
    home = _home(plan, first_messages(plan, number, size, mode, warmup=warmup), backends)
    if home is not None:
        return home
    prefix = "warmup" if warmup else "conversation"
    digest = hashlib.blake2b(f"{prefix}-{number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % backends


def default_warmup(plan: ConversationPlan, backends: int) -> int:
    """Warm-up conversations per mode by default: each backend gets the turns of enough of
    them that its delay reaches `min_samples` observations (`gateway.hedge.delay`) and has
    left `initial` before the first measured turn, with one conversation to spare (a turn
    that spills or fails is one sample fewer at its home)."""
    per_backend = -(-DelaySettings().min_samples // max(1, plan.turns)) + 1
    return per_backend * backends


def warmup_conversations(plan: ConversationPlan, mode: str,
                         backends: int) -> list[tuple[int, int, int]]:
    """The warm-up conversations of `mode`: (number, size, home backend) each, their count
    `plan.warmup` (default `default_warmup`), their sizes drawn from the plan's mix, and
    their homes as even over the backends as the count allows (backend k gets
    `count // backends`, one more for the first `count % backends`). Chosen among candidate
    numbers in order, so the same plan always warms up alike."""
    count = default_warmup(plan, backends) if plan.warmup is None else plan.warmup
    if count <= 0 or backends <= 0:
        return []
    want = [count // backends + (1 if k < count % backends else 0) for k in range(backends)]
    rng = random.Random(plan.seed + 7919)  # not the measured conversations' draws
    sizes, weights = zip(*plan.sizes, strict=True)
    chosen: list[tuple[int, int, int]] = []
    for number in range(WARMUP_CANDIDATES * count):
        size = rng.choices(sizes, weights=weights)[0]
        home = sticky_backend(plan, number, size, backends, mode=mode, warmup=True)
        if want[home] > 0:
            want[home] -= 1
            chosen.append((number, size, home))
            if len(chosen) == count:
                break
    return chosen


def key_threshold(plan: ConversationPlan) -> int:
    """The gateway's `affinity.min_input_tokens` over this plan's backends: the plan's own,
    else what the gateway makes of them by default (`gateway.settings.caching`): they are
    `openai` backends, the simulators on loopback or the user's servers at their URLs."""
    if plan.min_input_tokens is not None:
        return plan.min_input_tokens
    urls = plan.upstreams or ("http://127.0.0.1/v1",)
    return min(min_keyed_tokens("openai", url, sim_caches=False) for url in urls)


def gateway_yaml(port: int, upstreams: Sequence[int | str], hedging: bool,
                 affinity: bool = True, models: Sequence[str] | None = None,
                 min_input_tokens: int | None = None) -> str:
    """The gateway's configuration over `upstreams`: simulator ports on loopback, or base
    URLs (with `models`, the model each serves)."""
    backends = [{"name": name, "provider": "openai",
                 "model": models[k] if models else "sim",
                 "base_url": f"http://127.0.0.1:{u}/v1" if isinstance(u, int) else u,
                 "group": f"zone-{chr(97 + k)}"}
                for k, (name, u) in enumerate(zip(backend_names(len(upstreams)), upstreams,
                                                  strict=True))]
    config = {"server": {"host": "127.0.0.1", "port": port}, "hedging": {"enabled": hedging},
              "affinity": {"enabled": affinity},
              "pools": [{"name": POOL, "backends": backends, "timeout": "120s",
                         "timeouts": {"first_token": "120s"}, **(
                             {} if min_input_tokens is None
                             else {"affinity": {"min_input_tokens": min_input_tokens}})}]}
    return yaml.safe_dump(config, sort_keys=False)


async def _stream_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       turn: Turn) -> str:
    """One streamed turn: its TTFT (to the first content), usage and answer text."""
    text: list[str] = []
    started = time.monotonic()
    turn.cache_reported = False
    async with client.stream("POST", url, json=body) as response:
        turn.backend = response.headers.get("x-hedge-backend", turn.backend)
        attempts = response.headers.get("x-hedge-attempts", "1")
        turn.attempts = int(attempts) if attempts.isdigit() else 1
        if response.status_code != 200:
            turn.error = f"status {response.status_code}"
            await response.aread()
            return ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if turn.ttft is None:
                        turn.ttft = time.monotonic() - started
                    text.append(piece)
            usage = chunk.get("usage")
            if usage:
                turn.prompt_tokens = usage.get("prompt_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                turn.cache_reported = details.get("cached_tokens") is not None
                turn.cached_tokens = details.get("cached_tokens") or 0
    return "".join(text)


async def _conversation(client: httpx.AsyncClient, url: str, model: str, number: int,
                        size: int, plan: ConversationPlan, out: list[Turn],
                        mode: str, slots: asyncio.Semaphore, *, warmup: bool = False) -> None:
    """One conversation's turns, holding one of `slots` throughout. Against real servers
    (which keep their caches from mode to mode) its system prompt names the mode and its
    answers are capped."""
    if plan.concurrency is None:
        await asyncio.sleep(number * plan.stagger)
    async with slots:
        await _turns(client, url, model, number, size, plan, out, mode, warmup)


async def _turns(client: httpx.AsyncClient, url: str, model: str, number: int, size: int,
                 plan: ConversationPlan, out: list[Turn], mode: str, warmup: bool) -> None:
    messages = first_messages(plan, number, size, mode, warmup=warmup)
    previous = 0
    tag = "w" if warmup else "c"
    for index in range(plan.turns):
        turn = Turn(number, index, size, previous_prompt=previous)
        out.append(turn)
        body = turn_body(plan, model, messages)
        try:
            answer = await _stream_turn(client, url, body, turn)
        except httpx.HTTPError as exc:
            turn.error = type(exc).__name__
            return
        if turn.error is not None:
            return
        previous = turn.prompt_tokens
        messages = [*messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": words(size, f"{tag}{number}t{index + 1}")}]


async def _start_sims(children: Children, client: httpx.AsyncClient, mode: str,
                      seed: int) -> list[int]:
    ports = [free_port() for _ in range(BACKENDS)]
    procs = [children.start(f"sim-{mode}-{k}", [sys.executable, "-m", "gateway.cli", "sim",
                                                 "--port", str(p), "--seed", str(seed + k),
                                                 *SIM_ARGS])
             for k, p in enumerate(ports)]
    for port, proc in zip(ports, procs, strict=True):
        await wait_ready(client, f"http://127.0.0.1:{port}/v1/models", proc, children)
    return ports


async def _play(client: httpx.AsyncClient, plan: ConversationPlan, mode: str,
                conversations: Sequence[tuple[int, int, int]], bases: Sequence[str],
                models: Sequence[str], gateway: str | None, *,
                warmup: bool = False) -> list[Turn]:
    """Play `conversations` ((number, size, home backend) each) to their ends, `concurrency`
    at a time: to each one's home for the sticky client (`gateway` None), else through the
    gateway. Every turn, each labelled with the backend that answered it."""
    slots = asyncio.Semaphore(plan.concurrency or len(conversations) or 1)
    names = backend_names(len(bases))
    tasks = []
    for number, size, home in conversations:
        if gateway is None:
            url, model, label = f"{bases[home]}/chat/completions", models[home], names[home]
        else:
            url, model, label = gateway + "/v1/chat/completions", POOL, ""
        own: list[Turn] = []
        tasks.append((own, label, _conversation(client, url, model, number, size, plan, own,
                                                mode, slots, warmup=warmup)))
    await asyncio.gather(*(t[2] for t in tasks))
    turns: list[Turn] = []
    for own, label, _ in tasks:
        for turn in own:
            turn.backend = turn.backend or label
        turns.extend(own)
    return turns


async def _pool_stats(client: httpx.AsyncClient, gateway: str,
                      requests: int) -> dict[str, Any]:
    """The pool's lifetime `/hedge/stats` once it counts `requests` (a request is counted
    once it ended and its losers were closed), or after 5 s as it is."""
    deadline = time.monotonic() + 5.0
    while True:
        stats: dict[str, Any] = (await client.get(gateway + "/hedge/stats")).json()
        lifetime: dict[str, Any] = stats["pools"][POOL]["lifetime"]
        if lifetime.get("requests", 0) >= requests or time.monotonic() > deadline:
            return lifetime
        await asyncio.sleep(0.05)


def stats_delta(after: Any, before: Any) -> Any:
    """What the measured turns added to the lifetime counters: every number of `after` less
    the same one of `before` (nested alike), and the affinity hit rate of the difference.
    Anything else is `after`'s."""
    if isinstance(after, dict):
        base = before if isinstance(before, dict) else {}
        out = {key: stats_delta(value, base.get(key)) for key, value in after.items()}
        if {"hits", "spills", "misses"} <= out.keys() and "hit_rate" in out:
            total = out["hits"] + out["spills"] + out["misses"]
            out["hit_rate"] = round(out["hits"] / total, 4) if total else None
        return out
    if isinstance(after, int | float) and not isinstance(after, bool) \
            and isinstance(before, int | float) and not isinstance(before, bool):
        return after - before
    return after


@dataclass(slots=True)
class _ModeRun:
    """One mode's measurement in progress: its gateway (None for the sticky client), its
    measured conversations and the counters its warm-up left."""

    result: ModeResult
    gateway: str | None
    measured: list[tuple[int, int, int]]
    before: dict[str, Any] = field(default_factory=dict)


async def _prepare_mode(plan: ConversationPlan, mode: str, children: Children,
                        client: httpx.AsyncClient, bases: Sequence[str],
                        models: Sequence[str]) -> _ModeRun:
    """Start `mode`'s gateway (none for `sticky`) and play its warm-up conversations."""
    gateway = None
    if mode != "sticky":
        port = free_port()
        path = os.path.join(children.logdir, f"conversations-{mode}.yaml")
        with open(path, "w", encoding="utf-8") as file:
            file.write(gateway_yaml(port, bases, hedging=mode != "hedging-off",
                                    affinity=mode != "no-affinity", models=models,
                                    min_input_tokens=plan.min_input_tokens))
        argv, env = servers.server_command(servers.OWN, path, port)
        proc = children.start(f"gateway-conversations-{mode}", argv, env=env)
        gateway = f"http://127.0.0.1:{port}"
        await wait_ready(client, gateway + "/healthz", proc, children)
    run = _ModeRun(ModeResult(mode), gateway, [
        (number, size, sticky_backend(plan, number, size, len(bases), mode=mode))
        for number, size in enumerate(size_classes(plan))])
    warm = warmup_conversations(plan, mode, len(bases))
    if warm:
        warm_turns = await _play(client, plan, mode, warm, bases, models, gateway, warmup=True)
        run.result.warmup_turns = len(warm_turns)
        run.result.warmup_errors = sum(1 for t in warm_turns if t.error is not None)
        if gateway is not None:
            run.before = await _pool_stats(client, gateway, len(warm_turns))
    return run


async def _measure(plan: ConversationPlan, run: _ModeRun, client: httpx.AsyncClient,
                   conversations: Sequence[tuple[int, int, int]], bases: Sequence[str],
                   models: Sequence[str]) -> None:
    """Play `conversations` of the mode's measured ones, adding their turns and time."""
    started = time.monotonic()
    run.result.turns += await _play(client, plan, run.result.mode, conversations, bases,
                                    models, run.gateway)
    run.result.seconds += time.monotonic() - started


async def _finish_mode(run: _ModeRun, client: httpx.AsyncClient) -> ModeResult:
    """The mode's result, with what its gateway counted for the measured turns alone."""
    if run.gateway is not None:
        after = await _pool_stats(client, run.gateway,
                                  run.result.warmup_turns + len(run.result.turns))
        run.result.stats = stats_delta(after, run.before)
    return run.result


def _client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    return httpx.AsyncClient(timeout=httpx.Timeout(180.0), limits=limits)


async def _run_mode(plan: ConversationPlan, mode: str, children: Children) -> ModeResult:
    """One mode on fresh simulators of its own (cold caches), warm-up then measured turns."""
    async with _client() as client:
        ports = await _start_sims(children, client, mode, plan.seed)
        bases = [f"http://127.0.0.1:{p}/v1" for p in ports]
        models = ["sim"] * len(bases)
        run = await _prepare_mode(plan, mode, children, client, bases, models)
        if run.result.warmup_turns:
            # the delays are recomputed once a second, off the request path: the last
            # warm-up turns' samples are in force before the first measured turn
            await asyncio.sleep(WARMUP_SETTLE)
        await _measure(plan, run, client, run.measured, bases, models)
        result = await _finish_mode(run, client)
    children.close()  # the next mode starts with cold caches
    return result


def rounds(count: int, concurrency: int | None) -> list[range]:
    """The measured conversations' indices in rounds of `concurrency` (all in one round
    without it): each round is played in every mode before the next one starts."""
    size = concurrency or count or 1
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


async def _run_interleaved(plan: ConversationPlan, children: Children) -> list[ModeResult]:
    """Every mode against the user's own servers, interleaved: each mode's gateway starts and
    warms up, then the measured conversations are played in rounds of `concurrency`, each
    round in every mode in turn, each round opening with the next mode. Why: the servers are
    shared by every mode and run on the same cores, so a mode played after another (minutes
    later) met another machine, and a difference of a few per cent between whole modes was
    mostly that drift; a round takes seconds, and each mode meets the same servers within it,
    with the same conversations in flight at once."""
    async with _client() as client:
        bases = [base_url(u) for u in plan.upstreams]
        await settle(client, bases)
        models = await served_models(client, bases, plan.model)
        runs = [await _prepare_mode(plan, mode, children, client, bases, models)
                for mode in plan.modes]
        await asyncio.sleep(WARMUP_SETTLE)  # the last warm-up's delays in force (as above)
        for number, indices in enumerate(rounds(len(runs[0].measured) if runs else 0,
                                                plan.concurrency)):
            # each round opens with the next mode: no mode always plays first (after another
            # mode's conversations) or last
            start = number % len(runs)
            for run in runs[start:] + runs[:start]:
                await _measure(plan, run, client, [run.measured[i] for i in indices],
                               bases, models)
        return [await _finish_mode(run, client) for run in runs]


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(result: ModeResult) -> dict[str, Any]:
    """Per size class: turns, TTFT p50/p99 (ms), cache hit rate of later turns; per mode:
    errors, input tokens, hedges and the extra input tokens hedges sent."""
    classes: dict[str, Any] = {}
    for size in sorted({t.size for t in result.turns}):
        turns = [t for t in result.turns if t.size == size and t.error is None]
        ttfts = [t.ttft * 1000 for t in turns if t.ttft is not None]
        later = [t for t in turns if t.index > 0 and t.cache_reported]
        hits = sum(1 for t in later if t.hit)
        classes[str(size)] = {
            "turns": len(turns),
            "ttft_p50_ms": _quantile(ttfts, 0.5), "ttft_p99_ms": _quantile(ttfts, 0.99),
            "cache_hit_rate": hits / len(later) if later else None,
            "hedged": sum(1 for t in turns if t.attempts > 1),
        }
    ok = [t for t in result.turns if t.error is None]
    later = [t for t in ok if t.index > 0 and t.cache_reported]
    input_tokens = sum(t.prompt_tokens for t in ok)
    extra = int(result.stats.get("tokens", {}).get("hedge_input", 0)) if result.stats else 0
    hedges = result.stats.get("hedges", {}) if result.stats else {}
    ttfts = [t.ttft * 1000 for t in ok if t.ttft is not None]
    return {
        "mode": result.mode,
        "seconds": round(result.seconds, 1),
        "turns": len(result.turns),
        "warmup_turns": result.warmup_turns, "warmup_errors": result.warmup_errors,
        "errors": sum(1 for t in result.turns if t.error is not None),
        "ttft_p50_ms": _quantile(ttfts, 0.5), "ttft_p99_ms": _quantile(ttfts, 0.99),
        "cache_hit_rate": sum(1 for t in later if t.hit) / len(later) if later else None,
        "cached_token_share": (sum(t.cached_tokens for t in ok) / input_tokens
                               if input_tokens else None),
        "input_tokens": input_tokens,
        "extra_input_tokens": extra,
        "extra_input_share": extra / input_tokens if input_tokens else None,
        "hedges_started": hedges.get("started", 0), "hedges_won": hedges.get("won", 0),
        "affinity": result.stats.get("affinity") if result.stats else None,
        "classes": classes,
        #: each turn: conversation, turn, size, TTFT ms, prompt and cached tokens, backend,
        #: error, attempts
        "turns_detail": [[t.conversation, t.index, t.size,
                          None if t.ttft is None else round(t.ttft * 1000, 1),
                          t.prompt_tokens, t.cached_tokens, t.backend, t.error, t.attempts]
                         for t in result.turns],
    }


def paired(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each gateway mode's later turns (the second turn on) beside the sticky client's same
    turns (same conversation, same turn, both answered): p50 and p90 of each over those
    turns, their ratios, and the median of the per-turn differences. Why paired: a later
    turn's time is mostly the prefill of what its server has not cached, which differs from
    turn to turn far more than between modes; comparing a turn with itself leaves what the
    mode changed. `rows` gain `later_vs_sticky` (None without a sticky row)."""
    def later(row: dict[str, Any]) -> dict[tuple[int, int], float]:
        return {(t[0], t[1]): t[3] for t in row["turns_detail"]
                if t[1] > 0 and t[3] is not None and t[7] is None}

    sticky = next((later(r) for r in rows if r["mode"] == "sticky"), None)
    for row in rows:
        if sticky is None or row["mode"] == "sticky":
            row["later_vs_sticky"] = None
            continue
        own = later(row)
        keys = sorted(own.keys() & sticky.keys())
        mine, theirs = [own[k] for k in keys], [sticky[k] for k in keys]
        p50, p90 = _quantile(mine, 0.5), _quantile(mine, 0.9)
        s50, s90 = _quantile(theirs, 0.5), _quantile(theirs, 0.9)
        row["later_vs_sticky"] = {
            "turns": len(keys), "p50_ms": p50, "p90_ms": p90,
            "sticky_p50_ms": s50, "sticky_p90_ms": s90,
            "p50_ratio": round(p50 / s50, 3) if p50 is not None and s50 else None,
            "p90_ratio": round(p90 / s90, 3) if p90 is not None and s90 else None,
            "median_added_ms": _quantile([own[k] - sticky[k] for k in keys], 0.5),
            "slower_turns": sum(1 for k in keys if own[k] > sticky[k]),
        }
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per mode and size class, then one per mode with its totals."""
    head = (f"{'mode':<12} {'class':>7} {'turns':>5} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'cache hit':>9} {'hedged':>6}")
    lines = [head, "-" * len(head)]
    for row in rows:
        for size, c in row["classes"].items():
            lines.append(f"{row['mode']:<12} {int(size):>7,} {c['turns']:>5} "
                         f"{_ms(c['ttft_p50_ms']):>8} {_ms(c['ttft_p99_ms']):>8} "
                         f"{_pct(c['cache_hit_rate']):>9} {c.get('hedged', 0):>6}")
        lines.append(f"{row['mode']:<12} {'all':>7} {row['turns'] - row['errors']:>5} "
                     f"{_ms(row['ttft_p50_ms']):>8} {_ms(row['ttft_p99_ms']):>8} "
                     f"{_pct(row['cache_hit_rate']):>9}")
    lines.append("")
    head2 = (f"{'mode':<12} {'errors':>6} {'input tok':>11} {'extra tok':>10} {'extra':>6} "
             f"{'hedges':>6} {'won':>4} {'cached tok':>10} {'affinity hit/spill/miss':>24}"
             f" {'secs':>5}")
    lines += [head2, "-" * len(head2)]
    for row in rows:
        aff = row["affinity"]
        affinity = "-" if not aff else f"{aff['hits']}/{aff['spills']}/{aff['misses']}"
        lines.append(f"{row['mode']:<12} {row['errors']:>6} {row['input_tokens']:>11,} "
                     f"{row['extra_input_tokens']:>10,} {_pct(row['extra_input_share']):>6} "
                     f"{row['hedges_started']:>6} {row['hedges_won']:>4} "
                     f"{_pct(row['cached_token_share']):>10} {affinity:>24} "
                     f"{row['seconds']:>5}")
    pairs = [(row["mode"], row["later_vs_sticky"]) for row in rows
             if row.get("later_vs_sticky")]
    if pairs:
        head3 = (f"{'later turns':<12} {'turns':>5} {'p50 ms':>8} {'sticky':>8} {'x':>6} "
                 f"{'p90 ms':>8} {'sticky':>8} {'x':>6} {'added (median of turns)':>24} "
                 f"{'slower':>6}")
        lines += ["", head3, "-" * len(head3)]
        for mode, pair in pairs:
            added = pair["median_added_ms"]
            lines.append(f"{mode:<12} {pair['turns']:>5} {_ms(pair['p50_ms']):>8} "
                         f"{_ms(pair['sticky_p50_ms']):>8} {_ratio(pair['p50_ratio']):>6} "
                         f"{_ms(pair['p90_ms']):>8} {_ms(pair['sticky_p90_ms']):>8} "
                         f"{_ratio(pair['p90_ratio']):>6} "
                         f"{'-' if added is None else f'{added:+.1f} ms':>24} "
                         f"{pair['slower_turns']:>6}")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def policy_rows(plan: ConversationPlan) -> list[dict[str, Any]]:
    """The best simulated policies over this plan's conversations (`gateway.bench.policies`);
    none against real servers, whose model the simulation does not know."""
    if plan.upstreams:
        return []
    conversations = [Conversation(n, size, plan.turns)
                     for n, size in enumerate(size_classes(plan))]
    return best_policies(conversations, seed=plan.seed,
                         model=Model(backends=BACKENDS, system_tokens=plan.system_tokens))


def run_conversations(plan: ConversationPlan) -> list[dict[str, Any]]:
    """Every mode of `plan`: on simulators one after the other, each with fresh ones; on the
    user's own servers interleaved by rounds (`_run_interleaved`)."""
    with tempfile.TemporaryDirectory(prefix="hedge-conversations-") as logdir:
        children = Children(logdir)
        try:
            if plan.upstreams:
                results = asyncio.run(_run_interleaved(plan, children))
            else:
                results = [asyncio.run(_run_mode(plan, mode, children)) for mode in plan.modes]
            return paired([summarize(result) for result in results])
        finally:
            children.close()
