"""How a relayed stream ended: one enumeration for the relay, the client response and the stats.

The relay sets the ends it sees in the upstream's bytes, `SSEResponse` the ones it sees on the
client's side or from the drain, the proxy records whichever came first, and the stats count
every end but `DONE` as an error class `stream_<end>`. Written once here, so a new end cannot
be known to the response and unknown to the stats (a stream cut by a graceful shutdown was
once counted as `other` that way).
"""

from __future__ import annotations

from enum import StrEnum


class StreamEnd(StrEnum):
    #: `[DONE]` was relayed: the only clean end
    DONE = "done"
    #: the upstream sent an error event (relayed, or replaced by ours)
    UPSTREAM_ERROR = "upstream_error"
    #: the upstream's stream ended without `[DONE]` or an error event
    TRUNCATED = "truncated"
    #: reading the upstream failed mid-stream (reset, idle timeout, bad framing)
    FAILED = "failed"
    #: `timeouts.max_stream` passed
    TOO_LONG = "too_long"
    #: the client went away (also the relay's state until one of the ends above is seen)
    CLIENT_GONE = "client_gone"
    #: the client stopped reading for `timeouts.stuck_client`; its connection was dropped
    STUCK_CLIENT = "stuck_client"
    #: the shutdown grace ended while the stream was live
    SHUTDOWN = "shutdown"
    #: an exception of ours escaped the relay (a bug, logged; never a client that left)
    INTERNAL_ERROR = "internal_error"


#: the ends that are errors, each counted as `stream_<end>`
ERROR_ENDS: tuple[StreamEnd, ...] = tuple(end for end in StreamEnd if end is not StreamEnd.DONE)
