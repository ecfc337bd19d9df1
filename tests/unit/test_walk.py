"""A streamed chat request enters each file of its walk once, as `docs/architecture.md` ("A
request's walk") draws it: traced through the app under uvicorn against a scripted upstream.

Why a trace and not a read of the imports: the layering test holds which module may import
which; what it cannot see is a layer stepping into a file, leaving it, and coming back to it
later in the same request (the plan taken in two steps, a route's checks made one call at a
time, an object built in one file and run from another). Those returns are what make a walk
hard to follow and a change to one step touch several; this test names each file's entries.

What is an entry: a fresh call (a coroutine or generator resumed is not one) of a function of
`gateway/` or `providers/` whose nearest caller in those trees is in another file (or in none:
a task the event loop starts, which runs code a visit of the file began and is not counted).
Entering a file a second time is a return, unless the file is one of `HELPERS` (state and
tables every step reads); the returns left are exactly `RETURNS`, which the docs name, each
with why it stays.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from tests.harness.builders import POOL, gateway_settings
from tests.harness.factories import AsgiServerFactory, UpstreamFactory
from tests.harness.leaks import gateway_in_use
from tests.harness.loop import LoopThread

ROOT = Path(__file__).resolve().parents[2]
TREES = (str(ROOT / "gateway") + "/", str(ROOT / "providers") + "/")

#: files any step may call into, as often as it needs: not steps of the walk but the state and
#: tables they share. Each is named with why it is not a step.
HELPERS = {
    # the pool's runtime state (in-flight counts, sizes, delays): read and updated by the proxy,
    # the plan, the runner and the end, as the pool's own counters
    "gateway/hedge/pool.py": "the pool's state, counted by each step",
    # the balancer's counters: the race tells it each attempt's start and end, the end the
    # winner's release
    "gateway/hedge/balancer.py": "the backends' in-flight counters",
    "gateway/hedge/headroom.py": "the balancer's quota table",
    # the delays the race reads and then teaches with what it saw
    "gateway/hedge/sizing.py": "the delay readers, read then taught",
    "gateway/hedge/classes.py": "the delay readers, read then taught",
    "gateway/hedge/delay.py": "the delay readers, read then taught",
    "gateway/hedge/latency.py": "the latency windows every recorder feeds",
    "gateway/hedge/prefill.py": "the size table (tokens of bytes, size classes)",
    "gateway/hedge/budget.py": "the hedge budget's counters",
    # the request's translations, made when an attempt first needs one: a value the proxy,
    # the placement and the runner read, as they read the pool's state
    "gateway/hedge/translated.py": "the request's lazily made translations",
    # the shutdown's timers: a step registers its grace callback and forgets it as it ends
    "gateway/drain.py": "the shutdown's timer registry",
    # the wire rules of a protocol: the attempt reads events with its predicate, the relay
    # writes them with its encoder, per event by design
    "gateway/wire/chat.py": "the chat protocol's codec, read per event",
    "gateway/wire/base.py": "the protocols' shared codec types",
    "gateway/wire/sse.py": "the SSE codec, per chunk",
    "gateway/wire/ratelimit.py": "the quota headers' reader",
    # the upstream's client and its responses read as events: the attempt and the relay read
    # the stream an adapter opened (`AiohttpStream`) per read, and close it
    "providers/http.py": "the upstream client and its responses' events, per read",
    "providers/base.py": "the providers' shared close rule",
    # the summary is one record every step writes into; the stats, the tables that read it
    "gateway/stats/summary.py": "the request's summary record",
    "gateway/stats/races.py": "the stats tables",
    "gateway/stats/record.py": "the stats tables",
    "gateway/errors.py": "the error tree and its status table",
    # the admission counters: the body's read reserves its bytes, the proxy enters, the end
    # leaves (`gateway.api.admission`, apart from the proxy for this)
    "gateway/api/admission.py": "the admission counters, shared by three steps",
    "gateway/settings/hidden.py": "the secret rules the log's model name is read through",
    # the server's hooks in the scope (hold the head, abort, the client gone): the proxy and
    # the stream each read the ones they use, as they read the scope itself
    "gateway/server/extensions.py": "the server's hooks, read from the scope",
}

#: the files of the app's background loops (the delays' refresh, the retired providers'
#: close), which may tick while the request runs: what they call is not the request's walk
BACKGROUND = {"gateway/app.py"}

#: returns the walk still makes, each with why it stays (`docs/architecture.md` names the same):
#: the test holds exactly these, so one that goes (or comes) is seen here and in the docs. None
#: is left: each step is entered once, and a value handed on (the stream, the request's end,
#: the race's leftovers, the winner's prefix) is built as data and entered when it runs.
RETURNS: dict[str, str] = {}


def _tree_file(path: str) -> str | None:
    for tree in TREES:
        if path.startswith(tree):
            return path[len(str(ROOT)) + 1:]
    return None


class WalkTracer:
    """A profile hook (`sys.setprofile`) that notes each entry into a file of the trees."""

    def __init__(self) -> None:
        #: (caller file or None, entered file, function)
        self.entries: list[tuple[str | None, str, str]] = []
        self._seen: set[FrameType] = set()  # frames begun: a later 'call' is a resume

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame in self._seen:
            return
        entered = _tree_file(frame.f_code.co_filename)
        if entered is None:
            return
        self._seen.add(frame)
        caller = root = None  # the nearest and the outermost frame of the trees above it
        back = frame.f_back
        while back is not None:
            file = _tree_file(back.f_code.co_filename)
            if file is not None:
                caller, root = caller or file, file
            back = back.f_back
        if root in BACKGROUND or entered in BACKGROUND:
            return  # the app's own loops (the delays' refresh), not the request
        if caller != entered:
            self.entries.append((caller, entered, frame.f_code.co_name))


def returns(entries: list[tuple[str | None, str, str]]) -> list[str]:
    """Each entry into a file after its first, helpers aside: the walk's returns. An entry
    with no caller in the trees (a task the event loop starts, a callback it runs) runs code
    a visit of the file started, and is not counted."""
    entered: set[str] = set()
    found = []
    for caller, file, name in entries:
        if caller is None or file in HELPERS:
            continue
        if file in entered:
            found.append(f"{file} ({name}, from {caller})")
        entered.add(file)
    return found


def _idle(app: Any, loop_thread: LoopThread) -> None:
    """Wait until the gateway holds nothing (the request's end has run): a bounded poll for
    the end to be done, not a timing assertion."""
    for _ in range(500):
        if not loop_thread.call(lambda: gateway_in_use(app)) and \
                loop_thread.call(lambda: app.state.proxy.admission.active) == 0:
            return
        time.sleep(0.01)
    raise AssertionError(gateway_in_use(app))


def test_a_streamed_chat_request_enters_each_file_of_its_walk_once(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory,
) -> None:
    upstream = scripted_upstream(1)[0]
    app = create_app(gateway_settings([upstream.base_url], hedging=False))
    gateway = asgi_server(app)
    tracer = WalkTracer()
    chat = {"model": POOL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.Client() as client:
        # a first request, not traced: what runs once per process (imports, first-use caches)
        client.post(gateway.url("/v1/chat/completions"), json=chat).read()
        _idle(app, loop_thread)

        async def trace(hook: Any) -> None:
            sys.setprofile(hook)  # the loop thread's: the gateway and the upstream run there

        loop_thread.run(trace(tracer))
        try:
            with client.stream("POST", gateway.url("/v1/chat/completions"), json=chat) as answer:
                body = answer.read()
            _idle(app, loop_thread)
        finally:
            loop_thread.run(trace(None))
    assert answer.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
    entered = {entered for _, entered, _ in tracer.entries}
    # the walk was traced from the route to the end
    for step in ("gateway/api/chat.py", "gateway/api/proxy.py", "gateway/hedge/race.py",
                 "gateway/hedge/attempt.py", "providers/openai.py", "gateway/hedge/relay.py",
                 "gateway/api/end.py"):
        assert step in entered, step
    # and the values handed on were entered as they ran: the stream (sent by the app), the
    # winner's prefix (closed by the relay), the race's leftovers (reaped by the end)
    for value in ("gateway/api/stream.py", "gateway/hedge/prefix.py", "gateway/hedge/losers.py"):
        assert value in entered, value
    found = returns(tracer.entries)
    assert sorted({entry.split(" ")[0] for entry in found}) == sorted(RETURNS), found


@pytest.mark.parametrize(("entries", "found"), [
    # entered from the proxy, left, entered again (the plan in two steps): a return
    ([("api/proxy.py", "hedge/plan.py", "a"), ("api/proxy.py", "wire/usage.py", "b"),
      ("api/proxy.py", "hedge/plan.py", "c")], ["hedge/plan.py (c, from api/proxy.py)"]),
    # its own calls within: one visit
    ([("api/proxy.py", "hedge/plan.py", "a"), ("hedge/plan.py", "hedge/affinity.py", "b")], []),
    # a callee calling back up into the file that called it: a return
    ([("api/asgi.py", "api/chat.py", "r"), ("api/chat.py", "api/common.py", "a"),
      ("api/common.py", "api/chat.py", "b")], ["api/chat.py (b, from api/common.py)"]),
    # a task the loop starts, and a helper: not counted
    ([("api/proxy.py", "hedge/race.py", "a"), (None, "hedge/race.py", "run"),
      ("api/proxy.py", "gateway/errors.py", "a"), ("api/end.py", "gateway/errors.py", "b")],
     []),
])
def test_the_rule_of_returns(entries: list[tuple[str | None, str, str]], found: list[str]
                             ) -> None:
    assert returns(entries) == found
