"""The connection plumbing under the server, the consumer and the client.

The protocol (``streamq.protocol``) turns bytes into messages and knows nothing of sockets;
this module moves the bytes: addresses, opening a client connection, reading until the
protocol yields a message (asyncio and blocking) or dropping what a peer still sends
after an ERROR, all in reads of one size, and one place where the socket layer's errors
become streamq's (as httpcore's ``map_exceptions`` does), so callers never see
``ssl.SSLError`` or ``OSError``. The client's side of the handshake is written once, as
steps (``client_handshake``) that the consumer drives over asyncio (``handshake``) and
the blocking client over its socket (``handshake_blocking``), and so is what tells a
producer from another service's port (``not_a_producer``, ``silent_peer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, SupportsIndex, cast

from ..errors import ConnectionLostError, ErrorCode, RemoteProtocolError
from ..protocol import (
    PROTOCOL_VERSION,
    Authenticated,
    ClientConnection,
    ClientHello,
    Connection,
    ListStreams,
    Message,
    ServerHello,
    State,
    StreamList,
)
from .security import ClientTLS, tls_error, tls_refused

# The most one read takes from a connection: every read streamq makes, asyncio or blocking.
READ_SIZE = 256 * 1024


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into (host, port); no host means loopback. A URL or
    a port beyond 65535 is refused: the socket layer would look the scheme up as part of
    the host name, or wrap the port around to another one."""
    scheme, slashes, _ = address.partition("://")
    if slashes:
        raise ValueError(
            f"address must be HOST:PORT, not a URL: {address!r} (drop {scheme + slashes!r})"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, not {address!r}")
    if not 0 < int(port) <= 65535:
        raise ValueError(f"address port must be 1 to 65535, not {port} in {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@contextlib.contextmanager
def producer_errors(address: str, doing: str) -> Iterator[None]:
    """Map the socket layer's failures while ``doing`` something with the producer at
    ``address``: TLS failures to ``TLSError`` (what went wrong, not retried), anything
    else from the network (timeouts included) to ``ConnectionLostError``: "``doing``
    producer at ADDRESS: why"."""
    try:
        yield
    except ssl.SSLError as exc:
        raise tls_error(exc, address) from exc
    except OSError as exc:  # TimeoutError is one
        raise ConnectionLostError(f"{doing} producer at {address}: {exc!r}") from exc


def closed_by_producer(address: str, conn: ClientConnection) -> ConnectionLostError:
    """The error for an EOF from the producer, with a hint when it came before SERVER_HELLO:
    that is how a producer serving TLS answers a plain connection."""
    hint = " before its SERVER_HELLO (does it require TLS?)"
    if conn.their_state is not State.AWAIT_HELLO:
        hint = ""
    return ConnectionLostError(f"producer at {address} closed the connection{hint}")


class PushReader(asyncio.StreamReader):
    """A ``StreamReader`` that can hand each read to a callback instead of buffering it.

    A subscription reads its handshake as any client does, then streams: from
    ``push_to`` on, every read goes straight to ``receive`` on the loop's callback, so a
    frame costs no waiter, no task step and no timer of its own (a one-record frame cost a
    consumer 19 us the other way, most of it in that machinery). ``pause`` and ``resume``
    are the TCP flow control the buffer's limit gave before: a receiver that stops
    reading makes the producer wait.
    """

    _receive: Callable[[bytes], None] | None = None
    _ended: Callable[[BaseException | None], None] | None = None
    _reading: Any = None  # the transport it reads from

    def set_transport(self, transport: asyncio.BaseTransport) -> None:
        super().set_transport(transport)
        self._reading = transport

    def push_to(
        self, receive: Callable[[bytes], None], ended: Callable[[BaseException | None], None]
    ) -> bytes:
        """Reads go to ``receive`` from now on, and the connection's end (None: the peer
        closed it) to ``ended``, once; returns what was read and not yet taken."""
        self._receive, self._ended = receive, ended
        # StreamReader's own buffer and pause flag (asyncio's streams.py has kept them
        # under these names since 3.4): what came before, and a pause taken for it, undone.
        own: Any = self
        early, own._buffer = bytes(own._buffer), bytearray()
        if own._paused:
            own._paused = False
            self.resume()
        return early

    def stop_pushing(self) -> None:
        """Back to buffering, the connection being dropped: nothing more is handed on."""
        self._receive = self._ended = None

    def pause(self) -> None:
        if self._reading is not None:
            self._reading.pause_reading()

    def resume(self) -> None:
        if self._reading is not None:
            self._reading.resume_reading()

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        if self._receive is None:
            super().feed_data(data)
        else:
            self._receive(cast(bytes, data))

    def feed_eof(self) -> None:
        ended = self._ended
        if ended is None:
            super().feed_eof()
        else:
            self.stop_pushing()
            ended(None)

    def set_exception(self, exc: Exception) -> None:
        ended = self._ended
        if ended is None:
            super().set_exception(exc)
        else:
            self.stop_pushing()
            ended(exc)


async def open_connection(
    address: str, tls: ClientTLS | None, context: ssl.SSLContext | None, timeout: float
) -> tuple[PushReader, asyncio.StreamWriter]:
    """A TCP (or TLS) connection to the producer at ``address``, within ``timeout``:
    ``asyncio.open_connection``'s, with a ``PushReader``."""
    host, port = parse_address(address)
    server_hostname = None if tls is None else tls.server_name or host
    loop = asyncio.get_running_loop()
    reader = PushReader(limit=READ_SIZE, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    with producer_errors(address, "cannot connect to"):
        async with asyncio.timeout(timeout):
            transport, _ = await loop.create_connection(
                lambda: protocol, host, port, ssl=context, server_hostname=server_hostname
            )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def read_message(
    conn: Connection,
    reader: asyncio.StreamReader,
    *,
    timeout: float | None = None,
    read_timeout: float | None = None,
    frame_timeout: float | None = None,
) -> Message | None:
    """The peer's next message, reading as needed; None once the peer has closed.

    ``timeout`` bounds the whole wait; ``read_timeout`` each read (a peer silent that
    long is gone); ``frame_timeout`` a frame from its first byte (a trickle of bytes
    cannot hold a buffer for ever). Past one, ``TimeoutError``.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    frame_deadline = None
    while (message := conn.next_event()) is None:
        now = loop.time()
        if frame_timeout is not None and frame_deadline is None and conn.buffered:
            frame_deadline = now + frame_timeout
        limits = [d for d in (deadline, frame_deadline) if d is not None]
        if read_timeout is not None:
            limits.append(now + read_timeout)
        async with asyncio.timeout_at(min(limits) if limits else None):
            data = await reader.read(READ_SIZE)
        if not data:
            return None
        conn.receive_data(data)
    return message


async def discard_input(reader: asyncio.StreamReader, limit: int) -> None:
    """Read and drop what the peer sends, in reads as ``read_message``'s, until it closes
    or ``limit`` bytes or more have come; the caller bounds the time."""
    discarded = 0
    while discarded < limit and (data := await reader.read(READ_SIZE)):
        discarded += len(data)


def read_message_blocking(conn: ClientConnection, sock: socket.socket) -> Message | None:
    """``read_message`` on a blocking socket (its own timeout applies to each read),
    receiving into this thread's buffer (``_receive_buffer``). A ``recv`` makes a new
    object of up to ``READ_SIZE`` bytes per read, fresh memory the kernel has to map page
    by page; that cost several times the copy itself (a frame of 1.1 MB took 2.0 to 2.5 ms
    of CPU to receive, 0.3 to 0.6 ms this way)."""
    with memoryview(_receive_buffer()) as view:
        while (message := conn.next_event()) is None:
            count = sock.recv_into(view)
            if not count:
                return None
            conn.receive_data(view[:count])
    return message


_buffers = threading.local()


def _receive_buffer() -> bytearray:
    """This thread's buffer for every blocking read. ``receive_data`` copies what it is
    given, so all the connections of a thread share one: a buffer per connection took
    0.25 MiB and about 150 us to make (zeroed), each, for a Spark driver's hundreds."""
    buffer: bytearray | None = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = bytearray(READ_SIZE)
    return buffer


# What a handshake ends with: the producer's SERVER_HELLO, and the consumer its token
# named (AUTHENTICATED), None without a token.
Hello = tuple[ServerHello, str | None]

# A producer sends SERVER_HELLO as it accepts ("Handshake"); a peer still silent this long
# after the CLIENT_HELLO is sent a LIST_STREAMS, whose frame holds a line feed: a service
# that waits for a line (Python's http.server, Go's net/http) answers it at once,
# with bytes no producer sends. A producer merely slow answers it, and the answer is dropped.
PROBE_AFTER = 0.25


@dataclass(frozen=True, slots=True)
class Wait:
    """A handshake step: read the producer's next message. ``within``: nothing read that
    long throws ``TimeoutError`` into the steps (None: only the driver's own timeouts)."""

    within: float | None = None


_WAIT = Wait()
# A handshake's steps: each yields a message to send, or a ``Wait`` for the producer's next
# one (sent in), or the failure to read it (thrown in).
Handshake = Generator[Message | Wait, Message | None, Hello]


def client_handshake(
    address: str, name: str, token: str | None, tls: ClientTLS | None
) -> Handshake:
    """The client's side of the handshake, without I/O: CLIENT_HELLO and SERVER_HELLO (over
    TLS the producer's first: one refusing this client's certificate closes at once, which
    ``tls_refused`` says), then AUTHENTICATED if a token was sent. A peer that answers
    with anything but a streamq frame is another service (``not_a_producer``); one silent
    after the CLIENT_HELLO is probed (``PROBE_AFTER``)."""
    hello = ClientHello(PROTOCOL_VERSION, name, token)
    probed = False
    try:
        if tls is None:
            yield hello
            try:
                server_hello = yield Wait(PROBE_AFTER)
            except TimeoutError:
                yield ListStreams()
                probed = True
                server_hello = yield _WAIT
        else:  # no probe: closing after a CLIENT_HELLO could hide a refused certificate
            try:
                server_hello = yield _WAIT
            except (ConnectionLostError, ConnectionError) as exc:
                raise tls_refused(address, tls) from exc
            yield hello
    except RemoteProtocolError as exc:  # no producer answers so: another service's port
        raise not_a_producer(address, exc) from exc
    assert isinstance(server_hello, ServerHello)
    consumer = None
    if token is not None:
        authenticated = yield _WAIT
        assert isinstance(authenticated, Authenticated)
        consumer = authenticated.consumer
    if probed:  # the probe's answer: nobody asked for it
        listed = yield _WAIT
        assert isinstance(listed, StreamList)
    return server_hello, consumer


def not_a_producer(address: str, exc: RemoteProtocolError) -> RemoteProtocolError:
    """The error for a peer whose first answer is no streamq SERVER_HELLO: a database's
    port, a web server's. The decoder's reason (a frame of a billion bytes, say) is only
    noise here, left in the chained cause; a producer of another protocol version is
    said to be one."""
    if exc.code is ErrorCode.VERSION_MISMATCH:
        return RemoteProtocolError(f"producer at {address}: {exc}", exc.code)
    return RemoteProtocolError(
        f"the peer at {address} is not a streamq producer: it answered with no SERVER_HELLO",
        exc.code,
    )


def silent_peer(address: str, seconds: float) -> ConnectionLostError:
    """The error for a peer that accepted the connection and said nothing: a producer
    too busy to answer, or another service's port that waits for more."""
    return ConnectionLostError(
        f"no SERVER_HELLO from {address} within {seconds:g} s: is a streamq producer "
        "listening there, or another service (a web server, a database)?"
    )


def _resume(
    steps: Handshake,
    send: Callable[[Message], None],
    reply: Message | None,
    failed: Exception | None = None,
) -> Hello | Wait:
    """Go on with the handshake given the producer's message (or the failure to read it),
    sending what it yields until it waits for the next one (the ``Wait``), or its end."""
    try:
        step = steps.send(reply) if failed is None else steps.throw(failed)
        while not isinstance(step, Wait):
            send(step)
            step = steps.send(None)
    except StopIteration as done:
        hello: Hello = done.value
        return hello
    return step


async def handshake(
    steps: Handshake, send: Callable[[Message], None], receive: Callable[[], Awaitable[Message]]
) -> Hello:
    """Drive ``client_handshake``'s steps over an asyncio connection."""
    step = _resume(steps, send, None)
    while isinstance(step, Wait):
        try:
            async with asyncio.timeout(step.within):
                reply = await receive()
        except Exception as exc:
            step = _resume(steps, send, None, exc)
        else:
            step = _resume(steps, send, reply)
    return step


def start_handshake(steps: Handshake, send: Callable[[Message], None]) -> Wait:
    """Send the handshake's first messages, up to the producer's first answer: what
    ``handshake_blocking(waiting=)`` then goes on from, given the ``Wait`` returned.
    Started on many connections before any is finished, n handshakes cost about one
    round trip, not n."""
    step = _resume(steps, send, None)
    assert isinstance(step, Wait)  # every handshake waits for the producer
    return step


def handshake_blocking(
    steps: Handshake,
    send: Callable[[Message], None],
    receive: Callable[[], Message],
    readable: Callable[[float], bool],
    waiting: Wait | None = None,
) -> Hello:
    """``handshake`` over a blocking socket: ``readable(seconds)`` says whether the
    producer's next message (or its close) came within that long; ``waiting``: the step
    ``start_handshake`` returned."""
    step = _resume(steps, send, None) if waiting is None else waiting
    while isinstance(step, Wait):
        try:
            if step.within is not None and not readable(step.within):
                raise TimeoutError(f"nothing read within {step.within:g} s")
            reply = receive()
        except Exception as exc:
            step = _resume(steps, send, None, exc)
        else:
            step = _resume(steps, send, reply)
    return step
