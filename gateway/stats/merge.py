"""The whole server from several processes: a mergeable export, the merge, the document. Pure.

Under `serve --workers N` every worker counts its own requests, and across machines every
replica does. To show them as one server, each process *exports* its stats in a form
that adds up exactly: counters as plain counts (lifetime, and the recent window as it stood at
export time), latency series as DDSketch bins (`gateway.hedge.latency.state_of`: the bins of two
sketches of one accuracy add up to the sketch of the union, so merged quantiles are as exact as
one process's), Prometheus histograms as bucket counts, and live state (budget, in flight,
backend states and delays) listed per worker, since those are not counts.

`merge` takes exports and gives an export (so a merged server merges again with other replicas,
which `hedge-gateway stats URL URL` does), and `document` turns an export into the same
`/hedge/stats` JSON a single process serves (`gateway.stats.view`), plus:

- `workers[]`: the processes merged: `worker` (index), `pid`, `age_s` (how old its numbers
  are), `config` (its configuration in force), and `replica` (its URL) when merged from
  several replicas;
- `pools.<pool>.workers[]`: per process, `requests` (lifetime), `inflight_requests`,
  `budget`, and per backend its live fields;

and `races`, the last races of the processes (`gateway.stats.races`: the newest 50 of them all,
each marked with its process; served by `/hedge/races`, not part of the document);

and the pool's live fields summed or combined over the processes: `inflight_requests`,
`budget.tokens`, `.burst`, `.min_per_second`, `.extra_in_flight` summed (the host's bucket);
`budget.ineffective` true if any process's guard is on; `budget.recent_win_rate` the mean of the
processes'; per backend `inflight` summed, `state`/`reason`/`seconds_left` of the worst process
(`ejected` over `paused` over `low` over `ok`), `headroom` the least any process saw (with its
`headroom_resource`), `hedge_delay_ms` and `hedge_delay_quantile` the largest,
`hedge_delay_mode` and `hedge_delay_rule` the common one or `mixed`, `hedge_delay_by_class_ms`
the largest per class, `prefill_ms_per_1k` the largest; `budget.input_tokens` and
`.burst_input_tokens` summed. `config` is the first
process's (the worker that answered); each process's own is in its `workers[]` entry.

Exports may come from other machines (`stats URL URL`): anything malformed raises ValueError.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from gateway.hedge.latency import merge_states
from gateway.stats.races import merge_races
from gateway.stats.record import Latency, Stats
from gateway.stats.view import document as view_document

FORMAT = "hedge-gateway-stats/1"
#: the latency series of a pool, by export key and `PoolStats` attribute
POOL_SERIES = {"client_ttft": "client_ttft", "latency_saved": "saved", "loser_close": "close"}
#: the order of badness of backend states, for the merged state
_STATE_RANK = {"ok": 0, "low": 1, "paused": 2, "ejected": 3}


# -- export -----------------------------------------------------------------------------------


def _latency(series: Latency, now: float) -> dict[str, Any]:
    h = series.histogram
    return {
        "lifetime": series.lifetime.state(),
        "window": series.recent.state(now),
        "histogram": {"bounds": list(h.bounds), "counts": list(h.counts), "sum": h.sum},
    }


def export(stats: Stats, live: Mapping[str, Mapping[str, Any]], now: float,
           worker: Mapping[str, Any]) -> dict[str, Any]:
    """One process's stats in mergeable form; `live` is its `view.live_view`, `worker` what
    identifies the process (`{"worker": index, "pid": pid}`)."""
    pools: dict[str, Any] = {}
    for name, ps in stats.pools.items():
        entry: dict[str, Any] = {
            "lifetime": dict(ps.counts.lifetime),
            "window": dict(ps.counts.recent.total(now)),
        }
        for key, attr in POOL_SERIES.items():
            entry[key] = _latency(getattr(ps, attr), now)
        entry["backends"] = {
            b: {"lifetime": dict(bs.counts.lifetime), "window": dict(bs.counts.recent.total(now)),
                "ttft": _latency(bs.ttft, now)}
            for b, bs in ps.backends.items()
        }
        pools[name] = entry
    own = {
        pool: {"requests": stats.pools[pool].counts.lifetime["requests"], **state}
        for pool, state in live.items() if pool in stats.pools
    }
    return {
        "format": FORMAT,
        "window_s": stats.window,
        "uptime_s": max(0.0, now - stats.started),
        "pools": pools,
        "internal_errors": stats.internal_errors,
        "keys": {name: dict(counts) for name, counts in stats.keys.items()},
        "workers": [{**worker, "age_s": 0.0, "pools": own}],
        "races": stats.races.export(worker),
    }


# -- merge ------------------------------------------------------------------------------------


def _counts(value: Any) -> Counter[str]:
    if not isinstance(value, Mapping):
        raise ValueError("counts must be a mapping")
    out: Counter[str] = Counter()
    for key, n in value.items():
        if not isinstance(key, str) or isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"count {key!r}: {n!r} is not a count")
        out[key] = n
    return out


def _add_counts(into: dict[str, Any], key: str, other: Any) -> None:
    total = _counts(into.get(key, {}))
    total.update(_counts(other))
    into[key] = dict(total)


def _merge_latency(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> dict[str, Any]:
    hb = b["histogram"]
    counts, bounds, total = list(hb["counts"]), list(hb["bounds"]), float(hb["sum"])
    if len(counts) != len(bounds) + 1 or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) \
            or not math.isfinite(total):
        raise ValueError("malformed histogram")
    if a is None:
        return {"lifetime": merge_states([b["lifetime"]]), "window": merge_states([b["window"]]),
                "histogram": {"bounds": bounds, "counts": counts, "sum": total}}
    ha = a["histogram"]
    if ha["bounds"] != bounds:
        raise ValueError("histograms with different buckets cannot be merged")
    return {
        "lifetime": merge_states([a["lifetime"], b["lifetime"]]),
        "window": merge_states([a["window"], b["window"]]),
        "histogram": {"bounds": bounds,
                      "counts": [x + y for x, y in zip(ha["counts"], counts, strict=True)],
                      "sum": ha["sum"] + total},
    }


def _merge_pool(into: dict[str, Any], pool: Mapping[str, Any]) -> None:
    for scope in ("lifetime", "window"):
        _add_counts(into, scope, pool[scope])
    for key in POOL_SERIES:
        into[key] = _merge_latency(into.get(key), pool[key])
    backends = into.setdefault("backends", {})
    for name, b in pool["backends"].items():
        target = backends.setdefault(str(name), {})
        for scope in ("lifetime", "window"):
            _add_counts(target, scope, b[scope])
        target["ttft"] = _merge_latency(target.get("ttft"), b["ttft"])


def merge(exports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The export of the union of several processes' exports (associative: a merged export
    merges again). Pools and backends are the union of theirs; ValueError if an export is not
    one (another format, another window length, a malformed part)."""
    if not exports:
        raise ValueError("nothing to merge")
    windows = set()
    pools: dict[str, Any] = {}
    workers: list[Any] = []
    races: list[Any] = []
    uptime = 0.0
    internal_errors = 0
    keys: dict[str, Counter[str]] = {}
    for item in exports:
        if not isinstance(item, Mapping) or item.get("format") != FORMAT:
            raise ValueError(f"not a mergeable stats export (format {FORMAT!r} expected)")
        try:
            windows.add(float(item["window_s"]))
            uptime = max(uptime, float(item["uptime_s"]))
            internal_errors += int(item.get("internal_errors", 0))
            for name, counts in item.get("keys", {}).items():
                keys.setdefault(str(name), Counter()).update(
                    {str(k): int(v) for k, v in counts.items()})
            for name, pool in item["pools"].items():
                _merge_pool(pools.setdefault(str(name), {}), pool)
            entries = list(item["workers"])
            races = merge_races([races, item.get("races", [])])
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed stats export: {type(exc).__name__}: {exc}") from exc
        if not all(isinstance(w, Mapping) and isinstance(w.get("pools"), Mapping)
                   for w in entries):
            raise ValueError("malformed stats export: a worker entry without its pools")
        workers.extend(entries)
    if len(windows) != 1:
        raise ValueError(f"exports cover different windows: {sorted(windows)} s")
    return {"format": FORMAT, "window_s": windows.pop(), "uptime_s": uptime, "pools": pools,
            "internal_errors": internal_errors, "workers": workers, "races": races,
            "keys": {name: dict(counts) for name, counts in keys.items()}}


def only_pools(item: Mapping[str, Any], names: Collection[str]) -> dict[str, Any]:
    """An export with only the pools in `names` (the configuration in force): a pool a
    reload removed leaves the whole server as it leaves one process, even when a peer or
    the retired numbers of a dead worker still count it."""
    return {**item, "pools": {n: p for n, p in item["pools"].items() if n in names},
            "workers": [{**w, "pools": {n: p for n, p in w["pools"].items() if n in names}}
                        for w in item["workers"]]}


def lifetime_only(item: Mapping[str, Any]) -> dict[str, Any]:
    """An export reduced to its lifetime numbers, with no process and no race: what a worker
    that died leaves behind, so the server's lifetime counters never go down (a Prometheus
    counter that did would read as a reset and a spike)."""
    out = merge([item])
    for pool in out["pools"].values():
        pool["window"] = {}
        for key in POOL_SERIES:
            pool[key]["window"] = merge_states([])
        for backend in pool["backends"].values():
            backend["window"] = {}
            backend["ttft"]["window"] = merge_states([])
    out["workers"] = []
    out["races"] = []
    return out


# -- the document -----------------------------------------------------------------------------


def _absorb(series: Latency, state: Mapping[str, Any], now: float) -> None:
    series.lifetime.absorb(state["lifetime"])
    series.recent.absorb(state["window"], now)
    h, hist = series.histogram, state["histogram"]
    if tuple(hist["bounds"]) != h.bounds:
        raise ValueError("histogram buckets differ from this version's")
    h.counts = [int(c) for c in hist["counts"]]
    h.count = sum(h.counts)
    h.sum = float(hist["sum"])


def rebuild(item: Mapping[str, Any]) -> tuple[Stats, dict[str, dict[str, Any]], float]:
    """(a `Stats` holding the export's counts, the combined live state, the `now` to read it
    at). The `Stats` runs on a clock of its own: it started at 0, and `now` is the uptime, so
    its window holds exactly the exported window counts."""
    merged = merge([item])  # validates
    now = merged["uptime_s"]
    layout = {pool: list(p["backends"]) for pool, p in merged["pools"].items()}
    stats = Stats(layout, now=0.0, window=merged["window_s"])
    stats.internal_errors = merged["internal_errors"]
    stats.keys = {name: Counter(counts) for name, counts in merged["keys"].items()}
    for name, pool in merged["pools"].items():
        ps = stats.pools[name]
        ps.counts.lifetime.update(pool["lifetime"])
        ps.counts.recent.add(pool["window"], now)
        for key, attr in POOL_SERIES.items():
            _absorb(getattr(ps, attr), pool[key], now)
        for b, bp in pool["backends"].items():
            bs = ps.backends[b]
            bs.counts.lifetime.update(bp["lifetime"])
            bs.counts.recent.add(bp["window"], now)
            _absorb(bs.ttft, bp["ttft"], now)
    return stats, combined_live(merged["workers"]), now


def document(item: Mapping[str, Any]) -> dict[str, Any]:
    """The `/hedge/stats` document of an export (fields: `gateway.stats.view`, plus the
    `workers` lists of this module's docstring)."""
    stats, live, now = rebuild(item)
    workers = item["workers"]
    # the configuration in force where the first export came from (the worker answering);
    # every worker's own is in `workers[]` (a failed reload shows as a different generation)
    config = next((w["config"] for w in workers if w.get("config") is not None), None)
    doc = view_document(stats, live, now, config=config)
    for name, entry in doc["pools"].items():
        entry["workers"] = [
            {**_identity(w), **w["pools"][name]} for w in workers if name in w.get("pools", {})
        ]
    doc["workers"] = [_identity(w) for w in workers]
    return doc


def _identity(worker: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in worker.items() if k != "pools"}


def combined_live(workers: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each pool's live state over the processes (how each field combines: module docstring)."""
    per_pool: dict[str, list[Mapping[str, Any]]] = {}
    for worker in workers:
        for pool, state in worker.get("pools", {}).items():
            per_pool.setdefault(pool, []).append(state)
    return {pool: _combine_pool(states) for pool, states in per_pool.items()}


def _combine_pool(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    budgets = [s["budget"] for s in states]
    rates = [b["recent_win_rate"] for b in budgets if b.get("recent_win_rate") is not None]
    budget = {
        "tokens": round(sum(b["tokens"] for b in budgets), 3),
        "ratio": budgets[0]["ratio"],
        "burst": sum(b["burst"] for b in budgets),
        "min_per_second": sum(b["min_per_second"] for b in budgets),
        "input_tokens": _sum_known(b.get("input_tokens") for b in budgets),
        "burst_input_tokens": _sum_known(b.get("burst_input_tokens") for b in budgets),
        "extra_in_flight": sum(b["extra_in_flight"] for b in budgets),
        "ineffective": any(b["ineffective"] for b in budgets),
        "recent_win_rate": round(sum(rates) / len(rates), 4) if rates else None,
    }
    names: dict[str, list[Mapping[str, Any]]] = {}
    for state in states:
        for name, backend in state["backends"].items():
            names.setdefault(name, []).append(backend)
    return {
        "inflight_requests": sum(s["inflight_requests"] for s in states),
        "budget": budget,
        "backends": {name: _combine_backend(entries) for name, entries in names.items()},
    }


def _combine_backend(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    worst = max(entries, key=lambda e: _STATE_RANK.get(e["state"], 0))
    modes = {e["hedge_delay_mode"] for e in entries}
    rules = {e.get("hedge_delay_rule") for e in entries}
    quantiles = [e["hedge_delay_quantile"] for e in entries
                 if e.get("hedge_delay_quantile") is not None]
    seen = [e for e in entries if e.get("headroom") is not None]
    least = min(seen, key=lambda e: e["headroom"]) if seen else None
    return {
        "state": worst["state"],
        "reason": worst["reason"],
        "seconds_left": worst["seconds_left"],
        "headroom": None if least is None else least["headroom"],
        "headroom_resource": None if least is None else least.get("headroom_resource"),
        "group": worst["group"],
        "inflight": sum(e["inflight"] for e in entries),
        "hedge_delay_ms": max(e["hedge_delay_ms"] for e in entries),
        "hedge_delay_mode": modes.pop() if len(modes) == 1 else "mixed",
        "hedge_delay_quantile": max(quantiles) if quantiles else None,
        "hedge_delay_rule": rules.pop() if len(rules) == 1 else "mixed",
        "hedge_delay_by_class_ms": _largest_per_key(
            e.get("hedge_delay_by_class_ms") or {} for e in entries),
        "prefill_ms_per_1k": _largest_known(e.get("prefill_ms_per_1k") for e in entries),
    }


def _sum_known(values: Iterable[float | None]) -> float | None:
    """The sum of the values given, None when none is (a field every process left null)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _largest_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _largest_per_key(maps: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Per key the largest value any map gives (the latest delay of a class, per process)."""
    out: dict[str, float] = {}
    for values in maps:
        for key, value in values.items():
            out[key] = max(value, out.get(key, value))
    return dict(sorted(out.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))
