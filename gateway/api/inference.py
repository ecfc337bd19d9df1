"""The inference routes, in one table: method, path, route, whether it streams, its wire
protocol (and so its error shape), whether it is hedged.

The routers (`gateway.api.chat`, `.responses`, `.messages`) register these routes; each
entry's `protocol` is the one decision of how the route's streams and errors look: the
request it hands the proxy carries it, and the errors answered for it, before the proxy or
by it, are in its shape. The path's rule (`gateway.wire.paths.errors_of`) is only for answers
given where no route took the request (the server's own, an unknown path, a wrong method);
the unit test holds the two to the same shape on every path of the table.
`tests/unit/test_inference_routes.py` checks that the app serves exactly this table, and the
route matrix (`tests/e2e/test_route_matrix.py`) is generated from it: a new inference route
is added here, and it is tested under reloads, client keys and workers like every other.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.wire.base import WireProtocol
from gateway.wire.chat import CHAT
from gateway.wire.messages import COUNT_TOKENS, MESSAGES
from gateway.wire.paths import Endpoint, ErrorShape
from gateway.wire.responses import RESPONSES, RESPONSES_ITEM


@dataclass(frozen=True, slots=True)
class InferenceRoute:
    method: str
    #: the path as the router declares it (`{response_id}`: a stored response's id)
    path: str
    #: the upstream route it is sent to (`gateway.wire.paths.ENDPOINTS`)
    endpoint: Endpoint
    #: accepts `"stream": true`
    streams: bool
    #: the route's wire rules: first token, ends, error events and error bodies
    protocol: WireProtocol
    #: the body field that carries the prompt (checked present), None: no such rule; the
    #: stored-response operations take no body
    prompt: str | None
    #: the operation acts on a stored response (its id is in the path)
    stored: bool = False
    #: the key may come as `x-api-key` as well as a Bearer token (Anthropic's SDKs)
    x_api_key: bool = False
    #: one attempt at a time, never hedged: a token count is cheap and its answer the same
    #: from any backend; a stored response is held by one backend only
    single: bool = False

    @property
    def errors(self) -> ErrorShape:
        """The JSON shape of the route's error answers (its protocol's)."""
        return self.protocol.errors


INFERENCE_ROUTES: tuple[InferenceRoute, ...] = (
    InferenceRoute("POST", "/v1/chat/completions", "chat/completions", True, CHAT,
                   "messages"),
    InferenceRoute("POST", "/v1/completions", "completions", True, CHAT, "prompt"),
    InferenceRoute("POST", "/v1/embeddings", "embeddings", False, CHAT, "input"),
    InferenceRoute("POST", "/v1/responses", "responses", True, RESPONSES, None),
    InferenceRoute("GET", "/v1/responses/{response_id}", "responses/item", False,
                   RESPONSES_ITEM, None, stored=True, single=True),
    InferenceRoute("DELETE", "/v1/responses/{response_id}", "responses/item", False,
                   RESPONSES_ITEM, None, stored=True, single=True),
    InferenceRoute("POST", "/v1/responses/{response_id}/cancel", "responses/item", False,
                   RESPONSES_ITEM, None, stored=True, single=True),
    InferenceRoute("GET", "/v1/responses/{response_id}/input_items", "responses/item", False,
                   RESPONSES_ITEM, None, stored=True, single=True),
    InferenceRoute("POST", "/v1/messages", "messages", True, MESSAGES, "messages",
                   x_api_key=True),
    InferenceRoute("POST", "/v1/messages/count_tokens", "messages/count_tokens", False,
                   COUNT_TOKENS, "messages", x_api_key=True, single=True),
)

#: the table's paths, by number of segments, for `route_path_of`
_SEGMENTS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(dict.fromkeys(
    (r.path, tuple(r.path.split("/"))) for r in INFERENCE_ROUTES))


def route_path_of(path: str) -> str | None:
    """The table's path that `path` is a request to, whatever its method (a path parameter
    matches one non-empty segment), or None: `path` names no inference route. The request
    log names a refused request's route so."""
    parts = path.split("/")
    for template, segments in _SEGMENTS:
        if len(segments) == len(parts) and all(
            seg == part or (seg.startswith("{") and part != "")
            for seg, part in zip(segments, parts, strict=True)
        ):
            return template
    return None


def route(method: str, path: str) -> InferenceRoute:
    """The table's entry for `method path` (the routers take their facts from it)."""
    for entry in INFERENCE_ROUTES:
        if entry.method == method and entry.path == path:
            return entry
    raise KeyError(f"{method} {path} is not in INFERENCE_ROUTES")
