"""The relay after commit: plain reads pass as the bytes that arrived, the rest is re-framed.

Driven with the decoder's real batches over chunks as an upstream would send them (no sockets,
a fixed clock: no deadline can pass)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping

from gateway.hedge.prefix import Prefix
from gateway.hedge.relay import _Deadlines, relay
from gateway.wire.base import Hooks, RelayOutcome, StreamEnd
from gateway.wire.chat import CHAT, DONE
from gateway.wire.sse import SSEBatch, SSEDecoder, SSEEvent
from gateway.wire.translate.chat_messages_stream import MessagesToChat
from gateway.wire.translate.routes import TRANSLATIONS

ROLE = b'{"choices":[{"delta":{"role":"assistant"}}]}'
TOKEN = b'{"choices":[{"delta":{"content":"x"}}]}'


class Upstream:
    def __init__(self) -> None:
        self.headers: Mapping[str, str] = {}
        self.closed = 0

    def batches(self) -> AsyncIterator[SSEBatch]:  # pragma: no cover - Prefix holds its own
        raise NotImplementedError

    async def aclose(self) -> None:
        self.closed += 1


async def _batches(chunks: list[bytes]) -> AsyncIterator[SSEBatch]:
    decoder = SSEDecoder()
    decoder.feed(b"data: " + ROLE + b"\n\n")  # the race read the first read
    for chunk in chunks:
        batch = decoder.feed_batch(chunk)
        if batch is not None:
            yield batch


async def relayed(chunks: list[bytes]) -> tuple[list[bytes], RelayOutcome, Upstream]:
    upstream = Upstream()
    prefix = Prefix(upstream, _batches(chunks), [SSEEvent(ROLE), SSEEvent(TOKEN)])
    outcome = RelayOutcome()
    out = [part async for part in relay(prefix, request_id="r", idle=60.0,
                                        max_stream_deadline=1e9, clock=lambda: 0.0,
                                        outcome=outcome, protocol=CHAT)]
    return out, outcome, upstream


async def test_plain_reads_go_out_as_the_same_bytes() -> None:
    reads = [b"data: " + TOKEN + b"\n\n", b"data: " + TOKEN + b"\n\ndata: " + TOKEN + b"\n\n"]
    out, outcome, upstream = await relayed([*reads, b"data: [DONE]\n\n"])
    assert out[0] == b"data: " + ROLE + b"\n\ndata: " + TOKEN + b"\n\n"  # the race's events
    assert out[1] is reads[0] and out[2] is reads[1]  # not re-encoded, not even copied
    assert out[3] == DONE
    assert outcome.end is StreamEnd.DONE and upstream.closed == 1


async def test_split_reads_crlf_and_comments_are_re_framed() -> None:
    token = b"data: " + TOKEN + b"\n\n"
    chunks = [token[:9], token[9:],  # an event split across two reads
              b"data: " + TOKEN + b"\r\n\r\n",  # CRLF framing
              b": ping\n\n" + token,  # a comment before an event
              b"id: 3\nretry: 10\n" + token,  # fields the gateway never forwards
              token,  # plain again
              b"data: [DONE]\r\n\r\n"]
    out, outcome, _ = await relayed(chunks)
    assert b"".join(out[1:]) == token * 5 + DONE
    assert out[-2] is chunks[-2]
    assert outcome.end is StreamEnd.DONE


async def test_done_and_errors_inside_plain_reads_are_seen() -> None:
    error = b'{"error":{"message":"boom","type":"server_error","param":null,"code":null}}'
    token = b"data: " + TOKEN + b"\n\n"
    out, outcome, _ = await relayed([token + b"data: " + error + b"\n\n" + token])
    assert b"".join(out[1:]) == token + b"data: " + error + b"\n\n"  # nothing after the error
    assert outcome.end is StreamEnd.UPSTREAM_ERROR
    out, outcome, _ = await relayed([token + b"data: [DONE]\n\n" + token])
    assert b"".join(out[1:]) == token + DONE
    assert outcome.end is StreamEnd.DONE


async def test_a_word_error_in_content_is_not_an_error_event() -> None:
    chunk = b'data: {"choices":[{"delta":{"content":"\\"error\\""}}]}\n\n'
    out, outcome, _ = await relayed([chunk, b"data: [DONE]\n\n"])
    assert out[1] == chunk and outcome.end is StreamEnd.DONE


async def test_a_closed_prefix_closes_again_at_once_without_a_turn_of_the_loop() -> None:
    """The relay closes its upstream as the stream ends, and the request's end closes it
    again to be sure; the second close must not cost a task and turns of the loop (the
    client's next request on the connection waits behind them): it completes without ever
    suspending, and the upstream was closed once."""
    upstream = Upstream()
    prefix = Prefix(upstream, _batches([]), [SSEEvent(ROLE), SSEEvent(TOKEN)])
    await prefix.aclose()
    assert upstream.closed == 1
    again = prefix.aclose()
    try:
        again.send(None)  # a coroutine that suspends would yield here instead of returning
    except StopIteration:
        pass
    else:  # pragma: no cover - the failure this test is for
        again.close()
        raise AssertionError("the second close suspended (it ran through a task again)")
    assert upstream.closed == 1


async def test_a_deadline_in_the_turn_of_an_interrupt_cancels_the_read_once() -> None:
    """A continuation wins the stall race (`interrupt`) and the idle deadline fires in the
    same turn: the read is cancelled once, so the relay takes the cancellation back whole
    and takes the winner (a second cancel left one pending: the relay re-raised and the
    stream ended with no final event)."""
    now = [0.0]
    took: list[bool] = []
    reading = asyncio.Event()
    made: list[_Deadlines] = []

    async def reader() -> None:
        deadlines = _Deadlines(idle=1.0, max_stream_deadline=1e9, clock=lambda: now[0])
        made.append(deadlines)
        deadlines.reading = True
        reading.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            took.append(deadlines.took_back())
            took.append(deadlines.expired == "continued")
        finally:
            deadlines.close()

    task = asyncio.ensure_future(reader())
    await reading.wait()
    deadlines = made[0]
    now[0] = 5.0  # the idle deadline has passed
    deadlines.interrupt()
    deadlines._fire()
    await task
    assert took == [True, True]  # ours alone (the relay goes on), and the winner's


async def test_a_translated_messages_stream_is_counted_event_for_event() -> None:
    """A Messages backend's reads translated for a Chat client, its later reads written from
    their bytes: the client gets what feeding each event writes, and the relay counts every
    event it relayed (what a stream without usage is charged), the undecoded reads'
    included."""
    def named(name: bytes, data: bytes) -> bytes:
        return b"event: " + name + b"\ndata: " + data + b"\n\n"

    def delta(text: bytes) -> bytes:
        return (b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
                b'"text":"' + text + b'"}}')

    head = [(b"message_start", b'{"type":"message_start","message":{"id":"m","model":"c"}}'),
            (b"content_block_start", b'{"type":"content_block_start","index":0,'
                                     b'"content_block":{"type":"text","text":""}}'),
            (b"content_block_delta", delta(b"first"))]
    run = [(b"content_block_delta", delta(b"tok%d " % i)) for i in range(20)]
    end = [(b"content_block_stop", b'{"type":"content_block_stop","index":0}'),
           (b"message_stop", b'{"type":"message_stop"}')]
    reads = [b"".join(named(*e) for e in run), b"".join(named(*e) for e in run[:3] + end)]
    translation = TRANSLATIONS[("chat/completions", "messages")]
    slow = MessagesToChat(1, include_usage=False)
    expected = b"".join(slow.feed(SSEEvent(data, name))
                        for name, data in [*head, *run, *run[:3], *end])

    async def batches() -> AsyncIterator[SSEBatch]:
        decoder = SSEDecoder()
        decoder.feed(b"".join(named(*e) for e in head))  # the race read the first read
        for chunk in reads:
            batch = decoder.feed_batch(chunk)
            assert batch is not None and batch.named == chunk
            yield batch

    protocol = dataclasses.replace(CHAT, encoder=lambda _protocol, _rewrite: translation.encoder(
        1, False, CHAT.error_event))
    outcome = RelayOutcome()
    prefix = Prefix(Upstream(), batches(), [SSEEvent(data, name) for name, data in head])
    out = [part async for part in relay(prefix, request_id="r", idle=60.0,
                                        max_stream_deadline=1e9, clock=lambda: 0.0,
                                        outcome=outcome, protocol=protocol)]
    assert b"".join(out) == expected and outcome.end is StreamEnd.DONE
    assert outcome.events == len(head) + len(run) + 3 + len(end)


async def test_what_a_stream_owes_is_made_before_its_last_piece_and_a_bug_in_it_costs_nothing(
) -> None:
    """`outcome.on_done` is made as the relay has the end event, before the piece that
    carries it is yielded (and its counts are final then), once; a call in it that fails (a
    bug of ours) is logged, and the client still gets the piece, `[DONE]` included."""
    seen: list[tuple[int, int]] = []
    upstream = Upstream()
    prefix = Prefix(upstream, _batches([b"data: " + TOKEN + b"\n\ndata: [DONE]\n\n"]),
                    [SSEEvent(ROLE), SSEEvent(TOKEN)])
    out: list[bytes] = []
    outcome = RelayOutcome()

    def bug() -> None:
        raise RuntimeError("a bug in a key's charge")

    outcome.on_done = Hooks(lambda: seen.append((len(out), outcome.events)), bug)
    async for part in relay(prefix, request_id="r", idle=60.0, max_stream_deadline=1e9,
                            clock=lambda: 0.0, outcome=outcome, protocol=CHAT):
        out.append(part)
    assert seen == [(1, 4)]  # before the second piece (the last), with its events counted
    assert out[-1].endswith(DONE) and outcome.end is StreamEnd.DONE
