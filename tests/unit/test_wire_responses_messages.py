"""The Responses API and Messages first-token predicates, end and error rules,
table-tested on wire bytes as the APIs send them, decoded by the gateway's own SSE decoder and
split at every byte so that a token split across reads is still found exactly once."""

from __future__ import annotations

import json

import pytest

from gateway.api.common import protocol_for_path
from gateway.api.stored import RESPONSE_OBJECT_EVENTS, IdRewriter, MintFor, ResponseIds
from gateway.errors import FirstTokenTimeout, Overloaded, PayloadTooLarge
from gateway.wire.base import Kind, RelayOutcome, WireProtocol
from gateway.wire.messages import (
    MESSAGES,
    anthropic_error_body,
    classify_messages_body,
    messages_error_event,
)
from gateway.wire.named import named_encoder
from gateway.wire.responses import RESPONSES, classify_responses_body, responses_error_event
from gateway.wire.sse import SSEDecoder, SSEEvent
from providers.anthropic import AnthropicProvider
from providers.openai import OpenAIProvider
from providers.sim import SimProvider
from tests.harness.protocol_wire import (
    PING,
    anthropic_error,
    message_end,
    message_start,
    named,
    output_delta,
    responses_end,
    responses_head,
    text_block_start,
    text_delta,
)


def first_kinds(wire: bytes, protocol: WireProtocol) -> list[Kind]:
    events = SSEDecoder().feed(wire)
    return [protocol.classify(event) for event in events]


#: `first_token_index`: the stream failed (an error event) before any token
FAILS = -1
#: `first_token_index`: the stream reached its end event before any token: a complete
#: (empty) answer, not a failure
ENDS = -2


def first_token_index(wire: bytes, protocol: WireProtocol) -> int | None:
    kinds = first_kinds(wire, protocol)
    for i, kind in enumerate(kinds):
        if kind is not Kind.OTHER:
            return i if kind is Kind.TOKEN else FAILS if kind is Kind.ERROR else ENDS
    return None


KEEPALIVE = b": keep-alive\n\n"

MESSAGES_TABLE = [
    ("scaffolding then text", [message_start(), text_block_start(), PING, text_delta("Hi")], 3),
    ("empty delta is not a token", [message_start(), text_delta(""), text_delta("x")], 2),
    ("keep-alive comments", [KEEPALIVE, message_start(), KEEPALIVE, PING, text_delta("a")], 2),
    ("tool call first", [message_start(), named("content_block_start", {
        "index": 0, "content_block": {"type": "tool_use", "id": "t", "name": "lookup",
                                      "input": {}}})], 1),
    ("thinking first", [message_start(), named("content_block_start", {
        "index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
        named("content_block_delta", {"index": 0, "delta": {"type": "signature_delta",
                                                             "signature": "abc"}}),
        named("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta",
                                                             "thinking": "hmm"}})], 3),
    ("input json", [message_start(), named("content_block_delta", {
        "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{\""}})], 1),
    ("whitespace is a token", [message_start(), text_delta(" ")], 1),
    ("error event before a token", [message_start(), PING, anthropic_error()], FAILS),
    ("ends without a token: an empty answer", [message_start(), *message_end()], ENDS),
    ("malformed json", [b"event: content_block_delta\ndata: {nope\n\n", text_delta("ok")], 1),
    ("redacted thinking first", [message_start(), named("content_block_start", {
        "index": 0, "content_block": {"type": "redacted_thinking", "data": "EmwK"}})], 1),
]


def item_added(item: dict[str, object]) -> bytes:
    return named("response.output_item.added", {"output_index": 0, "item": item})


#: tool items that are output by themselves, with no name and no text (the item as added)
TOOL_ITEMS: list[dict[str, object]] = [
    {"type": "computer_call", "id": "cu", "call_id": "c", "action": {"type": "screenshot"},
     "pending_safety_checks": [], "status": "in_progress"},
    {"type": "image_generation_call", "id": "ig", "status": "in_progress", "result": None},
    {"type": "code_interpreter_call", "id": "ci", "code": "", "container_id": "cn",
     "outputs": None, "status": "in_progress"},
    {"type": "web_search_call", "id": "ws", "status": "in_progress"},
    {"type": "file_search_call", "id": "fs", "queries": [], "status": "in_progress"},
    {"type": "mcp_call", "id": "mc", "name": "fetch", "server_label": "s", "arguments": ""},
    {"type": "mcp_approval_request", "id": "ma", "name": "fetch", "server_label": "s",
     "arguments": "{}"},
    {"type": "local_shell_call", "id": "ls", "call_id": "c", "status": "in_progress",
     "action": {"type": "exec", "command": ["ls"], "env": {}}},
    {"type": "custom_tool_call", "id": "ct", "call_id": "c", "name": "grammar", "input": ""},
]

RESPONSES_TABLE = [
    ("scaffolding then text", [*responses_head(), output_delta("Hi")], 4),
    ("keep-alives", [KEEPALIVE, *responses_head(), KEEPALIVE, output_delta("a")], 4),
    ("empty delta", [*responses_head(), output_delta(""), output_delta("b")], 5),
    ("function call item first", [responses_head()[0], named("response.output_item.added", {
        "output_index": 0, "item": {"type": "function_call", "id": "fc", "call_id": "c",
                                    "name": "lookup", "arguments": ""}})], 1),
    ("arguments delta", [responses_head()[0], named(
        "response.function_call_arguments.delta", {"item_id": "fc", "delta": "{"})], 1),
    ("reasoning summary first", [*responses_head()[:2], named(
        "response.reasoning_summary_text.delta", {"item_id": "r", "delta": "Think"})], 2),
    ("refusal", [responses_head()[0], named("response.refusal.delta", {"delta": "No"})], 1),
    ("error event", [*responses_head()[:2], named("error", {"code": "server_error",
                                                            "message": "x"})], FAILS),
    ("failed", [responses_head()[0], named("response.failed", {"response": {}})], FAILS),
    ("completed without output: an empty answer",
     [responses_head()[0], *responses_end("r", "")], ENDS),
    *[(f"{item['type']} item first", [responses_head()[0], item_added(item)], 1)
      for item in TOOL_ITEMS],
    ("a reasoning item is scaffolding", [responses_head()[0], item_added(
        {"type": "reasoning", "id": "rs", "summary": []}), output_delta("a")], 2),
    ("a function call without its name yet", [responses_head()[0], item_added(
        {"type": "function_call", "id": "fc", "call_id": "c", "name": "", "arguments": ""}),
        output_delta("a")], 2),
    ("the server's tool listing is scaffolding", [responses_head()[0], item_added(
        {"type": "mcp_list_tools", "id": "ml", "server_label": "s", "tools": []}),
        output_delta("a")], 2),
    ("an item without a type", [responses_head()[0], item_added({"id": "x"}),
                                output_delta("a")], 2),
    ("code interpreter code", [responses_head()[0], named(
        "response.code_interpreter_call_code.delta", {"item_id": "ci", "delta": "print("})], 1),
    ("an empty code delta", [responses_head()[0], named(
        "response.code_interpreter_call_code.delta", {"item_id": "ci", "delta": ""}),
        output_delta("a")], 2),
    ("a partial image", [responses_head()[0], named(
        "response.image_generation_call.partial_image",
        {"item_id": "ig", "partial_image_index": 0, "partial_image_b64": "iVBO"})], 1),
    ("mcp call arguments", [responses_head()[0], named(
        "response.mcp_call_arguments.delta", {"item_id": "mc", "delta": "{"})], 1),
    ("data-only events (no event: line)", [
        b'data: {"type":"response.created","response":{"id":"r"}}\n\n',
        b'data: {"type":"response.output_text.delta","delta":"x"}\n\n'], 1),
]


@pytest.mark.parametrize(("protocol", "events", "expected"), [
    *[(MESSAGES, events, expected) for _, events, expected in MESSAGES_TABLE],
    *[(RESPONSES, events, expected) for _, events, expected in RESPONSES_TABLE],
], ids=[f"messages: {n}" for n, _, _ in MESSAGES_TABLE]
    + [f"responses: {n}" for n, _, _ in RESPONSES_TABLE])
def test_first_token(protocol: WireProtocol, events: list[bytes], expected: int) -> None:
    """`expected`: index (among decoded events) of the first token; FAILS: an error first;
    ENDS: the end event first (an empty answer)."""
    wire = b"".join(events)
    assert first_token_index(wire, protocol) == expected


@pytest.mark.parametrize("protocol", [MESSAGES, RESPONSES], ids=["messages", "responses"])
def test_split_reads_find_the_same_token(protocol: WireProtocol) -> None:
    wire = (b"".join([message_start(), PING, text_delta("é!")]) if protocol is MESSAGES
            else b"".join([*responses_head(), output_delta("é!")]))
    whole = [protocol.classify(e) for e in SSEDecoder().feed(wire)]
    for cut in range(1, len(wire)):
        decoder = SSEDecoder()
        events = decoder.feed(wire[:cut]) + decoder.feed(wire[cut:])
        assert [protocol.classify(e) for e in events] == whole, cut
    assert whole.count(Kind.TOKEN) == 1


def test_whole_bodies() -> None:
    assert classify_messages_body({"type": "message", "content": []}) is Kind.TOKEN
    assert classify_messages_body({"type": "error", "error": {}}) is Kind.ERROR
    assert classify_responses_body({"object": "response", "status": "completed",
                                    "error": None}) is Kind.TOKEN
    assert classify_responses_body({"object": "response", "status": "failed",
                                    "error": {"code": "x"}}) is Kind.ERROR
    assert classify_responses_body([1]) is Kind.OTHER


def relayed(protocol: WireProtocol, wire: bytes) -> tuple[bytes, str]:
    outcome = RelayOutcome()
    encode = named_encoder(protocol)
    out = encode(SSEDecoder().feed(wire), "req_1", outcome)
    return out, outcome.end


def test_relay_ends_at_the_protocol_end_event() -> None:
    wire = b"".join([message_start(), text_delta("a"), *message_end()])
    out, end = relayed(MESSAGES, wire + text_delta("after the end"))
    assert end == "done"
    assert out == wire  # byte for byte, event names kept, nothing after message_stop
    out, end = relayed(RESPONSES, b"".join([output_delta("x"), *responses_end("r", "x")]))
    assert end == "done" and out.endswith(b"\n\n") and b"[DONE]" not in out


def test_relay_stops_at_an_upstream_error_event() -> None:
    out, end = relayed(MESSAGES, text_delta("a") + anthropic_error() + text_delta("b"))
    assert end == "upstream_error" and b'"text":"b"' not in out
    out, end = relayed(RESPONSES, b'data: {"type":"response.failed","response":{}}\n\n')
    assert end == "upstream_error"
    out, end = relayed(RESPONSES, output_delta("a"))
    assert end == "client_gone"  # not over: the relay keeps reading


def test_error_events_in_each_shape() -> None:
    (event,) = SSEDecoder().feed(responses_error_event("cut", "stream_truncated", "req_1"))
    assert event.event == b"error"
    payload = json.loads(event.data)
    assert payload["type"] == "error" and payload["code"] == "stream_truncated"
    (event,) = SSEDecoder().feed(messages_error_event("cut", "stream_truncated", "req_1"))
    payload = json.loads(event.data)
    assert event.event == b"error" and payload["error"]["type"] == "api_error"
    assert "req_1" in payload["error"]["message"]


def test_anthropic_error_types() -> None:
    assert anthropic_error_body(404, "m") == {
        "type": "error", "error": {"type": "not_found_error", "message": "m"}}
    for exc, kind in [(PayloadTooLarge("x"), "request_too_large"),
                      (Overloaded("x"), "overloaded_error"),
                      (FirstTokenTimeout(), "timeout_error")]:
        assert MESSAGES.error_body(exc, "m")["error"] == {"type": kind, "message": "m"}
    assert protocol_for_path("/v1/messages/count_tokens") is MESSAGES
    assert protocol_for_path("/v1/messagesx").name == "chat"


def test_routes_per_provider() -> None:
    anthropic, openai, sim = AnthropicProvider.serves, OpenAIProvider.serves, SimProvider.serves
    assert "messages" in anthropic and "chat/completions" not in anthropic
    assert "responses" in openai and "messages" not in openai
    assert "messages" in sim and "responses" in sim


def test_a_response_id_round_trips_and_only_with_its_secret() -> None:
    ids = ResponseIds("s1")
    binding = ids.binding("client-key")
    minted = ids.mint("pool", "b0", "resp_up", binding)
    assert minted is not None and minted.startswith("resp_")
    assert ids.read(minted) == ("pool", "b0", "resp_up", binding)
    assert ResponseIds("s1").read(minted) is not None  # another process, same secret
    assert ResponseIds("s2").read(minted) is None
    assert ids.binding("") == b"" and ids.binding("other") != binding
    assert b"client-key" not in minted.encode()
    for bad in ("resp_", "resp_!!", minted + "=", minted[:-1], "x" + minted[1:], "resp_up"):
        assert ids.read(bad) is None
    assert ids.mint("pool", "b0", "r" * 600, b"") is None  # too long to wrap: relayed as is


def test_the_rewriter_swaps_ids_and_learns_one_it_did_not_see() -> None:
    ids = ResponseIds("s")
    known = IdRewriter([("resp_up", "resp_ours"), ("resp_prev_up", "resp_prev")])
    assert known(b'{"id":"resp_up","previous_response_id":"resp_prev_up"}') == (
        b'{"id":"resp_ours","previous_response_id":"resp_prev"}')
    learning = IdRewriter([], MintFor(ids, "p", "b1", b""))
    first = learning(b'{"type":"response.completed","response":{"id":"resp_late"}}')
    minted = json.loads(first)["response"]["id"]
    assert ids.read(minted) == ("p", "b1", "resp_late", b"")
    assert learning(b'{"response":{"id":"resp_late"}}') == (
        b'{"response":{"id":"' + minted.encode() + b'"}}')


def test_the_relay_rewrites_only_the_events_that_carry_the_response_object() -> None:
    """One set lookup per event; the replace runs on created/completed alone, so a delta
    that happens to mention the upstream id is relayed as it came."""
    seen: list[bytes] = []

    def rewrite(data: bytes) -> bytes:
        seen.append(data)
        return data.replace(b'"resp_up"', b'"resp_ours"')

    encode = named_encoder(RESPONSES, (RESPONSE_OBJECT_EVENTS, rewrite))
    batch = [
        SSEEvent(b'{"type":"response.created","response":{"id":"resp_up"}}',
                 b"response.created"),
        SSEEvent(b'{"type":"response.output_text.delta","delta":"resp_up"}',
                 b"response.output_text.delta"),
        SSEEvent(b'{"type":"response.completed","response":{"id":"resp_up"}}'),  # no name
    ]
    out = encode(batch, "req", RelayOutcome())
    assert out.count(b'"resp_ours"') == 2 and len(seen) == 2
    assert b'"delta":"resp_up"' in out


def test_event_without_name_uses_the_payload_type() -> None:
    from gateway.wire.named import event_name

    assert event_name(SSEEvent(b'{"type":"message_stop"}')) == b"message_stop"
    assert event_name(SSEEvent(b' { "type" : "ping"}')) == b"ping"
    assert event_name(SSEEvent(b"[1]")) is None


def data_only(payload: dict[str, object]) -> bytes:
    """A data-only event (no `event:` line) whose keys come in the order given."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def test_event_without_name_finds_its_type_in_any_key_order() -> None:
    """`type` need not come first: a late top-level `type` is read, a nested one is not."""
    from gateway.wire.named import event_name

    (late,) = SSEDecoder().feed(data_only(
        {"sequence_number": 9, "response": {"id": "r", "output": [{"type": "message"}]},
         "type": "response.completed"}))
    assert event_name(late) == b"response.completed"
    (nested,) = SSEDecoder().feed(data_only(
        {"index": 0, "delta": {"type": "message_stop"}, "type": "content_block_delta"}))
    assert event_name(nested) == b"content_block_delta"
    (delta,) = SSEDecoder().feed(data_only({"delta": "x", "type": "response.output_text.delta"}))
    assert event_name(delta) is None  # no name the relay acts on: not parsed


def test_relay_ends_whatever_the_key_order_of_a_nameless_end_event() -> None:
    """Without `event:` lines and with `type` last, the end is still the end (not a cut
    stream), an error still an error, and a usage event still read."""
    responses = b"".join([
        data_only({"delta": "a", "type": "response.output_text.delta"}),
        data_only({"sequence_number": 9, "response": {
            "id": "r", "object": "response", "status": "completed", "error": None,
            "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}},
            "type": "response.completed"}),
        data_only({"delta": "after", "type": "response.output_text.delta"}),
    ])
    out, end = relayed(RESPONSES, responses)
    assert end == "done" and b"after" not in out
    messages = b"".join([
        data_only({"index": 0, "delta": {"type": "text_delta", "text": "a"},
                   "type": "content_block_delta"}),
        data_only({"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2},
                   "type": "message_delta"}),
        data_only({"type": "message_stop"}),
    ])
    outcome = RelayOutcome()
    named_encoder(MESSAGES)(SSEDecoder().feed(messages), "req_1", outcome)
    assert outcome.end == "done"
    assert outcome.usage is not None and outcome.usage.output == 2
    out, end = relayed(MESSAGES, data_only(
        {"error": {"type": "overloaded_error", "message": "x"}, "type": "error"}))
    assert end == "upstream_error"
    out, end = relayed(MESSAGES, data_only(
        {"index": 0, "delta": {"type": "message_stop"}, "type": "content_block_delta"}))
    assert end == "client_gone"  # a nested `type` is no end


@pytest.mark.parametrize("end", ["response.completed", "response.incomplete"])
def test_the_usage_of_a_finished_response_is_read_complete_or_cut(end: str) -> None:
    """A response cut by `max_output_tokens` ends with `response.incomplete`, and its tokens
    were paid for as much as a completed one's: the relay reads the usage of both."""
    wire = b"".join([
        named("response.output_text.delta", {"delta": "a"}),
        named(end, {"response": {"id": "r", "object": "response", "status": end[9:],
                                 "usage": {"input_tokens": 7, "output_tokens": 16}}}),
    ])
    outcome = RelayOutcome()
    named_encoder(RESPONSES)(SSEDecoder().feed(wire), "req_1", outcome)
    assert outcome.end == "done"
    assert outcome.usage is not None and (outcome.usage.input, outcome.usage.output) == (7, 16)


def test_relay_passes_named_events_through_unparsed() -> None:
    """After commit the payload is never parsed: even one that is not JSON goes through as
    it came (with its name), and only a name ends the stream."""
    wire = b"event: content_block_delta\ndata: {not json\n\n"
    out, end = relayed(MESSAGES, wire)
    assert out == wire and end == "client_gone"


@pytest.mark.parametrize(("body", "stateful"), [
    ({"store": False}, False),
    ({}, True),  # the API stores by default
    ({"store": True}, True),
    ({"store": False, "previous_response_id": "resp_1"}, True),
    ({"store": False, "conversation": "conv_1"}, True),
    ({"store": False, "background": True}, True),
    ({"store": False, "background": False}, False),
])
def test_responses_store_rules(body: dict[str, object], stateful: bool) -> None:
    from gateway.api.responses import responses_stateful

    assert responses_stateful(body) is stateful


_DELTA = b'{"type":"content_block_delta","index":%s,"delta":{"type":"text_delta","text":"%s"}}'
_START = b'{"type":"content_block_start","index":%s,"content_block":{"type":"text","text":""}}'


@pytest.mark.parametrize(("data", "by_parse"), [
    (_DELTA % (b"0", b"a"), Kind.TOKEN),
    (_DELTA % (b"10", "é".encode()), Kind.TOKEN),
    (_DELTA % (b"0", b"\xed\xa0\x80"), Kind.TOKEN),  # a lone surrogate: the parse passes it
    (_DELTA % (b"0", b""), Kind.OTHER),
    (_DELTA % (b"00", b"a"), None),  # a leading zero: not JSON
    (_DELTA % (b"01", b"a"), None),
    (_DELTA % (b"0", b"\xff"), None),  # not UTF-8
    (_DELTA % (b"0", b"a\xc3"), None),  # a sequence cut short
    (_START % b"0", Kind.OTHER),
    (_START % b"00", None),
], ids=["usual", "non-ascii", "surrogate", "empty", "index 00", "index 01", "byte ff",
        "cut sequence", "empty start", "empty start 00"])
@pytest.mark.parametrize("name", [None, b"content_block_delta", b"error", b"message_stop"])
def test_an_event_told_by_its_bytes_is_classified_as_its_parse_would_be(
        data: bytes, by_parse: Kind | None, name: bytes | None) -> None:
    """The usual delta and the empty text start are told by their bytes without a parse:
    only what the parse reads as such. One the parse refuses (None) is classified by its
    SSE name, as any payload that is not JSON."""
    expected = by_parse if by_parse is not None else {
        b"error": Kind.ERROR, b"message_stop": Kind.DONE}.get(name or b"", Kind.OTHER)
    assert MESSAGES.classify(SSEEvent(data, name)) is expected
