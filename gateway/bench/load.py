"""The benchmark's load client: streaming chat requests with bounded concurrency.

Measured at the client, the way an application would feel it: the time to the first *content*
token (the first SSE event whose `delta.content` is a non-empty string; role chunks, comments
and headers do not count) and the time to the end of the stream. It speaks HTTP/1.1 through
`gateway.bench.client`, a lean keep-alive client that scans each chunk where it lands, not
through the OpenAI SDK or httpx: the gateway and the simulated upstreams run in other
processes, but the client shares a core with the simulators, and a client that saturates that
core first measures itself, not the gateway (see `gateway.bench.client` for the figures).

The oracle (`best_of`) sends one request to every URL at once and keeps the stream that yields
the first content token, closing the others at that moment: the lower bound that hedging,
which pays for a duplicate only after a delay, tries to approach.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from gateway.bench.client import LeanClient, Target, TransportError, request_bytes, target

#: what a benchmark request asks for; the model is rewritten by the gateway, ignored by the sim
CHAT_BODY: Mapping[str, object] = {
    "messages": [{"role": "user", "content": "Say something."}],
    "stream": True,
}


@dataclass(frozen=True, slots=True)
class Sample:
    """One logical request as the client saw it. Times in seconds from its start."""

    index: int
    ok: bool
    #: time to the first content token; None when none arrived
    ttft: float | None
    #: time to the end of the stream, or to the failure
    total: float
    error: str | None = None
    #: `x-hedge-attempts` from the gateway (attempts started), when present
    attempts: int | None = None
    #: `x-hedge-backend` from the gateway (the winner), when present
    backend: str | None = None
    #: `data:` events received before `[DONE]` (role, tokens, finish): all delivered?
    events: int = 0
    #: the longest time between two reads that brought events after the first token
    #: (None: no token)
    longest_gap: float | None = None


def is_content_token(payload: bytes | str) -> bool | None:
    """True for an event carrying non-empty `delta.content`, None for an error event, else
    False. Raises ValueError for a payload that is not JSON."""
    obj = json.loads(payload)
    if not isinstance(obj, dict):
        return False
    if "error" in obj:
        return None
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        content = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(content, str) and content:
            return True
    return False


def _is_error_event(payload: bytes) -> bool:
    """After the first token only errors matter; the substring test keeps the common case to
    one scan and no JSON decoding."""
    if b'"error"' not in payload:
        return False
    try:
        return is_content_token(payload) is None
    except ValueError:
        return True


def request_id(index: int) -> str:
    """`bench-<i>` for measured request i; `warmup-<k>` for warm-up request -k (index < 0).
    The simulators key their latency draws on it (`gateway.bench.upstream`)."""
    return f"bench-{index}" if index >= 0 else f"warmup-{-index}"


def _header_int(raw: bytes | None) -> int | None:
    return int(raw) if raw is not None and raw.isdigit() else None


#: called at an attempt's first token; False means another attempt already won: stop here
Claim = Callable[[], bool]


def _always() -> bool:
    return True


#: an event line longer than this is an error (the simulator's are about 150 bytes): the scan
#: keeps only the unfinished line, and not without bound
MAX_LINE = 64 * 1024


class StreamScan:
    """One streaming response as the client sees it, scanned where its bytes land (a
    `gateway.bench.client.Sink`): the first content token (timed with `clock`, claimed with
    `claim`), the `data:` events before `[DONE]`, and the first failure. Only the unfinished
    line is kept between chunks. Lines are split on LF by hand (a CR before it is stripped):
    the gateway and the simulator both end lines with LF."""

    __slots__ = ("_claim", "_clock", "_last", "_pending", "_start", "attempts", "backend",
                 "done", "error", "events", "longest_gap", "status", "ttft")

    def __init__(self, start: float, claim: Claim = _always,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._start, self._claim, self._clock = start, claim, clock
        self._pending = b""
        self.status: int | None = None
        self.attempts: int | None = None
        self.backend: str | None = None
        self.ttft: float | None = None
        self.events = 0
        self.done = False
        self.error: str | None = None
        #: when the last read with events after the first token landed, and the longest gap
        self._last: float | None = None
        self.longest_gap: float | None = None

    def head(self, status: int, headers: Mapping[bytes, bytes]) -> None:
        self.status = status
        self.attempts = _header_int(headers.get(b"x-hedge-attempts"))
        backend = headers.get(b"x-hedge-backend")
        self.backend = None if backend is None else backend.decode("latin-1")

    def body(self, data: bytes) -> bool:
        if self.error is not None:
            return False
        if self.status != 200 or self.done:
            return True  # read to the end of the body so the connection can be reused
        lines = (self._pending + data).split(b"\n") if self._pending else data.split(b"\n")
        self._pending = lines.pop()
        if self.ttft is not None and lines:  # a gap between reads after the first token
            now = self._clock()
            if self._last is not None:
                gap = now - self._last
                if self.longest_gap is None or gap > self.longest_gap:
                    self.longest_gap = gap
            self._last = now
        for raw in lines:
            if not raw.startswith(b"data:"):
                continue
            payload = raw[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                self._pending = b""
                return True
            self.events += 1
            if self.ttft is None:
                try:
                    kind = is_content_token(payload)
                except ValueError:
                    return self._fail("malformed event")
                if kind is None:
                    return self._fail("error event before the first token")
                if kind:
                    if not self._claim():
                        return self._fail("lost")
                    self._last = self._clock()
                    self.ttft = self._last - self._start
                    self.longest_gap = 0.0
            elif _is_error_event(payload):
                return self._fail("error event after the first token")
        if len(self._pending) > MAX_LINE:
            return self._fail("event line too long")
        return True

    def _fail(self, error: str) -> bool:
        self.error = error
        return False

    def sample(self, index: int, transport: str | None = None) -> Sample:
        """The request's Sample once it ended (`transport`: the TransportError's kind)."""
        if transport is not None:
            error: str | None = f"transport: {transport}"
        elif self.status != 200:
            error = f"status {self.status}"
        elif self.error is not None:
            error = self.error
        elif not self.done:
            error = "truncated (no [DONE])"
        else:
            error = None if self.ttft is not None else "no token"
        return Sample(index, error is None, self.ttft, self._clock() - self._start, error,
                      self.attempts, self.backend, self.events, self.longest_gap)


async def _attempt(client: LeanClient, url: Target, payload: bytes, index: int, start: float,
                   claim: Claim = _always) -> Sample:
    """Stream one response to its end and time it; every failure becomes a failed Sample."""
    scan = StreamScan(start, claim)
    try:
        await client.request(url, payload, scan)
    except TransportError as exc:
        return scan.sample(index, exc.kind)
    return scan.sample(index)


def chat_request(url: str, index: int, body: Mapping[str, object] = CHAT_BODY,
                 extra: Mapping[str, str] | None = None) -> tuple[Target, bytes]:
    """Request `index` as bytes for `LeanClient.request`: `body` as JSON, with its id and
    `extra` headers (a client key)."""
    where = target(url)
    headers = {"content-type": "application/json", "x-request-id": request_id(index),
               **(extra or {})}
    return where, request_bytes("POST", where, json.dumps(body).encode(), headers)


async def stream_one(
    client: LeanClient, url: str, index: int, *, body: Mapping[str, object] = CHAT_BODY,
    headers: Mapping[str, str] | None = None,
) -> Sample:
    """One streaming chat request to `url` (a full .../chat/completions URL), with `headers`
    besides its own (the `keys-1000` mode's client key)."""
    where, payload = chat_request(url, index, body, headers)
    return await _attempt(client, where, payload, index, time.perf_counter())


async def best_of(
    client: LeanClient,
    urls: Sequence[str],
    index: int,
    *,
    body: Mapping[str, object] = CHAT_BODY,
) -> Sample:
    """The oracle: the same request to every URL at once; the first content token wins and
    the other streams are closed right then (their tasks are cancelled, which closes their
    connections). Fails only when every attempt failed."""
    start = time.perf_counter()
    tasks: list[asyncio.Task[Sample]] = []
    winner: list[int] = []

    def claimer(k: int) -> Claim:
        # called from the winning connection's data callback, not from its task
        def claim() -> bool:
            if winner:
                return False
            winner.append(k)
            for j, task in enumerate(tasks):
                if j != k:
                    task.cancel()
            return True
        return claim

    for k, url in enumerate(urls):
        where, payload = chat_request(url, index, body)
        tasks.append(asyncio.create_task(
            _attempt(client, where, payload, index, start, claimer(k))))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    if winner:
        won = results[winner[0]]
        assert isinstance(won, Sample)
        return won
    samples = [r for r in results if isinstance(r, Sample)]
    errors = "; ".join(s.error or "failed" for s in samples) or "every attempt was cancelled"
    return Sample(index, False, None, time.perf_counter() - start, errors, len(urls))


class Progress:
    """A one-line progress bar on a terminal; on anything else one line when a phase ends."""

    WIDTH = 30

    def __init__(self, out: TextIO | None, label: str, total: int) -> None:
        self._out = out
        self._tty = out is not None and out.isatty()
        self._label = label
        self._total = max(1, total)
        self._done = 0
        self._start = time.perf_counter()
        self._drawn = 0.0
        self._draw(force=True)

    def advance(self) -> None:
        self._done += 1
        self._draw(force=self._done == self._total)

    def _draw(self, *, force: bool) -> None:
        if self._out is None or not self._tty:
            return
        now = time.perf_counter()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        filled = self.WIDTH * self._done // self._total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self._out.write(f"\r  {self._label:<28} [{bar}] {self._done}/{self._total} "
                        f"{now - self._start:6.1f}s")
        self._out.flush()

    def finish(self, note: str = "") -> None:
        if self._out is None:
            return
        elapsed = time.perf_counter() - self._start
        if self._tty:
            self._out.write(f"  {note}\n")
        else:
            self._out.write(f"  {self._label:<28} {self._done}/{self._total} requests in "
                            f"{elapsed:.1f}s {note}\n")
        self._out.flush()


def worker_client(timeout: float = 60.0) -> LeanClient:
    """The client of one load worker. One per worker, not one shared by all: a worker needs
    at most one connection per host at a time, so its pool is a short list."""
    return LeanClient(timeout=timeout, connect_timeout=5.0)


#: sends request `index` with the worker's own client; must turn failures into Samples
Send = Callable[[LeanClient, int], Awaitable[Sample]]


async def run_load(
    requests: int,
    concurrency: int,
    send: Send,
    *,
    progress: Progress | None = None,
    timeout: float = 60.0,
    after_warmup: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[Sample], list[Sample], float]:
    """Send requests 0..n-1 in order with at most `concurrency` in flight (a closed loop: each
    worker sends its next request when its previous one ended).

    First each worker sends one warm-up request (index -1, -2, ...), all at once, so that
    connections are open and first-call code paths ran before anything is timed;
    `after_warmup` runs once they all ended. Returns the measured samples by index, the
    warm-up samples, and the wall time from the first measured send to the last end."""
    samples: list[Sample | None] = [None] * requests
    next_index = 0

    async def worker(client: LeanClient) -> None:
        nonlocal next_index
        while next_index < requests:
            index = next_index
            next_index += 1
            samples[index] = await send(client, index)
            if progress is not None:
                progress.advance()

    # Every client exists before the clock starts: building one blocks the loop for a moment,
    # which would otherwise be charged to the requests already in flight.
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(worker_client(timeout))
                   for _ in range(max(1, min(concurrency, requests)))]
        warmup = await asyncio.gather(*(send(c, -k) for k, c in enumerate(clients, start=1)))
        if after_warmup is not None:
            await after_warmup()
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in clients))
        wall = time.perf_counter() - start
    return [s for s in samples if s is not None], list(warmup), wall
