"""What `hedge-gateway serve` adds to each request's ASGI scope, and the app reads.

The server owns these contracts: it puts them on the scope of every request of a connection
(`gateway.server.connection`), and the app reads them where they are present (absent under
another ASGI server: no abort hook, no back-off). Kept here, below both, so the server needs
nothing from the API layer and the API layer reads the server's own names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: `{"abort": Callable[[], object]}`: drop the connection now, unsent bytes and all. Without
#: it, a stuck client's connection can only be left to the server, which waits for the unsent
#: bytes to drain before it closes
ABORT_EXTENSION = "hedge_gateway.abort"

#: `{"hold": Callable[[], object]}`: the response's next write (its head) waits for the one
#: after it (its first body piece), and both leave in one send: one system call and one
#: packet before the client sees its first event, instead of two. A streamed response asks
#: for it only when its first piece is in hand (nothing may wait behind a held head). Absent
#: under another server: the head goes out on its own, as it always did
HOLD_HEAD_EXTENSION = "hedge_gateway.hold_head"

#: `{"gone": Callable[[], asyncio.Future[None]]}`: a future of the request's own that is
#: resolved when its client's connection is lost (cancel it when done with it). The proxy
#: watches the client through it for the whole request, where under another server it runs a
#: task that reads `receive` until `http.disconnect`: a task made and stepped twice on the
#: way to the upstream request, and cancelled at the request's end
GONE_EXTENSION = "hedge_gateway.gone"

#: `{"failed": FailedKeys}`, that connection's (absent under another server: no back-off)
FAILED_KEYS_EXTENSION = "hedge_gateway.failed_keys"


@dataclass(slots=True)
class FailedKeys:
    """Wrong keys seen on one client connection (one per connection, freed with it)."""

    count: int = 0


def hook(scope: Mapping[str, Any], extension: str, name: str) -> Callable[..., Any] | None:
    """The callable `name` of the server's `extension` in a request's scope, if the server
    offers it (None under another server)."""
    offered = (scope.get("extensions") or {}).get(extension) or {}
    found = offered.get(name)
    return found if callable(found) else None
