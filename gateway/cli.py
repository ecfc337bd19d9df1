"""`hedge-gateway`: serve, check-config, sim, bench, stats (SPEC §12). Argument parsing only."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from time import monotonic


def _serve(ns: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.live import ConfigOrigin
    from gateway.server import build_server
    from gateway.settings.load import ConfigError, default_settings, load_settings

    try:
        if ns.config:
            with open(ns.config, "rb") as file:
                origin: ConfigOrigin | None = ConfigOrigin.of_file(file.read(), now=monotonic())
            settings = load_settings(ns.config)
        else:
            origin, settings = None, default_settings()
    except ConfigError as exc:
        print(f"hedge-gateway: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"hedge-gateway: cannot read {ns.config}: {exc.strerror}", file=sys.stderr)
        return 2
    file_server = server = settings.server
    if ns.host is not None or ns.port is not None:
        server = replace(
            server,
            host=ns.host if ns.host is not None else server.host,
            port=ns.port if ns.port is not None else server.port,
        )
        settings = replace(settings, server=server)
    source = ns.config or "embedded default (pool 'demo' of simulated backends)"
    print(f"hedge-gateway: serving {source} on http://{server.host}:{server.port}/v1",
          file=sys.stderr)
    app = create_app(settings, origin=origin)
    path, reloader = ns.config, app.state.reloader

    def reload() -> bool:  # SIGHUP: re-read the file; an invalid one changes nothing
        return bool(reloader.reload_file(path, started_server=file_server))

    # drains live streams on SIGTERM, bounds request heads, exits 0 after a graceful stop,
    # reloads the configuration on SIGHUP
    runner = build_server(app, server, app.state.drain, log_config=logging_config(ns.log_level),
                          on_hangup=reload if path else None)
    runner.run()
    return 0 if runner.started else 3  # 3: could not start (port taken, lifespan failed)


def logging_config(level: str) -> dict[str, object]:
    """Our request log at INFO on stderr; libraries that log URLs or headers kept quiet.

    httpx logs every upstream URL at INFO and httpcore every response header at DEBUG:
    neither belongs in an operator's log (a URL can carry a tenant, a header a key). The
    request log (`hedge_gateway.requests`) replaces uvicorn's access log.
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
        },
        "root": {"handlers": ["stderr"], "level": "WARNING"},
    }


def _check_config(ns: argparse.Namespace) -> int:
    from gateway.settings.load import check_config

    return check_config(ns.file, sys.stdout, sys.stderr)


def _sim(ns: argparse.Namespace) -> int:
    from providers.sim.server import profile_from_args, run_sim

    run_sim(ns.host, ns.port, profile_from_args(ns), ns.seed)
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from gateway.bench import run_bench_command

    return run_bench_command(ns)


def _stats(ns: argparse.Namespace) -> int:
    from gateway.stats.table import print_stats

    return print_stats(ns.url, sys.stdout, sys.stderr)


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
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=_serve)

    check = sub.add_parser("check-config", help="validate a YAML configuration file")
    check.add_argument("file")
    check.set_defaults(func=_check_config)

    sim = sub.add_parser("sim", help="run a simulated OpenAI-compatible upstream")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=9001)
    from providers.sim.server import add_sim_arguments

    add_sim_arguments(sim)
    sim.set_defaults(func=_sim)

    bench = sub.add_parser("bench", help="benchmark hedging off / on / best-of-two (SPEC §14)")
    from gateway.bench.run import add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)

    stats = sub.add_parser("stats", help="print a running gateway's hedge stats as a table")
    stats.add_argument("url", nargs="?", default="http://127.0.0.1:8080")
    stats.set_defaults(func=_stats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    code: int = ns.func(ns)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
