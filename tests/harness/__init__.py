"""Shared harness for integration tests over real loopback sockets.

Why it exists: streaming behaviour (first token, hedges, cancellation) can only be tested over
real sockets, because in-memory ASGI transports buffer whole responses. So every integration
test runs real servers in one background event loop (`LoopThread`) and drives them from the
test thread with sync clients (the official `openai.OpenAI`, `httpx.Client`, raw sockets):

- `ScriptedUpstream`: a deliberately hostile upstream on raw `asyncio.start_server`, answering
  each request with a `Script` (data: status, headers, steps such as `Send`, `Hang`, `Reset`),
  and recording what happened (`RecordedRequest`: when it arrived, which SSE events were
  written when, when the client hung up). Tests assert order and causality from these records.
- `serve_asgi`: any ASGI app (the gateway, the simulator, a test app) under a real uvicorn.
- `LeakBaseline`: after a test, no asyncio task, file descriptor or TCP socket may remain.

Everything that waits takes a timeout, so a broken product fails a test instead of hanging it.

Modules, each importing only the ones above it in this list:

- `scripts`: a `Script` and its steps (`Head`, `Send`, `Sleep`, `Wait` on a `Gate`, `Hang`,
  `Reset`, `Close`), as plain data.
- `bodies`: OpenAI-shaped SSE events and JSON bodies, and ready-made scripts of them.
- `records`: `RecordedRequest` and the `SSEEventCounter` that fills in its event times.
- `http1`: the upstream's HTTP/1.1 wire work (read a request, write head and chunks, reset).
- `upstream`: `ScriptedUpstream` itself: connections, scripts, records, `wait_*` helpers.
- `loop`: `LoopThread`, the background event loop.
- `asgi`: `serve_asgi` and `RunningServer`, an ASGI app under uvicorn.
- `leaks`: `LeakBaseline`, the task/fd/socket leak check.
- `factories`: `UpstreamFactory` and `AsgiServerFactory` behind the conftest fixtures.

Two modules for the unit tests, imported by path (no sockets beyond the loop's own pipe):

- `virtualtime`: `VirtualLoop`, an event loop whose clock moves only when nothing is ready,
  and `run_virtual`, which runs a test on it and fails on a task left behind.
- `raceworld`: scripted attempts (`Step`: token, status, reset, hang, at a virtual time) for
  the race (`play`) and for the whole proxy (`proxy_for`).

One more, imported by path by the test of a real engine (it starts child processes and may
build them first, so nothing else should pull it in by accident):

- `engine`: llama-cpp-python's OpenAI-compatible server with a small model, built once into a
  cache outside the repository, started and stopped as real processes on 127.0.0.1.

This package re-exports the public names, so tests import from `tests.harness` only (apart
from the modules imported by path).
"""

from tests.harness.asgi import RunningServer, StartupFailed, serve_asgi
from tests.harness.bodies import (
    CHUNK_ID,
    CREATED,
    DONE,
    MODEL,
    SSE_HEADERS,
    chat_completion_obj,
    chunk_obj,
    comment,
    error_obj,
    error_script,
    finish_chunk,
    hang_script,
    json_script,
    reset_script,
    role_chunk,
    sse,
    stream_script,
    text_chunk,
    token_chunk,
    usage_chunk,
)
from tests.harness.factories import AsgiServerFactory, UpstreamFactory
from tests.harness.leaks import LeakBaseline
from tests.harness.loop import LoopThread
from tests.harness.records import Outcome, RecordedRequest, Responder, SSEEventCounter
from tests.harness.scripts import (
    Close,
    Framing,
    Gate,
    Hang,
    Head,
    Reset,
    Script,
    Send,
    Sleep,
    Step,
    Wait,
)
from tests.harness.upstream import ScriptedUpstream, default_responder

__all__ = [
    "CHUNK_ID",
    "CREATED",
    "DONE",
    "MODEL",
    "SSE_HEADERS",
    "AsgiServerFactory",
    "Close",
    "Framing",
    "Gate",
    "Hang",
    "Head",
    "LeakBaseline",
    "LoopThread",
    "Outcome",
    "RecordedRequest",
    "Reset",
    "Responder",
    "RunningServer",
    "SSEEventCounter",
    "Script",
    "ScriptedUpstream",
    "Send",
    "Sleep",
    "StartupFailed",
    "Step",
    "UpstreamFactory",
    "Wait",
    "chat_completion_obj",
    "chunk_obj",
    "comment",
    "default_responder",
    "error_obj",
    "error_script",
    "finish_chunk",
    "hang_script",
    "json_script",
    "reset_script",
    "role_chunk",
    "serve_asgi",
    "sse",
    "stream_script",
    "text_chunk",
    "token_chunk",
    "usage_chunk",
]
