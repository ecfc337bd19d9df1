"""A Bedrock runtime simulator: a real HTTP app (served by uvicorn on loopback in the tests)
that checks what the real service checks and answers in its wire format.

- **SigV4.** Every request's signature is recomputed with botocore's signer from what arrived
  (the path as sent, the signed headers, the body's hash, the `x-amz-date`) and the
  credentials the simulator was given, and compared; the credential scope must name the
  simulator's region and service `bedrock`, the date must be within five minutes, a session
  token must match, and a key given an expiry is refused after it (`ExpiredTokenException`,
  as for an expired session token). A failure answers 403 in Bedrock's shape, so a wrong
  signer fails loudly.
- **The routes** `POST /model/{model}/invoke` and `/invoke-with-response-stream`; the body must
  be a Messages body without `model` and `stream` and with Bedrock's `anthropic_version`.
- **Event-stream frames.** botocore parses frames but has no encoder, so `encode_frame` writes
  them (prelude, headers, payload, both CRCs): a `chunk` event holds one Messages event as
  base64 JSON, an exception frame names its `:exception-type`.
- **Faults** come from the test's `Reply`: an HTTP error of a Bedrock error type (throttling is
  a 429 with `x-amzn-ErrorType: ThrottlingException`), or an exception frame inside a stream.
"""

from __future__ import annotations

import base64
import datetime
import hmac
import json
import struct
import uuid
import zlib
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from providers.sim.cloud import (
    FAILURE,
    CallRecord,
    Reply,
    Responder,
    default_responder,
    message_body,
    play,
    read_call,
)

ANTHROPIC_VERSION = "bedrock-2023-05-31"
EVENT_STREAM = "application/vnd.amazon.eventstream"
#: how far a request's x-amz-date may be from the simulator's clock, as on AWS
MAX_SKEW = datetime.timedelta(minutes=5)
#: each Bedrock error type's status
STATUSES = {
    "ThrottlingException": 429, "ServiceQuotaExceededException": 400,
    "ValidationException": 400, "AccessDeniedException": 403,
    "UnrecognizedClientException": 403, "InvalidSignatureException": 403,
    "ExpiredTokenException": 403,
    "MissingAuthenticationTokenException": 403, "ResourceNotFoundException": 404,
    "ModelTimeoutException": 408, "ModelErrorException": 424, "ModelNotReadyException": 429,
    "InternalServerException": 500, "ServiceUnavailableException": 503,
}


# --- frames -------------------------------------------------------------------------------------


def encode_frame(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One AWS event-stream message: a 12-byte prelude (total length, headers length, their
    CRC32), the headers (each a 1-byte name length, the name, type 7 = string, a 2-byte value
    length, the value), the payload, and the CRC32 of everything before it."""
    encoded = b"".join(
        struct.pack("!B", len(name.encode())) + name.encode() + b"\x07"
        + struct.pack("!H", len(value.encode())) + value.encode()
        for name, value in headers.items()
    )
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack("!II", total, len(encoded))
    head = prelude + struct.pack("!I", zlib.crc32(prelude) & 0xFFFFFFFF)
    message = head + encoded + payload
    return message + struct.pack("!I", zlib.crc32(message) & 0xFFFFFFFF)


def chunk_frame(event: Mapping[str, Any]) -> bytes:
    """A `chunk` event carrying one Messages event (with Bedrock's `p` padding field)."""
    inner = json.dumps(event, separators=(",", ":")).encode()
    payload = json.dumps({"bytes": base64.b64encode(inner).decode(), "p": "abcdefgh"})
    return encode_frame({":event-type": "chunk", ":content-type": "application/json",
                         ":message-type": "event"}, payload.encode())


def exception_frame(exception_type: str, message: str) -> bytes:
    return encode_frame({":exception-type": exception_type,
                         ":content-type": "application/json", ":message-type": "exception"},
                        json.dumps({"message": message}).encode())


# --- SigV4 ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AwsKey:
    """Credentials the simulator accepts (until `expires`, when given)."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None
    expires: datetime.datetime | None = None


class SignatureRefused(Exception):
    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def verify_sigv4(
    method: str, url: str, headers: Mapping[str, str], body: bytes, *, region: str,
    keys: Mapping[str, AwsKey], service: str = "bedrock",
    now: datetime.datetime | None = None,
) -> AwsKey:
    """Recompute the request's SigV4 signature with botocore; the key that signed it, or
    `SignatureRefused` naming the AWS error type. `headers` are the received ones, lower-case;
    `url` carries the path exactly as received."""
    authorization = headers.get("authorization", "")
    algorithm, _, rest = authorization.partition(" ")
    if algorithm != "AWS4-HMAC-SHA256":
        raise SignatureRefused("MissingAuthenticationTokenException", "no SigV4 signature")
    parts = dict(part.strip().split("=", 1) for part in rest.split(",") if "=" in part)
    try:
        credential, signed, given = parts["Credential"], parts["SignedHeaders"], parts["Signature"]
        access_key, day, scope_region, scope_service, terminator = credential.split("/")
    except (KeyError, ValueError):
        raise SignatureRefused("IncompleteSignatureException", "malformed Authorization") from None
    key = keys.get(access_key)
    if key is None:
        raise SignatureRefused("UnrecognizedClientException", "unknown access key")
    if (scope_region, scope_service, terminator) != (region, service, "aws4_request"):
        raise SignatureRefused("InvalidSignatureException", "credential scope is wrong")
    stamp = headers.get("x-amz-date", "")
    try:
        signed_at = datetime.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(
            tzinfo=datetime.UTC)
    except ValueError:
        raise SignatureRefused("IncompleteSignatureException", "no x-amz-date") from None
    current = now or datetime.datetime.now(datetime.UTC)
    if day != stamp[:8] or abs(current - signed_at) > MAX_SKEW:
        raise SignatureRefused("InvalidSignatureException", "signature expired")
    if key.session_token is not None and headers.get("x-amz-security-token") != key.session_token:
        raise SignatureRefused("UnrecognizedClientException", "the security token is invalid")
    if key.expires is not None and current >= key.expires:
        raise SignatureRefused("ExpiredTokenException", "the security token is expired")
    names = signed.split(";")
    if "host" not in names or "x-amz-date" not in names or any(n not in headers for n in names):
        raise SignatureRefused("InvalidSignatureException", "signed headers are incomplete")
    request = AWSRequest(method=method, url=url, data=body,
                         headers={name: headers[name] for name in names})
    request.context["timestamp"] = stamp
    signer = SigV4Auth(Credentials(key.access_key_id, key.secret_access_key,
                                   key.session_token), service, region)
    canonical = signer.canonical_request(request)
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    if signer.signed_headers(signer.headers_to_sign(request)) != signed or not \
            hmac.compare_digest(expected, given):
        raise SignatureRefused("InvalidSignatureException", "the signature does not match")
    return key


# --- the app --------------------------------------------------------------------------------------


def bedrock_error(error_type: str, message: str, status: int | None = None) -> Response:
    """An error answer as Bedrock sends it: the type in `x-amzn-ErrorType`, a JSON message."""
    return JSONResponse(
        {"message": message}, status_code=status or STATUSES.get(error_type, 400),
        headers={"x-amzn-errortype":
                 f"{error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/"})


class BedrockSimulator:
    """The ASGI app (`app`) and what it saw (`calls`, `refused`)."""

    def __init__(self, *, region: str, keys: list[AwsKey] | Mapping[str, AwsKey],
                 responder: Responder = default_responder) -> None:
        self.region = region
        #: the accepted keys by access key id (a mapping of the test's own can issue them as
        #: a credential process does)
        self.keys: Mapping[str, AwsKey] = (
            keys if isinstance(keys, Mapping) else {key.access_key_id: key for key in keys})
        self.responder = responder
        #: every request that passed the signature check, in arrival order
        self.calls: list[CallRecord] = []
        #: the error types of requests refused before the responder was asked
        self.refused: list[str] = []
        self.app = Starlette(routes=[Route("/{rest:path}", self._handle, methods=["POST"])])

    async def _handle(self, request: Request) -> Response:
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        path = raw_path.decode("latin-1").split("?", 1)[0]
        segments = path.split("/")
        if len(segments) != 4 or segments[1] != "model" or segments[3] not in (
                "invoke", "invoke-with-response-stream"):
            return self._refuse("UnknownOperationException", 404)
        stream = segments[3] == "invoke-with-response-stream"
        call, raw = await read_call(request, stream=stream, model=unquote(segments[2]))
        try:
            key = verify_sigv4("POST", f"http://{call.headers.get('host', '')}{path}",
                               call.headers, raw, region=self.region, keys=self.keys)
        except SignatureRefused as refused:
            return self._refuse(refused.error_type)
        call.credential = key.access_key_id
        problem = self._check_body(call.body)
        if problem is not None:
            return self._refuse("ValidationException", message=problem)
        self.calls.append(call)
        reply = self.responder(call)
        if reply.status != 200:
            return bedrock_error(reply.error_type or "InternalServerException",
                                 reply.error_message, reply.status)
        message_id = f"msg_bdrk_{uuid.uuid4().hex[:12]}"
        if not stream:
            if reply.hold is not None:
                await reply.hold()
            call.completed = True
            return JSONResponse(message_body(reply, call.model, message_id))
        return StreamingResponse(self._frames(reply, call, message_id), media_type=EVENT_STREAM,
                                 headers={"x-amzn-requestid": str(uuid.uuid4())})

    def _refuse(self, error_type: str, status: int | None = None,
                message: str = "refused") -> Response:
        self.refused.append(error_type)
        return bedrock_error(error_type, message, status)

    @staticmethod
    def _check_body(body: Any) -> str | None:
        if not isinstance(body, dict):
            return "the body is not a JSON object"
        for key in ("model", "stream"):
            if key in body:
                return f"extraneous key [{key}] is not permitted"
        if body.get("anthropic_version") != ANTHROPIC_VERSION:
            return "invalid anthropic_version"
        if not isinstance(body.get("messages"), list) or "max_tokens" not in body:
            return "messages and max_tokens are required"
        return None

    @staticmethod
    async def _frames(reply: Reply, call: CallRecord, message_id: str) -> AsyncIterator[bytes]:
        async with aclosing(play(reply, call, call.model, message_id)) as events:
            async for event in events:
                if event is FAILURE:
                    yield exception_frame(reply.stream_exception, "simulated stream failure")
                    return
                assert isinstance(event, dict)
                yield chunk_frame(event)
