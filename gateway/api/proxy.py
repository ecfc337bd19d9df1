"""One logical request from validated body to response: admission, plan, race, relay,
bookkeeping.

This is the shell around the race. It finds the backends the request may use
(`gateway.hedge.routing`: a route none serves is refused before admission), admits the request,
has its plan taken once (`gateway.hedge.plan`: may it be hedged, its deadline, its backends'
order), hands the
race that plan and the attempts' runner (`gateway.hedge.runner`), runs it while watching for the
client's disconnect, and returns its answer as a value: the streaming response that relays
the winner (`gateway.api.stream.SSEResponse`, which runs the request's end as it closes), or
a JSON body or an error in the route's shape (the request's protocol) with the request's end
to run after it (`gateway.api.answer.Answer`). The stream is built as data (its code first
runs when the app sends it), as is the request's end (first run when the request ends).

One owner ends every request, whatever path it takes: `RequestEnd` (`gateway.api.end`),
carried by the answer. Only when no answer will be sent (the request task is cancelled) does
`handle` run it inline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from gateway.api.admission import Admission
from gateway.api.answer import Answer, error_response, note_refusal
from gateway.api.end import LINE_KEY, SUMMARY_KEY, RequestEnd, report_bug
from gateway.api.request import LogicalRequest
from gateway.api.stream import SSE_HEAD, SSEResponse
from gateway.clock import Clock
from gateway.drain import Drain
from gateway.errors import (
    AnswerBroken,
    Draining,
    GatewayError,
    InternalError,
    Overloaded,
)
from gateway.hedge.continuation import Continuations, may_continue
from gateway.hedge.losers import Leftovers
from gateway.hedge.plan import plan as make_plan
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.race import Race, RaceResult
from gateway.hedge.relay import relay
from gateway.hedge.routing import Routing, routing
from gateway.hedge.runner import UpstreamRequest, attempt_runner, race_over
from gateway.hedge.translated import Translated
from gateway.server.extensions import GONE_EXTENSION, hook
from gateway.settings import ServerSettings
from gateway.stats import RequestSummary, Stats
from gateway.stats.requestlog import log_request
from gateway.stats.spend import summary_cost
from gateway.tenants.spend import cost_text
from gateway.wire.base import (
    Hooks,
    RelayOutcome,
    Rewrite,
    StreamEnd,
    Translation,
    WireProtocol,
    json_bytes,
)
from gateway.wire.sse import SSEDecoder
from gateway.wire.usage import ask_for_usage, body_usage
from gateway.wire.whole import MAX_WHOLE_BYTES, streamed_body, whole_answer

if TYPE_CHECKING:  # tracing imports OpenTelemetry only when it is configured
    from gateway.stats.tracing import Tracing


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

    async def handle(self, request: Request, pool: PoolRuntime, req: LogicalRequest
                     ) -> Answer | SSEResponse:
        """`req`'s answer, errors included, and (once admitted) its end to run after the
        answer is sent (a stream's answer runs it itself, as it closes). Raises only when no
        answer will be sent: the request task was cancelled (the end has run), or a bug of
        ours before admission (nothing is held; the app answers it as any bug of a route)."""
        try:
            routes = routing(pool, req)
        except GatewayError as exc:  # no backend serves the route (or can carry the request):
            return self._error(exc, req, None, request.scope)  # refused before any race
        # from here every path writes the request's log line (the end, or a refusal below)
        state = request.scope.setdefault("state", {})
        state[LINE_KEY] = True
        method = request.scope["method"]
        held = req.body_bytes or 0  # counted against `server.max_inflight_body`
        try:
            if self.drain.draining:
                raise Draining()
            self.admission.enter(held)
        except Overloaded as exc:
            self._record_refusal(pool, req, exc, method)
            return self._error(exc, req, None)
        start = self.clock()
        pool.inflight_requests += 1
        pool.holding += 1
        summary = RequestSummary(req.request_id, pool.settings.name, req.endpoint, req.stream,
                                 start, metered=req.metered, route=req.route, method=method,
                                 model=req.model, key=req.key, objective=req.objective)
        state[SUMMARY_KEY] = summary  # read after the answer (`gateway.api.tenancy`)
        try:
            race, end, strip_usage, whole = self._prepare(request, pool, req, summary, routes,
                                                          held)
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
            return self._error(error, req, None)
        try:
            result = await self._race_or_disconnect(race, request.scope, request.receive, end)
            # no attempt starts after the race: let go of the body and its serialized copy,
            # which the runner holds and a stream would otherwise keep to its end
            race.runner = race_over
            summary.attach(race.attempts, race.suppressed, result)
            if result is None:  # the client went away before the first token
                summary.error = summary.reason = "client_disconnected"
                summary.status = 499
                return Answer(Response(status_code=499), end)
            end.prefix = winner = result.prefix
            rewrite = None
            if req.on_commit is not None and winner.translation is None:
                rewrite = req.on_commit(result.winner.backend, winner.buffered,
                                        req.stream or whole)
            headers = {
                **winner.stream.headers,  # allowlisted upstream headers; ours take precedence
                "x-request-id": req.request_id,
                "x-hedge-backend": result.winner.backend,
                "x-hedge-attempts": str(len(race.attempts)),
            }
            if winner.translation is not None:
                headers["x-hedge-translated"] = summary.translated = winner.translation.name
            summary.status = 200
            if whole:  # read upstream as a stream so that it could be continued
                return await self._whole_answer(pool, req, result, summary, headers, end,
                                                rewrite)
            if not req.stream:
                body = winner.buffered[0].data
                if rewrite is not None:
                    body = rewrite[1](body)
                if winner.translation is not None:
                    body = winner.translation.answer(
                        body, int(time.time()), winner.parsed if rewrite is None else None)
                if req.metered:
                    summary.usage = body_usage(body)
                cost = summary_cost(summary, pool.prices)
                if cost is not None:  # final already: every loser was closed at the commit
                    headers["x-hedge-cost"] = cost_text(cost)
                return Answer(
                    Response(body, media_type="application/json", headers=headers), end
                )
            # a stream runs the end itself, as it closes (`on_close`, exactly once, whatever
            # ends it): it is the answer, with no `Answer` around it to call it
            return self._streaming_response(pool, req, result, headers, end, strip_usage,
                                            rewrite, race.leftovers)
        except GatewayError as exc:  # answered in the route's shape, then the end runs
            summary.attach(race.attempts, race.suppressed, None)
            summary.error = exc.code or type(exc).__name__
            summary.status, summary.reason = exc.status, exc.log_reason()
            return self._error(exc, req, end)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: answered, reported
            report_bug(self.stats, exc)
            if summary.winner is None:
                summary.attach(race.attempts, race.suppressed, None)
            summary.error = summary.reason = InternalError.code
            summary.status = InternalError.status
            return self._error(InternalError.of(exc), req, end)
        except BaseException:
            await end()  # no answer will carry the end (the request task was cancelled)
            raise

    def _error(self, exc: GatewayError, req: LogicalRequest, end: RequestEnd | None,
               refused: Scope | None = None) -> Answer:
        """`exc` answered in the route's shape (`req.protocol`), then `end`. A body that
        cannot be rendered (a client's text JSON cannot carry, a bug of ours) is answered
        as the route's internal error instead, reported: never a bare 500, and the same end.
        `refused`: the scope of a request refused before the proxy took its log line, noted
        with what it was answered (`gateway.api.refusals`)."""
        try:
            response = error_response(exc, req.request_id, req.protocol)
        except (ValueError, TypeError) as bug:  # rendering failed: a bug of ours
            report_bug(self.stats, bug)
            exc = InternalError.of(bug)
            response = error_response(exc, req.request_id, req.protocol)
        if refused is not None:
            note_refusal(refused, exc)
        return Answer(response, end)

    def _prepare(
        self, request: Request, pool: PoolRuntime, req: LogicalRequest,
        summary: RequestSummary, routes: Routing, held: int = 0,
    ) -> tuple[Race, RequestEnd, bool, bool]:
        """The race of an admitted request, the owner of its end, whether the usage the
        gateway asked for is to be dropped from the stream, and whether a non-streaming
        request is read upstream as a stream (so that a break or a stall can be continued)
        and answered whole."""
        if not req.stream and routes.translated and may_continue(
                pool, req.protocol.name, True, req.stateful, req.pinned,
                routes.excluded | frozenset(routes.translated)):
            # a whole answer could be continued from its native backends: a translation that
            # refuses the request must not cost it the streamed read (a backend it refuses is
            # never attempted anyway)
            routes = routes.without_refusals()
        plan = make_plan(pool, req, routes.excluded, summary.started,
                         routes.translated.admits if routes.translated else None)
        summary.size = plan.size
        upstream_body, strip_usage = ask_for_usage(req.endpoint, req.stream, req.body)
        # continuations speak the client's API: never to a backend reached by translation
        # (and a translated winner is not continued: `_streaming_response`)
        apart = routes.excluded | frozenset(routes.translated)
        streamed = None
        if not req.stream and not routes.translated and may_continue(
                pool, req.protocol.name, True, req.stateful, req.pinned, apart):
            streamed = streamed_body(req.endpoint, req.body)
        if streamed is not None:
            upstream_body, strip_usage = streamed, False
        trace = None if self.tracing is None else self.tracing.start(
            req.headers, pool.settings.name, req.endpoint)
        upstream = _upstream_request(req, upstream_body, routes.translated,
                                     stream=req.stream or streamed is not None)
        runner = attempt_runner(pool, upstream, plan.options.deadline, self.clock, trace)
        # a stream learns its winner's TTFT once its first bytes are out (`SSEResponse`)
        race = Race(pool, runner, plan.options, self.clock,
                    defer_learning=req.stream and streamed is None)
        end = RequestEnd(pool, race, summary, leave=functools.partial(self.admission.leave, held),
                         stats=self.stats, clock=self.clock, trace=trace)
        if streamed is not None or may_continue(pool, req.protocol.name, req.stream,
                                                req.stateful, req.pinned, apart):
            end.continuations = Continuations(
                pool, upstream, replace(plan.options, excluded=apart), self.clock, trace)
        return race, end, strip_usage, streamed is not None

    async def _race_or_disconnect(
        self, race: Race, scope: Scope, receive: Receive, end: RequestEnd
    ) -> RaceResult | None:
        """Run the race; a client disconnect cancels it (and so every attempt), and so does
        the end of the shutdown grace period (the client then gets 503).

        One watcher of the client serves the whole request (`end.watcher`): a stream's
        response keeps using it after commit, and the end of the request cancels it. Under
        `hedge-gateway serve` it is the server's future of the connection's loss
        (`GONE_EXTENSION`), no task at all; under another server, a task reading `receive`
        until `http.disconnect`. The drain is a callback, not a task.

        The race runs in this task, not in one of its own: a task of its own cost a turn of
        the loop before the upstream request was written and another between the first
        token and the answer. The watcher and the drain stop it as `asyncio.timeout` stops
        what it wraps: they cancel this task, and a cancellation of theirs is taken back here
        (`Task.uncancel`) and answered; one from elsewhere (the server stopping) goes on."""
        task = asyncio.current_task()
        assert task is not None
        stop = _RaceStop(task)
        gone = hook(scope, GONE_EXTENSION, "gone")  # the server's watcher, if it has one
        watcher = end.watcher = gone() if gone is not None \
            else asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(stop)
        forget = self.drain.call_at_grace_end(self.server.shutdown_grace, stop)
        try:
            return await race.run()
        except asyncio.CancelledError:
            if not stop.fired or task.uncancel() > 0:  # not only ours: it goes on
                raise
        except BaseException:
            if stop.fired:  # ours, and then a bug in the race's clean-up: the bug goes on,
                task.uncancel()  # our cancellation does not (what else asked still counts)
            raise
        finally:
            stop.over = True  # a stop scheduled already, or the drain's, must not cancel
            forget()          # the rest of the request (it may run after this returns)
            watcher.remove_done_callback(stop)
        if self.drain.draining and not _saw_disconnect(watcher):
            raise Draining()
        return None

    def _record_refusal(self, pool: PoolRuntime, req: LogicalRequest, exc: Overloaded,
                        method: str) -> None:
        """A request refused before its race (overload, shutdown) still counts and logs."""
        now = self.clock()
        summary = RequestSummary(req.request_id, pool.settings.name, req.endpoint, req.stream,
                                 now, route=req.route, method=method, model=req.model,
                                 key=req.key,
                                 status=exc.status, reason=exc.log_reason())
        summary.error = exc.code
        summary.ended = now
        self.stats.record(summary)
        log_request(summary, self.stats.error_classes)

    async def _whole_answer(
        self, pool: PoolRuntime, req: LogicalRequest, result: RaceResult,
        summary: RequestSummary, headers: dict[str, str], end: RequestEnd,
        rewrite: Rewrite | None = None,
    ) -> Answer:
        """A non-streaming request whose upstream was read as a stream: relayed (a break or
        a stall continued, as a stream's is) into memory, then answered whole in its API's
        shape (`gateway.wire.whole`); an answer that broke and was not continued is the
        route's 502 (`AnswerBroken`). The client leaving ends the relay (499). Bounded: by
        the stream deadlines of the relay and by `MAX_WHOLE_BYTES`. `rewrite`: the route's
        rewrite of the events it names (the Responses API's response id made the client's),
        applied as the relay encodes them, so the whole answer carries it too."""
        outcome = RelayOutcome()
        timeouts = pool.settings.timeouts
        body = relay(
            result.prefix, request_id=req.request_id, idle=timeouts.idle,
            max_stream_deadline=self.clock() + timeouts.max_stream, clock=self.clock,
            outcome=outcome, protocol=req.protocol, rewrite=rewrite,
            resume=end.continuations, backend=result.winner.backend,
        )
        reading = asyncio.ensure_future(_read_whole(body))
        watcher = end.watcher
        try:
            if watcher is not None:
                either: set[asyncio.Future[Any]] = {reading, watcher}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            data = await reading if reading.done() or watcher is None else None
        finally:
            if not reading.done():
                reading.cancel()
                await asyncio.wait({reading})
            aclose = getattr(body, "aclose", None)  # an async generator: closed if not yet
            if aclose is not None:
                await aclose()
        summary.relay_end = outcome.end
        summary.usage, summary.relayed = outcome.usage, outcome.events
        if data is None:  # the client went away
            summary.error = summary.reason = "client_disconnected"
            summary.status = 499
            return Answer(Response(status_code=499), end)
        answer = None if outcome.end != StreamEnd.DONE else whole_answer(
            req.protocol.name, SSEDecoder().feed(data))
        if answer is None:
            exc = AnswerBroken(outcome.end.value)
            summary.error = exc.code
            summary.status, summary.reason = exc.status, exc.log_reason()
            return self._error(exc, req, end)
        whole = json_bytes(answer)
        if req.metered:  # read from the answer sent, as a body's is
            summary.usage = body_usage(whole)
        if end.continuations is not None:  # their legs are charged: the cost is final
            await end.continuations.aclose()
            summary.continuations = end.continuations.counts
        cost = summary_cost(summary, pool.prices)
        if cost is not None:
            headers["x-hedge-cost"] = cost_text(cost)
        return Answer(Response(whole, media_type="application/json",
                               headers=headers), end)

    def _streaming_response(
        self,
        pool: PoolRuntime,
        req: LogicalRequest,
        result: RaceResult,
        headers: dict[str, str],
        end: RequestEnd,
        strip_usage: bool,
        rewrite: Rewrite | None,
        leftovers: Leftovers,
    ) -> SSEResponse:
        """The stream that relays the winner: built as data (the stream's code first runs
        when the app sends it), with what the race left for it: the winner's backend slot,
        given back as the stream is complete (`Hooks`), and its TTFT, learnt after the first
        piece (each taken from the leftovers, so the end does not give them back again)."""
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
            protocol=protocol if result.prefix.translation is None
            else _translating(protocol, result.prefix.translation, not strip_usage),
            rewrite=rewrite,
            resume=end.continuations if result.prefix.translation is None else None,
            backend=result.winner.backend,
        )

        # the final events of a shutdown and of a bug of ours, built only for a stream that
        # ends that way (each is JSON to encode, on the way to the first byte)
        error_event, request_id = protocol.error_event, req.request_id

        def shutdown_event() -> bytes:
            return error_event("the gateway is shutting down", "gateway_shutdown", request_id)

        def internal_event() -> bytes:
            return error_event("internal error", InternalError.code, request_id)

        raw_headers = [*SSE_HEAD, *[(k.lower().encode("latin-1"), v.encode("latin-1"))
                                    for k, v in headers.items()]]
        # once the stream is complete (the relay has its end event, or the stream is done
        # with the relay): what the relay counted goes to the summary (a key's charge reads
        # it then, `gateway.api.tenancy`), and the winner's slot goes back
        outcome.on_done = done = Hooks(functools.partial(end.summary.take_relayed, outcome))
        if leftovers.release is not None:
            done.add(leftovers.release)
        stream = SSEResponse(
            body,
            raw_headers=raw_headers,
            keepalive=self.server.keepalive,
            stuck_client=timeouts.stuck_client,
            drain=self.drain,
            grace=self.server.shutdown_grace,
            shutdown_event=shutdown_event,
            on_close=functools.partial(end.after_stream, outcome),
            # the winner's slot goes back as the stream is complete, and its TTFT is learnt
            # after the first piece: the race's leftovers, handed out as data (the race is done)
            on_exhausted=done,
            clock=self.clock,
            client_gone=end.watcher,
            internal_event=internal_event,
            # the relay's first piece is the committed first token, in hand: it leaves first,
            # with the head; the race learns its winner's TTFT after it
            first_ready=True,
            on_first_sent=leftovers.unlearned,
        )
        # the stream owns these from here and calls each once, whatever ends it: callables
        # of the balancer and of the delay reader, made by the race at its commit (taken out
        # of the leftovers only once the stream is built: until then the end gives them back)
        leftovers.release = leftovers.unlearned = None
        return stream


def _upstream_request(req: LogicalRequest, body: Mapping[str, Any],
                      translated: Translated, stream: bool) -> UpstreamRequest:
    """What the race's attempts send for `req`, with `body` (the client's, or a copy that
    asks for usage or for a stream), and to the backends of another API their translation
    of it."""
    return UpstreamRequest(
        req.endpoint, body, stream, req.request_id, req.protocol, pinned=req.pinned,
        method=req.method, path=req.path, query=req.query, forward_headers=req.forward_headers,
        translated=translated,
    )


def _translating(protocol: WireProtocol, translation: Translation, include_usage: bool
                 ) -> WireProtocol:
    """The client's protocol (its errors, its shutdown event) with the translated stream's
    encoder: the backend's events written in the client's API. Once per translated stream."""
    encoder = translation.encoder(int(time.time()), include_usage, protocol.error_event)
    return dataclasses.replace(protocol, encoder=lambda _protocol, _rewrite: encoder)


class _RaceStop:
    """The callback (a done-callback of the disconnect watcher, or the drain's at the end of
    its grace) that stops a race running in `task`: it cancels the task once, and only while
    the race runs (`over`: the race is over, and the task has gone on to the answer)."""

    __slots__ = ("fired", "over", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.fired = self.over = False

    def __call__(self, *_: object) -> None:
        if not self.fired and not self.over:
            self.fired = True
            self.task.cancel()


def _saw_disconnect(task: asyncio.Future[None]) -> bool:
    """Whether the disconnect watcher saw the client leave (not merely got cancelled)."""
    return task.done() and not task.cancelled() and task.exception() is None


async def _read_whole(body: AsyncIterator[bytes]) -> bytes:
    """Every byte the relay yields, joined; `AnswerBroken` past `MAX_WHOLE_BYTES`."""
    parts: list[bytes] = []
    size = 0
    async for part in body:
        size += len(part)
        if size > MAX_WHOLE_BYTES:
            raise AnswerBroken("the answer passed its size bound")
        parts.append(part)
    return b"".join(parts)


async def _wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (the watcher under a server that offers no
    `GONE_EXTENSION`). Its task is made just before the race starts the primary's, so its
    first step would come first: it yields at once, and its first read of the client comes
    after the primary's first step (which opens the upstream request)."""
    await asyncio.sleep(0)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
