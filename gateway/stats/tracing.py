"""OpenTelemetry traces of races: a span per logical request, a child per attempt.

`hedge_gateway.request` (attributes `pool`, `route`, `outcome`, `winner`, `ttft_ms`, `hedges`,
`failovers`, `attempts`) has the client's W3C `traceparent` as its parent, and one child
`hedge_gateway.attempt` per attempt (`backend`, `kind`, `outcome`, `ttft_ms`, `reason`), which
runs from the attempt's start to its first token, failure or cancellation: the trace draws the
race. Each attempt sends its own span's `traceparent` upstream, so the backend's spans hang
under the attempt that reached it.

Off unless configured: `server.tracing.exporter`, or with `env` (the default) the standard
`OTEL_TRACES_EXPORTER` (`otlp`, `console`, `none`; unset means off here, not OTLP). The rest is
the SDK's own reading of `OTEL_*` (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, ...).

Free when off: `build_tracing` returns None and the proxy tests `is None` once per request;
OpenTelemetry is not even imported (this module imports it inside functions only). When on, the
work is per request and per attempt, never per event. The provider is the app's own, never the
process-global one, so two gateways in one process (the tests) do not share spans.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.settings import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from gateway.hedge.attempt import AttemptRecord
    from gateway.settings import TracingSettings
    from gateway.stats.summary import RequestSummary

DEFAULT_SERVICE_NAME = "hedge-gateway"


class TracingUnavailable(ConfigError):
    """Tracing was asked for in a way that cannot run (an unknown exporter, or the OTLP
    exporter not installed): a configuration error, reported as one at start."""


def exporter_name(settings: TracingSettings, env: Mapping[str, str]) -> str:
    """`none`, `console` or `otlp`: the setting, or with `env` the OTEL variable (unset: none)."""
    if settings.exporter != "env":
        return settings.exporter
    raw = env.get("OTEL_TRACES_EXPORTER", "none").strip().lower() or "none"
    first = raw.split(",")[0].strip()
    if first not in ("none", "console", "otlp"):
        raise TracingUnavailable(
            f"OTEL_TRACES_EXPORTER: {raw!r} is not supported (use otlp, console or none)"
        )
    return first


def build_tracing(settings: TracingSettings, env: Mapping[str, str]) -> Tracing | None:
    """The app's tracing, or None when it is off (nothing of OpenTelemetry imported then)."""
    name = exporter_name(settings, env)
    if name == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    attributes: dict[str, Any] = {}
    if settings.service_name:
        attributes["service.name"] = settings.service_name
    elif not env.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = DEFAULT_SERVICE_NAME
    exporter: SpanExporter = (
        ConsoleSpanExporter() if name == "console" else _otlp_exporter(settings.endpoint)
    )
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider)


def _otlp_exporter(endpoint: str | None) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise TracingUnavailable(
            "server.tracing.exporter: otlp needs the OTLP exporter: "
            "pip install 'hedge-gateway[otlp]'"
        ) from None
    if endpoint is None:
        return OTLPSpanExporter()
    return OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")


class Tracing:
    """The app's tracer: starts one `RequestTrace` per logical request."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("hedge_gateway")
        self.propagator = TraceContextTextMapPropagator()
        self.in_context = trace.set_span_in_context
        self.server_kind = trace.SpanKind.SERVER
        self.client_kind = trace.SpanKind.CLIENT
        self.error = trace.Status(trace.StatusCode.ERROR)

    def start(self, headers: Mapping[str, str], pool: str, route: str) -> RequestTrace:
        """The request span, child of the client's `traceparent` when it sent a valid one."""
        parent = self.propagator.extract(headers)
        span = self.tracer.start_span(
            "hedge_gateway.request",
            context=parent,
            kind=self.server_kind,
            attributes={"pool": pool, "route": route},
        )
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Flush what the batch processor holds and stop it (at app shutdown)."""
        self.provider.shutdown()


def _set(span: Span, values: Mapping[str, str | int | float | None]) -> None:
    span.set_attributes({k: v for k, v in values.items() if v is not None})


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class RequestTrace:
    """One logical request's spans. Attempt spans stay open until the request ends, because an
    attempt's outcome (won, lost) is known only then; each ends at the time its attempt did."""

    __slots__ = ("_attempts", "_tracing", "span")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self.span = span
        #: attempt index -> (its span, when its runner returned or raised, in ns)
        self._attempts: dict[int, tuple[Span, int | None]] = {}

    def attempt_started(self, record: AttemptRecord) -> dict[str, str]:
        """Open the attempt's span; returns the headers that carry it upstream."""
        tracing = self._tracing
        span = tracing.tracer.start_span(
            "hedge_gateway.attempt",
            context=tracing.in_context(self.span),
            kind=tracing.client_kind,
            attributes={"backend": record.backend, "kind": record.kind},
        )
        self._attempts[record.index] = (span, None)
        headers: dict[str, str] = {}
        tracing.propagator.inject(headers, context=tracing.in_context(span))
        return headers

    def attempt_ended(self, record: AttemptRecord) -> None:
        """The attempt's runner is done (first token, failure or cancellation)."""
        entry = self._attempts.get(record.index)
        if entry is not None and entry[1] is None:
            self._attempts[record.index] = (entry[0], time.time_ns())

    def end(self, summary: RequestSummary, error_classes: frozenset[str]) -> None:
        """Close every span with what the request's records say."""
        from gateway.stats.record import request_class

        for record in summary.attempts:
            entry = self._attempts.pop(record.index, None)
            if entry is None:
                continue
            span, ended = entry
            _set(span, {"outcome": record.outcome, "ttft_ms": _ms(record.ttft),
                        "reason": record.reason, "failure": record.failure})
            if record.outcome == "failed":
                span.set_status(self._tracing.error)
            span.end(end_time=ended)
        for span, ended in self._attempts.values():  # not in the summary (should not happen)
            span.end(end_time=ended)
        self._attempts.clear()
        kinds = [a.kind for a in summary.attempts]
        outcome = request_class(summary, error_classes)
        winner = summary.winner
        _set(self.span, {
            "outcome": outcome,
            "winner": None if winner is None else winner.backend,
            "ttft_ms": _ms(summary.client_ttft),
            "hedges": kinds.count("hedge"),
            "failovers": kinds.count("failover"),
            "attempts": len(kinds),
        })
        if outcome != "ok":
            self.span.set_status(self._tracing.error)
        self.span.end()
