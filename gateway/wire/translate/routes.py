"""Which client route reaches which backend route by translation, and how (pure).

A backend serves the routes its provider speaks, narrowed by its `apis`; a request on a route
the chosen backend does not serve goes to a route it does serve when a `Translation` joins
the two. The table is read once per request and per backend that needs it (never per event);
what a translation carries per stream is a fresh state machine behind the relay's `Encoder`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.wire.base import Encoder, RelayOutcome, StreamEnd, WireProtocol, json_bytes
from gateway.wire.chat import CHAT
from gateway.wire.messages import MESSAGES
from gateway.wire.paths import Endpoint
from gateway.wire.sse import SSEEvent
from gateway.wire.translate.chat_messages import chat_to_messages, messages_to_chat
from gateway.wire.translate.chat_messages_answer import (
    chat_answer_to_messages,
    messages_answer_to_chat,
)
from gateway.wire.translate.chat_messages_stream import ChatToMessages, MessagesToChat
from gateway.wire.translate.responses_chat import (
    ChatToResponses,
    chat_answer_to_responses,
    responses_to_chat,
)
from gateway.wire.usage import Usage

#: each API's routes (the `apis` a backend may be narrowed to)
API_ENDPOINTS: Mapping[str, frozenset[Endpoint]] = {
    "chat": frozenset({"chat/completions"}),
    "completions": frozenset({"completions"}),
    "embeddings": frozenset({"embeddings"}),
    "responses": frozenset({"responses", "responses/item"}),
    "messages": frozenset({"messages", "messages/count_tokens"}),
}



class ThroughChat:
    """A Messages stream written as a Responses stream through Chat: each Messages event to
    Chat chunks (`MessagesToChat`), each of those to Responses events (`ChatToResponses`).
    The chunks in between are single-line `data:` events, split without a decoder."""

    __slots__ = ("first", "second")

    def __init__(self, created: int) -> None:
        self.first = MessagesToChat(created, include_usage=True)
        self.second = ChatToResponses(created)

    @property
    def usage(self) -> Usage | None:
        return self.second.usage

    @property
    def ended(self) -> bool:
        return self.second.ended

    @property
    def failed(self) -> bool:
        return self.second.failed

    def feed(self, event: SSEEvent) -> bytes:
        chunks = self.first.feed(event)
        if not chunks:
            return b""
        return b"".join([self.second.feed(SSEEvent(part[6:]))
                         for part in chunks.split(b"\n\n") if part])


Machine = ChatToMessages | MessagesToChat | ChatToResponses | ThroughChat


@dataclass(frozen=True, slots=True)
class Translation:
    """A client route answered by a backend route of another API."""

    #: `client->backend` by API (`chat->messages`): the label it is counted under
    name: str
    client: Endpoint
    backend: Endpoint
    #: the backend's wire rules: its first token, its end, its errors before commit
    protocol: WireProtocol
    #: the client's request body -> the backend's (Untranslatable: a 400 naming the field)
    request: Callable[[Mapping[str, Any]], dict[str, Any]]
    #: a whole backend answer -> the client's, given `created` (seconds since the epoch)
    answer: Callable[[bytes, int], bytes]
    #: a fresh state machine for one stream, given `created`
    machine: Callable[[int], Machine]

    def encoder(self, created: int) -> Encoder:
        """The relay's encoder for one translated stream: the backend's events, each
        translated as it arrives (once per stream)."""
        machine = self.machine(created)
        feed = machine.feed
        chat = machine if isinstance(machine, MessagesToChat) else None

        def events(batch: list[SSEEvent], _request_id: str, outcome: RelayOutcome) -> bytes:
            if chat is not None:  # the client's own wish (the relay strips what it did not ask)
                chat.include_usage = not outcome.strip_usage
            # one event per read is the usual case: no list, no join
            out = feed(batch[0]) if len(batch) == 1 else b"".join([feed(e) for e in batch])
            outcome.usage = machine.usage or outcome.usage
            if machine.ended:
                outcome.end = StreamEnd.UPSTREAM_ERROR if machine.failed else StreamEnd.DONE
            return out

        return Encoder(events)


def _whole(translate: Callable[[dict[str, Any], int], dict[str, Any]]
           ) -> Callable[[bytes, int], bytes]:
    def answer(data: bytes, created: int) -> bytes:
        return json_bytes(translate(json.loads(data), created))

    return answer


TRANSLATIONS: Mapping[tuple[Endpoint, Endpoint], Translation] = {
    ("chat/completions", "messages"): Translation(
        "chat->messages", "chat/completions", "messages", MESSAGES, chat_to_messages,
        _whole(messages_answer_to_chat), lambda created: MessagesToChat(created, True)),
    ("messages", "chat/completions"): Translation(
        "messages->chat", "messages", "chat/completions", CHAT, messages_to_chat,
        _whole(lambda body, _created: chat_answer_to_messages(body)),
        lambda _created: ChatToMessages()),
    ("responses", "chat/completions"): Translation(
        "responses->chat", "responses", "chat/completions", CHAT, responses_to_chat,
        _whole(chat_answer_to_responses), ChatToResponses),
    ("responses", "messages"): Translation(
        "responses->messages", "responses", "messages", MESSAGES,
        lambda body: chat_to_messages(responses_to_chat(body)),
        _whole(lambda body, created: chat_answer_to_responses(
            messages_answer_to_chat(body, created), created)),
        ThroughChat),
}


#: every translation's name, in a fixed order: the only values the stats' label takes
TRANSLATION_NAMES: tuple[str, ...] = tuple(t.name for t in TRANSLATIONS.values())


def translation_for(client: Endpoint, serves: frozenset[str]) -> Translation | None:
    """The translation that takes a request on `client` to a backend serving `serves` (None:
    it serves `client` itself, or no translation reaches it)."""
    if client in serves:
        return None
    for (source, target), translation in TRANSLATIONS.items():
        if source == client and target in serves:
            return translation
    return None


def endpoints_of(apis: tuple[str, ...] | None, serves: frozenset[str]) -> frozenset[str]:
    """The routes a backend serves: its provider's (`serves`), narrowed to `apis` if set."""
    if apis is None:
        return serves
    return serves & frozenset().union(*(API_ENDPOINTS[api] for api in apis))
