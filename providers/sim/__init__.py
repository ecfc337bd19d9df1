"""The simulated upstream: `wire` draws a plan and its bytes, `provider` plays them
in-process (the embedded default pool), `server` serves them over real loopback sockets."""

from providers.sim.provider import SimProvider

__all__ = ["SimProvider"]
