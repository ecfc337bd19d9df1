"""A Vertex AI simulator with its own OAuth side: a real HTTP app (served by uvicorn on loopback
in the tests) that issues access tokens and checks them on Claude's raw-predict routes.

- **The token endpoint** (`POST /token`, what a test's service-account file names as its
  `token_uri`) takes the JWT-bearer grant google-auth sends: the assertion must be an RS256 JWT
  whose signature verifies with the service account's public key, whose `kid` is its
  `private_key_id`, `iss` its email, `aud` Google's token endpoint (what google-auth names) or
  this one, and `scope` the cloud-platform scope.
- **The metadata server** (`/computeMetadata/v1/instance/service-accounts/default/...`, with
  `Metadata-Flavor: Google`) issues tokens as on GCE.
- **The model routes** `POST /v1/projects/{project}/locations/{region}/publishers/anthropic/
  models/{model}:rawPredict` and `:streamRawPredict` want a token it issued and that has not
  expired (`token_lifetime`), the simulator's project and region, and a Messages body without
  `model` and with Vertex's `anthropic_version`; the stream is Anthropic's SSE.
- **Faults** come from the test's `Reply`: an HTTP error in Google's shape (`429
  RESOURCE_EXHAUSTED`), or an `event: error` inside the stream.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.auth import jwt
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

ANTHROPIC_VERSION = "vertex-2023-10-16"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
JWT_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
#: the audience google-auth names in its assertions whatever the file's `token_uri` (Google's
#: token endpoint takes it), besides this endpoint's own address
GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
#: Google's status names for the HTTP statuses the simulator answers with
STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
                503: "UNAVAILABLE"}


@dataclass(frozen=True)
class ServiceAccount:
    """A service account's key: the JSON file google-auth reads, and the public key the
    token endpoint verifies its assertions with."""

    email: str
    private_key_id: str
    private_key_pem: str
    public_key_pem: str

    @classmethod
    def generate(cls, email: str = "gateway@sim-project.iam.gserviceaccount.com"
                 ) -> ServiceAccount:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        private = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
        public = key.public_key().public_bytes(
            serialization.Encoding.PEM,
            serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        return cls(email, secrets.token_hex(20), private, public)

    def key_file(self, token_uri: str, project: str = "sim-project") -> dict[str, str]:
        """The service-account JSON, as Google's console downloads it."""
        return {"type": "service_account", "project_id": project,
                "private_key_id": self.private_key_id, "private_key": self.private_key_pem,
                "client_email": self.email, "client_id": "1234567890",
                "auth_uri": "https://accounts.google.com/o/oauth2/auth",
                "token_uri": token_uri}


def google_error(status: int, message: str) -> Response:
    return JSONResponse({"error": {"code": status, "message": message,
                                   "status": STATUS_NAMES.get(status, "UNKNOWN")}},
                        status_code=status)


class VertexSimulator:
    """The ASGI app (`app`) and what it saw (`calls`, `token_grants`, `refused`)."""

    def __init__(self, *, project: str, region: str,
                 service_account: ServiceAccount | None = None,
                 token_lifetime: float = 3600.0,
                 responder: Responder = default_responder) -> None:
        self.project = project
        self.region = region
        self.service_account = service_account
        self.token_lifetime = token_lifetime
        self.responder = responder
        #: the token endpoint's URL, for the key file (set once the app listens: `bind`)
        self.token_uri = ""
        #: issued token -> monotonic expiry
        self.tokens: dict[str, float] = {}
        #: how each token was had, in order: "jwt" (the token endpoint) or "metadata"
        self.token_grants: list[str] = []
        self.calls: list[CallRecord] = []
        self.refused: list[str] = []
        root = "/computeMetadata/v1/instance/service-accounts/default"
        self.app = Starlette(routes=[
            Route("/token", self._token, methods=["POST"]),
            Route(f"{root}/", self._metadata_info, methods=["GET"]),
            Route(f"{root}/token", self._metadata_token, methods=["GET", "POST"]),
            Route("/v1/projects/{project}/locations/{region}/publishers/anthropic/models/{rest}",
                  self._predict, methods=["POST"]),
        ])

    def bind(self, root_url: str) -> None:
        """Where the app listens (`http://127.0.0.1:PORT`): the token URI follows from it."""
        self.token_uri = root_url.rstrip("/") + "/token"

    def _issue(self, how: str) -> dict[str, Any]:
        token = f"ya29.sim-{len(self.token_grants)}-{secrets.token_urlsafe(16)}"
        self.tokens[token] = time.monotonic() + self.token_lifetime
        self.token_grants.append(how)
        return {"access_token": token, "expires_in": self.token_lifetime,
                "token_type": "Bearer"}

    # --- OAuth --------------------------------------------------------------------------------

    async def _token(self, request: Request) -> Response:
        form = parse_qs((await request.body()).decode())
        grant = form.get("grant_type", [""])[0]
        assertion = form.get("assertion", [""])[0]
        problem = self._check_assertion(grant, assertion)
        if problem is not None:
            self.refused.append(f"token: {problem}")
            return JSONResponse({"error": "invalid_grant", "error_description": problem},
                                status_code=400)
        return JSONResponse(self._issue("jwt"))

    def _check_assertion(self, grant: str, assertion: str) -> str | None:
        account = self.service_account
        if account is None:
            return "no service account is known"
        if grant != JWT_GRANT:
            return "not a JWT-bearer grant"
        if assertion.count(".") != 2:
            return "the assertion is not a JWT"
        try:
            header = jwt.decode_header(assertion)  # type: ignore[no-untyped-call]
            claims = jwt.decode(  # type: ignore[no-untyped-call]
                assertion, certs={account.private_key_id: account.public_key_pem},
                audience=[self.token_uri, GOOGLE_TOKEN_URI], clock_skew_in_seconds=10)
        except ValueError as exc:
            return f"the assertion does not verify: {exc}"
        if header.get("alg") != "RS256" or header.get("kid") != account.private_key_id:
            return "the assertion's header is wrong"
        if claims.get("iss") != account.email:
            return "the assertion's issuer is not the service account"
        if SCOPE not in str(claims.get("scope", "")).split():
            return "the assertion asks for no cloud-platform scope"
        if not 0 < int(claims.get("exp", 0)) - int(claims.get("iat", 0)) <= 3600:
            return "the assertion's lifetime is wrong"
        return None

    async def _metadata_info(self, request: Request) -> Response:
        if request.headers.get("metadata-flavor") != "Google":
            return Response("Metadata-Flavor: Google is required", status_code=403)
        email = self.service_account.email if self.service_account else "default@sim"
        return JSONResponse({"aliases": ["default"], "email": email, "scopes": [SCOPE]})

    async def _metadata_token(self, request: Request) -> Response:
        if request.headers.get("metadata-flavor") != "Google":
            return Response("Metadata-Flavor: Google is required", status_code=403)
        return JSONResponse(self._issue("metadata"))

    # --- the model routes ---------------------------------------------------------------------

    async def _predict(self, request: Request) -> Response:
        model, _, method = request.path_params["rest"].rpartition(":")
        if method not in ("rawPredict", "streamRawPredict"):
            return self._refuse(404, "unknown method")
        stream = method == "streamRawPredict"
        call, _ = await read_call(request, stream=stream, model=model)
        scheme, _, token = call.headers.get("authorization", "").partition(" ")
        expires = self.tokens.get(token)
        if scheme != "Bearer" or expires is None or expires <= time.monotonic():
            return self._refuse(401, "Request had invalid authentication credentials.")
        call.credential = token
        if (request.path_params["project"], request.path_params["region"]) != (
                self.project, self.region):
            return self._refuse(404, "no such project or location")
        problem = self._check_body(call.body, stream)
        if problem is not None:
            return self._refuse(400, problem)
        self.calls.append(call)
        reply = self.responder(call)
        if reply.status != 200:
            return google_error(reply.status, reply.error_message)
        message_id = f"msg_vrtx_{uuid.uuid4().hex[:12]}"
        if not stream:
            if reply.hold is not None:
                await reply.hold()
            call.completed = True
            return JSONResponse(message_body(reply, model, message_id))
        return StreamingResponse(self._events(reply, call, message_id),
                                 media_type="text/event-stream")

    def _refuse(self, status: int, message: str) -> Response:
        self.refused.append(f"{status}: {message}")
        return google_error(status, message)

    @staticmethod
    def _check_body(body: Any, stream: bool) -> str | None:
        if not isinstance(body, dict):
            return "the body is not a JSON object"
        if "model" in body:
            return "model is named by the path, not the body"
        if body.get("anthropic_version") != ANTHROPIC_VERSION:
            return "invalid anthropic_version"
        if bool(body.get("stream")) != stream:
            return "stream does not match the method"
        if not isinstance(body.get("messages"), list) or "max_tokens" not in body:
            return "messages and max_tokens are required"
        return None

    @staticmethod
    async def _events(reply: Reply, call: CallRecord, message_id: str) -> AsyncIterator[bytes]:
        async with aclosing(play(reply, call, call.model, message_id)) as events:
            async for event in events:
                if event is FAILURE:
                    event = {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "Overloaded"}}
                assert isinstance(event, dict)
                name = event["type"]
                yield f"event: {name}\ndata: {json.dumps(event)}\n\n".encode()
                if name == "error":
                    return
