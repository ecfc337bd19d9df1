"""The log line of a request refused before any pool's race.

A request that reaches a pool is logged by its end (`gateway.api.end`); one refused earlier
(a wrong content type, a body too large or not JSON, a wrong key, an unknown model, route or
method, a foreign origin, a route the pool's backends do not serve) never got there, and used
to leave no trace. Now each step that answers with an error notes why in the request's scope
state (`gateway.api.answer.note_refusal`), the route notes the model once it has read the body
(`note_model`), and the app writes the line after the answer is sent (`write_refusal_line`),
unless the proxy took the request and so its line (`gateway.api.end.LINE_KEY`). One place
writes, one flag decides: exactly one line per request.

Lines are written for requests to an inference route (any method: a 405 names its route) and
for requests to a path no route of the gateway matched (a client whose base URL lacks `/v1`
is what an operator looks for), not for the operational reads (`/healthz`, `/metrics`,
`/hedge/*`, the dashboard, `/v1/models`), which are not requests for a model.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from starlette.types import Scope

from gateway.api.answer import REFUSAL_KEY
from gateway.api.end import LINE_KEY
from gateway.api.inference import route_path_of
from gateway.errors import RouteNotFound
from gateway.stats.loggable import loggable_model
from gateway.stats.requestlog import log_refusal

#: scope state: the request's id (`gateway.api.common.request_id_of`)
REQUEST_ID_KEY = "request_id"
#: scope state: the model the client sent, loggable (`gateway.stats.loggable`)
MODEL_KEY = "hedge_model"
#: the reason of a request that got no answer of ours (cancelled while its body was read)
UNANSWERED = "unanswered"


def _state(scope: Scope) -> dict[str, Any]:
    state: dict[str, Any] = scope.setdefault("state", {})
    return state


def note_model(scope: Scope, body: Mapping[str, Any], hidden: Collection[str]) -> str | None:
    """The body's model, made loggable (never one of `hidden`, the configuration's secrets),
    kept for the line and returned for the proxy's."""
    model = loggable_model(body.get("model"), hidden)
    _state(scope)[MODEL_KEY] = model
    return model


def write_refusal_line(scope: Scope) -> None:
    """After the answer: the line of a request that was refused before any race, if it is
    one the log covers (see the module docstring) and no line was written for it yet."""
    state = scope.get("state")
    if state is not None and state.get(LINE_KEY):
        return
    state = state if state is not None else {}
    path: str = scope.get("path", "")
    route = route_path_of(path)
    status, reason = state.get(REFUSAL_KEY, (None, UNANSWERED))
    if route is None and reason != RouteNotFound.log_reason():
        return
    state[LINE_KEY] = True
    client = scope.get("client")
    log_refusal(state.get(REQUEST_ID_KEY), scope.get("method", ""), route, path,
                state.get(MODEL_KEY), status, reason, str(client[0]) if client else None)
