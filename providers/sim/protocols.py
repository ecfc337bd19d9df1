"""The simulator's Responses API and Anthropic Messages routes: which stream or body answers.

Same plans as the chat simulator (`providers.sim.wire`): the TTFT, the output, the faults. What
differs is the wire (`providers.sim.responses`, `providers.sim.messages`), and in particular
the early-headers trap both real APIs set: the status, the headers and the scaffolding events
go out at once (`message_start` and `ping`; `response.created` and `response.in_progress`), and
the first output only after the TTFT. A gateway that committed on the first byte or the first
event would lose every hedge.

Each stream item is `(event name, data)`: both protocols name their events.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from providers.sim.messages import count_tokens_body, messages_body, messages_stream
from providers.sim.responses import responses_body, responses_item_body, responses_stream
from providers.sim.wire import Event, SimPlan, Sleep

#: the routes this module simulates (chat, completions and embeddings are `chat`'s)
ROUTES = frozenset({"responses", "responses/item", "messages", "messages/count_tokens"})


def protocol_stream(plan: SimPlan, endpoint: str, *, model: str, request_id: str,
                    sleep: Sleep, created: int) -> AsyncGenerator[Event, None]:
    if endpoint == "messages":
        return messages_stream(plan, model=model, message_id=f"msg_sim_{request_id}",
                               sleep=sleep)
    return responses_stream(plan, model=model, response_id=f"resp_sim_{request_id}",
                            sleep=sleep, created=created)


def protocol_body(plan: SimPlan, endpoint: str, *, method: str, path: str | None, model: str,
                  request_id: str, created: int) -> dict[str, Any]:
    if endpoint == "messages":
        return messages_body(plan, model, f"msg_sim_{request_id}")
    if endpoint == "messages/count_tokens":
        return count_tokens_body(plan)
    if endpoint == "responses/item":
        return responses_item_body(method, path or "", model, created)
    return responses_body(plan, model, f"resp_sim_{request_id}", created)


def response_time(plan: SimPlan, endpoint: str) -> float:
    """A non-streaming answer's delay: item reads and token counts answer at once."""
    if endpoint in ("responses/item", "messages/count_tokens"):
        return 0.0
    return plan.response_time("chat/completions")
