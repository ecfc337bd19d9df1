"""Whether a simulated answer calls a tool, which one, and with what arguments. Pure.

Agents and SDK helpers (the OpenAI SDK's stream accumulators, Anthropic's tool runner) expect a
model that is offered tools to call them, and a gateway that hedges on the first token must
treat a call as output: a simulator that only ever wrote text would test neither. The rule:

- no function offered, or `tool_choice` none: text;
- `tool_choice` required (Messages: `any`) or naming a function: a call to it, always;
- otherwise (auto) text when the last input is a tool's result (the model answers with what the
  tool said), else a call. Always, not some share of the time: an agent's round trip (call,
  result, text) then completes on its first run, where a drawn share left one agent run in four
  (its request, and so its draw, the same on every rerun) answering in text at once.

Every choice (which tool, the arguments, the call's id) is drawn from a generator
seeded with the request's content (`prompt.content_key`), never from the backend's own random
stream: the same request gets the same call on every backend and in every run, so a hedge's
answer is the primary's, and drawing calls leaves the latency draws where they were.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from providers.sim.prompt import Api, content_key, ends_with_tool_result, offered_tools, tool_choice
from providers.sim.schema import arguments_for

#: characters of the arguments' JSON per streamed piece: one output token each, about the four
#: bytes a token of text is counted as
PIECE_CHARS = 4
#: the APIs whose answers may be calls
CALLING_APIS = frozenset({"chat", "responses", "messages"})


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name, its arguments as JSON text, and the hex key its ids are
    made of (each API's own prefix: `call_`, `fc_`, `toolu_`)."""

    name: str
    arguments: str
    key: str

    @property
    def pieces(self) -> tuple[str, ...]:
        """The arguments in streamed pieces (an empty object is still one piece)."""
        text = self.arguments
        return tuple(text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)) or ("",)

    def input_of(self, pieces: int) -> Any:
        """The arguments as a value, when all `pieces` of them were sent; `{}` for arguments
        a length limit cut (their JSON is incomplete)."""
        if pieces < len(self.pieces):
            return {}
        return json.loads(self.arguments)


def plan_tool_call(body: Mapping[str, Any], api: Api) -> ToolCall | None:
    """The call this request's answer makes, or None for a text answer."""
    if api not in CALLING_APIS:
        return None
    tools = offered_tools(body, api)
    if not tools:
        return None
    kind, name = tool_choice(body, api)
    if kind == "none":
        return None
    seed = hashlib.blake2b(content_key(body), digest_size=16).digest()
    rng = random.Random(int.from_bytes(seed, "big"))
    named = [tool for tool in tools if tool.name == name] if kind == "named" else []
    if kind == "auto" and ends_with_tool_result(body, api):
        return None
    tool = named[0] if named else rng.choice(tools)
    arguments = json.dumps(arguments_for(tool.schema, rng), separators=(",", ":"),
                           ensure_ascii=False)
    return ToolCall(tool.name, arguments, seed.hex()[:24])
