"""What a web page in a browser may not make the gateway do.

Without client keys (the default) any page a user opens could otherwise drive a gateway on
their machine or network: a cross-site `fetch` or form post reaches it, and spends its
upstream keys. Two checks, on every request before any route runs:

- `Origin`: browsers send it on every cross-site request and on every POST. A request that
  carries one is answered only if it is the gateway's own origin (its dashboard) or one of
  `server.allowed_origins`; anything else, `null` included, gets 403. Programs (SDKs, curl)
  send no `Origin` and are not affected.
- `Host`, while the gateway listens on loopback: a page on a name the attacker controls can
  re-point that name to 127.0.0.1 (DNS rebinding) and then be "same-origin" with the gateway;
  its requests still name the attacker's host. Only localhost, 127.0.0.1, [::1] and
  `server.allowed_hosts` are answered then. On any other address the same holds as soon as
  `server.allowed_hosts` is set (a rebound name reaches a pod or a container's published port
  just as well); unset, the `Host` is not checked there, since the names such a listener is
  reached by (an ingress's, a Service's, a node's) are not the gateway's to guess. The probes
  (`/healthz`, `/readyz`) are answered whatever the `Host`: a kubelet names the pod's address,
  and they tell a page nothing.

The checks read the raw header list once (two byte comparisons per header).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

#: the names a loopback listener always answers to
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
#: paths answered whatever the `Host` names: the probes
PROBE_PATHS = frozenset({"/healthz", "/readyz"})


def is_loopback(host: str) -> bool:
    """Whether the listening address `host` is reachable only from this machine."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name part of a `Host` header value, lowercase (`[::1]:8080` -> `[::1]`)."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host.rstrip(":")


class BrowserGuard:
    """Refuses requests by `Origin` and, on a loopback listener or wherever
    `server.allowed_hosts` is set, by `Host`."""

    def __init__(self, *, listen_host: str, allowed_origins: Iterable[str] = (),
                 allowed_hosts: Iterable[str] = ()) -> None:
        self.origins = frozenset(allowed_origins)
        hosts = frozenset(allowed_hosts)
        self.hosts: frozenset[str] | None = (
            LOOPBACK_NAMES | hosts if is_loopback(listen_host) or hosts else None
        )

    def refusal(self, scope_headers: Iterable[tuple[bytes, bytes]], scheme: str,
                path: str = "") -> str | None:
        """Why a request with these headers (to `path`) is refused, or None."""
        host = origin = None
        for name, value in scope_headers:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
        if self.hosts is not None and host is not None \
                and host_name(host) not in self.hosts and path not in PROBE_PATHS:
            return "this gateway does not answer to that host name"
        if origin is not None:
            origin = origin.strip().lower()
            own = host is not None and origin == f"{scheme}://{host.strip().lower()}"
            if not own and origin not in self.origins:
                return "requests from this web origin are not allowed (server.allowed_origins)"
        return None
