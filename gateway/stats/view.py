"""The JSON views of `gateway.stats` behind `GET /hedge/stats`. Pure.

Counting (`Stats.record`) and reading are separate jobs: this module only turns the counters,
sketches and live pool state into the documented JSON shape, at a given `now`; it never
changes what it reads.

`GET /hedge/stats` fields. Times in ms, rates 0..1, `null` when undefined (a rate with no
denominator, a quantile with no data). `<scope>` is `lifetime` or `window` (same fields).

Top level: `window_s` (length of the recent window), `uptime_s` (since the stats started),
`internal_errors` (exceptions of ours on the request path, wherever they were raised, each
answered with a 500 in the route's shape), `config` (the configuration in force, below),
`pools.<pool>` (one entry per configured pool), `keys.<name>` (one entry per named key that
sent a request with a TTFT objective, lifetime: `objectives_met`, `objectives_missed`,
`deadline_hedges` sent early for an objective, `deadline_refused` by the key's own share):

| field under `config.` | meaning |
|---|---|
| `loaded_at` | when the configuration in force was loaded (ISO 8601, UTC) |
| `loaded_s_ago` | seconds since then |
| `sha256` | checksum of the file's bytes (`source: file`) or of the embedded default |
| `source` | `file` (`serve --config`) or `embedded` |
| `generation` | 1 at start, +1 per successful reload (SIGHUP) |
| `failed_reloads` | reloads refused because the new file was invalid |


| field under `pools.<pool>.` | meaning |
|---|---|
| `inflight_requests` | logical requests of the pool in flight now |
| `budget.tokens` | hedge budget tokens available now; each extra attempt costs 1 |
| `budget.ratio` / `.burst` / `.min_per_second` | configured deposit, bucket size, reserve |
| `budget.input_tokens` | input tokens available now (null: the budget counts attempts only) |
| `budget.burst_input_tokens` | the input-token bucket's size (null: not counted) |
| `budget.extra_in_flight` | extra attempts (hedges, failovers) running now |
| `budget.ineffective` | efficacy guard on: hedges held to the probe rate |
| `budget.recent_win_rate` | win rate over the guard's window of recent hedges |
| `<scope>.requests` | logical requests that ended, whatever the outcome |
| `<scope>.attempts` | attempts those requests started, primaries included |
| `<scope>.attempts_per_request.mean` / `.max` | attempts per logical request |
| `<scope>.hedges.started` | delay-triggered hedges started |
| `<scope>.hedges.issue_rate` | hedges.started / requests |
| `<scope>.hedges.won` | requests whose winning stream came from a hedge |
| `<scope>.hedges.win_rate` | hedges.won / hedges.started |
| `<scope>.hedges.suppressed.<reason>` | hedges or failovers not started, by `SuppressReason` |
| `<scope>.failovers` / `.failovers_won` | replacements after a failure; those that won |
| `<scope>.ttft_ms.p50/p90/p95/p99` / `.count` | client-observed TTFT: arrival to commit |
| `<scope>.losers.cancelled` | attempts cancelled because another attempt won |
| `<scope>.losers.cancelled_before_first_token` | share of those without a token yet |
| `<scope>.losers.close_ms.p50/p99` / `.count` | cancel to upstream closed, per loser |
| `<scope>.losers.events_received_after_commit` | events losers read after commit (want 0) |
| `<scope>.cancelled` | attempts cancelled as the request ended without a winner |
| `<scope>.latency_saved_ms.p50/p99` / `.count` | hedge won: primary's tokenless time at commit |
| `<scope>.errors.<class>` | requests that did not end cleanly, by `request_class` |
| `<scope>.panic` | requests whose backend choice ran in panic mode (too few healthy backends) |
| `<scope>.affinity` | `hits`: primary first in its key's order; `spills`: a later one; `misses` |
| `<scope>.headroom_skips` | backends left out of a choice for low quota headroom, once per choice |
| `<scope>.empty_answers` | requests answered by a stream that ended normally without a token |
| `<scope>.continuations.started` / `.won` | continuations started; those that won |
| `<scope>.continuations.stalls` | streams without a token for their stall delay |
| `<scope>.continuations.breaks_continued` | streams that broke after commit, continued |
| `<scope>.continuations.breaks_ended` | the same, ended with the in-band error |
| `<scope>.continuations.refused.<reason>` | continuations not started, by reason |
| `<scope>.continuations.input_tokens` | input tokens the continuations resent (as priced) |
| `<scope>.refused_no_backend` | requests refused untried: no backend could take them (503) |
| `<scope>.routes.<route>` | requests per route (`chat/completions`, `responses`, `messages`, ...) |
| `<scope>.translated.<name>` | requests a backend of another API answered (`chat->messages`) |
| `<scope>.tokens.input` / `.output` | tokens the winning attempts reported (`usage`) |
| `<scope>.tokens.cached` | of the input, read from the upstreams' prompt caches (as reported) |
| `<scope>.tokens.cache_write` | of the input, written to a prompt cache (Anthropic's creation) |
| `<scope>.tokens.cache_hit_rate` | cached / input, over requests whose upstream reports a cache |
| `<scope>.tokens.hedge_input` | hedge cost: input tokens again per extra attempt that got sent |
| `<scope>.tokens.hedge_input_miss` | of the hedge cost, tokens that were cache misses where sent |
| `<scope>.tokens.hedge_input_miss_share` | hedge_input_miss / hedge_input |
| `<scope>.affinity.hit_rate` | hits / (hits + spills + misses) |
| `<scope>.spend.usd` | what the requests cost at their backends' `price`, losers included |
| `<scope>.spend.keys.<name>` | of that, each named client key's (`keys:`) |

| field under `pools.<pool>.backends.<backend>.` | meaning |
|---|---|
| `state` / `reason` | `ok`, `ejected`, `paused` or `low` (quota headroom), and why (null when ok) |
| `seconds_left` | until the pause, cool-down or low mark ends (0: awaiting its probe; null: ok) |
| `headroom` | least share of a quota left, as its latest rate-limit headers said (null: unknown) |
| `headroom_resource` | which quota that is: `requests`, `tokens`, `input-tokens`, `output-tokens` |
| `group` / `inflight` | the configured group; attempts running there now |
| `hedge_delay_ms` | hedge delay in force for requests whose primary is here |
| `hedge_delay_mode` | `adaptive` (TTFT quantile), `initial` (too few samples), `fixed` |
| `hedge_delay_quantile` | the TTFT quantile the delay follows (null in `fixed` mode) |
| `hedge_delay_rule` | `auto` (quantile from the budget ratio), `pinned` (configured), `fixed` |
| `hedge_delay_by_class_ms` | streams: delay per learnt size class, by its lower bound in tokens |
| `prefill_ms_per_1k` | the fitted prefill rate, ms per 1,000 uncached tokens (null: not fitted) |
| `<scope>.attempts` | attempts sent to the backend |
| `<scope>.primaries` / `.hedges` / `.failovers` | the same, by kind |
| `<scope>.won` / `.lost` / `.failed` / `.cancelled` | the same, by outcome |
| `<scope>.hedges_won` | hedges on this backend that won |
| `<scope>.headroom_skips` | choices that left it out for low quota headroom |
| `<scope>.continuations.started` / `.won` | continuations sent to it; those that won |
| `<scope>.continuations.stalls` | its streams that stalled after commit |
| `<scope>.continuations.breaks_continued` | its streams that broke, continued elsewhere |
| `<scope>.continuations.breaks_ended` | its streams that broke, ended with an error |
| `<scope>.ttft_ms.p50/p90/p95/p99` / `.count` | attempt TTFT (own start), attempts with a token |
| `<scope>.ttft_censored` | attempts cancelled before a token; kept out of `ttft_ms` |
| `<scope>.failures.<code>` | failed attempts by failure code (`unavailable`, ...) |
| `<scope>.tokens.input` / `.output` | tokens reported by the requests this backend won |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.errors import NoBackendAvailable
from gateway.hedge.budget import SuppressReason
from gateway.hedge.prefill import class_label
from gateway.stats.record import KEY_SPEND, ROUTES
from gateway.tenants.spend import MICRO
from gateway.wire.translate.routes import TRANSLATION_NAMES

if TYPE_CHECKING:
    from gateway.hedge.generation import Live
    from gateway.hedge.pool import PoolRuntime
    from gateway.stats.record import BackendStats, PoolStats, Stats

QUANTILES = (0.5, 0.9, 0.95, 0.99)
#: a named key's counters in `keys`
KEY_FIELDS = ("objectives_met", "objectives_missed", "deadline_hedges", "deadline_refused")
SCOPES = ("lifetime", "window")


def snapshot(
    stats: Stats, pools: Mapping[str, PoolRuntime], now: float, *, live: Live | None = None
) -> dict[str, Any]:
    """The `/hedge/stats` document (fields in the module docstring): the counts of `stats` plus
    live state (budget, balancer, hedge delays) read from `pools` at `now`, and the
    configuration in force when `live` is given."""
    config = None if live is None else config_view(live, now)
    return document(stats, live_view(pools, now), now, config=config)


def live_view(pools: Mapping[str, PoolRuntime], now: float) -> dict[str, dict[str, Any]]:
    """The live state of each pool at `now` as plain data: `inflight_requests`, `budget`, and
    per backend the live fields of the backend table (state, delay, in flight)."""
    return {
        name: {
            "inflight_requests": runtime.inflight_requests,
            "budget": budget_view(runtime, now),
            "backends": {b.name: backend_live(runtime, b.name, now)
                         for b in runtime.settings.backends},
        }
        for name, runtime in pools.items()
    }


def document(stats: Stats, state: Mapping[str, Mapping[str, Any]], now: float, *,
             config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `/hedge/stats` document from counts and already-read live state (`live_view`, or
    the merge of several processes' live states) and the `config` section, if any."""
    out: dict[str, Any] = {}
    for name, ps in stats.pools.items():
        pool_state = state.get(name)
        entry: dict[str, Any] = {}
        if pool_state is not None:
            entry["inflight_requests"] = pool_state["inflight_requests"]
            entry["budget"] = pool_state["budget"]
        for scope in SCOPES:
            entry[scope] = pool_view(ps, scope, now, stats.error_classes)
        backends = {} if pool_state is None else pool_state["backends"]
        entry["backends"] = {
            b: backend_view(bs, backends.get(b), now) for b, bs in ps.backends.items()
        }
        out[name] = entry
    doc: dict[str, Any] = {
        "window_s": stats.window,
        "uptime_s": round(max(0.0, now - stats.started), 3),
        "internal_errors": stats.internal_errors,
    }
    if config is not None:
        doc["config"] = dict(config)
    doc["pools"] = out
    doc["keys"] = {name: key_view(counts) for name, counts in sorted(stats.keys.items())}
    return doc


def key_view(counts: Mapping[str, int]) -> dict[str, int]:
    """One named key's deadline counters (`Stats.keys`), every field present."""
    return {field: counts.get(field, 0) for field in KEY_FIELDS}


def config_view(live: Live, now: float) -> dict[str, Any]:
    """When the configuration in force was loaded, its checksum, and the reload counts."""
    origin = live.current.origin
    return {
        "loaded_at": origin.loaded_wall,
        "loaded_s_ago": round(max(0.0, now - origin.loaded_at), 3),
        "sha256": origin.sha256,
        "source": origin.source,
        "generation": live.current.number,
        "failed_reloads": live.failed_reloads,
    }


def _rate(num: float, den: float) -> float | None:
    return None if den <= 0 else round(num / den, 4)


def budget_view(runtime: PoolRuntime, now: float) -> dict[str, Any]:
    budget = runtime.budget
    settings = budget.settings
    priced = settings.input_tokens
    return {
        "tokens": round(budget.tokens(now), 3),
        "ratio": settings.ratio,
        "burst": settings.burst,
        "min_per_second": settings.min_per_second,
        "input_tokens": round(budget.input_tokens(now)) if priced else None,
        "burst_input_tokens": settings.burst_input_tokens if priced else None,
        "extra_in_flight": budget.extra_in_flight,
        "ineffective": budget.ineffective(now),
        "recent_win_rate": budget.win_rate(),
    }


def pool_view(ps: PoolStats, scope: str, now: float, known: frozenset[str]) -> dict[str, Any]:
    c = ps.counts.view(scope, now)
    requests, attempts, hedges = c["requests"], c["attempts"], c["hedges"]
    sizes = [int(k[9:]) for k, v in c.items() if k.startswith("attempts=") and v > 0]
    close = ps.close.view_ms(scope, (0.5, 0.99), now)
    saved = ps.saved.view_ms(scope, (0.5, 0.99), now)
    return {
        "requests": requests,
        "attempts": attempts,
        "attempts_per_request": {
            "mean": _rate(attempts, requests),
            "max": max(sizes, default=None),
        },
        "hedges": {
            "started": hedges,
            "issue_rate": _rate(hedges, requests),
            "won": c["hedges_won"],
            "win_rate": _rate(c["hedges_won"], hedges),
            "suppressed": {r.value: c[f"suppressed.{r.value}"] for r in SuppressReason},
        },
        "failovers": c["failovers"],
        "failovers_won": c["failovers_won"],
        "ttft_ms": ps.client_ttft.view_ms(scope, QUANTILES, now),
        "losers": {
            "cancelled": c["losers"],
            "cancelled_before_first_token": _rate(c["losers_before_token"], c["losers"]),
            "close_ms": {"p50": close["p50"], "p99": close["p99"], "count": close["count"]},
            "events_received_after_commit": c["late_events"],
        },
        "cancelled": c["cancelled"],
        "routes": {route: c[f"route.{route}"] for route in ROUTES},
        "translated": {name: c[f"translated.{name}"] for name in TRANSLATION_NAMES},
        "latency_saved_ms": saved,
        "errors": {
            k[8:]: v for k, v in sorted(c.items())
            if k.startswith("outcome.") and k != "outcome.ok" and v > 0
        },
        "panic": c["panic"],
        "affinity": {"hits": c["affinity.hit"], "spills": c["affinity.spill"],
                     "misses": c["affinity.miss"],
                     "hit_rate": _rate(c["affinity.hit"], c["affinity.hit"]
                                       + c["affinity.spill"] + c["affinity.miss"])},
        "empty_answers": c["empty_answers"],
        "headroom_skips": c["headroom_skips"],
        "continuations": {
            **_continuations(c),
            "input_tokens": c["continuations.input_tokens"],
            "refused": {k[len(_REFUSED):]: v for k, v in sorted(c.items())
                        if k.startswith(_REFUSED) and v > 0},
        },
        "refused_no_backend": c[f"outcome.{NoBackendAvailable.code}"],
        "tokens": {
            "input": c["tokens.input"],
            "output": c["tokens.output"],
            "cached": c["tokens.cached"],
            "cache_write": c["tokens.cache_write"],
            "cache_hit_rate": _rate(c["tokens.cached"], c["tokens.input_cache_reported"]),
            "hedge_input": c["tokens.hedge_input"],
            "hedge_input_miss": c["tokens.hedge_input_miss"],
            "hedge_input_miss_share": _rate(c["tokens.hedge_input_miss"],
                                            c["tokens.hedge_input"]),
        },
        "spend": {
            "usd": c["spend.micro_usd"] / MICRO,
            "keys": {k[len(KEY_SPEND):]: v / MICRO for k, v in sorted(c.items())
                     if k.startswith(KEY_SPEND)},
        },
    }


_REFUSED = "continuations.refused."


def _continuations(c: Mapping[str, int]) -> dict[str, int]:
    """After commit: stalls seen, continuations started and won, breaks continued or ended
    with the in-band error."""
    return {"started": c["continuations.started"], "won": c["continuations.won"],
            "stalls": c["stalls"], "breaks_continued": c["breaks.continued"],
            "breaks_ended": c["breaks.ended"]}


def backend_live(runtime: PoolRuntime, name: str, now: float) -> dict[str, Any]:
    """A backend's live fields: state and why, time left, group, in flight, hedge delay."""
    state, reason = runtime.balancer.state(name, now)
    left = runtime.balancer.seconds_left(name, now)
    headroom = runtime.balancer.headroom(name, now)
    delay = runtime.delays[name]
    fixed = delay.settings.mode == "fixed"
    if fixed:
        mode = rule = "fixed"
    else:
        mode = "adaptive" if delay.adaptive(now) else "initial"
        rule = "auto" if delay.settings.quantile == "auto" else "pinned"
    return {
        "state": state,
        "reason": reason,
        "seconds_left": None if left is None else round(left, 3),
        "headroom": None if headroom is None else round(headroom[0], 4),
        "headroom_resource": None if headroom is None else headroom[1],
        "group": runtime.groups.get(name, ""),
        "inflight": runtime.balancer.inflight(name),
        "hedge_delay_ms": round(delay.delay(now) * 1000, 3),
        "hedge_delay_mode": mode,
        "hedge_delay_quantile": None if fixed else round(delay.quantile, 4),
        "hedge_delay_rule": rule,
        **class_view(runtime, name, now),
    }


def class_view(runtime: PoolRuntime, name: str, now: float) -> dict[str, Any]:
    """A backend's delays per size class (those learnt) and its fitted prefill rate."""
    classes = runtime.classes.get(name)
    if classes is None:
        return {"hedge_delay_by_class_ms": {}, "prefill_ms_per_1k": None}
    return {
        "hedge_delay_by_class_ms": {class_label(c): round(d.delay(now) * 1000, 3)
                                    for c, d in classes.learnt(now).items()},
        "prefill_ms_per_1k": None if classes.fit is None else round(classes.fit.ms_per_1k, 3),
    }


def backend_view(bs: BackendStats, live: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {} if live is None else dict(live)
    for scope in SCOPES:
        c = bs.counts.view(scope, now)
        out[scope] = {
            "attempts": c["attempts"],
            "primaries": c["kind.primary"],
            "hedges": c["kind.hedge"],
            "failovers": c["kind.failover"],
            "won": c["outcome.won"],
            "lost": c["outcome.lost"],
            "failed": c["outcome.failed"],
            "cancelled": c["outcome.cancelled"],
            "hedges_won": c["hedges_won"],
            "headroom_skips": c["headroom_skips"],
            "continuations": _continuations(c),
            "ttft_ms": bs.ttft.view_ms(scope, QUANTILES, now),
            "ttft_censored": c["ttft_censored"],
            "failures": {
                k[8:]: v for k, v in sorted(c.items()) if k.startswith("failure.") and v > 0
            },
            "tokens": {"input": c["tokens.input"], "output": c["tokens.output"]},
        }
    return out
