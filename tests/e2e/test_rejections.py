"""An upstream's rejection (400/413/422) as a client reads it: the upstream's own explanation
(message, type, param, code) in the client's route shape, the backend named beside it, and
nothing of a credential or an address. Over real sockets: the gateway under its own server
class, the simulator in process (the embedded demo) or a scripted upstream that echoes a
secret in its error body, and the official `openai` and `anthropic` SDKs as clients.

Also Claude Code's first request on the demo, recorded from the CLI itself: the CLI sends a
`system` turn inside `messages` under a beta the simulator does not take, reads the 400's
message, and sends the turn again in a form the simulator takes. Through a gateway that hid
the message, it never found what to change and ended with `API Error: 400`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.settings import Settings, default_settings
from tests.harness import LoopThread, ScriptedUpstream, UpstreamFactory, json_script
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import MESSAGES, Canary, Gateway, GatewayFactory, sdk, verbose_logs

#: the configured key of the scripted backend: no credential's shape, so only knowing it
#: keeps it out of an answer
KEY = Canary("upstream-key-for-the-tests", "tok_9f8e7d6c5b4a39281706f5e4d3c2b1a0",
             "internal.example", "10.1.2.3")
#: what the upstream answers: OpenAI's wording, echoing the key it was sent, an internal URL
#: and address, and a token of its own
ECHO = {"error": {
    "message": f"Incorrect API key provided: {KEY.needles[0]}. Session {KEY.needles[1]}; see "
               f"https://{KEY.needles[2]}:8443/docs or call {KEY.needles[3]}:9000.",
    "type": "invalid_request_error", "param": "messages", "code": "invalid_api_key"}}
RECORDED = Path(__file__).parent / "recorded"


def demo(loop_thread: LoopThread) -> Gateway:
    return GatewayFactory(loop_thread)(default_settings())


def one_backend(loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
                provider: str) -> tuple[Gateway, ScriptedUpstream]:
    (upstream,) = scripted_upstream(1, responder=lambda _: json_script(ECHO, 400))
    settings = gateway_settings([upstream.base_url], api_key=KEY.value)
    if provider == "anthropic":  # Anthropic's base URL has no /v1
        backend = dataclasses.replace(settings.pools[0].backends[0], provider="anthropic",
                                      base_url=upstream.root_url)
        settings = dataclasses.replace(settings, pools=(dataclasses.replace(
            settings.pools[0], backends=(backend,)),))
    return GatewayFactory(loop_thread)(settings), upstream


def claude(root: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=20.0)


# ---- the simulator's words, in each route's shape ---------------------------------------------


def test_the_responses_api_reads_the_simulators_own_explanation(loop_thread: LoopThread) -> None:
    gateway = demo(loop_thread)
    with sdk(gateway.v1) as client, pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="demo", input="hi", store=False, max_output_tokens=4)
    body: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    backend = body["message"].rsplit("(backend ", 1)[1].rstrip(")")
    assert backend in ("sim-a", "sim-b", "sim-c")
    assert body == {
        "message": "Invalid 'max_output_tokens': integer below minimum value. Expected a value "
                   f">= 16, but got 4 instead. (backend {backend})",
        "type": "invalid_request_error", "param": "max_output_tokens",
        "code": "integer_below_min_value"}
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_chat_and_messages_read_the_simulators_own_explanation(loop_thread: LoopThread) -> None:
    gateway = demo(loop_thread)
    with sdk(gateway.v1) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, stream=True, n=2)
    assert caught.value.code == "unsupported_value" and caught.value.param == "n"
    assert caught.value.message.endswith(
        "Unsupported value: 'n' does not support 2 with this model. Only the default (1) "
        f"value is supported. (backend {caught.value.message.rsplit('(backend ', 1)[1]}")
    assert caught.value.response.headers["x-should-retry"] == "false"
    with claude(gateway.root) as client, pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="demo", max_tokens=16, messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "ls", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "cat"})
    error = info.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(
        "tool_choice: tool 'cat' not found in 'tools' (backend sim-")


# ---- an upstream that echoes a secret ---------------------------------------------------------


def test_an_echoed_key_url_and_address_never_reach_an_openai_client(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    verbose_logs(caplog)
    gateway, upstream = one_backend(loop_thread, scripted_upstream, "openai")
    with sdk(gateway.v1) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=POOL, messages=MESSAGES, stream=True)
    assert upstream.requests[0].headers["authorization"] == f"Bearer {KEY.value}"
    assert caught.value.body == {
        "message": "Incorrect API key provided: [redacted]. Session [redacted]; see [redacted] "
                   "or call [redacted] (backend b0)",
        "type": "invalid_request_error", "param": "messages", "code": "invalid_api_key"}
    KEY.assert_absent_everywhere(gateway.root, caplog, caught.value.response.text)


def test_an_echoed_key_url_and_address_never_reach_an_anthropic_client(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    verbose_logs(caplog)
    gateway, upstream = one_backend(loop_thread, scripted_upstream, "anthropic")
    with claude(gateway.root) as client, pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=POOL, max_tokens=16,
                               messages=[{"role": "user", "content": "hi"}])
    assert upstream.requests[0].headers["authorization"] == f"Bearer {KEY.value}"
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "Incorrect API key provided: [redacted]. Session [redacted]; see [redacted] "
                   "or call [redacted] (backend b0) [param messages, code invalid_api_key]"}}
    KEY.assert_absent_everywhere(gateway.root, caplog, caught.value.response.text)


# ---- Claude Code's recorded requests -----------------------------------------------------------


def recorded(name: str) -> tuple[str, dict[str, str], bytes]:
    saved = json.loads((RECORDED / name).read_text())
    return saved["path"], saved["headers"], json.dumps(saved["body"]).encode()


def post(gateway: Gateway, name: str) -> httpx.Response:
    path, headers, body = recorded(name)
    return httpx.post(gateway.url(path), content=body, timeout=20.0,
                      headers={**headers, "authorization": "Bearer demo-needs-no-key"})


@pytest.mark.parametrize("version", ["2.1.332"])
def test_claude_codes_recorded_requests_are_answered_on_the_demo(
    loop_thread: LoopThread, version: str
) -> None:
    """`claude -p --model demo "say hi"`, every default tool: its first request puts a
    `system` turn in `messages`, which the simulator refuses as the Messages API does
    without the beta; the CLI reads the refusal's words and sends the request again without
    that turn, and that request is answered (200, a whole stream)."""
    gateway = demo(loop_thread)
    first = post(gateway, f"claude-code-{version}-first.json")
    assert first.status_code == 400
    error = first.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(  # the words the CLI acts on, as the simulator says
        "messages.1.role: Input should be 'user' or 'assistant' (backend sim-")
    retry = post(gateway, f"claude-code-{version}-retry.json")
    assert retry.status_code == 200, retry.text
    assert retry.headers["content-type"].startswith("text/event-stream")
    assert "event: message_stop" in retry.text


def test_default_settings_are_the_demo() -> None:
    """The recorded requests name the model `demo`: the embedded default's pool."""
    settings: Settings = default_settings()
    assert [p.name for p in settings.pools] == ["demo"]
    for name in ("claude-code-2.1.332-first.json", "claude-code-2.1.332-retry.json"):
        assert recorded(name)[2].startswith(b'{"model": "demo"')
