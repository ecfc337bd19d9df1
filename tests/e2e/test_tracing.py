"""OpenTelemetry traces over real sockets: a hedged request's trace holds one
request span under the client's `traceparent`, with both attempts as its children, and each
upstream received its own attempt's `traceparent`. Spans go to an in-memory exporter.

And tracing is off by default: no span, no `traceparent` upstream, OpenTelemetry not imported.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence

import openai
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    BudgetSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    Settings,
)
from gateway.stats.tracing import Tracing
from tests.harness import (
    SSE_HEADERS,
    AsgiServerFactory,
    Hang,
    RecordedRequest,
    Responder,
    Script,
    ScriptedUpstream,
    Send,
    UpstreamFactory,
    role_chunk,
    stream_script,
)

POOL = "chat"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def straggling_primary() -> Responder:
    """For both upstreams: the request's first attempt hangs after its role chunk, the
    second (the hedge) answers."""
    arrivals: list[RecordedRequest] = []

    def respond(rec: RecordedRequest) -> Script:
        arrivals.append(rec)
        if len(arrivals) == 1:
            return Script(headers=SSE_HEADERS, steps=[Send(role_chunk()), Hang()])
        return stream_script(["traced ", "answer"])

    return respond


def settings_for(ups: Sequence[ScriptedUpstream]) -> Settings:
    backends = tuple(
        BackendSettings(name, "openai", "m", base_url=up.base_url, group=name)
        for name, up in zip("ab", ups, strict=True)
    )
    hedging = HedgingSettings(max_attempts=2, delay=DelaySettings(mode="fixed", value=0.1),
                              budget=BudgetSettings(burst=10, ratio=0.5))
    return Settings((PoolSettings(POOL, backends, hedging=hedging),))


def finished(exporter: InMemorySpanExporter, count: int) -> tuple[ReadableSpan, ...]:
    """The exported spans once `count` have ended (the request span ends after the client
    has read the stream's end)."""
    deadline = time.monotonic() + 10.0
    while len(exporter.get_finished_spans()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return exporter.get_finished_spans()


def test_a_hedged_request_traces_both_attempts_under_the_clients_trace(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    responder = straggling_primary()
    ups = [scripted_upstream.one(responder=responder, name=n) for n in "ab"]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = asgi_server.build(
        lambda: create_app(settings_for(ups), seed=1, tracing=Tracing(provider)))
    with openai.OpenAI(base_url=gateway.v1, api_key="sk-none", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=POOL, messages=MESSAGES, stream=True,
            extra_headers={"traceparent": TRACEPARENT}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "traced answer"

    spans = finished(exporter, 3)
    (request,) = [s for s in spans if s.name == "hedge_gateway.request"]
    attempts = sorted((s for s in spans if s.name == "hedge_gateway.attempt"),
                      key=lambda s: s.start_time or 0)
    assert len(spans) == 3 and len(attempts) == 2
    # the request span continues the client's trace, as a child of the client's span
    assert request.context is not None and request.parent is not None
    assert f"{request.context.trace_id:032x}" == TRACE_ID
    assert f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert request.attributes is not None
    assert dict(request.attributes) == {
        "pool": POOL, "route": "chat/completions", "outcome": "ok",
        "winner": dict(attempts[1].attributes or {})["backend"],
        "ttft_ms": request.attributes["ttft_ms"], "hedges": 1, "failovers": 0, "attempts": 2,
    }
    # both attempts are its children: the primary lost to the hedge
    for span in attempts:
        assert span.context is not None and span.parent is not None
        assert span.context.trace_id == request.context.trace_id
        assert span.parent.span_id == request.context.span_id
    primary, hedge = (dict(s.attributes or {}) for s in attempts)
    assert (primary["kind"], primary["outcome"]) == ("primary", "lost")
    assert primary["reason"] == "cancelled before its first token"
    assert (hedge["kind"], hedge["outcome"]) == ("hedge", "won")
    assert {primary["backend"], hedge["backend"]} == {"a", "b"}
    assert isinstance(hedge["ttft_ms"], float) and isinstance(primary["ttft_ms"], float)
    # the hedge's span started after the primary's and ended (first token) after it started
    assert attempts[1].start_time is not None and attempts[0].start_time is not None
    assert attempts[1].start_time > attempts[0].start_time
    # each upstream received its own attempt's traceparent, not the client's
    by_backend = {dict(s.attributes or {})["backend"]: s for s in attempts}
    for name, up in zip("ab", ups, strict=True):
        (rec,) = up.requests
        span = by_backend[name]
        assert span.context is not None
        expected = f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
        assert rec.headers["traceparent"] == expected


def test_tracing_is_off_by_default(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    up = scripted_upstream.one()
    up.queue(stream_script(["untraced"]))
    settings = Settings((PoolSettings(POOL, (BackendSettings("a", "openai", "m",
                                                             base_url=up.base_url),)),))
    gateway = asgi_server.build(lambda: create_app(settings))
    with openai.OpenAI(base_url=gateway.v1, api_key="sk-none", max_retries=0) as client:
        list(client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True,
                                            extra_headers={"traceparent": TRACEPARENT}))
    (rec,) = up.requests
    assert "traceparent" not in rec.headers


def test_no_opentelemetry_sdk_when_tracing_is_off() -> None:
    """Free when off: the app has no tracer, and the OpenTelemetry SDK is never imported.
    (The API package may be: recent FastAPI imports it for its own opt-in telemetry.)"""
    code = (
        "import sys\n"
        "from gateway.app import create_app\n"
        "from gateway.settings import default_settings\n"
        "app = create_app(default_settings())\n"
        "print(app.state.proxy.tracing, "
        "sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "OTEL_TRACES_EXPORTER": "none"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, check=True)
    assert out.stdout.strip() == "None []"


def test_serve_refuses_an_unknown_traces_exporter_clearly() -> None:
    env = {"PATH": "/usr/bin:/bin", "OTEL_TRACES_EXPORTER": "zipkin"}
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", "0"],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2
    assert "invalid configuration" in done.stderr and "OTEL_TRACES_EXPORTER" in done.stderr
    assert "Traceback" not in done.stderr
