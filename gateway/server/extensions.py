"""What `hedge-gateway serve` adds to each request's ASGI scope, and the app reads.

The server owns these contracts: it puts them on the scope of every request of a connection
(`gateway.server.connection`), and the app reads them where they are present (absent under
another ASGI server: no abort hook, no back-off). Kept here, below both, so the server needs
nothing from the API layer and the API layer reads the server's own names.
"""

from __future__ import annotations

from dataclasses import dataclass

#: `{"abort": Callable[[], object]}`: drop the connection now, unsent bytes and all. Without
#: it, a stuck client's connection can only be left to the server, which waits for the unsent
#: bytes to drain before it closes
ABORT_EXTENSION = "hedge_gateway.abort"

#: `{"failed": FailedKeys}`, that connection's (absent under another server: no back-off)
FAILED_KEYS_EXTENSION = "hedge_gateway.failed_keys"


@dataclass(slots=True)
class FailedKeys:
    """Wrong keys seen on one client connection (one per connection, freed with it)."""

    count: int = 0
