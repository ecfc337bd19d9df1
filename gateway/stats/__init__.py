"""What the gateway tells operators: counters, the `/hedge/stats` view, Prometheus metrics,
the request log, and the `stats` command's tables.

`record` holds the counters, fed once per logical request; the others only read them.
"""

from gateway.stats.prometheus import Metrics
from gateway.stats.record import (
    BackendStats,
    BucketHistogram,
    CounterRing,
    PoolStats,
    Stats,
    failure_class,
    latency_saved,
    request_class,
)
from gateway.stats.requestlog import LOGGER_NAME, log_request, request_record
from gateway.stats.summary import RequestSummary
from gateway.stats.table import print_stats, render
from gateway.stats.view import snapshot

__all__ = [
    "LOGGER_NAME",
    "BackendStats",
    "BucketHistogram",
    "CounterRing",
    "Metrics",
    "PoolStats",
    "RequestSummary",
    "Stats",
    "failure_class",
    "latency_saved",
    "log_request",
    "print_stats",
    "render",
    "request_class",
    "request_record",
    "snapshot",
]
