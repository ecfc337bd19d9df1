"""The process-wide admission counters: the body's read reserves its bytes
(`gateway.api.common.read_body`), the proxy enters an admitted request and its end leaves.

Apart from the proxy because three steps of a request count in it (the read, the proxy, the
end): a counter they share, not a step of the request's walk.
"""

from __future__ import annotations

from gateway.errors import Overloaded


class Admission:
    """The process-wide caps on concurrent logical requests and on the request-body bytes
    they hold. A request holds several times its body while it is in flight (the parsed
    body, the serialized copy sent upstream, the copy each attempt sends), so counting
    requests alone let a few hundred large ones take the process's memory; the bytes are
    counted as received, and the first request is always admitted, however large."""

    def __init__(self, limit: int, max_bytes: int | None = None) -> None:
        self.limit = limit
        self.active = 0
        #: None: no bound on bytes
        self.max_bytes = max_bytes
        self.active_bytes = 0
        #: bytes of bodies still arriving (`reserve`): held as much as an admitted body's
        self.receiving_bytes = 0

    def reserve(self, size: int, own: int = 0) -> None:
        """`size` more bytes of a body still arriving, whose request reserved `own` so far:
        Overloaded when they would pass `max_bytes` while other requests hold bytes (a lone
        request is always let through, as `enter` lets the first in). Called before the
        bytes are read (the declared length) or as each piece arrives, so uploads cannot
        pile up unbounded behind the check; `unreserve` gives them back once read."""
        if self.max_bytes is not None:
            others = self.active_bytes + self.receiving_bytes - own
            if others > 0 and others + own + size > self.max_bytes:
                raise Overloaded("the gateway holds too many request bytes in flight",
                                 retry_after=1.0)
        self.receiving_bytes += size

    def unreserve(self, size: int) -> None:
        self.receiving_bytes -= size

    def enter(self, size: int = 0) -> None:
        # retryable (no `x-should-retry: false`): SDKs come back after the pause
        if self.active >= self.limit:
            raise Overloaded("the gateway is at its concurrency limit", retry_after=1.0)
        if self.max_bytes is not None and (self.active or self.receiving_bytes) and \
                self.active_bytes + self.receiving_bytes + size > self.max_bytes:
            raise Overloaded("the gateway holds too many request bytes in flight",
                             retry_after=1.0)
        self.active += 1
        self.active_bytes += size

    def leave(self, size: int = 0) -> None:
        self.active -= 1
        self.active_bytes -= size
