"""Request ids against an upstream that validates them, over real sockets.

llama-cpp-python's server answers 400 to any `x-request-id` that does not parse as a UUID;
the scripted upstream here does the same, so a gateway that sends anything else upstream
fails every request these tests make. The client still gets its own id back.
"""

from __future__ import annotations

import uuid
from typing import Literal

import anthropic
import httpx
import pytest

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    HedgingSettings,
    PoolSettings,
    Settings,
)
from providers.requestid import upstream_request_id
from tests.harness import (
    AsgiServerFactory,
    RecordedRequest,
    Responder,
    Script,
    UpstreamFactory,
    chat_completion_obj,
    error_script,
    json_script,
    stream_script,
)
from tests.harness.protocol_wire import messages_script

POOL = "chat"
MESSAGES = [{"role": "user", "content": "hi"}]


def is_uuid(value: str) -> bool:
    """What llama-cpp-python's server checks (`uuid.UUID` parses it), nothing stricter."""
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def validating(answer: Script) -> Responder:
    """A responder that answers 400 unless the request's `x-request-id` is a UUID, as
    llama-cpp-python's server does, and `answer` otherwise."""

    def respond(request: RecordedRequest) -> Script:
        if not is_uuid(request.headers.get("x-request-id", "")):
            return error_script(400, "Invalid UUID in request header X-Request-ID")
        return answer

    return respond


def one_backend(base_url: str,
                provider: Literal["openai", "anthropic"] = "openai") -> Settings:
    backend = BackendSettings(name="only", provider=provider, model="backend-model",
                              base_url=base_url, api_key="sk-upstream")
    pool = PoolSettings(name=POOL, backends=(backend,), hedging=HedgingSettings(enabled=False))
    return Settings(pools=(pool,))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_uuid_goes_upstream_whatever_id_the_client_sent(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory, stream: bool
) -> None:
    answer = stream_script(["hi"]) if stream else json_script(chat_completion_obj("hi"))
    up = scripted_upstream.one(responder=validating(answer))
    gateway = asgi_server(create_app(one_backend(up.base_url), seed=1))
    client_uuid = str(uuid.uuid4())
    sent_ids = ["client-req-42", client_uuid, None]
    body = {"model": POOL, "messages": MESSAGES, "stream": stream}
    replies = []
    with httpx.Client(timeout=8.0, trust_env=False) as client:
        for rid in sent_ids:
            headers = {} if rid is None else {"x-request-id": rid}
            replies.append(client.post(gateway.url("/v1/chat/completions"), json=body,
                                       headers=headers))
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    named, uuid_named, unnamed = up.requests
    # the client's own id comes back to it; the upstream got a UUID derived from it, and the
    # client's id beside it
    assert replies[0].headers["x-request-id"] == "client-req-42"
    assert named.headers["x-request-id"] == upstream_request_id("client-req-42")
    assert uuid.UUID(named.headers["x-request-id"]).version == 4
    assert named.headers["x-client-request-id"] == "client-req-42"
    # a client's UUID and the gateway's own id go upstream unchanged, alone
    assert replies[1].headers["x-request-id"] == client_uuid
    assert uuid_named.headers["x-request-id"] == client_uuid
    generated = replies[2].headers["x-request-id"]
    assert uuid.UUID(generated).version == 4
    assert unnamed.headers["x-request-id"] == generated
    assert "x-client-request-id" not in uuid_named.headers
    assert "x-client-request-id" not in unnamed.headers


def test_anthropic_upstreams_get_a_uuid_too(
    scripted_upstream: UpstreamFactory, asgi_server: AsgiServerFactory
) -> None:
    up = scripted_upstream.one(responder=validating(messages_script(["hi"])))
    gateway = asgi_server(create_app(one_backend(up.root_url, "anthropic"), seed=1))
    with anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0,
                             timeout=8.0) as client, client.messages.stream(
        model=POOL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-request-id": "claude-req-7"},
    ) as events:
        text = events.get_final_text()
        seen = events.response.headers["x-request-id"]
    assert text == "hi"
    assert seen == "claude-req-7"
    (request,) = up.requests
    assert request.headers["x-request-id"] == upstream_request_id("claude-req-7")
    assert request.headers["x-client-request-id"] == "claude-req-7"

