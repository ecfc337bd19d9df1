"""`hedge-gateway`: serve, check-config, schema, sim, bench, stats. Every option of these
commands lives here: the commands behind them take parsed values (a `SimProfile`, a
`BenchPlan`), never argparse objects. The bench's child simulator
(`python -m gateway.bench.upstream`) is no command of ours and parses its own two flags, so
nothing under `gateway.bench` imports this module.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from time import monotonic
from typing import TYPE_CHECKING

from gateway import argtypes

if TYPE_CHECKING:
    from gateway.settings import ServerSettings, Settings, SimProfile
    from gateway.settings.origin import ConfigOrigin
    from gateway.settings.tenants import TenantKeySettings


DEFAULT_STATS_URL = "http://127.0.0.1:8080"


def _serve(ns: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.server.serve import build_server, raise_open_file_limit, tune_collector
    from gateway.settings.load import ConfigError

    try:
        origin, file_settings = _load(ns.config)
        settings = _with_overrides(file_settings, ns)
    except ConfigError as exc:
        print(f"hedge-gateway: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"hedge-gateway: cannot read {ns.config}: {exc.strerror}", file=sys.stderr)
        return 2
    file_server, server = file_settings.server, settings.server
    warn_at_start(server, ns.log_level, settings.keys)
    before, after = raise_open_file_limit()  # a stream holds two descriptors (and workers
    raised = f" (raised from {before})" if after != before else ""  # inherit the limit)
    print(f"hedge-gateway: open-file limit {after}{raised}", file=sys.stderr)
    source = ns.config or "embedded default (pool 'demo' of simulated backends)"
    for line in startup_lines(settings, source):
        print(line, file=sys.stderr)
    if server.workers > 1:
        from gateway.server.supervisor import ConfigSource, Supervisor

        config = ConfigSource(ns.config, file_server, origin,
                              reload=lambda: _reload_for_workers(ns))
        return Supervisor(settings, server.workers, log_config=logging_config(ns.log_level),
                          build_app=create_app, config=config).run()
    try:
        app = create_app(settings, origin=origin)
    except ConfigError as exc:  # what only building can tell (tracing from OTEL_* variables)
        print(f"hedge-gateway: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    path, reloader = ns.config, app.state.reloader

    def reload() -> None:  # SIGHUP: re-read the file; an invalid one changes nothing
        reloader.hangup(path, started_server=file_server)

    # drains live streams on SIGTERM, bounds request heads, exits 0 after a graceful stop,
    # reloads the configuration on SIGHUP
    runner = build_server(app, server, app.state.drain, log_config=logging_config(ns.log_level),
                          on_hangup=reload if path else None)
    tune_collector(server)
    runner.run()
    return 0 if runner.started else 3  # 3: could not start (port taken, lifespan failed)


#: providers whose backends serve Chat Completions (the others speak Messages only)
CHAT_PROVIDERS = ("sim", "openai")


def startup_lines(settings: Settings, source: str) -> list[str]:
    """What `serve` tells a newcomer before it starts: where it listens, the pools, the
    dashboard, and one curl line that works against the first pool as configured (what an
    operator must hear, such as a listener beyond loopback with no client keys, is logged
    by `warn_at_start`)."""
    from gateway.api.browser import is_loopback

    server = settings.server
    listen = f"[{server.host}]" if ":" in server.host else server.host
    local = listen if is_loopback(server.host) else ("[::1]" if ":" in server.host
                                                     else "127.0.0.1")
    root = f"http://{local}:{server.port}"
    lines = [f"hedge-gateway: serving {source} on http://{listen}:{server.port}/v1"]
    for pool in settings.pools:
        kinds = sorted({b.provider for b in pool.backends})
        lines.append(f"hedge-gateway:   pool {pool.name!r}: {len(pool.backends)} backend"
                     f"{'s' if len(pool.backends) != 1 else ''} ({', '.join(kinds)})")
    ops = " (with an ops key)" if server.ops_keys else ""
    lines.append(f"hedge-gateway: dashboard {root}/dashboard, stats {root}/hedge/stats{ops}")
    if settings.pools:
        lines.append("hedge-gateway: try: " + _curl_line(settings, root))
    return lines


def _curl_line(settings: Settings, root: str) -> str:
    """A streamed request to the first pool that serves chat, else a Messages request."""
    import json

    auth = ' -H "authorization: Bearer $KEY"' if settings.server.api_keys else ""
    chat = next((p for p in settings.pools
                 if any(b.provider in CHAT_PROVIDERS for b in p.backends)), None)
    if chat is not None:
        body = {"model": chat.name, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        path = "/v1/chat/completions"
    else:
        body = {"model": settings.pools[0].name, "max_tokens": 64, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        path = "/v1/messages"
    data = json.dumps(body, separators=(",", ":"))
    return (f"curl -N {root}{path}{auth} -H 'content-type: application/json' "
            f"-d '{data}'")


def start_warnings(server: ServerSettings,
                   keys: tuple[TenantKeySettings, ...] = ()) -> list[str]:
    """What an operator should hear before `serve` listens: keys or secrets short enough to
    guess, a listener reachable from other machines that asks no client key (anyone who
    reaches the port spends the upstream keys; a page's rebound name too, unless
    `server.allowed_hosts` is set), and rules of `keys:` this version does not enforce yet."""
    from gateway.api.browser import is_loopback
    from gateway.settings.load import unenforced_keys, weak_secrets

    lines = weak_secrets(server) + unenforced_keys(keys)
    if not is_loopback(server.host) and not server.api_keys and not keys:
        lines.append(f"listening on {server.host}, reachable from other machines, without "
                     "client keys: anyone who reaches the port can use the upstreams; set "
                     "server.api_keys")
    return lines


def warn_at_start(server: ServerSettings, level: str,
                  keys: tuple[TenantKeySettings, ...] = ()) -> None:
    """Log `start_warnings`, one line each, on `hedge_gateway.config` (configured here: the
    server configures the same logging again when it starts). Kept apart from the start-up
    lines printed above and below it, so either can change without the other."""
    import logging.config

    lines = start_warnings(server, keys)
    if lines:
        logging.config.dictConfig(logging_config(level))
        for line in lines:
            logging.getLogger("hedge_gateway.config").warning("%s", line)


def _load(path: str | None) -> tuple[ConfigOrigin | None, Settings]:
    """The configuration file's origin (checksum, load time) and settings; without a file,
    the embedded default. ConfigError or OSError when it cannot be used."""
    from gateway.settings.load import default_settings, load_settings
    from gateway.settings.origin import ConfigOrigin
    from providers.registry import missing_extras

    if not path:
        return None, default_settings()
    with open(path, "rb") as file:
        origin = ConfigOrigin.of_file(file.read(), now=monotonic())
    return origin, load_settings(path, installed=missing_extras)


def _reload_for_workers(ns: argparse.Namespace) -> tuple[ConfigOrigin | None, Settings]:
    """SIGHUP under `--workers`: what a worker started from now on runs (the supervisor keeps
    the server section it started with, as each worker's own reload does)."""
    origin, settings = _load(ns.config)
    return origin, _with_overrides(settings, ns)


def _with_overrides(settings: Settings, ns: argparse.Namespace) -> Settings:
    """The settings with the command line's --host, --port and --workers applied."""
    server = settings.server
    changes = {key: getattr(ns, key) for key in ("host", "port", "workers")
               if getattr(ns, key) is not None}
    return replace(settings, server=replace(server, **changes)) if changes else settings


def logging_config(level: str) -> dict[str, object]:
    """Our request log at INFO on stderr; libraries that log URLs or headers kept quiet.

    httpx logs every upstream URL at INFO and httpcore every response header at DEBUG, and
    aiohttp's client logs at DEBUG too: none of it belongs in an operator's log (a URL can
    carry a tenant, a header a key). The request log (`hedge_gateway.requests`) replaces
    uvicorn's access log.
    """
    upper = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
            "bare": {"format": "%(message)s"},
        },
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "plain",
                       "stream": "ext://sys.stderr"},
            "requests": {"class": "logging.StreamHandler", "formatter": "bare",
                         "stream": "ext://sys.stderr"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": upper, "propagate": False},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
            "hedge_gateway.requests": {"handlers": ["requests"], "level": upper,
                                       "propagate": False},
            "hedge_gateway.config": {"handlers": ["stderr"], "level": upper,
                                     "propagate": False},
            "httpx": {"level": "WARNING"},
            "httpcore": {"level": "WARNING"},
            "aiohttp": {"level": "WARNING"},
        },
        "root": {"handlers": ["stderr"], "level": "WARNING"},
    }


def _check_config(ns: argparse.Namespace) -> int:
    from gateway.settings.load import check_config
    from providers.registry import missing_extras

    return check_config(ns.file, sys.stdout, sys.stderr, installed=missing_extras)


def _schema(ns: argparse.Namespace) -> int:
    import json

    from gateway.settings.schema import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def _sim(ns: argparse.Namespace) -> int:
    from providers.sim.server import run_sim

    try:
        profile = sim_profile(ns)
    except ValueError as exc:
        print(f"hedge-gateway sim: {exc}", file=sys.stderr)
        return 2
    run_sim(ns.host, ns.port, profile, ns.seed)
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from gateway.bench.commands import (
        run_bench_command,
        run_clouds_command,
        run_conversations_command,
        run_soak_command,
    )
    from gateway.bench.run import BenchPlan
    from gateway.bench.workloads import selected

    if ns.workload == "conversations":
        return run_conversations_command(conversations=ns.requests, quick=ns.quick,
                                         seed=ns.seed, out=ns.out, upstreams=ns.upstream,
                                         model=ns.upstream_model, sizes=ns.sizes,
                                         concurrency=ns.concurrency, warmup=ns.warmup)
    if ns.upstream:
        print("hedge-gateway bench: --upstream runs --workload conversations", file=sys.stderr)
        return 2
    if ns.workload == "claude-everywhere":
        return run_clouds_command(requests=ns.requests, concurrency=ns.concurrency,
                                  quick=ns.quick, seed=ns.seed, out=ns.out)
    if ns.workload == "soak":
        return run_soak_command(duration=ns.duration, quick=ns.quick,
                                concurrency=ns.concurrency, seed=ns.seed, out=ns.out,
                                progress=not ns.no_progress)
    from gateway.bench.servers import nginx_binary

    # `--workload overhead` is the cost workload: each feature's row, the keys' and the
    # translated rows and the floors beside the gateway unless switched off (`--no-features`,
    # `--no-keys`, `--no-translated`, `--no-nginx`, `--no-passthrough`); nginx only if
    # installed
    overhead = ns.workload == "overhead"
    features = overhead if ns.features is None else ns.features
    keys = overhead if ns.keys is None else ns.keys
    translated = overhead if ns.translated is None else ns.translated
    passthrough = overhead if ns.passthrough is None else ns.passthrough
    nginx = nginx_binary() if ns.nginx or (ns.nginx is None and overhead) else None
    if ns.nginx and nginx is None:
        print("hedge-gateway bench: --nginx: nginx is not installed (Debian: apt-get "
              "install nginx-light)", file=sys.stderr)
        return 2
    plan = BenchPlan(workloads=selected(ns.workload, quick=ns.quick), seed=ns.seed,
                     progress=None if ns.no_progress else sys.stderr, tables=sys.stdout,
                     baseline_src=ns.baseline_src,
                     workers=ns.workers, servers=ns.servers, repeat=ns.repeat,
                     features=features, nginx=nginx, passthrough=passthrough, keys=keys,
                     translated=translated)
    return run_bench_command(plan, out=ns.out, requests=ns.requests,
                             concurrency=ns.concurrency, quick=ns.quick)


def _stats(ns: argparse.Namespace) -> int:
    if len(ns.url) > 1:
        from gateway.stats.replicas import print_merged

        return print_merged(ns.url, sys.stdout, sys.stderr)
    from gateway.stats.table import print_stats

    return print_stats(ns.url[0] if ns.url else DEFAULT_STATS_URL, sys.stdout, sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hedge-gateway",
        description="OpenAI-compatible gateway that hedges streaming requests on the first token.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="YAML file; without it, the embedded demo pool")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--workers", type=argtypes.positive,
                       help="processes serving the address (default: server.workers, 1)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=_serve)

    check = sub.add_parser("check-config", help="validate a YAML configuration file")
    check.add_argument("file")
    check.set_defaults(func=_check_config)

    schema = sub.add_parser("schema", help="print the configuration's JSON Schema")
    schema.set_defaults(func=_schema)

    sim = sub.add_parser("sim", help="run a simulated OpenAI-compatible upstream")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=9001)
    _add_sim_arguments(sim)
    sim.set_defaults(func=_sim)

    bench = sub.add_parser("bench", help="benchmark hedging off / on / best-of-two")
    _add_bench_arguments(bench)
    bench.set_defaults(func=_bench)

    stats = sub.add_parser("stats", help="print a running gateway's hedge stats as a table; "
                           "with several URLs, the replicas' stats merged into one view")
    stats.add_argument("url", nargs="*", help=f"gateway root URL (default {DEFAULT_STATS_URL})")
    stats.set_defaults(func=_stats)

    keys = sub.add_parser("keys", help="client keys made at run time, and each key's usage, "
                          "in the store (docs/tenants.md)")
    keys.add_argument("--store", help="store URL, sqlite:///path (default: --config's "
                      "server.store, else the embedded file)")
    keys.add_argument("--config", help="YAML file whose server.store to use")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="make a key; its secret is printed once")
    create.add_argument("name")
    create.add_argument("--pool", action="append", help="a pool it may use (repeatable; "
                        "default: every pool)")
    for flag in ("requests-per-minute", "input-tokens-per-minute", "output-tokens-per-minute",
                 "in-flight"):
        create.add_argument(f"--{flag}", type=argtypes.count, help="limit (default: none)")
    create.add_argument("--budget-usd", type=float, help="a spend budget in US dollars per "
                        "--budget-period (default: none); past it: 429 budget_exceeded")
    create.add_argument("--budget-period", choices=("day", "month"), default="month",
                        help="the budget's period, UTC (default: month)")
    actions.add_parser("list", help="every key of the store, active or revoked")
    revoke = actions.add_parser("revoke", help="revoke a key: refused by every worker within "
                                "a second")
    revoke.add_argument("name")
    usage = actions.add_parser("usage", help="requests and tokens per key and UTC day")
    usage.add_argument("name", nargs="?")
    keys.set_defaults(func=_keys)
    return parser


def _keys(ns: argparse.Namespace) -> int:
    from gateway.tenants.command import run

    return run(ns, sys.stdout, sys.stderr)


# --- sim ---------------------------------------------------------------------------------------


def _add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """The profile options of `hedge-gateway sim` (defaults: the bench's "stragglers" workload)."""
    from gateway.settings import SimProfile

    d = SimProfile()
    opt = parser.add_argument
    opt("--ttft-median-ms", type=argtypes.non_negative, default=d.ttft_median * 1000,
        help="median time to first token (lognormal body), ms (default %(default)s)")
    opt("--ttft-sigma", type=argtypes.non_negative, default=d.ttft_sigma,
        help="sigma of the lognormal TTFT (default %(default)s)")
    opt("--straggler-probability", type=argtypes.probability, default=d.straggler_probability,
        help="share of requests that get the straggler delay on top (default %(default)s)")
    opt("--straggler-extra-ms", type=argtypes.non_negative, default=d.straggler_extra * 1000,
        help="extra TTFT of a straggler, ms (default %(default)s)")
    opt("--tokens", type=argtypes.count, default=d.tokens,
        help="tokens per response, capped by max_tokens (default %(default)s)")
    opt("--inter-token-ms", type=argtypes.non_negative, default=d.inter_token * 1000,
        help="delay between tokens, ms (default %(default)s)")
    opt("--no-usage", dest="usage", action="store_false",
        help="send a usage chunk only when the request asks (stream_options.include_usage)")
    opt("--fail-probability", type=argtypes.probability, default=d.fail_probability,
        help="share of requests answered with --fail-status (default %(default)s)")
    opt("--fail-status", type=argtypes.status, default=d.fail_status,
        help="status of a simulated failure (default %(default)s)")
    opt("--hang-probability", type=argtypes.probability, default=d.hang_probability,
        help="share of streams that send the role chunk and then nothing (default %(default)s)")
    opt("--midstream-error-probability", type=argtypes.probability,
        default=d.midstream_error_probability,
        help="share of streams that end with an in-band error event (default %(default)s)")
    opt("--stall-probability", type=argtypes.probability, default=d.stall_probability,
        help="share of streams that stall once after their first token (default %(default)s)")
    opt("--stall-length-ms", type=argtypes.non_negative, default=d.stall_length * 1000,
        help="how long a mid-stream stall lasts, ms (default %(default)s)")
    opt("--break-probability", type=argtypes.probability, default=d.break_probability,
        help="share of streams that break after their first token (default %(default)s)")
    opt("--break-kind", choices=("reset", "closed", "error", "malformed"),
        default=d.break_kind, help="how a stream breaks (default %(default)s)")
    opt("--prefill-ms-per-1k", type=argtypes.non_negative, default=d.prefill_ms_per_1k,
        help="TTFT added per 1,000 input tokens not in the prefix cache, ms; > 0 also turns "
        "the prefix cache on (default %(default)s)")
    opt("--prefix-cache-entries", type=argtypes.count, default=d.prefix_cache_entries,
        help="message prefixes the prefix cache holds, LRU (default %(default)s)")
    opt("--rate-limit-requests", type=argtypes.count, default=d.rate_limit_requests,
        help="requests allowed per window, stated in rate-limit headers on every answer; "
        "past it 429 with Retry-After; 0: no quota, no headers (default %(default)s)")
    opt("--rate-limit-window-ms", type=argtypes.non_negative, default=d.rate_limit_window * 1000,
        help="the quota's window, from the first request, ms (default %(default)s)")
    opt("--seed", type=int, default=None, help="seed for reproducible draws (default: random)")
    opt("--draws", choices=("sequence", "request"), default=d.draws,
        help="sequence: each request takes the next seeded draws; request: drawn from the seed "
        "and the request's messages, equal for equal requests whatever their order "
        "(default %(default)s)")


def sim_profile(ns: argparse.Namespace) -> SimProfile:
    """The profile the `sim` options describe. ValueError if the fault probabilities add up to
    more than 1 (they are mutually exclusive per request)."""
    from gateway.settings import SimProfile

    faults = ns.fail_probability + ns.hang_probability + ns.midstream_error_probability
    if faults > 1.0:
        raise ValueError("fail, hang and midstream-error probabilities add up to more than 1")
    return SimProfile(
        ttft_median=ns.ttft_median_ms / 1000,
        ttft_sigma=ns.ttft_sigma,
        straggler_probability=ns.straggler_probability,
        straggler_extra=ns.straggler_extra_ms / 1000,
        tokens=ns.tokens,
        inter_token=ns.inter_token_ms / 1000,
        usage=ns.usage,
        fail_probability=ns.fail_probability,
        fail_status=ns.fail_status,
        hang_probability=ns.hang_probability,
        midstream_error_probability=ns.midstream_error_probability,
        stall_probability=ns.stall_probability,
        stall_length=ns.stall_length_ms / 1000,
        break_probability=ns.break_probability,
        break_kind=ns.break_kind,
        seed=ns.seed,
        draws=ns.draws,
        prefill_ms_per_1k=ns.prefill_ms_per_1k,
        prefix_cache_entries=ns.prefix_cache_entries,
        rate_limit_requests=ns.rate_limit_requests,
        rate_limit_window=max(ns.rate_limit_window_ms, 1.0) / 1000,
    )


# --- bench -------------------------------------------------------------------------------------


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.bench.servers import parse_servers
    from gateway.bench.workloads import WORKLOAD_GROUPS, WORKLOADS

    names = [w.name for w in WORKLOADS]
    parser.add_argument("--workload",
                        choices=[*names, *WORKLOAD_GROUPS, "soak", "conversations",
                                 "claude-everywhere", "all"],
                        default="all",
                        help="which workload to run (default: all; `soak`, `conversations` "
                             "and `claude-everywhere` only when named; conversations: "
                             "--requests is the number of conversations, default 48; "
                             "claude-everywhere: the stragglers race over "
                             "config/claude-everywhere.yaml's Anthropic, Bedrock and Vertex "
                             "pool, on simulators); "
                             "slow-shares: " + ", ".join(WORKLOAD_GROUPS["slow-shares"]))
    parser.add_argument("--duration", type=argtypes.positive_seconds,
                        help="soak: seconds of traffic (default 600; 20 with --quick)")
    parser.add_argument("--requests", type=argtypes.positive,
                        help="requests per mode (default: per workload)")
    parser.add_argument("--concurrency", type=argtypes.positive,
                        help="requests in flight (default: per workload; conversations: "
                             "conversations at once, default all, as many as servers with "
                             "--upstream)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests per mode, and without --workload no slow shares:"
                             " a smoke run of under a minute; targets its sample cannot decide"
                             " print as not judged")
    parser.add_argument("--seed", type=int, default=1, help="simulator seed (default 1)")
    parser.add_argument("--repeat", type=argtypes.positive, default=1,
                        help="run each workload N times, seed after seed, and print the "
                             "spread of each mode's TTFT p99 and of the hedging cut")
    parser.add_argument("--out", help="JSON report path (default bench-results/<time>.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--baseline-src", metavar="DIR",
                        help="another hedge-gateway checkout: its gateway runs as an extra "
                             "mode, `baseline`, side by side in the same run")
    parser.add_argument("--workers", type=argtypes.positive, default=1,
                        help="serve the gateway under test with --workers N (default 1)")
    parser.add_argument("--upstream", action="append", default=[], metavar="URL",
                        help="conversations: your own OpenAI-compatible server (base URL, "
                             ".../v1) instead of a simulator; repeat for each")
    parser.add_argument("--upstream-model", metavar="NAME",
                        help="the model to ask --upstream servers for (default: the first "
                             "each lists)")
    parser.add_argument("--sizes", metavar="LIST",
                        help="conversations: new-message tokens, e.g. 200,4000,30000 or "
                             "200:0.5,4000:0.35,30000:0.15 (default that, or 20,100,300 "
                             "with --upstream)")
    parser.add_argument("--features", action=argparse.BooleanOptionalAction, default=None,
                        help="a mode per feature of the request path switched off "
                             "(no-affinity, no-size-classes, no-prefill-fit, no-input-budget, "
                             "no-headroom, then all-off), hedging on otherwise: each "
                             "feature's cost is its row's difference from hedging-on "
                             "(default: on for --workload overhead only)")
    parser.add_argument("--keys", action=argparse.BooleanOptionalAction, default=None,
                        help="a mode `keys-1000` right after hedging-on: 1,000 named keys, "
                             "each with all four limits, the client sending one; its CPU per "
                             "request prints over hedging-on's (default: on for --workload "
                             "overhead only)")
    parser.add_argument("--translated", action=argparse.BooleanOptionalAction, default=None,
                        help="a mode `translated` after hedging-on (and keys-1000): the same "
                             "simulators spoken to in Messages (provider anthropic), the same "
                             "chat requests, each translated both ways; its CPU per request "
                             "prints over hedging-on's (default: on for --workload overhead "
                             "only)")
    parser.add_argument("--nginx", action=argparse.BooleanOptionalAction, default=None,
                        help="a mode `nginx` after direct: nginx as a plain reverse proxy to "
                             "the same simulators, the floor; the gateway's CPU per request "
                             "and added TTFT print as multiples of its (default: for "
                             "--workload overhead when nginx is installed; --nginx requires it)")
    parser.add_argument("--passthrough", action=argparse.BooleanOptionalAction, default=None,
                        help="a mode `passthrough` after direct (and nginx): uvicorn and "
                             "aiohttp with nothing of the gateway between them, this stack's "
                             "floor; the gateway's CPU per request and added TTFT print as "
                             "multiples of its too (default: on for --workload overhead only)")
    parser.add_argument("--warmup", type=argtypes.count, metavar="N",
                        help="conversations: unmeasured warm-up conversations per mode, before "
                             "the measured ones, their homes spread evenly over the backends "
                             "(default: enough for every backend's hedge delay to learn, 6 per "
                             "backend at 4 turns; 0: none)")
    parser.add_argument("--servers", type=parse_servers, default=("uvicorn",), metavar="LIST",
                        help="e.g. uvicorn,granian: each server but uvicorn (`serve`, which runs"
                             " the other modes) adds a mode of its name, hedging on")


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        code: int = ns.func(ns)
    except BrokenPipeError:
        # whoever read our output stopped (`hedge-gateway schema | head`): not an error of
        # ours; point stdout at /dev/null so the flush at exit does not raise again
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    raise SystemExit(main())
