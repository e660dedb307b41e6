"""Bad input over real sockets: one precise ERROR to that peer; the producer and others go on."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import msgpack
import pytest

from streamq import Client, Consumer, Producer, ServerSettings
from streamq.errors import ErrorCode
from streamq.producer.server import MAX_CONSUMER_NAME
from streamq.protocol import (
    PROTOCOL_VERSION,
    Ack,
    ClientHello,
    Error,
    FrameDecoder,
    GetHead,
    GetRange,
    Message,
    ReportPosition,
    ServerHello,
    Subscribe,
    decode_message,
    encode,
    frame,
)

from ..conftest import wait_for

HELLO = encode(ClientHello(PROTOCOL_VERSION, "test"))


async def exchange(address: str, data: bytes, timeout: float = 10.0) -> list[Message]:
    """Send raw bytes, then read every frame until the server closes the connection."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        decoder = FrameDecoder()
        messages: list[Message] = []
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                decoder.feed(chunk)
                while (body := decoder.next_frame()) is not None:
                    messages.append(decode_message(body))
        return messages
    finally:
        writer.close()


def error_of(messages: list[Message]) -> Error:
    assert messages, "the server sent nothing"
    last = messages[-1]
    assert isinstance(last, Error), f"expected an ERROR frame last, got {messages!r}"
    return last


@pytest.fixture
async def producer(producer_db: str) -> AsyncIterator[Producer]:
    settings = ServerSettings(max_frame_size=64 * 1024, max_batch_bytes=32 * 1024)
    async with Producer(producer_db, settings=settings) as producer:
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"%d" % n for n in range(20)])
        yield producer


@pytest.fixture
async def bystander(producer: Producer) -> AsyncIterator[Consumer]:
    """A well-behaved consumer that must keep receiving whatever others do."""
    async with Consumer(producer.address, "orders", start_seq=1) as consumer:
        assert (await anext(consumer)).last_seq == 20
        yield consumer


async def check_unharmed(producer: Producer, bystander: Consumer) -> None:
    seq = await producer.publish("orders", b"after the bad input")
    batch = await asyncio.wait_for(anext(bystander), 10)
    assert [r.seq for r in batch] == [seq]
    assert producer.head("orders") == seq == 21


BAD_INPUTS = {
    "garbage body": (
        HELLO + frame(b"\xc1\xc1\xc1"),
        ErrorCode.MALFORMED_FRAME,
        "not valid msgpack",
    ),
    "trailing bytes": (
        HELLO + frame(msgpack.packb([8, "orders"]) + b"\x00"),
        ErrorCode.MALFORMED_FRAME,
        "not valid msgpack",
    ),
    "unknown type": (
        HELLO + frame(msgpack.packb([99])),
        ErrorCode.MALFORMED_FRAME,
        "unknown message type 99",
    ),
    "wrong field type": (
        HELLO + frame(msgpack.packb([10, "orders", -1, 5])),
        ErrorCode.MALFORMED_FRAME,
        "GET_RANGE.start",
    ),
    "huge array header": (
        HELLO + frame(b"\xdd\xff\xff\xff\xff"),
        ErrorCode.MALFORMED_FRAME,
        "not valid msgpack",
    ),
    "deep nesting": (HELLO + frame(b"\x91" * 10_000), ErrorCode.MALFORMED_FRAME, ""),
    "oversized length prefix": (
        HELLO + struct.pack(">I", 2**31),
        ErrorCode.FRAME_TOO_LARGE,
        "exceeds the limit of 65536",
    ),
    "empty frame": (HELLO + struct.pack(">I", 0), ErrorCode.MALFORMED_FRAME, "empty frame"),
    "version mismatch": (
        frame(msgpack.packb([1, 7, "a future client", {"new": "fields"}])),
        ErrorCode.VERSION_MISMATCH,
        "peer speaks protocol version 7",
    ),
    "request before hello": (
        encode(GetHead("orders")),
        ErrorCode.UNEXPECTED_MESSAGE,
        "CLIENT_HELLO",
    ),
    "ack before subscribe": (HELLO + encode(Ack(3)), ErrorCode.UNEXPECTED_MESSAGE, "ACK"),
    "two subscribes": (
        HELLO
        + encode(Subscribe("orders", 1, "a", None))
        + encode(Subscribe("orders", 1, "b", None)),
        ErrorCode.UNEXPECTED_MESSAGE,
        "one subscription per connection",
    ),
    "unknown stream": (
        HELLO + encode(Subscribe("nope", 1, "a", None)),
        ErrorCode.UNKNOWN_STREAM,
        "unknown stream 'nope'",
    ),
    "start beyond head": (
        HELLO + encode(Subscribe("orders", 22, "a", None)),
        ErrorCode.OFFSET_OUT_OF_RANGE,
        "cannot start at seq 22, beyond the head (20)",
    ),
    "start at zero": (
        HELLO + encode(Subscribe("orders", 0, "a", None)),
        ErrorCode.OFFSET_OUT_OF_RANGE,
        "seqs start at 1",
    ),
    "range past head": (
        HELLO + encode(GetRange("orders", 5, 30)),
        ErrorCode.OFFSET_OUT_OF_RANGE,
        r"range [5, 30) is not within [1, 21)",
    ),
    "filter with a share beyond its count": (
        HELLO + frame(msgpack.packb([3, "orders", 1, "a", None, None, {"share": [3, 2]}])),
        ErrorCode.MALFORMED_FRAME,
        "invalid filter: share must be (index, count)",
    ),
    "filter with an unknown field": (
        HELLO + frame(msgpack.packb([10, "orders", 1, 5, None, {"type": b"paid"}])),
        ErrorCode.MALFORMED_FRAME,
        "invalid filter: unknown filter fields: type",
    ),
    "filter that is not a map": (
        HELLO + frame(msgpack.packb([10, "orders", 1, 5, 0, [b"k"]])),
        ErrorCode.MALFORMED_FRAME,
        "GET_RANGE.filter has an invalid value",
    ),
    "wrong producer": (
        HELLO + encode(Subscribe("orders", 1, "a", "someone-else")),
        ErrorCode.PRODUCER_MISMATCH,
        "not someone-else",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
async def test_bad_input_gets_its_error(case: str, producer: Producer, bystander: Consumer) -> None:
    data, code, text = BAD_INPUTS[case]
    messages = await exchange(producer.address, data)
    assert isinstance(messages[0], ServerHello)
    error = error_of(messages)
    assert (ErrorCode(error.code), text in error.message) == (code, True), error
    await check_unharmed(producer, bystander)


async def test_data_gone_to_retention_names_the_seqs(
    producer: Producer, bystander: Consumer
) -> None:
    await producer.truncate("orders", 8)
    error = error_of(
        await exchange(producer.address, HELLO + encode(Subscribe("orders", 3, "a", None)))
    )
    assert error.code == ErrorCode.OFFSET_OUT_OF_RANGE
    assert "seqs 3..7 no longer held" in error.message
    assert error.details == {"stream": "orders", "requested": 3, "low": 8, "head": 20}
    await check_unharmed(producer, bystander)


async def test_error_survives_unread_pipelined_input(
    producer: Producer, bystander: Consumer
) -> None:
    """The ERROR frame arrives even when the client has sent much more than was read."""
    flood = encode(GetHead("orders")) * 50_000  # ~0.5 MB queued behind the bad request
    messages = await exchange(producer.address, HELLO + encode(GetHead("nope")) + flood)
    assert error_of(messages).code == ErrorCode.UNKNOWN_STREAM
    await check_unharmed(producer, bystander)


async def test_connection_limit_and_handshake_timeout(producer_db: str) -> None:
    settings = ServerSettings(max_connections=2, handshake_timeout=0.3)
    async with Producer(producer_db, settings=settings) as producer:
        await producer.publish("orders", b"x")
        async with Consumer(producer.address, "orders") as first:
            assert [r.seq for r in await anext(first)] == [1]
            host, port = producer.address.rsplit(":", 1)
            # A silent connection is closed after the handshake timeout...
            silent = await exchange(producer.address, b"")
            assert error_of(silent).code == ErrorCode.IDLE_TIMEOUT
            # ...and so is one trickling a hello that never completes.
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(HELLO[:3])
                second_wave = await exchange(producer.address, b"")  # over the limit: 1 + 2
                assert error_of(second_wave).code == ErrorCode.TOO_MANY_CONNECTIONS
                decoder = FrameDecoder()
                async with asyncio.timeout(10):
                    while chunk := await reader.read(65536):
                        decoder.feed(chunk)
                messages = []
                while (body := decoder.next_frame()) is not None:
                    messages.append(decode_message(body))
                assert error_of(messages).code == ErrorCode.IDLE_TIMEOUT
            finally:
                writer.close()
            await producer.publish("orders", b"y")
            assert [r.seq for r in await asyncio.wait_for(anext(first), 10)] == [2]
        await wait_for(lambda: producer.server is not None and producer.server.connections == 0)


async def test_overlong_consumer_names_are_refused(producer: Producer, bystander: Consumer) -> None:
    """Positions keep the names peers report (status, metrics labels): their number is
    capped, so must each name's length be, or 1,024 names of a frame's size fill memory."""
    long_name = "c" * (MAX_CONSUMER_NAME + 1)
    requests = [
        encode(ReportPosition("orders", long_name, 5)),
        encode(Subscribe("orders", 1, long_name, None)) + encode(Ack(5)),
    ]
    for request in requests:
        error = error_of(await exchange(producer.address, HELLO + request))
        assert error.code == ErrorCode.MALFORMED_FRAME
        assert f"at most {MAX_CONSUMER_NAME} characters" in error.message
        assert error.details == {"length": MAX_CONSUMER_NAME + 1}  # "Errors": MALFORMED_FRAME
    assert all(p.consumer != long_name for p in producer.consumer_lags())

    def report_longest() -> None:
        with Client(producer.address, timeout=10) as client:
            client.report_position("orders", "c" * MAX_CONSUMER_NAME, 5)

    await asyncio.to_thread(report_longest)
    await check_unharmed(producer, bystander)


@pytest.mark.parametrize("timestamp", [2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
async def test_seek_time_takes_every_msgpack_int(
    timestamp: int, producer: Producer, bystander: Consumer
) -> None:
    """ "SEEK_TIME": any int, up to 2**64 - 1, which the database cannot even compare: one
    beyond every stored timestamp answers head + 1, not INTERNAL_ERROR."""

    def seek() -> int:
        with Client(producer.address, timeout=10) as client:
            return client.seek_time("orders", timestamp).seq

    assert await asyncio.to_thread(seek) == (1 if timestamp < 0 else 21)
    await check_unharmed(producer, bystander)
