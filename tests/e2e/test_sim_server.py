"""The simulator as a real loopback server, with the official SDK and httpx as clients."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anthropic
import httpx
import openai
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.settings import SimProfile
from gateway.wire.base import Kind
from gateway.wire.chat import classify
from gateway.wire.sse import SSEDecoder, SSEEvent
from providers.sim.embeddings import embedding_vector
from providers.sim.server import create_sim_app
from tests.harness import AsgiServerFactory
from tests.harness.asgi import wait_for_sim_stats as wait_for_stats

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "stream": True}


class FakeSleep:
    """Records the delays asked for instead of sleeping."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


# --- a real server on loopback --------------------------------------------------------------


@asynccontextmanager
async def serve(profile: SimProfile) -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_sim_app(profile, seed=1),
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def test_real_server_with_the_openai_sdk() -> None:
    profile = SimProfile(
        ttft_median=0.001, ttft_sigma=0.0, straggler_probability=0.0, tokens=500, inter_token=0.01
    )
    async with serve(profile) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                max_tokens=5,
                stream_options={"include_usage": True},
                extra_headers={"x-sim-ttft-ms": "5"},
            )
            text = ""
            usage = None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                usage = chunk.usage or usage
            assert text == "tok0 tok1 tok2 tok3 tok4 "
            assert usage is not None and usage.completion_tokens == 5
            await wait_for_stats(base, "streams_completed", 1)

            # a 5-second stream, dropped after its first token: the server must notice
            long = await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for chunk in long:
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            await long.close()
            stats = await wait_for_stats(base, "streams_closed_early", 1)
            assert stats["open_streams"] == 0
            assert stats["requests"] == 2

            completion = await client.completions.create(
                model="sim-model", prompt="x", max_tokens=2
            )
            assert completion.choices[0].text == "tok0 tok1 "
            embedding = await client.embeddings.create(model="e", input="a")
            # the SDK asked for base64 and decoded the float32 values
            assert embedding.data[0].embedding == pytest.approx(embedding_vector("a"), abs=1e-6)
        finally:
            await client.close()


async def test_real_server_fault_status_and_retry_after() -> None:
    profile = SimProfile(fail_probability=1.0, fail_status=429)
    async with serve(profile) as base, httpx.AsyncClient(base_url=base) as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "rate_limit_error"
        bad = await http.post("/v1/chat/completions", content=b"{")
        assert bad.status_code == 400


async def test_real_server_states_its_quota_and_refuses_past_it() -> None:
    """`rate_limit_requests`: every answer says what is left, in the route's family; the
    request past the quota gets a 429 with Retry-After and nothing left."""
    profile = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=2,
                         inter_token=0.0, rate_limit_requests=3, rate_limit_window=3600.0)
    message = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    async with serve(profile) as base, httpx.AsyncClient(base_url=base) as http:
        chat = await http.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 200 and chat.headers["x-ratelimit-limit-requests"] == "3"
        assert chat.headers["x-ratelimit-remaining-requests"] == "2"
        assert chat.headers["x-ratelimit-reset-requests"].endswith("s")
        whole = await http.post("/v1/messages", json=message)
        assert whole.status_code == 200
        assert whole.headers["anthropic-ratelimit-requests-remaining"] == "1"
        assert whole.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
        streamed = await http.post("/v1/messages", json={**message, "stream": True})
        assert streamed.headers["anthropic-ratelimit-requests-remaining"] == "0"
        refused = await http.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 429
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert 3500 <= int(refused.headers["retry-after"]) <= 3600
        assert refused.json()["error"]["type"] == "rate_limit_error"


async def test_real_server_hang_is_counted_when_the_client_leaves() -> None:
    async with (
        serve(SimProfile(hang_probability=1.0)) as base,
        httpx.AsyncClient(base_url=base) as http,
    ):
        async with http.stream("POST", "/v1/chat/completions", json=CHAT) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            decoder = SSEDecoder()
            events: list[SSEEvent] = []
            async for raw in response.aiter_raw():
                events.extend(decoder.feed(raw))
                if events:
                    break
            assert classify(events[0]) is Kind.OTHER  # the role chunk, then nothing
        stats = await wait_for_stats(base, "streams_closed_early", 1)
        assert stats["open_streams"] == 0
        # a hanging non-streaming request ends with its client, not with the server
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json={**CHAT, "stream": False}, timeout=0.1)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/messages", {**CHAT, "max_tokens": 100}),
    ("/v1/responses", {"model": "m", "input": "hello there", "stream": True}),
])
async def test_real_server_breaks_mid_stream_by_header(path: str, body: dict[str, object]
                                                       ) -> None:
    """Each break kind by header on each API, over HTTP: ten tokens, then the break (the
    connection dropped mid-body, a body ended without its end event, half an event, or an
    error event), counted as broken; a continuation past the break point is not broken."""
    profile = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0,
                         inter_token=0.0)
    async with serve(profile) as base, httpx.AsyncClient(base_url=base) as http:
        for n, kind in enumerate(("reset", "closed", "malformed", "error"), start=1):
            raw = b""
            headers = {"x-sim-break-at": "10", "x-sim-break": kind}
            try:
                async with http.stream("POST", path, json=body, headers=headers) as response:
                    async for piece in response.aiter_bytes():
                        raw += piece
                dropped = False
            except httpx.RemoteProtocolError:
                dropped = True
            assert dropped == (kind == "reset")
            assert len(re.findall(rb"tok\d+ ", raw)) == 10 and b"tok10" not in raw
            assert b"[DONE]" not in raw and b"message_stop" not in raw \
                and b"response.completed" not in raw
            if kind == "malformed":
                assert not raw.endswith(b"\n\n")
            if kind == "error":
                assert b"error" in raw.rsplit(b"tok9", 1)[1]
            else:
                await wait_for_stats(base, "streams_broken", n)


def test_every_streaming_route_skips_starlettes_routing(
        asgi_server: AsgiServerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chat, Messages and the Responses API streams are answered by their handler directly,
    so each event is one send through the same layers whichever API a bench reads (Starlette's
    routing and middleware wrap every send); other routes still go through Starlette."""
    app = create_sim_app(SimProfile(ttft_median=0.0, ttft_sigma=0.0,
                                    straggler_probability=0.0, tokens=5), seed=1)
    routed: list[str] = []
    starlette = app._routes

    async def counting(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            routed.append(scope["path"])
        await starlette(scope, receive, send)

    monkeypatch.setattr(app, "_routes", counting)
    sim = asgi_server(app)
    with anthropic.Anthropic(base_url=sim.base_url, api_key="x", max_retries=0) as claude, \
            claude.messages.stream(model="m", max_tokens=50,
                                   messages=[{"role": "user", "content": "hi"}]) as stream:
        assert stream.get_final_text() == "tok0 tok1 tok2 tok3 tok4 "
    with openai.OpenAI(base_url=sim.v1, api_key="x", max_retries=0) as gpt:
        text = "".join(e.delta for e in gpt.responses.create(model="m", input="hi", stream=True)
                       if e.type == "response.output_text.delta")
        assert text == "tok0 tok1 tok2 tok3 tok4 "
        chunks = gpt.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert routed == []
    assert httpx.get(sim.url("/v1/models")).status_code == 200
    assert routed == ["/v1/models"]  # the counter sees what Starlette routes
