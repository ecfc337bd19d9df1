"""The simulator as an in-process provider: `SimProvider`, no sockets, same wire content.

Plans come from `providers.sim.wire` and bytes from each API's module, shared with the loopback
server (`providers.sim.server`); this module only plays them out as `UpstreamStream`s inside
the gateway's event loop, with delays that an `aclose` from another task can cut short. A
request the real API would refuse (`providers.sim.validate`) fails with status 400, as it
would over HTTP.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping

from gateway.errors import (
    UpstreamDisconnected,
    UpstreamRejectedRequest,
    UpstreamStatusError,
    UpstreamTimeout,
)
from gateway.settings import BackendSettings, SimProfile
from gateway.wire.explain import explain
from gateway.wire.sse import SSEBatch, SSEEvent
from providers.base import ENDPOINTS, UpstreamCall, UpstreamStream
from providers.sim import protocols
from providers.sim.chat import sim_payloads, sim_response
from providers.sim.quota import SimQuota, refusal
from providers.sim.validate import check_request, error_answer
from providers.sim.wire import (
    TTFT_HEADER,
    SimBreak,
    SimModel,
    SimPlan,
    Sleep,
    parse_fault_headers,
    parse_ttft_override,
    retry_after_for,
    wire_json,
)


class _Closed(Exception):
    """Raised inside a stream's sleep once `aclose` ran, to unwind its generators."""


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _SimStream:
    """A streaming attempt. `aclose` also ends a read parked in a delay, from any task: an async
    generator cannot be closed while another task is inside it, so the parked reader is woken
    and unwinds by itself."""

    def __init__(
        self, payloads: Callable[[Sleep], AsyncGenerator[bytes | tuple[bytes, bytes], None]]
    ) -> None:
        self.headers: Mapping[str, str] = {}
        self._closed = False
        self._parked = False
        self._waiter: asyncio.Future[None] | None = None
        self._payloads = payloads(self._sleep)
        self._iterator: AsyncGenerator[SSEBatch, None] | None = None

    def batches(self) -> AsyncIterator[SSEBatch]:
        if self._iterator is None:
            self._iterator = self._iterate()
        return self._iterator

    async def _iterate(self) -> AsyncGenerator[SSEBatch, None]:
        try:
            async for item in self._payloads:
                # chat payloads are bare data; the Responses/Messages ones (name, data)
                event = SSEEvent(item) if isinstance(item, bytes) else SSEEvent(item[1], item[0])
                yield SSEBatch([event])
                if self._closed:
                    return
        except _Closed:
            return
        except SimBreak as exc:
            # what the HTTP client makes of each break: a reset is a disconnect; a body
            # that ends early, or inside an event (which the decoder drops), just ends
            if exc.kind == "reset":
                raise UpstreamDisconnected("simulated connection reset mid-stream") from None
            return

    async def _sleep(self, delay: float) -> None:
        if self._closed:
            raise _Closed
        self._parked = True
        try:
            if delay <= 0:
                await asyncio.sleep(0)  # still let others run between zero-latency tokens
            else:
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                handle = None if math.isinf(delay) else loop.call_later(delay, _wake, fut)
                self._waiter = fut
                try:
                    await fut
                finally:
                    self._waiter = None
                    if handle is not None:
                        handle.cancel()
        finally:
            self._parked = False
        if self._closed:
            raise _Closed

    async def aclose(self) -> None:
        self._closed = True
        if self._parked:
            if self._waiter is not None:
                _wake(self._waiter)
            return
        if self._iterator is not None:
            await self._iterator.aclose()
        await self._payloads.aclose()


class _SimBody:
    """A finished non-streaming attempt: one event holding the JSON body."""

    def __init__(self, body: bytes) -> None:
        self.headers: Mapping[str, str] = {}
        self._body: bytes | None = body

    async def batches(self) -> AsyncIterator[SSEBatch]:
        if self._body is not None:
            yield SSEBatch([SSEEvent(self._body)])

    async def aclose(self) -> None:
        self._body = None


async def _await_whole(plan: SimPlan, wait: float, call: UpstreamCall) -> None:
    """A non-streaming answer: status and headers come with the whole body, as over HTTP,
    after `wait`; past the first-byte timeout it times out; a mid-stream fault is a 500."""
    if wait > call.first_byte_timeout:
        await asyncio.sleep(call.first_byte_timeout)
        raise UpstreamTimeout("no response before the first-byte timeout")
    await asyncio.sleep(wait)
    if plan.midstream_error_after is not None:
        raise UpstreamStatusError.of(500)


class SimProvider:
    """A simulated backend inside the gateway's process: no sockets, same wire content.

    Randomness: the profile's `seed` wins when set (a config asks for a reproducible backend);
    otherwise `rng` (the registry derives one per backend), otherwise a fresh generator.
    """

    #: the simulator speaks every route
    #: it builds its own request from `UpstreamCall.body`, never sends `content`: the proxy
    #: then serializes no copy of the body for it (`gateway.api.proxy`)
    sends_content = False
    serves: frozenset[str] = frozenset(ENDPOINTS)

    def __init__(self, settings: BackendSettings, *, rng: random.Random | None = None) -> None:
        self.name = settings.name
        self._model_name = settings.model
        profile = settings.sim or SimProfile()
        if profile.seed is not None or rng is None:
            rng = random.Random(profile.seed)
        self.model = SimModel(profile, rng)
        self.quota = SimQuota(profile.rate_limit_requests, profile.rate_limit_window) \
            if profile.rate_limit_requests else None

    async def open(self, call: UpstreamCall) -> UpstreamStream:
        """The planned answer; with a quota, refused past it (429) and stating what is left
        in its headers (`providers.sim.quota`)."""
        quota = self.quota
        if quota is None:
            return await self._open(call)
        now = time.monotonic()
        if not quota.take(now):
            raise refusal(quota, call.endpoint, now)
        headers = quota.headers(call.endpoint, now)
        try:
            stream = await self._open(call)
        except UpstreamStatusError as exc:
            exc.quota = headers
            raise
        stream.headers = headers
        return stream

    async def _open(self, call: UpstreamCall) -> UpstreamStream:
        try:
            override = parse_ttft_override(call.extra_headers.get(TTFT_HEADER))
            faults = parse_fault_headers(call.extra_headers)
        except ValueError:
            raise UpstreamStatusError.of(400) from None
        rejection = check_request(call.endpoint, call.body)
        if rejection is not None:  # what the real API refuses, in its words (as over HTTP)
            raise UpstreamRejectedRequest(400, explanation=explain(
                wire_json(error_answer(call.endpoint, 400, rejection))))
        plan = self.model.plan(call.body, endpoint=call.endpoint, ttft_override=override,
                               faults=faults)
        if plan.status != 200:
            raise UpstreamStatusError.of(plan.status, retry_after=retry_after_for(plan.status))
        created = int(time.time())
        if call.endpoint in protocols.ROUTES:
            return await self._open_protocol(call, plan, created)
        if call.stream and call.endpoint != "embeddings":
            endpoint = call.endpoint

            def payloads(sleep: Sleep) -> AsyncGenerator[bytes, None]:
                return sim_payloads(
                    plan,
                    endpoint=endpoint,
                    model=self._model_name,
                    request_id=call.request_id,
                    sleep=sleep,
                    created=created,
                )

            return _SimStream(payloads)
        await _await_whole(plan, plan.response_time(call.endpoint), call)
        body = sim_response(plan, call.endpoint, self._model_name, call.request_id, created)
        return _SimBody(wire_json(body))

    async def _open_protocol(
        self, call: UpstreamCall, plan: SimPlan, created: int
    ) -> UpstreamStream:
        """The Responses API and Messages routes, with the same plan semantics."""
        if call.stream and call.endpoint in ("responses", "messages"):
            endpoint = call.endpoint

            def payloads(sleep: Sleep) -> AsyncGenerator[tuple[bytes, bytes], None]:
                return protocols.protocol_stream(
                    plan, endpoint, model=self._model_name, request_id=call.request_id,
                    sleep=sleep, created=created,
                )

            return _SimStream(payloads)
        await _await_whole(plan, protocols.response_time(plan, call.endpoint), call)
        body = protocols.protocol_body(
            plan, call.endpoint, method=call.method, path=call.path, model=self._model_name,
            request_id=call.request_id, created=created,
        )
        return _SimBody(wire_json(body))

    async def aclose(self) -> None:
        """Nothing to release: every attempt owns its own state."""
