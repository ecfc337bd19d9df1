"""Streams between Chat Completions and Messages, event by event (pure).

One small state machine per stream: each upstream event is parsed once, and what it means in
the client's API is written at once; nothing is held back but the end (a Chat stream's finish
reason comes before its usage chunk, and Messages puts both in `message_delta`, so that one
event is written when `[DONE]` arrives). Tool-call arguments pass as they stream, fragment for
fragment: Chat's `tool_calls[].function.arguments` <-> Messages' `input_json_delta`.

Each machine says when the client's stream is over (`ended`, `failed`) and keeps the usage it
read (`usage`), which the relay's encoder hands the stats.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.wire.base import json_bytes
from gateway.wire.messages import INDEX
from gateway.wire.sse import SSEEvent, named_events
from gateway.wire.translate.chat_messages import JSON_TOOL
from gateway.wire.translate.chat_messages_answer import (
    STOP_OF_FINISH,
    chat_error_to_messages,
    chat_usage,
    finish_of,
    messages_error_to_chat,
    messages_usage,
)
from gateway.wire.usage import Usage, usage_of

#: one JSON string literal (possessive: never backtracks), as the APIs write a delta's text
#: (no raw line feed or carriage return: JSON has none in a string, and one written raw
#: into the client's event would end its line there, and could start a line of its own)
_STRING = rb'"[^"\\\n\r]*+(?:\\[^\n\r][^"\\\n\r]*+)*+"'
#: the common Messages delta, whole: its block index, its kind, its text as a JSON string
_MESSAGES_DELTA = re.compile(
    rb'\{"type":"content_block_delta","index":(' + INDEX + rb'),"delta":\{"type":'
    rb'"(text_delta(?=","text")|input_json_delta(?=","partial_json"))","(?:text|partial_json)":('
    + _STRING + rb')\}\}')
_messages_delta = _MESSAGES_DELTA.fullmatch
#: the common Chat chunk's choice: text or one tool call's arguments, no finish reason
_CHAT_DELTA = re.compile(
    rb'"choices":\[\{"index":0,"delta":\{(?:"content":(' + _STRING + rb')|"tool_calls":\['
    rb'\{"index":(' + INDEX + rb'),"function":\{"arguments":(' + _STRING + rb')\}\}\])\}'
    rb'(?:,"logprobs":null)?,"finish_reason":null(?:,"logprobs":null)?\}\]')
#: stands for a delta's text while a chunk's bytes are built once per stream
_MARK = "\x00mark\x00"
_MARK_JSON = json_bytes(_MARK)
_chat_delta = _CHAT_DELTA.match
#: Messages' scaffolding as servers write it, told apart without a parse: the keep-alive
#: and a block's end (nothing in Chat), the stream's end, and a text block's empty start
_PING = b'{"type":"ping"}'
_MESSAGE_STOP = b'{"type":"message_stop"}'
_block_stop = re.compile(rb'\{"type":"content_block_stop","index":' + INDEX + rb'\}').fullmatch
_text_start = re.compile(rb'\{"type":"content_block_start","index":(' + INDEX + rb'),'
                         rb'"content_block":\{"type":"text","text":""\}\}').fullmatch
#: a delta event's bytes up to its payload, in the named framing (`feed_named`)
_DELTA_EVENT = b"event: content_block_delta\ndata: "
#: `message_stop` as `_named` writes it
_MESSAGE_STOP_EVENT = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
#: a Chat chunk's choice after its delta, with no finish reason
_NO_FINISH = b',"finish_reason":null,"logprobs":null}]}\n\n'
_ROLE = b'{"role":"assistant","content":""}'


def _payload(event: SSEEvent) -> dict[str, Any] | None:
    try:
        obj = json.loads(event.data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _data(obj: object) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def _named(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json_bytes(obj) + b"\n\n"


def _around_named(name: str, obj: dict[str, Any]) -> tuple[bytes, bytes]:
    """The named event's bytes before and after its one `_MARK` string."""
    before, _, after = _named(name, obj).rpartition(_MARK_JSON)
    return before, after


def splice_run(datas: list[bytes], opening: bytes, before: bytes, after: bytes
               ) -> bytes | None:
    """`before + text + after` for each of `datas` (at least two), each `opening`, one JSON
    string `text` and `}}` (a usual delta of one block: `opening` holds no backslash); None
    when any is not, or its text holds a quote inside or an escape (then each event takes
    `MessagesToChat._each`, whose per-event test this is exactly).

    Why: after the first read, a zero-delay Messages stream's reads are runs of dozens of
    deltas, and a test and a splice per event in Python were most of what the translation
    cost. Joined by LF (which no one-line event data holds), the run is told by C scans:
    LFs only at the joins; at each join the closing `"}}`, the next `opening` and its `"`
    (so every text, the first's and the last's checked by length, has a quote at each end
    and two characters at least); two quotes a text in all (so none inside); no backslash.
    Then one `replace` at the joins writes every chunk."""
    n = len(datas)
    blob = b"\n".join(datas)
    head = len(opening)
    if (blob.count(10) != n - 1 or blob.find(92) >= 0
            or not blob.startswith(opening + b'"') or not blob.endswith(b'"}}')
            or len(datas[0]) < head + 4 or len(datas[-1]) < head + 4
            or blob.count(b'"}}\n' + opening + b'"') != n - 1
            or blob.count(34) != n * (opening.count(34) + 2)):
        return None
    return before + blob[head:-2].replace(b"}}\n" + opening, after + before) + after


def splice_named(run: bytes, head: bytes, before: bytes, after: bytes) -> bytes | None:
    """`splice_run` over a read's bytes: `before + text + after` for each event of `run`, each
    `head` (`event: content_block_delta`, its `data: ` and a usual delta's payload up to its
    text: no backslash in it), one JSON string `text`, `}}` and a blank line; None when any
    is not, or its text holds a quote inside or an escape.

    Told by C scans as `splice_run` tells a run of events: the number of events is the
    joins (`"}}`, the blank line, the next `head` and its `"`) and one; the LFs are three an
    event (so none is in a text, and every join is counted); the first and the last text
    are two characters at least; two quotes a text in all; no backslash, no CR."""
    n = run.count(b'"}}\n\n' + head + b'"') + 1
    size = len(head)
    last = run.rfind(b"\n\n", 0, len(run) - 2) + 2  # where the last event starts (or 0)
    if (run.count(10) != 3 * n or run.find(92) >= 0 or 13 in run
            or not run.startswith(head + b'"') or not run.endswith(b'"}}\n\n')
            or run.find(b"\n\n") < size + 4 or len(run) - last < size + 6
            or run.count(34) != n * (head.count(34) + 2)):
        return None
    return before + run[size:-4].replace(b"}}\n\n" + head, after + before) + after


class MessagesToChat:
    """A Messages stream (a Messages backend) written as a Chat stream (a Chat client).

    `include_usage`: the client asked for the usage chunk (`stream_options.include_usage`);
    `created`: the chunks' `created` (Messages has no such field)."""

    __slots__ = (
        "_current",
        "_head",
        "_messages_usage",
        "_spliced",
        "calls",
        "created",
        "ended",
        "failed",
        "id",
        "include_usage",
        "json_blocks",
        "model",
        "usage",
    )

    def __init__(self, created: int, include_usage: bool) -> None:
        self.created, self.include_usage = created, include_usage
        self.id: object = None
        self.model: object = None
        #: Messages content block index -> its Chat tool call index
        self.calls: dict[int, int] = {}
        #: blocks of the forced JSON tool (a translated `response_format`): their arguments
        #: are the answer's text
        self.json_blocks: set[int] = set()
        self.usage: Usage | None = None
        self.ended = self.failed = False
        self._messages_usage: dict[str, Any] = {}
        #: per content block index (its digits, as the events write it): the delta type it
        #: takes, the chunk's bytes around such a delta's text (`feed`), and such a delta's
        #: payload up to its text (`feed_all`)
        self._spliced: dict[bytes, tuple[bytes, bytes, bytes, bytes]] = {}
        #: the block of the last delta spliced (`feed_all` tries it first): most deltas in a
        #: row are one block's
        self._current: tuple[bytes, bytes, bytes, bytes] | None = None
        #: every chunk's bytes up to its `choices` (`_opening`), made once per id and model
        self._head: bytes | None = None

    def _opening(self) -> bytes:
        """`data: ` and a chunk's JSON up to its `choices`' value: the same in every chunk of
        the stream, so written once (the id and the model are known at `message_start`)."""
        head = self._head
        if head is None:
            head = self._head = (
                b'data: {"id":' + json_bytes(self.id)
                + b',"object":"chat.completion.chunk","created":' + b"%d" % self.created
                + b',"model":' + json_bytes(self.model) + b',"choices":')
        return head

    def _chunk(self, delta: dict[str, Any] | bytes, finish: str | None = None) -> bytes:
        """The chunk `_data` writes for this choice (`delta` as a dict, or its JSON)."""
        return (self._opening() + b'[{"index":0,"delta":'
                + (delta if isinstance(delta, bytes) else json_bytes(delta))
                + b',"finish_reason":' + (b"null" if finish is None else json_bytes(finish))
                + b',"logprobs":null}]}\n\n')

    def _take_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._messages_usage.update({k: v for k, v in usage.items() if v is not None})
            self.usage = usage_of({"usage": self._messages_usage})

    def _splice(self, index: int, kind: bytes, delta: dict[str, Any]) -> None:
        """Build once the chunk a `kind` delta of block `index` becomes (its text marked)."""
        digits = str(index).encode()
        self._current = None  # it may have been this index's former block
        before, _, after = json_bytes(delta).rpartition(_MARK_JSON)
        self._spliced[digits] = (
            kind, self._opening() + b'[{"index":0,"delta":' + before, after + _NO_FINISH,
            b'{"type":"content_block_delta","index":' + digits + b',"delta":{"type":"'
            + kind + (b'","text":' if kind == b"text_delta" else b'","partial_json":'))

    def feed_all(self, events: list[SSEEvent]) -> bytes:
        """The Chat bytes for a read's events: `feed`'s. A read that opens with a run of
        usual deltas of the block the last one was of (most reads after the first) has the
        run spliced whole (`splice_run`: a few scans over the run's bytes, no per-event
        work in Python), the rest read by `_each`. Before the first usual delta has named
        the block (the stream's first read, which at zero delay often holds the whole
        answer), the events are fed one by one up to it, and the rest read so."""
        parts: list[bytes] = []
        if self._current is None and not self.ended:
            for i, event in enumerate(events):
                parts.append(self.feed(event))
                if self._current is not None and not self.ended:
                    events = events[i + 1:]
                    break
            else:
                return b"".join(parts)
        current = None if self.ended else self._current
        if current is not None and len(events) > 1:
            _, before, after, opening = current
            end = len(events)
            while end and not events[end - 1].data.startswith(opening):
                end -= 1  # the scaffolding that ends the stream, after the run
            if end > 1:
                run = splice_run([event.data for event in events[:end]], opening, before,
                                 after)
                if run is not None:
                    parts.append(run)
                    events = events[end:]
        if events:
            parts.append(self._each(events))
        return b"".join(parts)

    def feed_named(self, chunk: bytes) -> bytes | None:
        """`feed_all`'s bytes for a read in the named framing (`SSEBatch.named`), written
        from the read's bytes when it opens with a run of usual deltas of the block the last
        one was of (`splice_named`; the rest decoded and read by `_each`): a read after the
        first, of a zero-delay stream, is dozens of them, and its events are never built.
        None (nothing read) for any other read: its events are decoded and fed."""
        current = None if self.ended else self._current
        if current is None:
            return None
        _, before, after, opening = current
        head = _DELTA_EVENT + opening
        if not chunk.startswith(head):
            return None
        last = chunk.rfind(b"\n\n" + head)  # the run's last delta (a text holds no LF)
        end = chunk.find(b"\n\n", len(head) if last < 0 else last + 2 + len(head)) + 2
        if end < 2:
            return None
        run = splice_named(chunk[:end] if end < len(chunk) else chunk, head, before, after)
        if run is None or end == len(chunk):
            return run
        events = named_events(chunk[end:])
        return None if events is None else run + self._each(events)

    def _each(self, events: list[SSEEvent]) -> bytes:
        """`feed`'s bytes for `events`, each usual delta of the block the last one was of
        cut from its payload by one comparison and two slices (no regex, no call), every
        other event fed."""
        parts: list[bytes] = []
        current = None if self.ended else self._current
        opening = before = after = b""
        if current is not None:
            _, before, after, opening = current
        for event in events:
            data = event.data
            if current is not None and data.startswith(opening) and data.endswith(b"}}"):
                text = data[len(opening):-2]
                # exactly one JSON string: quoted at both ends, no quote between, no
                # escape (an escaped text takes the regex's way: `feed`) and no line feed
                # (a multi-line `data:`: the regex refuses it too)
                if text.count(34) == 2 and text[0] == 34 and text[-1] == 34 \
                        and text.find(92) < 0 and text.find(10) < 0:
                    parts.append(before + text + after)
                    continue
            parts.append(self.feed(event))
            current = None if self.ended else self._current
            if current is not None:
                _, before, after, opening = current
        return b"".join(parts)

    def feed(self, event: SSEEvent) -> bytes:
        """The Chat bytes for one Messages event (often none). A text or arguments delta of
        the usual shape is spliced into its block's chunk without parsing (the per-event
        cost); every other event is parsed."""
        found = _messages_delta(event.data)
        if found is not None:
            index, kind, text = found.group(1, 2, 3)
            around = self._spliced.get(index)
            if around is not None and around[0] == kind and not self.ended:
                self._current = around
                return around[1] + text + around[2]
        data = event.data
        # the usual scaffolding, by its exact bytes (what the parse below makes of them)
        if data == _PING or _block_stop(data) is not None:
            return b""
        if data == _MESSAGE_STOP:
            return b"" if self.ended else self._stop()
        if (start := _text_start(data)) is not None:
            if not self.ended:
                self._splice(int(start.group(1)), b"text_delta", {"content": _MARK})
            return b""
        obj = _payload(event)
        kind = obj.get("type") if obj is not None else None
        if kind is None and event.event is not None:
            kind = event.event.decode("latin-1")
        if obj is None or self.ended:
            return b""
        if kind == "content_block_delta":
            return self._delta(obj)
        if kind == "content_block_start":
            return self._start(obj)
        if kind == "message_start":
            message = obj.get("message") or {}
            self.id, self.model = message.get("id"), message.get("model")
            self._head = None
            self._take_usage(message.get("usage"))
            return self._chunk(_ROLE)
        if kind == "message_delta":
            self._take_usage(obj.get("usage"))
            stop = (obj.get("delta") or {}).get("stop_reason")
            if stop is None:
                return b""
            return self._chunk(b"{}", finish_of(stop, json_only=bool(self.json_blocks)
                                             and not self.calls))
        if kind == "message_stop":
            return self._stop()
        if kind == "error":
            self.ended = self.failed = True
            return _data(messages_error_to_chat(obj))
        return b""  # ping, content_block_stop, an event this API version does not know

    def _stop(self) -> bytes:
        """`message_stop`: the usage chunk (when asked for) and `[DONE]`; the stream is over."""
        self.ended = True
        tail = b""
        if self.include_usage:
            tail = (self._opening() + b'[],"usage":' + json_bytes(chat_usage(self._messages_usage))
                    + b"}\n\n")
        return tail + b"data: [DONE]\n\n"

    def _start(self, obj: dict[str, Any]) -> bytes:
        block = obj.get("content_block") or {}
        index = obj.get("index")
        kind = block.get("type")
        if kind == "tool_use" and isinstance(index, int):
            if block.get("name") == JSON_TOOL:
                self.json_blocks.add(index)
                self._splice(index, b"input_json_delta", {"content": _MARK})
                return b""
            call = self.calls[index] = len(self.calls)
            self._splice(index, b"input_json_delta", {"tool_calls": [{
                "index": call, "function": {"arguments": _MARK}}]})
            return self._chunk({"tool_calls": [{
                "index": call, "id": block.get("id"), "type": "function",
                "function": {"name": block.get("name"), "arguments": ""}}]})
        if kind == "text" and isinstance(index, int):
            self._splice(index, b"text_delta", {"content": _MARK})
        if kind == "text" and block.get("text"):
            return self._chunk({"content": block["text"]})
        if kind == "thinking" and block.get("thinking"):
            return self._chunk({"reasoning_content": block["thinking"]})
        return b""

    def _delta(self, obj: dict[str, Any]) -> bytes:
        delta = obj.get("delta") or {}
        kind = delta.get("type")
        if kind == "text_delta":
            return self._chunk({"content": delta.get("text", "")})
        if kind == "thinking_delta":
            return self._chunk({"reasoning_content": delta.get("thinking", "")})
        if kind == "input_json_delta":
            index = obj.get("index")
            if index in self.json_blocks:
                return self._chunk({"content": delta.get("partial_json", "")})
            call = self.calls.get(index) if isinstance(index, int) else None
            if call is None:
                return b""
            return self._chunk({"tool_calls": [{
                "index": call, "function": {"arguments": delta.get("partial_json", "")}}]})
        return b""  # signature_delta: a signature is for Messages backends only


class ChatToMessages:
    """A Chat stream (a Chat backend) written as a Messages stream (a Messages client).

    Blocks open as the output's kind changes (thinking, text, a tool call) and close when the
    next opens; `message_delta` (stop reason and usage) and `message_stop` are written at
    `[DONE]`, after the usage chunk the translated request asked for."""

    __slots__ = (
        "_chat_usage",
        "_spliced",
        "_usual",
        "ended",
        "failed",
        "include_usage",
        "model",
        "next_index",
        "open",
        "started",
        "stop",
        "tools",
        "usage",
    )

    def __init__(self, model: object = None) -> None:
        self.model = model
        self.started = False
        #: the open block: ("text" | "thinking" | "tool", its index); None between blocks
        self.open: tuple[str, int] | None = None
        self.next_index = 0
        #: Chat tool call index -> its Messages content block index
        self.tools: dict[int, int] = {}
        self.stop: str | None = None
        self.usage: Usage | None = None
        self.ended = self.failed = False
        #: Messages always reports usage: what a Chat client asks for does not apply
        self.include_usage = True
        self._chat_usage: dict[str, Any] | None = None
        #: per block index: the `content_block_delta` bytes around a delta's text (`feed`)
        self._spliced: dict[int, tuple[bytes, bytes]] = {}
        #: while a text block is open: the last text chunk's bytes before and after its
        #: text, and the delta event's around it (`feed_all`: the next chunks of the stream
        #: differ only in their text)
        self._usual: tuple[bytes, bytes, bytes, bytes] | None = None

    def _splice(self, index: int, delta: dict[str, Any]) -> tuple[bytes, bytes]:
        around = self._spliced[index] = _around_named("content_block_delta", {
            "type": "content_block_delta", "index": index, "delta": delta})
        return around

    def _begin(self, obj: dict[str, Any]) -> bytes:
        self.started = True
        return _named("message_start", {"type": "message_start", "message": {
            "id": obj.get("id"), "type": "message", "role": "assistant",
            "model": obj.get("model", self.model), "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})

    def _close(self) -> bytes:
        self._usual = None
        if self.open is None:
            return b""
        index = self.open[1]
        self.open = None
        # (`_named`'s bytes for the event, written without an encoder: one a block)
        return (b'event: content_block_stop\ndata: {"type":"content_block_stop","index":'
                + str(index).encode() + b"}\n\n")

    def _block(self, kind: str, block: dict[str, Any]) -> bytes:
        """Close the open block and open a new one of `kind`."""
        out = self._close()
        index = self.next_index
        self.next_index += 1
        self.open = (kind, index)
        return out + _named("content_block_start", {
            "type": "content_block_start", "index": index, "content_block": block})

    def _text(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open is None or self.open[0] != kind:
            out = self._block(kind, {"type": "text", "text": ""} if kind == "text" else
                              {"type": "thinking", "thinking": "", "signature": ""})
        assert self.open is not None
        delta = ({"type": "text_delta", "text": text} if kind == "text"
                 else {"type": "thinking_delta", "thinking": text})
        return out + _named("content_block_delta", {
            "type": "content_block_delta", "index": self.open[1], "delta": delta})

    def _tool(self, call: dict[str, Any]) -> bytes:
        out = b""
        position = call.get("index", 0)
        function = call.get("function") or {}
        index = self.tools.get(position)
        if index is None:
            out = self._block("tool", {"type": "tool_use", "id": call.get("id"),
                                       "name": function.get("name"), "input": {}})
            assert self.open is not None
            index = self.tools[position] = self.open[1]
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            out += _named("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return out

    def _end(self) -> bytes:
        self.ended = True
        usage = messages_usage(self._chat_usage) if self._chat_usage else {"output_tokens": 0}
        return self._close() + _named("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": self.stop or "end_turn",
                                               "stop_sequence": None},
            "usage": usage}) + _MESSAGE_STOP_EVENT

    def feed_named(self, chunk: bytes) -> bytes | None:
        """None: a Chat backend's reads are not in the named framing."""
        return None

    def feed_all(self, events: list[SSEEvent]) -> bytes:
        """The Messages bytes for a read's chunks: `feed`'s, a text chunk that differs from
        the last one spliced only in its text cut by two comparisons and a slice (no find,
        no regex: the per-event cost), every other chunk fed."""
        parts: list[bytes] = []
        usual = self._usual
        opening = closing = before = after = b""
        if usual is not None:
            opening, closing, before, after = usual
        end = -len(closing)
        for event in events:
            data = event.data
            if usual is not None and data.startswith(opening) and data.endswith(closing):
                text = data[len(opening):end]
                # exactly one JSON string, as `_CHAT_DELTA` reads one: quoted at both ends,
                # no quote between and no escape (else `feed`'s regex decides)
                if text.count(34) == 2 and text[0] == 34 and text[-1] == 34 \
                        and text.find(92) < 0:
                    parts.append(before + text + after)
                    continue
            parts.append(self.feed(event))
            usual = None if self.ended else self._usual
            if usual is not None:
                opening, closing, before, after = usual
                end = -len(closing)
        return b"".join(parts)

    def feed(self, event: SSEEvent) -> bytes:
        """The Messages bytes for one Chat chunk (often a few events, sometimes none). A text
        or arguments delta of the usual shape into the open block (its first opens it the
        long way) is spliced without parsing (the per-event cost); every other chunk is
        parsed."""
        if self.ended:
            return b""
        data = event.data
        current = self.open
        if (current is not None or self.started) \
                and (at := data.find(b'"choices":[{"index":0,"delta":{')) > 0:
            found = _chat_delta(data, at)
            # a usage object in the same chunk (after its choices, as every server writes it)
            # is read the long way
            if found is not None and data.find(b'"usage":{', found.end()) < 0:
                text, call, arguments = found.group(1, 2, 3)
                kind, index = current if current is not None else ("", -1)
                if text is not None and (
                        kind == "text" or (current is None and text != b'""')):
                    out = b""
                    if current is None:  # the answer's first text opens its block
                        out = self._block("text", {"type": "text", "text": ""})
                        index = self.next_index - 1
                    around = self._spliced.get(index) or self._splice(
                        index, {"type": "text_delta", "text": _MARK})
                    self._usual = (data[:found.start(1)], data[found.end(1):], *around)
                    return out + around[0] + text + around[1]
                if call is not None and kind == "tool" and \
                        self.tools.get(int(call)) == index and arguments != b'""':
                    around = self._spliced.get(index) or self._splice(
                        index, {"type": "input_json_delta", "partial_json": _MARK})
                    return around[0] + arguments + around[1]
        if event.data.strip() == b"[DONE]":
            return (b"" if self.started else self._begin({})) + self._end()
        obj = _payload(event)
        if obj is None:
            return b""
        if obj.get("error") is not None or event.event == b"error":
            self.ended = self.failed = True
            self._usual = None
            return _named("error", chat_error_to_messages(obj))
        out = b"" if self.started else self._begin(obj)
        if isinstance(obj.get("usage"), dict):
            self._chat_usage = obj["usage"]
            self.usage = usage_of(obj)
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out += self._text("thinking", reasoning)
            for name in ("content", "refusal"):
                text = delta.get(name)
                if isinstance(text, str) and text:
                    out += self._text("text", text)
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._tool(call)
            finish = choice.get("finish_reason")
            if finish:
                self.stop = STOP_OF_FINISH.get(str(finish), "end_turn")
                out += self._close()
        return out


