"""The front servers the bench can run the gateway under (`bench --servers`).

The gateway's own server is uvicorn with httptools and uvloop plus our protocol subclass and
drain (`hedge-gateway serve`): the bench's standard gateway modes always run under it. Every
other server named in `--servers` adds one mode of its own name: the same generated
configuration file, hedging on (as in `hedging-on`), the same CPU pinning, served by that
server through `gateway.app:app_from_env`. So the servers are compared in one run, on the
same simulators and load client, by the gateway process tree's own CPU counters.

Those servers are optional (`pip install 'hedge-gateway[granian]'`); `missing` says which
of the named ones are not installed, so the bench can refuse before starting anything.
Pure planning: names, command lines, environments; `gateway.bench.run` starts them.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from argparse import ArgumentTypeError
from collections.abc import Callable, Sequence

#: the gateway's own server, which always serves the standard gateway modes
OWN = "uvicorn"
#: every server `--servers` knows, with the package that provides it
PACKAGES = {"uvicorn": "uvicorn", "granian": "granian", "hypercorn": "hypercorn"}
#: the factory the other servers import
FACTORY = "gateway.app:app_from_env"


def parse_servers(text: str) -> tuple[str, ...]:
    """`uvicorn,granian` -> ('uvicorn', 'granian'): known names, in order, each once.
    ArgumentTypeError (the option's own error message) naming the problem otherwise."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ArgumentTypeError("name at least one server")
    unknown = [n for n in names if n not in PACKAGES]
    if unknown:
        raise ArgumentTypeError(f"unknown server {', '.join(unknown)} "
                         f"(known: {', '.join(PACKAGES)})")
    return tuple(dict.fromkeys(names))


def extra_modes(servers: Sequence[str]) -> tuple[str, ...]:
    """The bench modes the servers add: one per server other than our own, named after it."""
    return tuple(s for s in servers if s != OWN)


def missing(servers: Sequence[str],
            installed: Callable[[str], bool] | None = None) -> list[str]:
    """The named servers whose package is not installed (`installed`: injected in tests)."""
    check = installed or (lambda package: importlib.util.find_spec(package) is not None)
    return [s for s in servers if not check(PACKAGES[s])]


def server_command(server: str, config: str, port: int, *, workers: int = 1
                   ) -> tuple[list[str], dict[str, str] | None]:
    """The command line (and extra environment) that serves the gateway for the file
    `config` on 127.0.0.1:`port` under `server`. Our own server runs `hedge-gateway serve`
    (with `--workers` when more than one); the others run one worker each, on uvloop like
    ours, with their access logs off like ours."""
    # here, not at the top: the command line imports this module to parse `--servers`, and
    # the configuration's modules are needed only to name its variable (the bench reads no
    # module of the app's composition root)
    from gateway.settings.origin import CONFIG_ENV

    host = "127.0.0.1"
    if server == OWN:
        extra = ["--workers", str(workers)] if workers > 1 else []
        return [sys.executable, "-m", "gateway.cli", "serve", "--config", config, "--host", host,
                "--port", str(port), "--log-level", "warning", *extra], None
    env = {CONFIG_ENV: config}
    if server == "granian":
        return [sys.executable, "-m", "granian", "--interface", "asgi", "--factory",
                "--host", host, "--port", str(port), "--workers", "1", "--loop", "uvloop",
                "--no-ws", "--log-level", "warning", FACTORY], env
    if server == "hypercorn":
        return [sys.executable, "-m", "hypercorn", "--worker-class", "uvloop", "--workers", "1",
                "--bind", f"{host}:{port}", "--log-level", "warning", f"{FACTORY}()"], env
    raise ValueError(f"unknown server {server!r}")


#: the mode `bench --nginx` adds: Debian's nginx as a plain reverse proxy to the same
#: simulators, the floor a proxy in Python is compared with
NGINX = "nginx"


#: the mode `bench --passthrough` adds: this stack with nothing of the gateway in it, uvicorn
#: in front of an aiohttp client session (`gateway.bench.passthrough`), the floor of a proxy
#: built on the gateway's own server and upstream client
PASSTHROUGH = "passthrough"
#: the modes that are proxies but not the gateway: the client sends them the body it sends
#: direct, and they have no /hedge/stats
FLOORS = (NGINX, PASSTHROUGH)


def passthrough_command(port: int, upstreams: Sequence[str]) -> list[str]:
    """The command line that serves the pass-through on 127.0.0.1:`port` to `upstreams`."""
    return [sys.executable, "-m", "gateway.bench.passthrough", "--port", str(port),
            *(arg for url in upstreams for arg in ("--upstream", url))]


def nginx_binary(which: Callable[[str], str | None] | None = None) -> str | None:
    """The nginx executable (on PATH, or Debian's /usr/sbin/nginx), None when not installed
    (`which`: injected in tests)."""
    find = which or shutil.which
    return find("nginx") or find("/usr/sbin/nginx")


def nginx_config(port: int, upstream_ports: Sequence[int], prefix: str) -> str:
    """nginx.conf for a plain reverse proxy on 127.0.0.1:`port` spreading requests round-robin
    over the simulators (as the gateway's balancer spreads them over the same two), with
    kept-alive upstream connections (as the gateway pools them), no buffering of the
    streamed answer, no access log (the gateway's is off too: `--log-level warning`), one
    worker (the gateway is one process), every file under `prefix`."""
    servers_block = "".join(f"        server 127.0.0.1:{p};\n" for p in upstream_ports)
    return f"""daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream sims {{
{servers_block}        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://sims;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 120s;
        }}
    }}
}}
"""


def nginx_command(binary: str, config: str, prefix: str) -> list[str]:
    """The command line that runs nginx in the foreground on `config`, its files in `prefix`."""
    return [binary, "-p", prefix, "-c", config, "-e", f"{prefix}/error.log"]
