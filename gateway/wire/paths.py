"""The upstream routes, and which error shape a client path is answered in (pure).

Below the API layer and the server both: the server answers a 431 or a 408 before any route
runs, in the shape the path's SDK reads, and the providers name the routes they serve; neither
may import the API layer for it.
"""

from __future__ import annotations

from typing import Literal, get_args

Endpoint = Literal[
    "chat/completions",
    "completions",
    "embeddings",
    "responses",
    #: `GET`/`DELETE /responses/{id}`, `/cancel`, `/input_items`: the path is `UpstreamCall.path`
    "responses/item",
    "messages",
    "messages/count_tokens",
]
#: every route, in a fixed order: the only values a `route` label in stats or metrics takes
ENDPOINTS: tuple[Endpoint, ...] = get_args(Endpoint)

#: the JSON shape of an error answer: OpenAI's `{"error": {message, type, param, code}}` or
#: Anthropic's `{"type": "error", "error": {type, message}}`
ErrorShape = Literal["openai", "anthropic"]

#: the paths under which errors take Anthropic's shape, even on a path no route matched (a
#: 404 under /v1/messages is still read by an Anthropic SDK); the unit test checks that it
#: covers the Anthropic-shaped routes of the table and no other
ANTHROPIC_PREFIXES: tuple[str, ...] = ("/v1/messages",)


def errors_of(path: str) -> ErrorShape:
    """The error shape of a request to `path`."""
    for prefix in ANTHROPIC_PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return "anthropic"
    return "openai"


#: each API's routes, by the names a backend's `apis` takes
API_ENDPOINTS: dict[str, frozenset[Endpoint]] = {
    "chat": frozenset({"chat/completions"}),
    "completions": frozenset({"completions"}),
    "embeddings": frozenset({"embeddings"}),
    "responses": frozenset({"responses", "responses/item"}),
    "messages": frozenset({"messages", "messages/count_tokens"}),
}


def endpoints_of(apis: tuple[str, ...] | None, serves: frozenset[str]) -> frozenset[str]:
    """The routes a backend serves: its provider's (`serves`), narrowed to `apis` if set."""
    if apis is None:
        return serves
    return serves & frozenset().union(*(API_ENDPOINTS[api] for api in apis))
