"""Runs one attempt: builds what it sends to its backend, opens it, reads to the first token.

The race owns its runners: the proxy hands it the request's upstream facts as data
(`UpstreamRequest`) and the race's attempts run here, with no call back up into the API layer.
The body is serialized once per logical request; each attempt joins its backend's model name
in front of it. A request on a stored response (`path`) is sent as the client sent it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gateway.clock import Clock
from gateway.errors import UpstreamRejectedRequest, UpstreamStatusError, upstream_status
from gateway.hedge.attempt import AttemptRecord, open_until_first_token, open_whole_response
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import AttemptRunner
from gateway.wire.base import Translation, WireProtocol
from gateway.wire.paths import Endpoint
from providers.base import UpstreamCall


class AttemptTrace(Protocol):
    """A request's trace as an attempt sees it (`gateway.stats.tracing.RequestTrace`): the
    headers that carry its context upstream, and the attempt's end."""

    def attempt_started(self, record: AttemptRecord) -> Mapping[str, str]: ...

    def attempt_ended(self, record: AttemptRecord) -> None: ...


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """What every attempt of one logical request sends, less its backend's model name."""

    endpoint: Endpoint
    body: Mapping[str, Any]
    stream: bool
    request_id: str
    #: the route's wire rules: the first token, a complete answer without one
    protocol: WireProtocol
    #: the only backend this request may use (the one holding its stored response)
    pinned: str | None = None
    method: str = "POST"
    path: str | None = None
    query: tuple[tuple[str, str], ...] = ()
    forward_headers: Mapping[str, str] = field(default_factory=dict)
    #: per backend reached by translation: its translation and the body it is sent, made
    #: when first read (`gateway.hedge.routing`); empty for the usual request
    translated: Mapping[str, tuple[Translation, Mapping[str, Any]]] = field(
        default_factory=dict)


def attempt_runner(
    pool: PoolRuntime, req: UpstreamRequest, deadline: float, clock: Clock,
    trace: AttemptTrace | None = None,
) -> AttemptRunner:
    """The runner of one request's attempts: opens `backend` and reads to the first token
    (a streamed request) or to the whole body, before the shared first-token `deadline`."""
    protocol = req.protocol
    body = req.body
    models = pool.models
    translated = req.translated
    # serialized once for every attempt: `{"model":` + the backend's model + the rest;
    # a request on a stored response (`path`) carries its body as the client sent it;
    # not at all for providers that build their own request from the body (a copy of
    # a body of up to `server.max_body` held for nothing)
    # (kept as serialized, `{...}`, and joined past its brace: each slice or `+` of it
    # was one more copy of the whole body)
    rest = memoryview(b"")
    # (a backend reached by translation is sent its own body: none of this)
    if req.path is None and any(_sends_content(p) for name, p in pool.providers.items()
                                if not (translated and name in translated)):
        rest = memoryview(json.dumps({k: v for k, v in body.items() if k != "model"},
                                     separators=(",", ":")).encode())[1:]
    comma = b"" if bytes(rest[:1]) == b"}" else b","

    async def run(backend: str, record: AttemptRecord) -> Prefix:
        # the record's own check, read by the attempt per batch before its first token:
        # the attempt reads its record, it does not call back into the runner
        is_lost = record.lost
        if translated and backend in translated:
            # (made now if the race's pick did not make it: only an attempt here pays it)
            return await run_translated(backend, record, is_lost, *translated[backend])
        call = UpstreamCall(
            endpoint=req.endpoint,
            body={**body, "model": models[backend]} if req.path is None else body,
            stream=req.stream,
            request_id=req.request_id,
            first_byte_timeout=max(0.0, deadline - clock()),
            content=b"".join((b'{"model":', pool.models_json[backend], comma, rest))
            if rest and _sends_content(pool.providers[backend]) else b"",
            extra_headers=req.forward_headers,
            method=req.method,
            path=req.path,
            query=req.query,
        )
        if trace is not None:
            call = replace(
                call, extra_headers={**call.extra_headers, **trace.attempt_started(record)})
        provider = pool.providers[backend]
        seen = pool.quota_watch(backend, clock)
        try:
            if req.stream:
                return await open_until_first_token(provider, call, is_lost, protocol, seen)
            return await open_whole_response(provider, call, is_lost, protocol, seen)
        except UpstreamStatusError as exc:
            if req.pinned is not None and upstream_status(exc.status).pinned_answer:
                # no other backend holds this state: its verdict on the request (404: it
                # no longer has the response) is the answer, not a 502 (the status table
                # says which statuses are such a verdict)
                raise UpstreamRejectedRequest(exc.status) from None
            raise
        finally:
            _ended(record, clock(), trace)

    async def run_translated(backend: str, record: AttemptRecord, is_lost: Callable[[], bool],
                             translation: Translation, sent: Mapping[str, Any]) -> Prefix:
        """An attempt on a backend of another API: the translated body, the backend's route
        and its first-token rule; the prefix says how its answer is written back. It is sent
        the client's forwarded headers (the deadline's, the trace's) as a native attempt is,
        less those only the client's API reads."""
        call = UpstreamCall(
            endpoint=translation.backend,
            body={**sent, "model": models[backend]},
            stream=req.stream,
            request_id=req.request_id,
            first_byte_timeout=max(0.0, deadline - clock()),
            extra_headers=translation.forwarded(req.forward_headers),
        )
        if trace is not None:
            call = replace(
                call, extra_headers={**call.extra_headers, **trace.attempt_started(record)})
        provider, backend_protocol = pool.providers[backend], translation.protocol
        seen = pool.quota_watch(backend, clock)
        try:
            if req.stream:
                prefix = await open_until_first_token(provider, call, is_lost,
                                                      backend_protocol, seen)
            else:
                prefix = await open_whole_response(provider, call, is_lost, backend_protocol,
                                                   seen)
        finally:
            _ended(record, clock(), trace)
        prefix.translation = translation
        return prefix

    return run


def _ended(record: AttemptRecord, now: float, trace: AttemptTrace | None) -> None:
    """An attempt's runner returned or raised: its end time, its trace's span, and the race's
    wake-up (`AttemptRecord.on_end`: the race takes it up in the next turn)."""
    record.ended = now
    if trace is not None:
        trace.attempt_ended(record)
    if record.on_end is not None:
        record.on_end()


async def race_over(backend: str, record: AttemptRecord) -> Prefix:
    """The runner of a race that has ended (it holds nothing; it is never called)."""
    raise RuntimeError(f"attempt on {backend} after its race ended")


def _sends_content(provider: object) -> bool:
    """Whether `provider` sends `UpstreamCall.content` (the HTTP APIs do; a provider that
    builds its own request from the body says `sends_content = False`)."""
    return bool(getattr(provider, "sends_content", True))
