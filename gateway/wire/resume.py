"""A broken answer continued on another backend, as the wire sees it (pure).

After commit a stream may break (a reset, a body that ends early, an error event). The answer
relayed so far is text the client already holds; another backend is asked for the same
request with that text as the start of the assistant's turn, and its events are spliced
after the ones relayed, so the client reads one answer. Three things are the wire's, per API:

- `Relayed`: what the client holds, read once from the relayed events when the stream
  breaks (never per event): the text, how many text deltas carried it (one per token, as
  streaming servers send them), the ids and model the client saw. An answer that is not
  plain text (a tool call, a reasoning block, more than one choice, a finish already sent)
  is not continued: the client gets the route's in-band error, as without continuations.
  The Responses API's answer is one message item with one text part, still open.
- `continuation_body`: the request to send, in the backend's `continuation` style: the
  client's messages, then an assistant message holding the text (`prefill`), with
  `continue_final_message: true` and `add_generation_prompt: false` for the OpenAI-compatible
  engines that need it asked (`continue_final_message`). Its output limit is lowered by the
  tokens already relayed. Anthropic refuses a final assistant message that ends in white
  space: the trailing white space is left out of the prefill and out of the continuation's
  first text (the client has it already).
- `Splice`: the continuation's events rewritten to follow the relayed ones: its scaffolding
  dropped (chat's role chunk; Messages' `message_start`, `ping` and the start of the text block
  that is still open; the Responses API's `response.created`, `response.in_progress` and the
  start of the message item and its part), its ids, model, indices and sequence numbers made
  the relayed ones (the Responses API's done events and final object carry the whole text),
  and its usage
  counted as the docs say: output = the text deltas relayed + the continuation's output;
  input = the continuation's input less those same tokens (the relayed text it read as
  input is output the client's request paid for once, not input it asked).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.wire.sse import SSEEvent

Style = Literal["prefill", "continue_final_message"]

#: the output-limit fields of each route's request
_LIMITS: Mapping[str, tuple[str, ...]] = {
    "chat": ("max_tokens", "max_completion_tokens"),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


@dataclass(slots=True)
class Relayed:
    """What the client was sent of an answer before its stream broke (`relayed_answer`)."""

    api: str
    text: str
    #: text deltas relayed: the tokens of output the client holds
    tokens: int
    #: the first chunk's id, created, model and system_fingerprint (chat), or the message id
    #: and model (Messages): what every continued event must say
    head: dict[str, Any] = field(default_factory=dict)
    #: Messages: the index of the text block still open (None: none is open), and the
    #: index the next block takes
    open_index: int | None = None
    next_index: int = 0


def _loads(event: SSEEvent) -> dict[str, Any] | None:
    try:
        obj = json.loads(event.data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def relayed_answer(api: str, events: list[SSEEvent]) -> Relayed | None:
    """The text answer the client holds, or None when what it holds cannot be continued
    (see the module docstring). Called once, when a stream breaks."""
    if api == "chat":
        return _relayed_chat(events)
    if api == "messages":
        return _relayed_messages(events)
    if api == "responses":
        return _relayed_responses(events)
    return None


def _relayed_chat(events: list[SSEEvent]) -> Relayed | None:
    out = Relayed("chat", "", 0)
    parts: list[str] = []
    for event in events:
        if event.data.strip() == b"[DONE]":
            return None
        obj = _loads(event)
        if obj is None:
            continue
        if obj.get("error") is not None:
            return None
        if not out.head and isinstance(obj.get("id"), str):
            out.head = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint")
                        if k in obj}
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return None  # more than one choice: not one text to continue
            if choice.get("finish_reason") is not None or "text" in choice:
                return None  # finished already, or a legacy completion
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                return None
            if any(delta.get(key) for key in ("tool_calls", "function_call", "refusal",
                                               "reasoning_content", "reasoning", "audio")):
                return None
            content = delta.get("content")
            if isinstance(content, str) and content:
                parts.append(content)
                out.tokens += 1
    out.text = "".join(parts)
    return out if out.text and out.head else None


def _relayed_messages(events: list[SSEEvent]) -> Relayed | None:
    out = Relayed("messages", "", 0)
    parts: list[str] = []
    for event in events:
        obj = _loads(event)
        if obj is None:
            continue
        kind = obj.get("type")
        if kind == "message_start":
            message = obj.get("message") or {}
            out.head = {k: message[k] for k in ("id", "model") if k in message}
        elif kind == "content_block_start":
            block = obj.get("content_block") or {}
            index = obj.get("index")
            if not isinstance(block, dict) or block.get("type") != "text" \
                    or not isinstance(index, int):
                return None  # a tool call or a thinking block: not text to continue
            out.open_index, out.next_index = index, index + 1
            text = block.get("text")
            if isinstance(text, str) and text:
                parts.append(text)
        elif kind == "content_block_delta":
            delta = obj.get("delta") or {}
            if not isinstance(delta, dict) or delta.get("type") != "text_delta":
                return None
            text = delta.get("text")
            if isinstance(text, str) and text:
                parts.append(text)
                out.tokens += 1
        elif kind == "content_block_stop":
            out.open_index = None
        elif kind in ("message_delta", "message_stop", "error"):
            return None  # finished, or failed before the break
    out.text = "".join(parts)
    return out if out.text and out.head else None


def _relayed_responses(events: list[SSEEvent]) -> Relayed | None:
    """The Responses API: one message item with one output_text part, still open."""
    out = Relayed("responses", "", 0)
    parts: list[str] = []
    seq = -1
    for event in events:
        obj = _loads(event)
        if obj is None:
            continue
        kind = obj.get("type")
        number = obj.get("sequence_number")
        if isinstance(number, int):
            seq = max(seq, number)
        if kind in ("response.created", "response.in_progress"):
            response = obj.get("response") or {}
            if isinstance(response, dict):
                out.head.update({k: response[k] for k in ("id", "model") if k in response})
        elif kind == "response.output_item.added":
            item = obj.get("item") or {}
            if not isinstance(item, dict) or item.get("type") != "message" \
                    or "item_id" in out.head:
                return None  # a function call, reasoning, or a second message
            out.head["item_id"] = item.get("id")
            out.head["output_index"] = obj.get("output_index", 0)
        elif kind == "response.content_part.added":
            part = obj.get("part") or {}
            if not isinstance(part, dict) or part.get("type") != "output_text":
                return None
            out.head["content_index"] = obj.get("content_index", 0)
        elif kind == "response.output_text.delta":
            delta = obj.get("delta")
            if isinstance(delta, str) and delta:
                parts.append(delta)
                out.tokens += 1
        elif isinstance(kind, str) and (kind.endswith(".done") or kind in (
                "response.completed", "response.incomplete", "response.failed", "error")):
            return None  # the text was finished (or failed) before the break
    out.head["seq"] = seq + 1
    out.text = "".join(parts)
    return out if out.text and "id" in out.head and "item_id" in out.head else None


def continuation_body(body: Mapping[str, Any], relayed: Relayed, style: Style
                      ) -> tuple[dict[str, Any], str]:
    """The request that continues `relayed`, and the white space the prefill left out (to be
    dropped from the continuation's first text)."""
    text, dropped = relayed.text, ""
    if relayed.api == "messages":
        kept = text.rstrip()
        text, dropped = kept, text[len(kept):]
    if relayed.api == "responses":  # the input as items, then the assistant's text
        given = body.get("input")
        messages = [{"role": "user", "content": given}] if isinstance(given, str) \
            else list(given or ())
    else:
        messages = list(body.get("messages") or ())
    last = messages[-1] if messages else None
    if isinstance(last, Mapping) and last.get("role") == "assistant" \
            and isinstance(last.get("content"), str):
        # the client's own prefill: the relayed text went on from it
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    field_name = "input" if relayed.api == "responses" else "messages"
    out: dict[str, Any] = {**body, field_name: messages}
    for key in _LIMITS.get(relayed.api, ()):
        limit = out.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            out[key] = max(1, limit - relayed.tokens)
    if style == "continue_final_message":
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    return out, dropped


def limit_reached(body: Mapping[str, Any], relayed: Relayed) -> bool:
    """Whether the text relayed already holds the request's output limit (`max_tokens`...):
    then there is nothing to continue (a continuation asked for one more token would go past
    the limit the client set)."""
    for key in _LIMITS.get(relayed.api, ()):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit <= relayed.tokens:
            return True
    return False


def ended_at_limit(relayed: Relayed) -> list[SSEEvent] | None:
    """The end of an answer that reached its output limit, as a continuation of it would
    send it (to go through its `Splice`): finish reason `length` (chat), stop reason
    `max_tokens` (Messages). None for the Responses API, whose end holds the whole response
    object (such a break ends with the route's in-band error)."""
    if relayed.api == "chat":
        return [SSEEvent(_dumps({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]})),
            SSEEvent(b"[DONE]")]
    if relayed.api != "messages":
        return None
    out: list[tuple[str, dict[str, Any]]] = []
    if relayed.open_index is not None:  # the open text block is closed
        out += [("content_block_start", {"index": 0, "content_block": {"type": "text",
                                                                       "text": ""}}),
                ("content_block_stop", {"index": 0})]
    out += [("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                               "usage": {"output_tokens": 0}}),
            ("message_stop", {})]
    return [SSEEvent(_dumps({"type": kind, **obj}), kind.encode()) for kind, obj in out]


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class Splice:
    """Rewrites a continuation's events to follow the relayed ones (one per continuation;
    its events only, so the work per event is paid by continued streams alone)."""

    def __init__(self, relayed: Relayed, dropped: str = "") -> None:
        self.relayed = relayed
        #: white space to take off the continuation's first text (see `continuation_body`)
        self._dropped = dropped
        #: the continuation has sent text (its scaffolding is behind it)
        self._started = False
        #: Messages, Responses: whether the continuation's first text block (message item)
        #: is the open one; and whether the open one was closed here instead, because the
        #: continuation went on with another block or item (a tool call) first
        self._joined = False
        self._closed = False
        #: Responses: the continuation's id of the message item it joined, and where each of
        #: its items goes in the client's output (the joined one: the relayed item's place;
        #: any other: the next place after it)
        self._message: object = None
        self._places: dict[int, int] = {}
        self._next_place = int(relayed.head.get("output_index", 0)) + 1
        #: Responses: the continuation's text so far (its done events carry the whole text),
        #: and the next sequence number
        self._text: list[str] = []
        self._seq = int(relayed.head.get("seq", 0))

    def events(self, events: list[SSEEvent]) -> list[SSEEvent]:
        """The continuation's `events` as the client must read them, in order."""
        out: list[SSEEvent] = []
        for event in events:
            if event.data.strip() == b"[DONE]":
                out.append(event)
                continue
            obj = _loads(event)
            if obj is None:
                out.append(event)
                continue
            api = self.relayed.api
            if api == "chat":
                kept = self._chat(obj)
                if kept is not None:
                    out.append(SSEEvent(_dumps(kept), event.event))
                continue
            closing = self._closing(obj)  # the relayed block or item, closed first
            kept = self._messages(obj) if api == "messages" else self._responses(obj)
            out += [SSEEvent(_dumps(made), str(made["type"]).encode()) for made in closing]
            if kept is not None:
                out.append(SSEEvent(_dumps(kept), event.event))
        return out

    def _closing(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """Messages, Responses: the events that end the relayed text block (message item),
        when the continuation's first block (item) is another one (a tool call): the client
        holds the relayed one open, and nothing else would close it. Empty otherwise."""
        if self._joined or self._closed:
            return []
        relayed, kind = self.relayed, obj.get("type")
        if relayed.api == "messages" and kind == "content_block_start":
            block = obj.get("content_block") or {}
            if relayed.open_index is None or (obj.get("index") == 0
                                              and block.get("type") == "text"):
                return []  # nothing open, or the continuation joins it
            self._closed = True
            return [{"type": "content_block_stop", "index": relayed.open_index}]
        if relayed.api == "responses" and kind == "response.output_item.added":
            if (obj.get("item") or {}).get("type") == "message":
                return []  # the continuation joins it
            self._closed = True
            return self._relayed_item_done()
        return []

    def _relayed_item_done(self) -> list[dict[str, Any]]:
        """Responses: the done events of the relayed message item, with its text."""
        head, text = self.relayed.head, self.relayed.text
        where = {"item_id": head["item_id"], "output_index": head.get("output_index", 0)}
        part = {"type": "output_text", "text": text, "annotations": []}
        made = [{"type": "response.output_text.done", **where,
                 "content_index": head.get("content_index", 0), "text": text},
                {"type": "response.content_part.done", **where,
                 "content_index": head.get("content_index", 0), "part": part},
                {"type": "response.output_item.done", "output_index": where["output_index"],
                 "item": self._relayed_item()}]
        for event in made:
            event["sequence_number"] = self._seq
            self._seq += 1
        return made

    def _relayed_item(self) -> dict[str, Any]:
        """Responses: the relayed message item, whole, as the client holds it."""
        return {"id": self.relayed.head["item_id"], "type": "message", "status": "completed",
                "role": "assistant", "content": [
                    {"type": "output_text", "text": self.relayed.text, "annotations": []}]}

    def _first_text(self, text: str) -> str:
        if not self._started:
            self._started = True
            if self._dropped and text.startswith(self._dropped):
                text = text[len(self._dropped):]
            elif self._dropped:
                text = text.lstrip()
        return text

    def _chat(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        choices = obj.get("choices")
        if isinstance(choices, list) and not self._started:
            finishing = any(isinstance(c, dict) and c.get("finish_reason") is not None
                            for c in choices)
            outputs = [c for c in choices if isinstance(c, dict)
                       and isinstance(c.get("delta"), dict)
                       and any(c["delta"].get(name) for name in _CHAT_OUTPUTS)]
            usage_chunk = not choices and isinstance(obj.get("usage"), dict)
            if not outputs and not finishing and not usage_chunk and obj.get("error") is None:
                return None  # the role chunk, empty deltas: the client has them
            # (a usage chunk is kept: a break after the last text delta leaves only the
            # finish and usage chunks to the continuation, and the client asked for usage)
        obj.update(self.relayed.head)
        for choice in choices if isinstance(choices, list) else ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict):
                delta.pop("role", None)
                content = delta.get("content")
                if isinstance(content, str) and content:
                    delta["content"] = self._first_text(content)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            _count(usage, "prompt_tokens", "completion_tokens", self.relayed.tokens)
            if isinstance(usage.get("prompt_tokens"), int) \
                    and isinstance(usage.get("completion_tokens"), int):
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return obj

    def _messages(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        relayed = self.relayed
        kind = obj.get("type")
        if kind in ("message_start", "ping"):
            return None
        index = obj.get("index")
        if isinstance(index, int):
            if kind == "content_block_start" and index == 0 and relayed.open_index is not None \
                    and (obj.get("content_block") or {}).get("type") == "text":
                self._joined = True
                return None  # the relayed text block is still open: it goes on
            base = relayed.open_index if self._joined and relayed.open_index is not None \
                else relayed.next_index  # (a block after the relayed one, closed or not)
            obj["index"] = base + index
        delta = obj.get("delta")
        if kind == "content_block_delta" and isinstance(delta, dict) \
                and isinstance(delta.get("text"), str) and delta["text"]:
            delta["text"] = self._first_text(delta["text"])
        usage = obj.get("usage")
        if kind == "message_delta" and isinstance(usage, dict):
            # the input is the original message_start's: the continuation's (which read the
            # relayed text as input) would overwrite it in the client's accumulated usage
            for key in _MESSAGES_INPUT:
                usage.pop(key, None)
            if isinstance(usage.get("output_tokens"), int):
                usage["output_tokens"] += relayed.tokens
        return obj


    def _responses(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        head = self.relayed.head
        kind = obj.get("type")
        if kind in ("response.created", "response.in_progress"):
            return None
        place = obj.get("output_index")
        if kind == "response.output_item.added":
            item = obj.get("item") or {}
            if not self._joined and not self._closed and item.get("type") == "message":
                self._joined, self._message = True, item.get("id")
                if isinstance(place, int):
                    self._places[place] = head.get("output_index", 0)
                return None  # the relayed message item is still open: it goes on
            if isinstance(place, int):  # another item: after the relayed one
                self._places[place] = self._next_place
                self._next_place += 1
        # the joined message's events speak of the relayed item; any other item keeps its
        # own id and takes its place after the relayed one
        item = obj.get("item")
        ours = self._joined and (obj.get("item_id", self._message) == self._message) and not (
            isinstance(item, dict) and item.get("id") != self._message)
        if kind == "response.content_part.added" and ours and not self._started:
            return None
        if isinstance(place, int):
            obj["output_index"] = self._places.get(place, self._next_place + place)
        if ours and "item_id" in obj:
            obj["item_id"] = head["item_id"]
        if ours and "content_index" in obj:
            obj["content_index"] = head.get("content_index", 0)
        if "sequence_number" in obj:
            obj["sequence_number"] = self._seq
            self._seq += 1
        whole = self.relayed.text + "".join(self._text)
        if kind == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            obj["delta"] = self._first_text(obj["delta"])
            if ours:
                self._text.append(obj["delta"])
        elif not ours:
            pass
        elif kind == "response.output_text.done":
            obj["text"] = whole
        elif kind == "response.content_part.done" and isinstance(obj.get("part"), dict):
            obj["part"]["text"] = whole
        elif kind == "response.output_item.done" and isinstance(obj.get("item"), dict):
            self._whole_item(obj["item"], whole)
        if kind in ("response.completed", "response.incomplete") \
                and isinstance(obj.get("response"), dict):
            response = obj["response"]
            response["id"] = head["id"]
            output = response.get("output")
            if isinstance(output, list):
                for entry in output:
                    if isinstance(entry, dict) and entry.get("type") == "message" \
                            and self._joined and entry.get("id") == self._message:
                        self._whole_item(entry, whole)
                if self._closed:  # the relayed item, ended here, is the answer's first
                    output.insert(0, self._relayed_item())
            usage = response.get("usage")
            if isinstance(usage, dict):
                _count(usage, "input_tokens", "output_tokens", self.relayed.tokens)
                if isinstance(usage.get("input_tokens"), int) \
                        and isinstance(usage.get("output_tokens"), int):
                    usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        return obj

    def _whole_item(self, item: dict[str, Any], whole: str) -> None:
        """A message item as the client's: the relayed item's id, the whole text."""
        item["id"] = self.relayed.head["item_id"]
        for part in item.get("content") or ():
            if isinstance(part, dict) and part.get("type") == "output_text":
                part["text"] = whole


#: a chat delta's fields that carry output: before the continuation's own output begins, a
#: chunk without any (the role, empty deltas) is the client's already; one with a tool call,
#: a refusal or text is the answer going on
_CHAT_OUTPUTS = ("content", "tool_calls", "function_call", "refusal")
#: Messages usage fields of the input, left out of a continuation's `message_delta`
_MESSAGES_INPUT = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                   "cache_creation")


def _count(usage: dict[str, Any], input_key: str, output_key: str, tokens: int) -> None:
    """Move `tokens` of the continuation's input (the relayed text it read) to output."""
    if isinstance(usage.get(output_key), int):
        usage[output_key] += tokens
    if isinstance(usage.get(input_key), int):
        usage[input_key] = max(0, usage[input_key] - tokens)
