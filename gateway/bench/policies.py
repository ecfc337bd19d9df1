"""The best hedging policies for the conversations workload: the limit a run is judged against.

Pure: plain numbers in, plain numbers out. The bench's simulators draw each request's time to
first token as it arrives, so no two modes of a run see the same draws and a measured row
cannot be replayed under another policy. This module simulates the workload instead, with the
simulators' own model (a lognormal base, a share of stragglers, prefill per uncached token,
a prefix cache per backend that even a cancelled copy fills, as a real server's does) and one
set of seeded draws per (conversation, turn, backend), the same for every policy:

- `no hedge`: every turn on its conversation's home backend (the sticky client);
- `one delay`: one hedge delay for every request, the copy to another backend at random;
- `delay per class`: a delay per size class of the request's uncached input (log2 buckets, as
  `gateway.hedge.prefill.size_class`), the copy to another backend at random;
- `per class, key order`: per class, the copy to the next backend of the conversation's order,
  so that repeated copies of one conversation find their history where the last copy left it.

Each policy's delays are the best ones in hindsight: those whose copies number at most
`budget` of the requests and resend at most `budget` of all the input tokens (the gateway's
budget counts both) and give the lowest TTFT p99 of each size of new message,
taken together (the mean of each size's p99 over its p99 without hedging: the overall p99 of
this workload is the long turns' normal prefill, which no hedge can shorten, so it alone
would not tell policies apart). One delay is searched over a grid; delays per class by
coordinate descent over the same grid (each class in turn set to its best delay, or no
hedge, until nothing improves). The gateway's measured
rows are then compared with the best: the distance left to close. Like the single-hedge oracle
of the stragglers workloads, this knows the draws in hindsight and ignores what a real gateway
adds, so it is a bound, not a target to beat.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.hedge.prefill import new_tokens, size_class

#: the extra input the policies may resend, as a share of all input (the workload's goal)
BUDGET = 0.12
#: candidate delays: log-spaced seconds, 50 ms to about 10 s (and no hedge)
GRID = tuple(0.05 * 1.07**k for k in range(80))
INF = math.inf


@dataclass(frozen=True, slots=True)
class Model:
    """The simulated backends (the conversations workload's simulator profile)."""

    ttft_median: float = 0.150
    ttft_sigma: float = 0.25
    straggler_probability: float = 0.03
    straggler_extra: float = 1.5
    prefill_per_token: float = 60e-6
    backends: int = 3
    answer_tokens: int = 30
    system_tokens: int = 1000


@dataclass(frozen=True, slots=True)
class Conversation:
    number: int
    size: int
    turns: int


@dataclass(slots=True)
class Draws:
    """One base TTFT per (conversation, turn, backend), stragglers included, seeded."""

    model: Model
    seed: int
    _cache: dict[tuple[int, int, int], float] = field(default_factory=dict)

    def base(self, conversation: int, turn: int, backend: int) -> float:
        key = (conversation, turn, backend)
        value = self._cache.get(key)
        if value is None:
            digest = hashlib.blake2b(f"{self.seed}:{key}".encode(), digest_size=8).digest()
            rng = random.Random(int.from_bytes(digest, "big"))
            m = self.model
            value = m.ttft_median * math.exp(m.ttft_sigma * rng.gauss(0.0, 1.0))
            if rng.random() < m.straggler_probability:
                value += m.straggler_extra
            self._cache[key] = value
        return value


def order_of(conversation: int, backends: int) -> list[int]:
    """The conversation's backend order: its home (as the sticky client hashes it) first."""
    digest = hashlib.blake2b(f"conversation-{conversation}".encode(), digest_size=8).digest()
    home = int.from_bytes(digest, "big") % backends
    rest = sorted((b for b in range(backends) if b != home),
                  key=lambda b: hashlib.blake2b(f"{conversation}:{b}".encode(),
                                                digest_size=8).digest())
    return [home, *rest]


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: int
    index: int
    size: int
    #: prompt tokens, and of those new since the last turn (the class's input at home)
    prompt: int
    new: int


def turns_of(conversations: Sequence[Conversation], model: Model) -> list[Turn]:
    out = []
    for c in conversations:
        previous: int | None = None
        for t in range(c.turns):
            prompt = model.system_tokens + (t + 1) * c.size + t * model.answer_tokens
            out.append(Turn(c.number, t, c.size, prompt, new_tokens(prompt, previous)))
            previous = prompt
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    ttfts: tuple[float, ...]
    sizes: tuple[int, ...]
    input_tokens: int
    extra_tokens: int
    hedges: int
    won: int

    def quantile(self, q: float, size: int | None = None) -> float:
        values = sorted(t for t, s in zip(self.ttfts, self.sizes, strict=True)
                        if size is None or s == size)
        return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]

    @property
    def extra_share(self) -> float:
        return self.extra_tokens / self.input_tokens if self.input_tokens else 0.0


Target = Callable[[Turn, list[int]], int]


def simulate(turns: Sequence[Turn], draws: Draws, delay_of: Callable[[Turn], float],
             target: Target) -> Outcome:
    """Every turn on its home; a copy after `delay_of(turn)` to `target(turn, order)` when the
    home has not answered by then. Each backend's cache holds, per conversation, the longest
    prompt it was sent (the system prompt is taken as cached everywhere)."""
    m = draws.model
    held: dict[tuple[int, int], int] = {}
    ttfts, sizes = [], []
    extra = hedges = won = inputs = 0
    for turn in turns:
        order = order_of(turn.conversation, m.backends)
        home = order[0]

        def at(backend: int, turn: Turn = turn) -> float:
            cached = max(held.get((turn.conversation, backend), 0), m.system_tokens)
            uncached = max(0, turn.prompt - cached)
            return draws.base(turn.conversation, turn.index, backend) + \
                m.prefill_per_token * uncached

        primary = at(home)
        result = primary
        delay = delay_of(turn)
        if delay < primary:
            other = target(turn, order)
            copy = delay + at(other)
            hedges += 1
            extra += turn.prompt
            if copy < primary:
                won += 1
                result = copy
            held[(turn.conversation, other)] = turn.prompt
        held[(turn.conversation, home)] = turn.prompt
        inputs += turn.prompt
        ttfts.append(result)
        sizes.append(turn.size)
    return Outcome(tuple(ttfts), tuple(sizes), inputs, extra, hedges, won)


def random_other(seed: int) -> Target:
    def pick(turn: Turn, order: list[int]) -> int:
        digest = hashlib.blake2b(f"{seed}:{turn.conversation}:{turn.index}:other".encode(),
                                 digest_size=8).digest()
        return order[1 + int.from_bytes(digest, "big") % (len(order) - 1)]

    return pick


def next_in_order(turn: Turn, order: list[int]) -> int:
    return order[1]


@dataclass(frozen=True, slots=True)
class Objective:
    """Lower is better: the mean over sizes of each size's p99 against its p99 without
    hedging, then the extra input; over the budget (in hedges or in input), never chosen."""

    plain: Mapping[int, float]
    budget: float

    def __call__(self, outcome: Outcome) -> tuple[float, float]:
        if outcome.extra_share > self.budget + 1e-12 or \
                outcome.hedges > self.budget * len(outcome.ttfts) + 1e-9:
            return (INF, INF)
        ratios = [outcome.quantile(0.99, s) / p for s, p in self.plain.items()]
        return (sum(ratios) / len(ratios), outcome.extra_share)

    @classmethod
    def of(cls, plain: Outcome, budget: float) -> Objective:
        return cls({s: plain.quantile(0.99, s) for s in sorted(set(plain.sizes))}, budget)


def best_one_delay(turns: Sequence[Turn], draws: Draws, target: Target,
                   objective: Objective) -> tuple[float, Outcome]:
    best = (INF, simulate(turns, draws, lambda _: INF, target))
    best_score = objective(best[1])
    for d in GRID:
        outcome = simulate(turns, draws, lambda _, d=d: d, target)  # type: ignore[misc]
        score = objective(outcome)
        if score < best_score:
            best, best_score = (d, outcome), score
    return best


def best_per_class(turns: Sequence[Turn], draws: Draws, target: Target,
                   objective: Objective, rounds: int = 4) -> tuple[dict[int, float], Outcome]:
    """Coordinate descent over per-class delays (candidates: the grid, and no hedge)."""
    delays = {size_class(t.new): INF for t in turns}

    def run(current: Mapping[int, float]) -> Outcome:
        return simulate(turns, draws, lambda t: current[size_class(t.new)], target)

    best = run(delays)
    best_score = objective(best)
    for _ in range(rounds):
        moved = False
        for c in sorted(delays):
            for d in (*GRID, INF):
                if d == delays[c]:
                    continue
                trial = {**delays, c: d}
                outcome = run(trial)
                score = objective(outcome)
                if score < best_score:
                    delays, best, best_score, moved = trial, outcome, score, True
        if not moved:
            break
    return delays, best


def best_policies(conversations: Sequence[Conversation], *, seed: int, model: Model = Model(),
                  budget: float = BUDGET) -> list[dict[str, Any]]:
    """One row per policy: TTFT p50/p99 overall and per size, extra input share, hedges."""
    turns = turns_of(conversations, model)
    draws = Draws(model, seed)
    other = random_other(seed)
    plain = simulate(turns, draws, lambda _: INF, other)
    objective = Objective.of(plain, budget)
    rows: list[tuple[str, Outcome, Any]] = [("no hedge", plain, None)]
    d, outcome = best_one_delay(turns, draws, other, objective)
    rows.append(("one delay", outcome, None if d == INF else round(d * 1000)))
    delays, outcome = best_per_class(turns, draws, other, objective)
    rows.append(("delay per class", outcome, _ms(delays)))
    delays, outcome = best_per_class(turns, draws, next_in_order, objective)
    rows.append(("per class, key order", outcome, _ms(delays)))
    sizes = sorted({c.size for c in conversations})
    return [{
        "policy": name,
        "score": round(objective(o)[0], 4),
        "ttft_p50_ms": o.quantile(0.5) * 1000, "ttft_p99_ms": o.quantile(0.99) * 1000,
        "classes": {str(s): {"ttft_p50_ms": o.quantile(0.5, s) * 1000,
                             "ttft_p99_ms": o.quantile(0.99, s) * 1000} for s in sizes},
        "extra_input_share": o.extra_share, "hedges": o.hedges, "hedges_won": o.won,
        "delays_ms": delays_ms,
    } for name, o, delays_ms in rows]


def _ms(delays: Mapping[int, float]) -> dict[str, int | None]:
    return {str(2**c): None if d == INF else round(d * 1000) for c, d in sorted(delays.items())}


def format_policies(rows: Sequence[Mapping[str, Any]], measured: Mapping[str, Any] | None = None,
                    anchor: Mapping[str, Any] | None = None) -> str:
    """The policy table, then the distance left: per size, the p99 the measured hedging-on row
    (`measured`) reached against the sticky client of the same run (`anchor`), beside what
    the best simulated policy reached against no hedge over the same draws. Ratios of ratios,
    because the simulation's draws are not the run's: a size whose draws hold no straggler
    has nothing to cut in one and one to cut in the other."""
    sizes = list(rows[0]["classes"]) if rows else []
    head = (f"{'policy (simulated)':<22} {'p50 ms':>7} {'p99 ms':>7} "
            + " ".join(f"{'p99 ' + s:>10}" for s in sizes) + f" {'extra':>6} {'hedges':>6}")
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = " ".join(f"{row['classes'][s]['ttft_p99_ms']:>10,.0f}" for s in sizes)
        lines.append(f"{row['policy']:<22} {row['ttft_p50_ms']:>7,.0f} "
                     f"{row['ttft_p99_ms']:>7,.0f} {cells} "
                     f"{100 * row['extra_input_share']:>5.1f}% {row['hedges']:>6}")
    if measured is None or anchor is None or not rows:
        return "\n".join(lines)
    best, plain = min(rows, key=lambda r: r["score"]), rows[0]
    lines += ["", f"p99 against no hedging: hedging-on / sticky (measured, this run) and "
                  f"{best['policy']} / no hedge (simulated)"]
    pairs = [("all", measured.get("ttft_p99_ms"), anchor.get("ttft_p99_ms"),
              best["ttft_p99_ms"], plain["ttft_p99_ms"])]
    for s in sizes:
        pairs.append((f"{int(s):,}", (measured.get("classes", {}).get(s) or {}).get("ttft_p99_ms"),
                      (anchor.get("classes", {}).get(s) or {}).get("ttft_p99_ms"),
                      best["classes"][s]["ttft_p99_ms"], plain["classes"][s]["ttft_p99_ms"]))
    for label, got, ref, sim, sim_ref in pairs:
        if got is None or not ref:
            continue
        lines.append(f"  {label:>7}: measured {got / ref:.2f} x, best simulated "
                     f"{sim / sim_ref:.2f} x")
    return "\n".join(lines)
