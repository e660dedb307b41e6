"""The client's side of the handshake with a peer still silent after the CLIENT_HELLO: it
is sent a LIST_STREAMS whose frame holds a line feed (``transport.PROBE_AFTER``). A web
server that waits for a line answers it and is named at once; a producer merely slow
answers it after its hellos, and that answer is dropped. The steps without I/O, then the
blocking client and the consumer over real loopback sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamq import (
    Client,
    Consumer,
    Producer,
    RemoteProtocolError,
    ServerSettings,
    TokenAuth,
    make_token,
)
from streamq.errors import ErrorCode
from streamq.protocol import (
    PROTOCOL_VERSION,
    Authenticated,
    ClientHello,
    ListStreams,
    ServerConnection,
    ServerHello,
    StreamList,
    encode,
)
from streamq.wire.transport import PROBE_AFTER, Wait, client_handshake, parse_address

from ..faultproxy import FaultProxy, Latency, Link

SECRET = b"0123456789abcdef-test-secret"
TOKEN = make_token(SECRET, "billing")
HELLO = ServerHello(PROTOCOL_VERSION, "p", 1, 1 << 20)


def test_the_probe_is_a_list_streams_with_a_line_feed() -> None:
    """Its length prefix ends in a line feed; a producer reads it as any LIST_STREAMS."""
    probe = encode(ListStreams())
    assert b"\n" in probe[:4]
    server = ServerConnection()
    server.send(HELLO)
    server.receive_data(encode(ClientHello(PROTOCOL_VERSION, "consumer billing")) + probe)
    assert server.next_event() == ClientHello(PROTOCOL_VERSION, "consumer billing")
    assert server.next_event() == ListStreams()


@pytest.mark.parametrize("token", [None, TOKEN], ids=["plain", "token"])
def test_a_silent_peer_is_probed_and_the_answer_dropped(token: str | None) -> None:
    steps = client_handshake("127.0.0.1:7400", "consumer billing", token, None)
    assert next(steps) == ClientHello(PROTOCOL_VERSION, "consumer billing", token)
    assert next(steps) == Wait(PROBE_AFTER)
    assert steps.throw(TimeoutError()) == ListStreams()  # nothing came: the probe
    assert next(steps) == Wait()  # and no second probe
    answers: list[ServerHello | Authenticated | StreamList] = [HELLO]
    if token is not None:
        answers.append(Authenticated("billing"))
    for answer in answers:
        assert steps.send(answer) == Wait()
    with pytest.raises(StopIteration) as done:
        steps.send(StreamList(()))
    assert done.value.value == (HELLO, None if token is None else "billing")


def test_a_hello_of_another_version_is_named_a_producer() -> None:
    """Not "not a streamq producer": the reason, which the other answers leave out, is the
    one thing to say."""
    steps = client_handshake("127.0.0.1:7400", "consumer billing", None, None)
    next(steps), next(steps)
    message = "peer speaks protocol version 2, this side speaks 1"
    other = RemoteProtocolError(message, ErrorCode.VERSION_MISMATCH)
    with pytest.raises(RemoteProtocolError) as refused:
        steps.throw(other)
    assert str(refused.value) == (
        "producer at 127.0.0.1:7400: peer speaks protocol version 2, this side speaks 1"
    )


def test_a_client_names_a_web_server_without_waiting_for_its_timeout(http_server: str) -> None:
    """``streamq tail``'s CLIENT_HELLO has no line feed (``streamq status``'s has one only by
    the length of its name): Python's http.server says nothing until the probe."""
    started = time.monotonic()
    with pytest.raises(RemoteProtocolError) as refused:
        Client(http_server, timeout=30.0, name="streamq-tail")
    assert time.monotonic() - started < 10.0  # generous: the producer's wait would be 30 s
    assert str(refused.value) == (
        f"the peer at {http_server} is not a streamq producer: it answered with no SERVER_HELLO"
    )


class Overheard(Latency):
    """Delays the producer's first chunk on each connection (its SERVER_HELLO), and keeps
    what the client sends, passed at once."""

    def __init__(self, latency: float) -> None:
        super().__init__(latency)
        self.heard = bytearray()

    async def forward(self, link: Link, data: bytes) -> None:
        if link.direction == "upstream":
            self.heard += data
        if link.direction == "upstream" or link.forwarded:
            await link.send(data)
        else:
            await super().forward(link, data)


@pytest.mark.parametrize("token", [None, TOKEN], ids=["plain", "token"])
async def test_a_producer_slower_than_the_probe_is_read_as_usual(
    producer_db: str, token: str | None
) -> None:
    """Its SERVER_HELLO (and AUTHENTICATED) come after PROBE_AFTER: the consumer and the
    client probe it, drop the STREAM_LIST it answers, and read on."""
    auth = None if token is None else TokenAuth(SECRET, {"billing": ["orders"]})
    async with Producer(producer_db, settings=ServerSettings(auth=auth)) as producer:
        await producer.publish("orders", b"a")
        async with FaultProxy(*parse_address(producer.address)) as proxy:
            slow = Overheard(3 * PROBE_AFTER)
            proxy.toxic = slow
            async with Consumer(proxy.address, "orders", start_seq=1, token=token) as consumer:
                batch = await asyncio.wait_for(anext(consumer), 10)
                assert [record.seq for record in batch] == [1]

            def head() -> int:
                with Client(proxy.address, timeout=10.0, token=token) as client:
                    return client.head("orders").head

            assert await asyncio.to_thread(head) == 1
    assert slow.heard.count(encode(ListStreams())) == 2  # each was probed
