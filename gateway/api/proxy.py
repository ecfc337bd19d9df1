"""One logical request from validated body to response: deadline, race, relay, bookkeeping.

This is the shell around the race. It decides whether a request may be hedged,
computes its deadline, runs the race while watching for the client's disconnect, and
answers: a streaming response that relays the winner, a JSON body, or an error.

One owner ends every request, whatever path it takes: `RequestEnd` (`gateway.api.end`).
Only when no response will carry it (a bug of ours raised, or the request task is cancelled)
does `handle` run it inline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from gateway.api.end import LINE_KEY, AnswerThen, RequestEnd, report_bug
from gateway.api.request import (
    Admission,
    LogicalRequest,
    affinity_applies,
    affinity_route,
    excluded_backends,
    header_seconds,
    hedge_refusal,
)
from gateway.api.stream import SSEResponse
from gateway.clock import Clock
from gateway.drain import Drain
from gateway.errors import (
    Draining,
    GatewayError,
    InternalError,
    Overloaded,
    UpstreamRejectedRequest,
    UpstreamStatusError,
)
from gateway.hedge.attempt import AttemptRecord, Prefix, open_until_first_token, open_whole_response
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.race import AttemptRunner, Race, RaceResult
from gateway.hedge.relay import relay
from gateway.settings import ServerSettings
from gateway.stats import RequestSummary, Stats
from gateway.stats.requestlog import log_request
from gateway.wire.base import RelayOutcome, StreamEnd
from gateway.wire.named import Rewrite, named_encoder
from gateway.wire.usage import ask_for_usage, body_usage
from providers.base import UpstreamCall

if TYPE_CHECKING:  # tracing imports OpenTelemetry only when it is configured
    from gateway.stats.tracing import RequestTrace, Tracing


#: statuses of the one backend holding a stored response that answer the client as they are
#: (a 401 or 429 there says nothing about the client's request: those stay a 502)
PINNED_ANSWERS = frozenset({400, 404, 409, 422})


class Proxy:
    """Runs logical requests against pools. One per app."""

    def __init__(
        self, server: ServerSettings, stats: Stats, clock: Clock, drain: Drain,
        tracing: Tracing | None = None,
    ) -> None:
        self.server = server
        #: None when tracing is off: then a request pays one `is None` test for it
        self.tracing = tracing
        self.drain = drain
        self.stats = stats
        self.clock = clock
        self.admission = Admission(server.max_concurrent_requests,
                                   server.max_inflight_body_bytes)

    def deadline(self, pool: PoolRuntime, req: LogicalRequest, start: float) -> float:
        """One absolute first-token deadline shared by every attempt.

        A non-streaming response (and an embedding) has no token before its whole body, so
        `timeouts.first_token` would cut off every answer that takes longer to generate: those
        are bounded by the pool's `timeout`, for the whole response."""
        limits = [pool.settings.timeout]
        if req.stream:
            limits.append(pool.settings.timeouts.first_token)
        for name in ("x-request-timeout", "x-stainless-read-timeout"):
            seconds = header_seconds(req.headers, name)
            if seconds is not None:
                limits.append(seconds)
        return start + min(limits)

    async def handle(self, request: Request, pool: PoolRuntime, req: LogicalRequest) -> Response:
        excluded = excluded_backends(pool, req)
        # from here every path writes the request's log line (the end, or a refusal below)
        request.scope.setdefault("state", {})[LINE_KEY] = True
        method = request.scope["method"]
        held = req.body_bytes or 0  # counted against `server.max_inflight_body`
        try:
            if self.drain.draining:
                raise Draining()
            self.admission.enter(held)
        except Overloaded as exc:
            self._record_refusal(pool, req, exc, method)
            raise
        start = self.clock()
        pool.inflight_requests += 1
        pool.holding += 1
        summary = RequestSummary(req.request_id, pool.settings.name, req.endpoint, req.stream,
                                 start, metered=req.metered, route=req.route, method=method,
                                 model=req.model)
        try:
            race, end, strip_usage = self._prepare(request, pool, req, summary, excluded, held)
        except BaseException as exc:  # nothing owns the request's end yet: give back here
            pool.inflight_requests -= 1
            pool.holding -= 1
            self.admission.leave(held)
            if not isinstance(exc, Exception):
                raise
            error = exc if isinstance(exc, GatewayError) else InternalError.of(exc)
            if not isinstance(exc, GatewayError):
                report_bug(self.stats, exc)
            summary.error = error.code or type(error).__name__
            summary.status, summary.reason = error.status, error.log_reason()
            summary.ended = self.clock()
            self.stats.record(summary)
            log_request(summary, self.stats.error_classes)
            if error is exc:
                raise
            raise error from exc
        try:
            result = await self._race_or_disconnect(race, request.receive, end)
            # no attempt starts after the race: let go of the body and its serialized copy,
            # which the runner holds and a stream would otherwise keep to its end
            race.runner = _race_over
            summary.attach(race.attempts, race.suppressed, result)
            if result is None:  # the client went away before the first token
                summary.error = summary.reason = "client_disconnected"
                summary.status = 499
                return AnswerThen(Response(status_code=499), end)
            end.prefix = winner = result.prefix
            rewrite = None
            if req.on_commit is not None:
                rewrite = req.on_commit(result.winner.backend, winner.buffered)
            headers = {
                **winner.stream.headers,  # allowlisted upstream headers; ours take precedence
                "x-request-id": req.request_id,
                "x-hedge-backend": result.winner.backend,
                "x-hedge-attempts": str(len(race.attempts)),
            }
            summary.status = 200
            if not req.stream:
                body = winner.buffered[0].data
                if rewrite is not None:
                    body = rewrite[1](body)
                if req.metered:
                    summary.usage = body_usage(body)
                return AnswerThen(
                    Response(body, media_type="application/json", headers=headers), end
                )
            return self._streaming_response(pool, req, result, summary, headers, end,
                                            strip_usage, rewrite)
        except GatewayError as exc:
            summary.attach(race.attempts, race.suppressed, None)
            summary.error = exc.code or type(exc).__name__
            summary.status, summary.reason = exc.status, exc.log_reason()
            exc.after_response = end  # the error handler answers, then ends the request
            raise
        except Exception as exc:  # a bug of ours: answered in the route's shape all the same
            report_bug(self.stats, exc)
            if summary.winner is None:
                summary.attach(race.attempts, race.suppressed, None)
            summary.error = summary.reason = InternalError.code
            summary.status = InternalError.status
            error = InternalError.of(exc)
            error.after_response = end
            raise error from exc
        except BaseException:
            await end()  # no response will carry the end (a bug of ours, a cancellation)
            raise

    def _prepare(
        self, request: Request, pool: PoolRuntime, req: LogicalRequest,
        summary: RequestSummary, excluded: frozenset[str], held: int = 0,
    ) -> tuple[Race, RequestEnd, bool]:
        """The race of an admitted request, the owner of its end, and whether the usage the
        gateway asked for is to be dropped from the stream."""
        start = summary.started
        refusal = None if req.single else hedge_refusal(pool, req)
        deadline = self.deadline(pool, req, start)
        upstream_body, strip_usage = ask_for_usage(req.endpoint, req.stream, req.body)
        trace = None if self.tracing is None else self.tracing.start(
            req.headers, pool.settings.name, req.endpoint)
        route = affinity_route(pool, req, excluded)
        summary.size = size = pool.size_of(req.body_bytes if req.metered else None, route)
        delays, cold = pool.sized(size, req.endpoint, req.stream)
        race = Race(
            pool,
            self._runner(pool, req if upstream_body is req.body else
                         dataclasses.replace(req, body=upstream_body), deadline, trace),
            RaceOptions(
                deadline,
                delays,
                refusal is None and not req.single,
                refusal,
                excluded,
                learn=req.metered,
                affinity=route,
                cold=cold,
                input_tokens=0 if size is None else size.tokens,
            ),
            self.clock,
        )
        if race.options.affinity is None and affinity_applies(pool, req):
            race.placement.affinity = "miss"
        end = RequestEnd(pool, race, summary, leave=functools.partial(self.admission.leave, held),
                         stats=self.stats,
                         clock=self.clock, trace=trace)
        return race, end, strip_usage

    def _runner(
        self, pool: PoolRuntime, req: LogicalRequest, deadline: float, trace: RequestTrace | None
    ) -> AttemptRunner:
        protocol = req.protocol
        body = req.body
        models = pool.models
        # serialized once for every attempt: `{"model":` + the backend's model + the rest;
        # a request on a stored response (`path`) carries its body as the client sent it;
        # not at all for providers that build their own request from the body (a copy of
        # a body of up to `server.max_body` held for nothing)
        # (kept as serialized, `{...}`, and joined past its brace: each slice or `+` of it
        # was one more copy of the whole body)
        rest = memoryview(b"")
        if req.path is None and any(_sends_content(p) for p in pool.providers.values()):
            rest = memoryview(json.dumps({k: v for k, v in body.items() if k != "model"},
                                         separators=(",", ":")).encode())[1:]
        comma = b"" if bytes(rest[:1]) == b"}" else b","

        async def run(backend: str, record: AttemptRecord) -> Prefix:
            def is_lost() -> bool:
                if record.outcome is not None:
                    record.late_events += 1
                    return True
                return False

            call = UpstreamCall(
                endpoint=req.endpoint,
                body={**body, "model": models[backend]} if req.path is None else body,
                stream=req.stream,
                request_id=req.request_id,
                first_byte_timeout=max(0.0, deadline - self.clock()),
                content=b"".join((b'{"model":', pool.models_json[backend], comma, rest))
                if rest and _sends_content(pool.providers[backend]) else b"",
                extra_headers=req.forward_headers,
                method=req.method,
                path=req.path,
                query=req.query,
            )
            if trace is not None:
                call = dataclasses.replace(
                    call, extra_headers={**call.extra_headers, **trace.attempt_started(record)})
            provider = pool.providers[backend]
            seen = pool.quota_watch(backend, self.clock)
            try:
                if req.stream:
                    return await open_until_first_token(
                        provider, call, is_lost, protocol.classify, protocol.answered, seen
                    )
                return await open_whole_response(provider, call, is_lost, protocol.classify_body,
                                                 seen)
            except UpstreamStatusError as exc:
                if req.pinned is not None and exc.status in PINNED_ANSWERS:
                    # no other backend holds this state: its verdict on the request (404: it
                    # no longer has the response) is the answer, not a 502
                    raise UpstreamRejectedRequest(exc.status) from None
                raise
            finally:
                record.ended = self.clock()
                if trace is not None:
                    trace.attempt_ended(record)

        return run

    async def _race_or_disconnect(
        self, race: Race, receive: Receive, end: RequestEnd
    ) -> RaceResult | None:
        """Run the race; a client disconnect cancels it (and so every attempt), and so does
        the end of the shutdown grace period (the client then gets 503).

        One task watches the client for the whole request (`end.watcher`): a stream's
        response keeps using it after commit, and the end of the request cancels it. The
        drain is a callback, not a task."""
        race_task = asyncio.ensure_future(race.run())
        watcher = end.watcher = asyncio.ensure_future(_wait_disconnect(receive))
        stop_race = _canceller(race_task)
        watcher.add_done_callback(stop_race)
        forget = self.drain.call_at_grace_end(self.server.shutdown_grace, stop_race)
        try:
            await asyncio.wait({race_task})
        finally:
            forget()
            watcher.remove_done_callback(stop_race)
            if not race_task.done():
                race_task.cancel()
                await asyncio.wait({race_task})
        if race_task.cancelled():
            if self.drain.draining and not _saw_disconnect(watcher):
                raise Draining()
            return None
        return race_task.result()

    def _record_refusal(self, pool: PoolRuntime, req: LogicalRequest, exc: Overloaded,
                        method: str) -> None:
        """A request refused before its race (overload, shutdown) still counts and logs."""
        now = self.clock()
        summary = RequestSummary(req.request_id, pool.settings.name, req.endpoint, req.stream,
                                 now, route=req.route, method=method, model=req.model,
                                 status=exc.status, reason=exc.log_reason())
        summary.error = exc.code
        summary.ended = now
        self.stats.record(summary)
        log_request(summary, self.stats.error_classes)

    def _streaming_response(
        self,
        pool: PoolRuntime,
        req: LogicalRequest,
        result: RaceResult,
        summary: RequestSummary,
        headers: dict[str, str],
        end: RequestEnd,
        strip_usage: bool,
        rewrite: Rewrite | None = None,
    ) -> Response:
        outcome = RelayOutcome(strip_usage=strip_usage)
        timeouts = pool.settings.timeouts
        protocol = req.protocol
        body = relay(
            result.prefix,
            request_id=req.request_id,
            idle=timeouts.idle,
            max_stream_deadline=self.clock() + timeouts.max_stream,
            clock=self.clock,
            outcome=outcome,
            encode_batch=named_encoder(protocol, rewrite) if protocol.ends else None,
            error_event=protocol.error_event,
        )

        async def finish(early_end: StreamEnd | None) -> None:
            summary.relay_end = early_end or outcome.end
            summary.usage = outcome.usage
            await end()

        return SSEResponse(
            body,
            headers=headers,
            keepalive=self.server.keepalive,
            stuck_client=timeouts.stuck_client,
            drain=self.drain,
            grace=self.server.shutdown_grace,
            shutdown_event=protocol.error_event(
                "the gateway is shutting down", "gateway_shutdown", req.request_id
            ),
            on_close=finish,
            on_exhausted=end.release_winner,
            clock=self.clock,
            client_gone=end.watcher,
            internal_event=protocol.error_event(
                "internal error", InternalError.code, req.request_id
            ),
        )

async def _race_over(backend: str, record: AttemptRecord) -> Prefix:
    """The runner of a race that has ended (it holds nothing; it is never called)."""
    raise RuntimeError(f"attempt on {backend} after its race ended")


def _sends_content(provider: object) -> bool:
    """Whether `provider` sends `UpstreamCall.content` (the HTTP APIs do; a provider that
    builds its own request from the body says `sends_content = False`)."""
    return bool(getattr(provider, "sends_content", True))


def _canceller(task: asyncio.Future[Any]) -> Callable[..., None]:
    """A callback (for a done-callback or a timer) that cancels `task`."""

    def cancel(*_: object) -> None:
        task.cancel()

    return cancel


def _saw_disconnect(task: asyncio.Future[None]) -> bool:
    """Whether the disconnect watcher saw the client leave (not merely got cancelled)."""
    return task.done() and not task.cancelled() and task.exception() is None


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
