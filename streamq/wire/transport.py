"""The connection plumbing under the server, the consumer and the client.

The protocol (``streamq.protocol``) turns bytes into messages and knows nothing of sockets;
this module moves the bytes: addresses, opening a client connection, reading until the
protocol yields a message (asyncio and blocking) or dropping what a peer still sends
after an ERROR, all in reads of one size, and one place where the socket layer's errors
become streamq's (as httpcore's ``map_exceptions`` does), so callers never see
``ssl.SSLError`` or ``OSError``. The client's side of the handshake is written once, as
steps (``client_handshake``) that the consumer drives over asyncio (``handshake``) and
the blocking client over its socket (``handshake_blocking``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Generator, Iterator

from ..errors import ConnectionLostError, RemoteProtocolError
from ..protocol import (
    PROTOCOL_VERSION,
    Authenticated,
    ClientConnection,
    ClientHello,
    Connection,
    Message,
    ServerHello,
    State,
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


async def open_connection(
    address: str, tls: ClientTLS | None, context: ssl.SSLContext | None, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP (or TLS) connection to the producer at ``address``, within ``timeout``."""
    host, port = parse_address(address)
    server_hostname = None if tls is None else tls.server_name or host
    with producer_errors(address, "cannot connect to"):
        async with asyncio.timeout(timeout):
            return await asyncio.open_connection(
                host, port, limit=READ_SIZE, ssl=context, server_hostname=server_hostname
            )


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
# Its steps: each yields a message to send, or None to be sent the producer's next one.
Handshake = Generator[Message | None, Message | None, Hello]


def client_handshake(
    address: str, name: str, token: str | None, tls: ClientTLS | None
) -> Handshake:
    """The client's side of the handshake, without I/O: CLIENT_HELLO and SERVER_HELLO (over
    TLS the producer's first: one refusing this client's certificate closes at once, which
    ``tls_refused`` says), then AUTHENTICATED if a token was sent. A driver sends what it
    yields, and sends in the producer's next message when it yields None, or throws in
    the failure to read it."""
    hello = ClientHello(PROTOCOL_VERSION, name, token)
    try:
        if tls is None:
            yield hello
            server_hello = yield None
        else:
            try:
                server_hello = yield None
            except (ConnectionLostError, ConnectionError) as exc:
                raise tls_refused(address, tls) from exc
            yield hello
    except RemoteProtocolError as exc:  # no producer answers so: another service's port
        raise not_a_producer(address, exc) from exc
    assert isinstance(server_hello, ServerHello)
    if token is None:
        return server_hello, None
    authenticated = yield None
    assert isinstance(authenticated, Authenticated)
    return server_hello, authenticated.consumer


def not_a_producer(address: str, exc: RemoteProtocolError) -> RemoteProtocolError:
    """The error for a peer whose first answer is no streamq frame: a database's port, a
    web server's (one that answers bytes it cannot parse at once)."""
    return RemoteProtocolError(
        f"the peer at {address} is not a streamq producer: it answered with no "
        f"SERVER_HELLO ({exc})",
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
) -> Hello | None:
    """Go on with the handshake given the producer's message (or the failure to read it),
    sending what it yields until it waits for the next one (None), or its end."""
    try:
        step = steps.send(reply) if failed is None else steps.throw(failed)
        while step is not None:
            send(step)
            step = steps.send(None)
    except StopIteration as done:
        hello: Hello = done.value
        return hello
    return None


async def handshake(
    steps: Handshake, send: Callable[[Message], None], receive: Callable[[], Awaitable[Message]]
) -> Hello:
    """Drive ``client_handshake``'s steps over an asyncio connection."""
    hello = _resume(steps, send, None)
    while hello is None:
        try:
            reply = await receive()
        except Exception as exc:
            hello = _resume(steps, send, None, exc)
        else:
            hello = _resume(steps, send, reply)
    return hello


def start_handshake(steps: Handshake, send: Callable[[Message], None]) -> None:
    """Send the handshake's first messages, up to the producer's first answer: what
    ``handshake_blocking(started=True)`` then goes on from. Started on many connections
    before any is finished, n handshakes cost about one round trip, not n."""
    hello = _resume(steps, send, None)
    assert hello is None  # every handshake waits for the producer


def handshake_blocking(
    steps: Handshake,
    send: Callable[[Message], None],
    receive: Callable[[], Message],
    started: bool = False,
) -> Hello:
    """``handshake`` over a blocking socket; ``started``: by ``start_handshake``."""
    hello = None if started else _resume(steps, send, None)
    while hello is None:
        try:
            reply = receive()
        except Exception as exc:
            hello = _resume(steps, send, None, exc)
        else:
            hello = _resume(steps, send, reply)
    return hello
