"""Factories behind the conftest fixtures: start servers in the loop thread, stop them at
teardown.

Why: a test asks for "two upstreams and a gateway" in one line, and the teardown (LIFO, in the
loop) can never be forgotten.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp

from tests.harness.asgi import RunningServer, serve_asgi
from tests.harness.leaks import gateway_in_use
from tests.harness.loop import LoopThread
from tests.harness.records import Responder
from tests.harness.upstream import ScriptedUpstream


class UpstreamFactory:
    """`factory(n)` starts n `ScriptedUpstream`s in the loop thread, stopped at teardown."""

    def __init__(self, loop_thread: LoopThread) -> None:
        self._loop_thread = loop_thread

    def __call__(
        self, count: int = 1, *, responder: Responder | None = None
    ) -> list[ScriptedUpstream]:
        return [self.one(responder=responder) for _ in range(count)]

    def one(self, *, responder: Responder | None = None, name: str = "") -> ScriptedUpstream:
        async def create() -> ScriptedUpstream:
            # constructed in the loop thread: its asyncio objects belong to that loop
            up = ScriptedUpstream(responder, name=name or "upstream")
            await up.start()
            return up

        upstream = self._loop_thread.run(create())
        self._loop_thread.add_cleanup(upstream.stop)
        self._loop_thread.add_live_check(upstream.unfinished)
        return upstream


class AsgiServerFactory:
    """`factory(app)` serves an ASGI app under uvicorn in the loop thread, stopped at
    teardown; `factory.build(make_app)` first calls `make_app()` inside the loop thread."""

    def __init__(self, loop_thread: LoopThread) -> None:
        self._loop_thread = loop_thread

    def __call__(self, app: ASGIApp, **kwargs: Any) -> RunningServer:
        return self.build(lambda: app, **kwargs)

    def build(self, make_app: Callable[[], ASGIApp], **kwargs: Any) -> RunningServer:
        async def create() -> RunningServer:
            return await serve_asgi(make_app(), **kwargs)

        running = self._loop_thread.run(create(), 30.0)
        self._loop_thread.add_cleanup(running.stop)
        self._loop_thread.add_live_check(lambda: gateway_in_use(running.server.config.app))
        return running
