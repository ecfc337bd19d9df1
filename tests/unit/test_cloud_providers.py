"""Bedrock's and Vertex's wire pieces without sockets: event-stream frames (the simulator's
encoder through botocore's parser, and the provider's decoder), the mapping of Bedrock errors
to the error tree, the SigV4 round trip between the provider's signer and the simulator's
check, the request each provider builds, and the credential refresher."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import cast

import pytest
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer, EventStreamMessage

from gateway.errors import (
    UpstreamAuthFailed,
    UpstreamCredentialsUnavailable,
    UpstreamNotFound,
    UpstreamProtocolError,
    UpstreamRateLimited,
    UpstreamRateLimitedEverywhere,
    UpstreamRejectedRequest,
    UpstreamServerError,
    UpstreamTimeout,
    UpstreamUnavailable,
    all_attempts_failed,
)
from gateway.settings import BackendSettings, Timeouts
from gateway.settings.model import AwsSettings
from gateway.wire.base import Kind
from gateway.wire.messages import classify_messages
from providers.base import UpstreamCall
from providers.bedrock import (
    UNKNOWN_EXPIRY_LIFETIME,
    BedrockProvider,
    EventStreamDecoder,
    bedrock_error,
    lifetime_of,
)
from providers.credentials import Fetched, Refresher
from providers.http import UpstreamClient
from providers.sim.bedrock import (
    AwsKey,
    SignatureRefused,
    chunk_frame,
    encode_frame,
    exception_frame,
    verify_sigv4,
)
from providers.sim.cloud import message_start, stream_tail, text_delta
from providers.vertex import VertexProvider

KEY = AwsKey("AKIDSIMULATED", "simulated-secret-key", "simulated-session-token")

# --- credential lifetimes ----------------------------------------------------------------------


def test_temporary_credentials_live_until_their_expiry_and_static_ones_for_ever() -> None:
    """What the credential refresher is told: the real expiry of the chain's temporary
    credentials (botocore keeps it privately), none for static keys, and a short re-read
    should a botocore release stop keeping it where it is read."""
    import datetime

    from botocore.credentials import Credentials, RefreshableCredentials

    now = datetime.datetime(2026, 12, 7, 12, 0, tzinfo=datetime.UTC)
    expiry = now + datetime.timedelta(minutes=42)
    temporary = RefreshableCredentials("AKID", "secret", "token", expiry,
                                       refresh_using=lambda: {}, method="sts-assume-role")
    assert lifetime_of(temporary, now) == 42 * 60
    assert lifetime_of(Credentials("AKID", "secret"), now) is None
    delattr(temporary, "_expiry_time")  # as if a botocore release kept it elsewhere
    assert lifetime_of(temporary, now) == UNKNOWN_EXPIRY_LIFETIME


# --- frames ------------------------------------------------------------------------------------


def test_the_simulators_frames_parse_with_botocore() -> None:
    """The encoder is ours, the parser AWS's: byte by byte, both CRCs and every header must
    be right for botocore to hand the message back."""
    headers = {":event-type": "chunk", ":content-type": "application/json",
               ":message-type": "event", "x-unicode": "héllo"}
    frames = encode_frame(headers, b'{"bytes":"e30="}') + encode_frame({"a": "b"}, b"")
    buffer = EventStreamBuffer()
    messages: list[EventStreamMessage] = []
    for i in range(len(frames)):
        buffer.add_data(frames[i:i + 1])
        messages.extend(buffer)
    # the stubs call a message's headers an int; botocore's parser makes them a dict
    assert [cast(object, m.headers) for m in messages] == [headers, {"a": "b"}]
    assert [m.payload for m in messages] == [b'{"bytes":"e30="}', b""]


def test_a_corrupted_frame_is_a_protocol_error() -> None:
    frame = bytearray(chunk_frame(text_delta("x")))
    frame[-6] ^= 0xFF  # a payload byte: the message CRC no longer matches
    with pytest.raises(UpstreamProtocolError, match="malformed event stream"):
        EventStreamDecoder().feed(bytes(frame))


def test_chunks_become_named_messages_events_whatever_the_reads() -> None:
    events = [message_start("claude", "msg_1"), text_delta("Hi"), *stream_tail(1)]
    wire = b"".join(chunk_frame(e) for e in events)
    for size in (1, 7, len(wire)):
        decoder = EventStreamDecoder()
        decoded = [ev for i in range(0, len(wire), size) for ev in decoder.feed(wire[i:i + size])]
        assert [ev.event for ev in decoded] == [e["type"].encode() for e in events]
        assert [json.loads(ev.data) for ev in decoded] == events
    token = EventStreamDecoder().feed(chunk_frame(text_delta("Hi")))[0]
    assert classify_messages(token) is Kind.TOKEN


def test_a_chunk_without_its_bytes_is_a_protocol_error() -> None:
    frame = encode_frame({":event-type": "chunk", ":message-type": "event"}, b'{"nope":1}')
    with pytest.raises(UpstreamProtocolError):
        EventStreamDecoder().feed(frame)


def test_a_throttling_frame_is_a_pushback_after_the_events_before_it() -> None:
    decoder = EventStreamDecoder()
    read = chunk_frame(message_start("claude", "m")) + exception_frame(
        "throttlingException", "Too many requests, please wait before trying again.")
    assert [ev.event for ev in decoder.feed(read)] == [b"message_start"]
    failure = decoder.pending_failure()
    assert isinstance(failure, UpstreamRateLimited)
    # no pause of its own: the race pauses it for the pool's `health.default_pause`
    assert failure.status == 429 and failure.retry_after is None and failure.throttle
    assert "wait" not in failure.reason  # the upstream's text never reaches a message


def test_a_model_stream_error_is_an_in_band_error_event() -> None:
    (event,) = EventStreamDecoder().feed(exception_frame("modelStreamErrorException", "boom"))
    assert event.event == b"error" and classify_messages(event) is Kind.ERROR
    payload = json.loads(event.data)
    assert payload["error"]["type"] == "api_error" and "boom" not in event.data.decode()


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error_type", "status", "expected", "replaceable"),
    [
        ("ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/", 429,
         UpstreamRateLimited, True),
        ("ServiceQuotaExceededException", 400, UpstreamRateLimited, True),
        ("ServiceUnavailableException", 503, UpstreamUnavailable, True),
        ("ValidationException", 400, UpstreamRejectedRequest, False),
        ("AccessDeniedException", 403, UpstreamAuthFailed, True),
        ("UnrecognizedClientException", 403, UpstreamAuthFailed, True),
        ("ResourceNotFoundException", 404, UpstreamNotFound, True),
        ("ModelTimeoutException", 408, UpstreamTimeout, True),
        ("ModelErrorException", 424, UpstreamServerError, True),
        ("InternalServerException", 500, UpstreamServerError, True),
        (None, 429, UpstreamRateLimited, True),
        (None, 400, UpstreamRejectedRequest, False),
        ("validationException", None, UpstreamRejectedRequest, False),
        ("internalServerException", None, UpstreamServerError, True),
        ("somethingNewException", None, UpstreamProtocolError, True),
    ],
)
def test_bedrock_errors_map_by_type(error_type: str | None, status: int | None,
                                    expected: type, replaceable: bool) -> None:
    error = bedrock_error(error_type, status)
    assert type(error) is expected and error.replaceable is replaceable


def test_bedrock_pushbacks_are_throttles_without_a_pause_of_their_own() -> None:
    """Throttling, quotas and a busy model name no pause: the race gives each the pool's
    `health.default_pause`; a validation error is no throttle."""
    for error in (bedrock_error("ThrottlingException", 429), bedrock_error("throttlingException"),
                  bedrock_error("ServiceQuotaExceededException", 400),
                  bedrock_error("ServiceUnavailableException", 503)):
        assert error.throttle and error.retry_after is None
    assert bedrock_error("ThrottlingException", 429, retry_after=3.0).retry_after == 3.0
    assert not bedrock_error("ValidationException", 400).throttle


def test_throttled_everywhere_is_a_429_once_the_pauses_are_given() -> None:
    failures = [bedrock_error("ThrottlingException", 429),
                bedrock_error("throttlingException")]
    for failure in failures:  # what the race does with a throttle that names no pause
        failure.retry_after = 2.5
    answer = all_attempts_failed(["a: status 429", "b: status 429"], failures, lambda s: s)
    assert isinstance(answer, UpstreamRateLimitedEverywhere)
    assert answer.status == 429 and answer.retry_after == 2.5


# --- the requests the providers build ----------------------------------------------------------


def _bedrock(**changes: object) -> BedrockProvider:
    settings = BackendSettings(
        name="bedrock", provider="bedrock", region="us-east-1",
        model="anthropic.claude-sonnet-4-5-20250929-v1:0",
        base_url="http://127.0.0.1:9", aws=AwsSettings(
            access_key_id=KEY.access_key_id, secret_access_key=KEY.secret_access_key,
            session_token=KEY.session_token), **changes)  # type: ignore[arg-type]
    return BedrockProvider(settings, UpstreamClient(max_connections=1), Timeouts())


def _call(stream: bool, **headers: str) -> UpstreamCall:
    body = {"model": "the-backends-model", "max_tokens": 5, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]}
    return UpstreamCall(endpoint="messages", body=body, stream=stream, request_id="req-1",
                        first_byte_timeout=5.0, extra_headers=headers)


def test_bedrock_builds_the_body_and_path_bedrock_reads() -> None:
    provider = _bedrock()
    body = json.loads(provider.body(_call(True, **{"anthropic-beta": "a-1, b-2"})))
    assert "model" not in body and "stream" not in body
    assert body["anthropic_version"] == "bedrock-2023-05-31"
    assert body["anthropic_beta"] == ["a-1", "b-2"]
    assert provider._stream_url == ("http://127.0.0.1:9/model/"
                                    "anthropic.claude-sonnet-4-5-20250929-v1:0/"
                                    "invoke-with-response-stream")
    own = _bedrock(anthropic_version="bedrock-2099-01-01")
    assert json.loads(own.body(_call(False)))["anthropic_version"] == "bedrock-2099-01-01"


def test_the_signature_verifies_and_breaks_with_any_change() -> None:
    provider = _bedrock()
    call = _call(True, traceparent="00-abc-def-01")
    url = provider._stream_url
    content = provider.body(call)
    credentials = Credentials(KEY.access_key_id, KEY.secret_access_key, KEY.session_token)
    sent = {k.lower(): v for k, v in provider.signed_headers(url, content, credentials,
                                                             call).items()}
    sent["host"] = "127.0.0.1:9"
    keys = {KEY.access_key_id: KEY}
    assert verify_sigv4("POST", url, sent, content, region="us-east-1", keys=keys) == KEY
    signed = sent["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    # ours and the request id are signed; the trace context is sent but, as botocore does,
    # left unsigned (a proxy may rewrite it)
    assert {"host", "x-amz-date", "x-amz-security-token", "content-type", "x-request-id",
            "x-amzn-bedrock-accept"} <= set(signed)
    assert sent["traceparent"] == "00-abc-def-01" and "traceparent" not in signed

    def refused(*, body: bytes = content, region: str = "us-east-1",
                accepted: dict[str, AwsKey] = keys, headers: dict[str, str] = sent) -> str:
        with pytest.raises(SignatureRefused) as caught:
            verify_sigv4("POST", url, headers, body, region=region, keys=accepted)
        return caught.value.error_type

    assert refused(body=content + b" ") == "InvalidSignatureException"
    assert refused(region="eu-west-1") == "InvalidSignatureException"
    other = AwsKey(KEY.access_key_id, "another-secret", KEY.session_token)
    assert refused(accepted={KEY.access_key_id: other}) == "InvalidSignatureException"
    assert refused(accepted={}) == "UnrecognizedClientException"
    assert refused(headers={**sent, "x-amz-security-token": "stolen"}) == (
        "UnrecognizedClientException")
    assert refused(headers={**sent, "x-request-id": "forged"}) == "InvalidSignatureException"


def test_vertex_builds_the_body_and_path_vertex_reads() -> None:
    settings = BackendSettings(name="vertex", provider="vertex", project="my-project",
                               region="europe-west1", model="claude-sonnet-4-5@20250929")
    provider = VertexProvider(settings, UpstreamClient(max_connections=1), Timeouts())
    body = json.loads(provider.body(_call(True)))
    assert "model" not in body and body["stream"] is True
    assert body["anthropic_version"] == "vertex-2023-10-16"
    assert provider._stream_url == (
        "https://europe-west1-aiplatform.googleapis.com/v1/projects/my-project/locations/"
        "europe-west1/publishers/anthropic/models/claude-sonnet-4-5@20250929:streamRawPredict")
    assert provider._predict_url.endswith("@20250929:rawPredict")


# --- the refresher ------------------------------------------------------------------------------


class Source:
    """A fetch the test steers: each call takes the next value, or raises."""

    def __init__(self, lifetime: float | None) -> None:
        self.lifetime = lifetime
        self.calls = 0
        self.threads: set[int] = set()
        self.fail = False

    def __call__(self) -> Fetched[str]:
        self.calls += 1
        self.threads.add(threading.get_ident())
        if self.fail:
            raise OSError("token endpoint unreachable: secret-detail")
        return Fetched(f"token-{self.calls}", self.lifetime)


async def test_the_refresher_fetches_in_a_thread_and_ahead_of_expiry() -> None:
    source = Source(lifetime=0.2)
    refresher = Refresher(source, what="test", min_interval=0.01)
    try:
        assert await refresher.get() == "token-1"
        assert threading.get_ident() not in source.threads  # never on the loop
        # the next fetch comes by itself, before the first value expired, while it is read
        for _ in range(200):
            assert await refresher.get() in ("token-1", "token-2")
            if source.calls == 2:
                break
            await asyncio.sleep(0.005)
        assert source.calls == 2
        assert await refresher.get() == "token-2"
    finally:
        await refresher.aclose()


async def test_an_idle_refresher_stops_and_a_failure_is_told_at_once() -> None:
    source = Source(lifetime=0.05)
    refresher = Refresher(source, what="backend b: Google access token", min_interval=0.01)
    try:
        await refresher.get()
        await asyncio.sleep(0.3)  # nobody reads: at most one refresh, then it stops
        assert source.calls <= 2
        stopped_at = source.calls
        await asyncio.sleep(0.1)
        assert source.calls == stopped_at
        source.fail = True
        with pytest.raises(UpstreamCredentialsUnavailable) as caught:
            await refresher.get()
        assert caught.value.reason == (
            "backend b: Google access token: could not get credentials (OSError)")
        source.fail = False
        for _ in range(200):  # the retry after the pause succeeds
            try:
                await refresher.get()
                break
            except UpstreamCredentialsUnavailable:
                await asyncio.sleep(0.01)
        else:
            pytest.fail("the refresher never recovered")
        before = source.calls
        refresher.invalidate()  # a 401: the value is not handed out again
        assert await refresher.get() == f"token-{before + 1}"
    finally:
        await refresher.aclose()
    with pytest.raises(UpstreamCredentialsUnavailable):
        await refresher.get()


async def test_a_refresher_stopped_while_idle_refreshes_in_the_background_when_read_again(
) -> None:
    """Its value unread at the refresh point, the refresher stops; a read between that point
    and the expiry gets the still good value at once and starts the refresh, so the value is
    replaced before it expires rather than on a later request's path. (The refresher's clock
    is the test's: it says where the value is in its life; its sleeps are real.)"""
    now = [0.0]
    source = Source(lifetime=0.2)  # due for refresh at 0.1, handed out until 0.18
    refresher = Refresher(source, what="test", clock=lambda: now[0], min_interval=0.01)
    try:
        assert await refresher.get() == "token-1"  # read: refreshed once at its point
        task = refresher._task
        assert task is not None
        await asyncio.wait_for(task, 5.0)  # token-2 unread at its refresh point: stopped
        assert source.calls == 2
        now[0] = 0.15
        assert await refresher.get() == "token-2"  # still good: not waited for
        for _ in range(500):  # no other read: the refresh runs by itself
            if source.calls == 3:
                break
            await asyncio.sleep(0.01)
        assert source.calls == 3
        assert await refresher.get() == "token-3"
    finally:
        await refresher.aclose()


async def test_a_value_without_a_lifetime_is_fetched_once_until_it_is_refused() -> None:
    """Static keys never expire: nothing re-reads them; a refusal of the value in force makes
    the next read fetch, and a refusal of a value already replaced does nothing."""
    source = Source(lifetime=None)
    refresher = Refresher(source, what="test", min_interval=0.01)
    try:
        first = await refresher.get()
        task = refresher._task
        assert task is not None
        await asyncio.wait_for(task, 5.0)  # nothing to refresh: the task ended
        assert await refresher.get() == first and source.calls == 1
        assert refresher.invalidate(first)
        second = await refresher.get()
        assert second == "token-2"
        assert not refresher.invalidate(first)  # refused with the old one: already replaced
        assert await refresher.get() == second and source.calls == 2
    finally:
        await refresher.aclose()
