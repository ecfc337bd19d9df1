"""The inference routes, in one table: method, path, route, whether it streams, error shape,
whether it is hedged.

The routers (`gateway.api.chat`, `.responses`, `.messages`) register these routes and the
error handler answers them in the shape given here (`gateway.wire.paths.errors_of`);
`tests/unit/test_inference_routes.py` checks that the app serves exactly this table, and the
route matrix (`tests/e2e/test_route_matrix.py`) is generated from it: a new inference route
is added here, and it is tested under reloads, client keys and workers like every other.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.wire.paths import Endpoint, ErrorShape


@dataclass(frozen=True, slots=True)
class InferenceRoute:
    method: str
    #: the path as the router declares it (`{response_id}`: a stored response's id)
    path: str
    #: the upstream route it is sent to (`gateway.wire.paths.ENDPOINTS`)
    endpoint: Endpoint
    #: accepts `"stream": true`
    streams: bool
    errors: ErrorShape
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


INFERENCE_ROUTES: tuple[InferenceRoute, ...] = (
    InferenceRoute("POST", "/v1/chat/completions", "chat/completions", True, "openai",
                   "messages"),
    InferenceRoute("POST", "/v1/completions", "completions", True, "openai", "prompt"),
    InferenceRoute("POST", "/v1/embeddings", "embeddings", False, "openai", "input"),
    InferenceRoute("POST", "/v1/responses", "responses", True, "openai", None),
    InferenceRoute("GET", "/v1/responses/{response_id}", "responses/item", False, "openai",
                   None, stored=True, single=True),
    InferenceRoute("DELETE", "/v1/responses/{response_id}", "responses/item", False,
                   "openai", None, stored=True, single=True),
    InferenceRoute("POST", "/v1/responses/{response_id}/cancel", "responses/item", False,
                   "openai", None, stored=True, single=True),
    InferenceRoute("GET", "/v1/responses/{response_id}/input_items", "responses/item", False,
                   "openai", None, stored=True, single=True),
    InferenceRoute("POST", "/v1/messages", "messages", True, "anthropic", "messages",
                   x_api_key=True),
    InferenceRoute("POST", "/v1/messages/count_tokens", "messages/count_tokens", False,
                   "anthropic", "messages", x_api_key=True, single=True),
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
