"""The translations: which client route reaches which backend route, and how (pure).

A backend serves the routes its provider speaks, narrowed by its `apis`; a request on a route
the chosen backend does not serve goes to a route it does serve when a `Translation`
(`gateway.wire.base`) of this table joins the two. The composition root hands the table to
each pool, so the race and its plan read no one API's module; it is read once per request
and per backend that needs it (never per event), and what a translation carries per stream
is a fresh state machine behind the relay's `Encoder`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from gateway.errors import AllAttemptsFailed
from gateway.wire.base import AnswerTranslation, Translation, json_bytes
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


class ThroughChat:
    """A Messages stream written as a Responses stream through Chat: each Messages event to
    Chat chunks (`MessagesToChat`), each of those to Responses events (`ChatToResponses`).
    The chunks in between are single-line `data:` events, split without a decoder."""

    __slots__ = ("first", "include_usage", "second")

    def __init__(self, created: int) -> None:
        self.first = MessagesToChat(created, include_usage=True)
        self.second = ChatToResponses(created)
        #: the Responses API always reports usage: a Chat client's wish does not apply
        self.include_usage = True

    @property
    def usage(self) -> Usage | None:
        return self.second.usage

    @property
    def ended(self) -> bool:
        return self.second.ended

    @property
    def failed(self) -> bool:
        return self.second.failed

    def feed_all(self, events: list[SSEEvent]) -> bytes:
        return b"".join([self.feed(event) for event in events])

    def feed_named(self, chunk: bytes) -> bytes | None:
        """None: each event is fed through both machines."""
        return None

    def feed(self, event: SSEEvent) -> bytes:
        chunks = self.first.feed(event)
        if not chunks:
            return b""
        return b"".join([self.second.feed(SSEEvent(part[6:]))
                         for part in chunks.split(b"\n\n") if part])




def _whole(translate: Callable[[dict[str, Any], int], dict[str, Any]]) -> AnswerTranslation:
    def answer(data: bytes, created: int, parsed: object = None) -> bytes:
        """The client's answer; a backend answer of a shape its API never has (a string
        where an object goes) is the backend's failure, a 502, not a bug of ours. `parsed`:
        the answer as the race parsed it to judge it (not parsed twice)."""
        try:
            body = parsed if isinstance(parsed, dict) else json.loads(data)
            return json_bytes(translate(body, created))
        except (ValueError, TypeError, AttributeError, KeyError, IndexError,
                RecursionError) as exc:
            raise AllAttemptsFailed([f"the backend's answer could not be translated "
                                     f"({type(exc).__name__})"]) from None

    return answer


#: forwarded headers only one API reads (`Translation.client_only_headers`)
_ANTHROPIC_ONLY = ("anthropic-",)
_OPENAI_ONLY = ("openai-",)

TRANSLATIONS: Mapping[tuple[Endpoint, Endpoint], Translation] = {
    ("chat/completions", "messages"): Translation(
        "chat->messages", "chat/completions", "messages", MESSAGES, chat_to_messages,
        _whole(messages_answer_to_chat), lambda created: MessagesToChat(created, True),
        _OPENAI_ONLY),
    ("messages", "chat/completions"): Translation(
        "messages->chat", "messages", "chat/completions", CHAT, messages_to_chat,
        _whole(lambda body, _created: chat_answer_to_messages(body)),
        lambda _created: ChatToMessages(), _ANTHROPIC_ONLY),
    ("responses", "chat/completions"): Translation(
        "responses->chat", "responses", "chat/completions", CHAT, responses_to_chat,
        _whole(chat_answer_to_responses), ChatToResponses, _OPENAI_ONLY),
    ("responses", "messages"): Translation(
        "responses->messages", "responses", "messages", MESSAGES,
        lambda body: chat_to_messages(responses_to_chat(body)),
        _whole(lambda body, created: chat_answer_to_responses(
            messages_answer_to_chat(body, created), created)),
        ThroughChat, _OPENAI_ONLY),
}


#: every translation's name, in a fixed order: the only values the stats' label takes
TRANSLATION_NAMES: tuple[str, ...] = tuple(t.name for t in TRANSLATIONS.values())
