"""The features of the request path, each switched from its default through the public
configuration: what `python -m gateway.bench.instructions --variant` counts and `hedge-gateway
bench --features` times, so a feature's cost per request is measured the same way in both.
Data and one pure merge; nothing here starts a process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in, mappings key by key (neither is changed)."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = (merged(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping)
                    else merged({}, value) if isinstance(value, Mapping) else value)
    return out


@dataclass(frozen=True, slots=True)
class Variant:
    """One feature switched from its default, through the public configuration (`top`:
    merged into the document; `pool`: into every pool) or a `serve` flag."""

    name: str
    #: the feature, as the docs' table names it
    feature: str
    #: whether the default has the feature on (this variant then turns it off)
    default_on: bool = True
    top: Mapping[str, Any] = field(default_factory=dict)
    pool: Mapping[str, Any] = field(default_factory=dict)
    serve_args: tuple[str, ...] = ()
    #: each pool's backends speak the other API (the chat pool Messages, the Messages pool
    #: Chat Completions only): every request is translated, both ways
    translated: bool = False
    #: headers every measured request carries (a client key)
    headers: Mapping[str, str] = field(default_factory=dict)
    #: the chat pool's OpenAI-compatible backends continue answers (`continuation:
    #: continue_final_message`): a whole chat request is read upstream as a stream
    continued: bool = False


_OFF: tuple[Variant, ...] = (
    Variant("no-affinity", "conversation keys (affinity)",
            top={"affinity": {"enabled": False}}),
    Variant("no-size-classes", "size classes (delay per size class)",
            pool={"hedging": {"delay": {"by_size": False}}}),
    Variant("no-prefill-fit", "prefill fit (skip_cold)", pool={"hedging": {"skip_cold": False}}),
    Variant("no-input-budget", "input-token budget",
            pool={"hedging": {"budget": {"input_tokens": False}}}),
    Variant("no-headroom", "quota headroom (min_headroom 0)",
            pool={"health": {"min_headroom": 0}}),
    Variant("no-request-log", "request log (serve --log-level warning)",
            serve_args=("--log-level", "warning")),
    Variant("no-hedging", "delay-triggered hedges (hedging.enabled)",
            top={"hedging": {"enabled": False}}),
)


def _all_off() -> Variant:
    top: dict[str, Any] = {}
    pool: dict[str, Any] = {}
    for v in _OFF:
        top, pool = merged(top, v.top), merged(pool, v.pool)
    return Variant("all-off", "every feature above off at once", top=top, pool=pool,
                   serve_args=tuple(a for v in _OFF for a in v.serve_args))


#: how many named keys the `keys-1000` variant configures; its client sends one in the middle
BENCH_KEYS = 1000


#: the index of the key the `keys-1000` variant's client sends
BENCH_CLIENT_KEY = BENCH_KEYS // 2
#: the bench's mode (and the instruction count's variant) with the 1,000 keys
KEYS_MODE = "keys-1000"


def _bench_key(index: int) -> str:
    return f"bench-key-{index:04d}-0123456789abcdefghijklmnopq"


def key_name(index: int) -> str:
    """The name of the `keys-1000` variant's key `index` (its usage is counted under it)."""
    return f"tenant-{index:04d}"


def _many_keys() -> Variant:
    """1,000 named keys, each with all four limits (high enough never to refuse the
    measured requests), against the default's no keys at all: what a key lookup, its limits'
    admission and settlement, its headers and its usage count cost a request. The store
    these keys open is in the measurement's own folder (`XDG_STATE_HOME`)."""
    limits = {"requests_per_minute": 10**9, "input_tokens_per_minute": 10**12,
              "output_tokens_per_minute": 10**12, "in_flight": 10**6}
    keys = [{"name": key_name(index),
             "key_sha256": hashlib.sha256(_bench_key(index).encode()).hexdigest(),
             "limits": limits} for index in range(BENCH_KEYS)]
    return Variant(KEYS_MODE, "1,000 named keys with limits (keys:)", default_on=False,
                   top={"keys": keys},
                   headers={"authorization": f"Bearer {_bench_key(BENCH_CLIENT_KEY)}"})


#: the bench's mode (and the instruction count's variant) whose backends speak the other API
TRANSLATED_MODE = "translated"
#: the translation every request of the bench's `translated` mode takes (its pool is a chat
#: pool of Messages backends): the name `/hedge/stats` counts it under
TRANSLATED_ROUTE = "chat->messages"
#: the variant modes `bench --workload overhead` runs right after `hedging-on`, in this order,
#: each the same gateway and the same client requests with one thing changed, its CPU per
#: request divided by hedging-on's: the change's cost where it is paid, in service
OVER_HEDGING_ON: tuple[str, ...] = (KEYS_MODE, TRANSLATED_MODE)


#: name -> variant; `default` is the configuration the guard measures
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("default", "every feature at its default"),
    *_OFF,
    Variant("no-continuations", "continuations after commit (hedging.stall)",
            pool={"hedging": {"stall": {"enabled": False}}}),
    Variant("tracing-on", "request tracing (server.tracing.exporter: console)",
            default_on=False, top={"server": {"tracing": {"exporter": "console"}}}),
    Variant(TRANSLATED_MODE, "translation (each pool's backends speak the other API)",
            default_on=False, translated=True),
    Variant("continued", "continuations on every backend (a whole answer read as a stream)",
            default_on=False, continued=True),
    _all_off(),
    _many_keys(),
)}


def feature_modes() -> tuple[str, ...]:
    """The variants `bench --features` adds as modes: each default-on feature switched off,
    then all of them at once. Not `no-request-log` (the bench's gateways already run with
    `--log-level warning`), `no-hedging` (the bench's own `hedging-off`) nor
    `no-continuations` (the bench's OpenAI-compatible backends continue nothing by default;
    `--workload stalls` measures continuations on and off)."""
    return tuple(name for name, v in VARIANTS.items()
                 if v.default_on and name not in ("default", "no-request-log", "no-hedging",
                                                  "no-continuations"))
