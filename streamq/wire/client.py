"""A blocking client for requests: heads, ranges, stream lists, status.

For code with no event loop: Spark executors and drivers, scripts, the CLI.
It drives the same sans-IO ``ClientConnection`` as the asyncio consumer over
a plain socket. One client, one connection; requests run one after another.
"""

from __future__ import annotations

import asyncio
import math
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from ..errors import (
    ConnectionLostError,
    SeqsReusedError,
    StreamQError,
    error_from_frame,
)
from ..filters import Filter
from ..protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_SEQ,
    RECORDS_MESSAGES,
    ClientConnection,
    Error,
    GetHead,
    GetHistory,
    GetRange,
    GetStatus,
    ListStreams,
    Message,
    RangeEnd,
    Record,
    RecordColumns,
    RecordRows,
    Records,
    RecordsMessage,
    ReportPosition,
    SeekTime,
    StatusReport,
    StreamInfo,
    StreamList,
    TimePosition,
    WatchHead,
)
from .security import ClientTLS
from .transport import (
    client_handshake,
    closed_by_producer,
    handshake_blocking,
    parse_address,
    producer_errors,
    read_message_blocking,
    silent_peer,
    start_handshake,
)

_AT_ONCE = 0.001  # s: a read's timeout for an answer that has come, or is about to

# Maps a function over items, in parallel perhaps (``Client.connect_all``'s connects).
Parallel = Callable[[Callable[[str], Any], Sequence[str]], list[Any]]


def _connect(address: str, timeout: float | None) -> socket.socket:
    with producer_errors(address, "cannot connect to"):
        return socket.create_connection(parse_address(address), timeout=timeout)


T = TypeVar("T")


class Vouch(NamedTuple):
    """A producer's word on a reader's position (docs/protocol.md, "Epochs")."""

    after_epoch: int  # the epoch that wrote the position's seq in the log now; 0 if unknown
    rewritten_from: int  # the first seq up to the position written again since; 0 if none


def vouch_request(stream: str, position: int, seen_epoch: int = 0) -> GetRange:
    """What ``Client.vouch`` asks: an empty range read at ``position + 1``."""
    return GetRange(stream, position + 1, position + 1, seen_epoch)


def watch_request(stream: str, head: int, wait: float | None = None) -> WatchHead:
    """What ``Client.watch_head`` asks: ``wait`` in seconds, the heartbeat interval if None."""
    return WatchHead(stream, head, None if wait is None else math.ceil(wait * 1000))


def vouch_answer(end: Message) -> Vouch:
    """The producer's answer to ``vouch_request``."""
    assert isinstance(end, RangeEnd)
    return Vouch(end.after_epoch or 0, end.rewritten_from or 0)


class RangeRead(Iterator[T]):
    """The answer to a range request, batch by batch as the producer sends it. Consume it
    fully before the next request on the same client; the request goes out at the first
    ``next()``.

    With ``seen_epoch`` ("Epochs" in docs/protocol.md), ``epoch`` is the epoch that wrote
    the batch just returned, and once the iterator is exhausted ``after_epoch`` is the epoch
    that wrote seq ``start - 1`` in the producer's log now. If the producer no longer holds
    the seqs up to ``start - 1`` as they were read (under epochs up to ``seen_epoch``), it
    sends no records, and ``next()`` raises ``SeqsReusedError`` whose ``lost`` names them.
    Without ``seen_epoch`` these attributes stay None.
    """

    def __init__(
        self,
        client: Client,
        request: GetRange,
        unpack: Callable[[RecordsMessage], T],
        columnar: bool = False,
    ) -> None:
        self._client = client
        self._request: GetRange | None = request
        self._unpack = unpack
        self._raw = unpack is not _records
        self._columnar = columnar
        self._done = False
        self.stream, self.start, self.end = request.stream, request.start, request.end
        self.seen_epoch = request.seen_epoch
        self.epoch: int | None = None
        self.after_epoch: int | None = None
        self.rewritten_from: int | None = None

    def send(self) -> None:
        """Send the request now, before its answer is read (else at the first ``next()``):
        a reader of many producers asks the next one while it reads this one's answer."""
        if self._request is not None:
            request, self._request = self._request, None
            self._client._send(request)

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        client = self._client
        self.send()
        conn = client._conn
        conn.raw_records, conn.columnar_records = self._raw, self._columnar
        try:
            message = client._receive()
        except BaseException:
            self._done = True
            raise
        finally:
            conn.raw_records = conn.columnar_records = False
        if isinstance(message, RangeEnd):
            self._done = True
            self.after_epoch, self.rewritten_from = message.after_epoch, message.rewritten_from
            if message.rewritten_from:
                raise _seqs_reused(client, self.stream, message.rewritten_from, self.start - 1)
            raise StopIteration
        assert isinstance(message, RECORDS_MESSAGES)
        self.epoch = message.epoch
        return self._unpack(message)


def _seqs_reused(client: Client, stream: str, first: int, position: int) -> SeqsReusedError:
    """The error for a reader of ``stream`` up to ``position`` whose seqs from ``first`` on
    the producer has rewritten."""
    return SeqsReusedError(
        f"producer {client.producer_id} at {client.address} lost commits of stream {stream!r} "
        f"and re-used their seqs: it no longer holds seqs {first}..{position} as they were "
        "read (a power loss rolled back commits that were not synced, durability='normal'); "
        "other records now stand under them.",
        range(first, position + 1),
    )


def _records(message: RecordsMessage) -> tuple[Record, ...]:
    assert isinstance(message, Records)
    return message.records


def _frames(message: RecordsMessage) -> RecordRows | RecordColumns:
    assert isinstance(message, RecordRows | RecordColumns)
    return message


class Client:
    """``with Client("127.0.0.1:7400") as c: c.head("orders")``.

    ``producer_id`` and ``epoch`` are known once connected. Errors from the
    producer raise the matching ``ServerError`` subclass; socket failures raise
    ``ConnectionLostError``; a failed TLS handshake ``TLSError``. With ``token``,
    ``consumer`` is the name the producer authenticated (None if it checks no tokens).
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = 30.0,
        name: str = "client",
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        tls: ClientTLS | None = None,
        token: str | None = None,
    ) -> None:
        self._start(address, None, timeout, name, max_frame_size, tls, token)
        self._finish(timeout)

    def _start(
        self,
        address: str,
        sock: socket.socket | None,
        timeout: float | None,
        name: str,
        max_frame_size: int,
        tls: ClientTLS | None,
        token: str | None,
    ) -> None:
        """Connect (unless ``sock`` is connected already) and send the handshake's first
        messages; ``_finish`` reads the producer's answer."""
        self.address = address
        if sock is None:
            sock = _connect(address, timeout)
        self._sock = sock
        self._conn = ClientConnection(max_frame_size)
        # A WATCH_HEAD's: its answer unread (since when, time.monotonic()), or read early.
        self._watching: float | None = None
        self._watched: StreamInfo | None = None
        # Answers due before the watch's that nobody reads: a superseded watch's, and those
        # of the requests ``watch_head`` sent before it.
        self._dropping = 0
        self.consumer: str | None = None
        self._handshake = client_handshake(address, name, token, tls)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                self._sock = self._wrap(tls, parse_address(address)[0])
            self._handshake_step = start_handshake(self._handshake, self._send)
        except BaseException:
            self._sock.close()
            raise

    def _finish(self, timeout: float | None) -> None:
        """Read the producer's answer to the handshake; ``timeout``: what it was given,
        said if it gives none."""
        try:
            server_hello, self.consumer = handshake_blocking(
                self._handshake, self._send, self._receive, self._readable, self._handshake_step
            )
        except ConnectionLostError as exc:
            self._sock.close()
            if isinstance(exc.__cause__, TimeoutError):
                raise silent_peer(self.address, timeout or 0) from exc
            raise
        except BaseException:
            self._sock.close()
            raise
        self.producer_id = server_hello.producer_id
        self.epoch = server_hello.epoch

    @classmethod
    def connect_all(
        cls,
        addresses: Sequence[str],
        *,
        timeout: float | None = 30.0,
        name: str = "client",
        tls: ClientTLS | None = None,
        token: str | None = None,
        parallel: Parallel | None = None,
    ) -> list[Client | StreamQError]:
        """A client for each address, their handshakes together: every CLIENT_HELLO is
        sent before any SERVER_HELLO is read, so n producers cost about one round trip,
        not n. ``parallel`` maps the TCP connects (a thread pool: an address that does not
        answer then costs its timeout once, not once per address after it); the answers,
        all due within ``timeout`` of the last CLIENT_HELLO. One that cannot be reached,
        or refuses, is its error, in its place in the list."""
        mapped = parallel or (lambda connect, items: [connect(item) for item in items])

        def connect(address: str) -> socket.socket | StreamQError:
            try:
                return _connect(address, timeout)
            except StreamQError as exc:
                return exc

        clients: list[Client | StreamQError] = []
        for address, sock in zip(addresses, mapped(connect, addresses), strict=True):
            if isinstance(sock, StreamQError):
                clients.append(sock)
                continue
            client = cls.__new__(cls)
            try:
                client._start(address, sock, timeout, name, DEFAULT_MAX_FRAME_SIZE, tls, token)
            except StreamQError as exc:
                clients.append(exc)
                continue
            clients.append(client)
        # The answers are awaited together too: each within what is left of ``timeout``.
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, one in enumerate(clients):
            if isinstance(one, Client):
                if deadline is not None:
                    one.timeout = max(deadline - time.monotonic(), _AT_ONCE)
                try:
                    one._finish(timeout)
                except StreamQError as exc:
                    clients[i] = exc
                    continue
                one.timeout = timeout
        return clients

    def _wrap(self, tls: ClientTLS, host: str) -> socket.socket:
        context = tls.context()  # errors in this side's own files are not the handshake's
        with producer_errors(self.address, "TLS with"):
            return context.wrap_socket(self._sock, server_hostname=tls.server_name or host)

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()

    @property
    def closed(self) -> bool:
        """Closed by ``close``, or after an ERROR or a failure."""
        return self._sock.fileno() == -1

    def fileno(self) -> int:
        """The socket's file descriptor (-1 once closed), for ``select.poll``: only what
        ``answer_ready`` says is buffered in the client is not seen there."""
        return self._sock.fileno()

    def keep_alive(self, idle: float, interval: float, probes: int) -> None:
        """Have the kernel probe the connection once it has been quiet ``idle`` seconds
        (TCP keepalive), every ``interval`` seconds up to ``probes`` times: a producer gone
        without a word (its machine crashed, or rebooted) then ends the connection within
        about ``idle + interval * probes``, for a read or a poll to find, where a watch
        waiting for its answer would otherwise wait for ever. The producer's kernel
        answers the probes: they do not wake the producer's process."""
        sock = self._sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (
            ("TCP_KEEPIDLE", idle),  # Linux; macOS names it TCP_KEEPALIVE
            ("TCP_KEEPALIVE", idle),
            ("TCP_KEEPINTVL", interval),
            ("TCP_KEEPCNT", probes),
        ):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), math.ceil(value))

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _send(self, message: Message) -> None:
        with producer_errors(self.address, "sending to"):
            self._sock.sendall(self._conn.send(message))

    def _receive(self) -> Message:
        try:
            self._drop_answers()
            if isinstance(self._conn.answering, WatchHead):  # its answer is next: keep it
                self._watched, self._watching = self._receive_info(), None
            return self._receive_message()
        except StreamQError:
            self.close()  # an ERROR ends the connection; so does a peer out of step
            raise

    def _readable(self, seconds: float) -> bool:
        """Whether the next answer (or the connection's end) came within ``seconds``, or
        the read timeout if shorter (``connect_all``'s last handshakes have little left)."""
        timeout = self.timeout
        if timeout is not None:
            seconds = min(seconds, timeout)
        return bool(answers_ready([self], time.monotonic() + seconds))

    def _drop_answers(self, waiting: bool = True) -> None:
        """Read the answers nobody reads (``watch_head``), or without ``waiting`` those that
        have come; an ERROR among them raises."""
        while self._dropping and (waiting or self.answer_ready):
            self._receive_message()
            self._dropping -= 1

    def _receive_message(self) -> Message:
        with producer_errors(self.address, "reading from"):
            message = read_message_blocking(self._conn, self._sock)
        if message is None:
            raise closed_by_producer(self.address, self._conn)
        if isinstance(message, Error):
            raise error_from_frame(message.code, message.message, message.details)
        return message

    def _receive_info(self) -> StreamInfo:
        info = self._receive_message()
        assert isinstance(info, StreamInfo)  # the state machine let nothing else through
        return info

    def send_requests(self, *requests: Message) -> None:
        """Send ``requests`` in one write without waiting for answers (pipelined: the
        protocol's "Requests MAY be pipelined"); ``next_answer`` reads them in order. What
        lets one thread ask many producers at once."""
        with producer_errors(self.address, "sending to"):
            self._sock.sendall(b"".join(map(self._conn.send, requests)))
        if any(isinstance(request, WatchHead) for request in requests):
            self._watching, self._watched = time.monotonic(), None

    def next_answer(self) -> Message:
        """The answer to the oldest request sent with ``send_requests`` and not yet read;
        an ERROR raises its ``ServerError`` (the producer then ends the connection, and
        answers no request pipelined after it)."""
        return self._receive()

    def watch_head(self, stream: str, head: int, *told: Message, wait: float | None = None) -> None:
        """Ask to be told once ``stream``'s head is beyond ``head`` (WATCH_HEAD), without
        waiting: ``watch_answered`` says when ``watched`` can read the answer at once. The
        producer answers at the latest after ``wait`` seconds (its heartbeat interval if
        None), head as it is. Other requests may follow: they end the wait (their answers
        come after its answer).

        ``told``: requests sent first, in the same write, whose answers nobody reads (an
        advisory REPORT_POSITION): they are dropped as they come, and an ERROR among them
        raises from the next read. A watch still waiting is replaced, its answer dropped
        too: the new one is answered at once if the head has moved beyond ``head``."""
        replaced = self._watching is not None  # its answer is dropped too
        if self._conn.owed != self._dropping + replaced:
            raise RuntimeError("watch_head() with answers still to read")
        self.send_requests(*told, watch_request(stream, head, wait))
        self._dropping += len(told) + replaced

    @property
    def watching(self) -> float | None:
        """Since when (``time.monotonic()``) a ``watch_head`` waits for its answer; None if
        none does."""
        return self._watching

    def watched(self) -> StreamInfo:
        """The answer to the last ``watch_head`` (or WATCH_HEAD in ``send_requests``),
        waiting for it if it has not come; the answers before it must have been read."""
        if self._watching is not None:
            try:
                self._drop_answers()
                self._watched, self._watching = self._receive_info(), None
            except StreamQError:
                self.close()
                raise
        if self._watched is None:
            raise RuntimeError("watched() without watch_head()")
        info, self._watched = self._watched, None
        return info

    def watch_answered(self) -> bool:
        """Whether ``watched`` can return without waiting. The answers it would drop first
        (``watch_head``'s ``told``) are read as far as they have come."""
        try:
            self._drop_answers(waiting=False)
        except StreamQError:
            self.close()
            raise
        return not self._dropping and (self._watching is None or self.answer_ready)

    @property
    def answer_ready(self) -> bool:
        """Whether the next answer (or the connection's end) can be read without waiting."""
        return bool(answers_ready([self], time.monotonic()))

    @property
    def timeout(self) -> float | None:
        """Seconds a request's read or write may wait (the constructor's ``timeout``)."""
        return self._sock.gettimeout()

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._sock.settimeout(seconds)

    def head(self, stream: str) -> StreamInfo:
        """The stream's head (last committed seq) and low (first seq still held)."""
        self._send(GetHead(stream))
        info = self._receive()
        assert isinstance(info, StreamInfo)
        return info

    def streams(self) -> list[StreamInfo]:
        """Every stream of the producer (those the token may read), with heads and lows."""
        self._send(ListStreams())
        result = self._receive()
        assert isinstance(result, StreamList)
        return list(result.streams)

    def status(self) -> dict[str, Any]:
        """Producer id, streams with heads, connected consumers and their positions."""
        self._send(GetStatus())
        report = self._receive()
        assert isinstance(report, StatusReport)
        return report.status

    def report_position(self, stream: str, consumer: str, seq: int) -> StreamInfo:
        """Tell the producer that ``consumer`` has durably read ``stream`` up to ``seq``."""
        self._send(ReportPosition(stream, consumer, seq))
        info = self._receive()
        assert isinstance(info, StreamInfo)
        return info

    def read_range(
        self,
        stream: str,
        start: int,
        end: int,
        *,
        seen_epoch: int | None = None,
        filter: Filter | None = None,
    ) -> RangeRead[tuple[Record, ...]]:
        """Batches of the records with ``start <= seq < end``, as the producer sends them.

        Consume the iterator fully before the next request on this client. ``seen_epoch``:
        the highest epoch that wrote what the caller read up to seq ``start - 1`` (0 if
        unknown); it asks for epochs, see ``RangeRead``. ``filter``: only the records it
        matches, chosen by the producer ("Filters").
        """
        return RangeRead(self, GetRange(stream, start, end, seen_epoch, filter), _records)

    def vouch(self, stream: str, position: int, seen_epoch: int = 0) -> Vouch:
        """Whether the producer still holds ``stream``'s seqs up to ``position`` as a reader
        read them under epochs up to ``seen_epoch`` ("Epochs"): an empty range read at
        ``position + 1``. Raises ``OffsetOutOfRangeError`` if ``position`` is beyond the head
        (its ``details`` then add ``rewritten_from`` when not 0) or below ``low - 1``."""
        self._send(vouch_request(stream, position, seen_epoch))
        return vouch_answer(self._receive())

    def history(
        self, stream: str, key: bytes, from_seq: int = 1, to_seq: int | None = None
    ) -> list[Record]:
        """The records of ``stream`` with this ``key`` and ``from_seq <= seq < to_seq``
        (default: up to the head), in seq order: an index seek on the producer for a
        stream created with ``key_index=True``, a scan there otherwise."""
        self._send(GetHistory(stream, key, from_seq, MAX_SEQ if to_seq is None else to_seq))
        found: list[Record] = []
        while not isinstance(message := self._receive(), RangeEnd):
            assert isinstance(message, Records)
            found += message.records
        return found

    def seek_time(self, stream: str, timestamp: int) -> TimePosition:
        """The first seq whose timestamp is >= ``timestamp`` (ms since the epoch), as
        ``TimePosition.seq``; the head + 1 when no record is that late."""
        self._send(SeekTime(stream, timestamp))
        position = self._receive()
        assert isinstance(position, TimePosition)
        return position

    def read_range_frames(
        self,
        stream: str,
        start: int,
        end: int,
        *,
        seen_epoch: int | None = None,
        filter: Filter | None = None,
        columnar: bool = True,
    ) -> RangeRead[RecordRows | RecordColumns]:
        """Like ``read_range``, frame by frame for columnar readers, no object made per
        record: each frame as ``RecordColumns`` (Arrow's buffers, every record checked)
        where the compiled decoder takes it, else (and always if not ``columnar``) as
        ``RecordRows``, whose field types and order are the caller's to check."""
        request = GetRange(stream, start, end, seen_epoch, filter)
        return RangeRead(self, request, _frames, columnar)


def answers_ready(clients: Sequence[Client], until: float) -> list[Client]:
    """Those of ``clients`` whose next answer (or connection's end) can be read without
    waiting, once all of them can or at ``until`` (``time.monotonic()``), whichever comes
    first: one ``poll`` for many producers (not ``select``, which stops at 1,024 sockets)."""
    ready, waiting, poller = [], {}, select.poll()
    for client in clients:
        sock = client._sock
        if client._conn.buffered or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            ready.append(client)
            continue
        try:
            poller.register(sock, select.POLLIN)
        except (OSError, ValueError):  # closed: reading says so at once
            ready.append(client)
            continue
        waiting[sock.fileno()] = client
    while waiting:
        left = until - time.monotonic()
        for fd, _ in poller.poll(max(0, math.ceil(left * 1000))):
            poller.unregister(fd)
            ready.append(waiting.pop(fd))
        if left <= 0:
            break
    return ready


async def history(
    address: str,
    stream: str,
    key: bytes,
    *,
    from_seq: int = 1,
    to_seq: int | None = None,
    timeout: float | None = 30.0,
    tls: ClientTLS | None = None,
    token: str | None = None,
) -> list[Record]:
    """``Client.history`` for asyncio code: one request on a connection of its own."""

    def fetch() -> list[Record]:
        with Client(address, timeout=timeout, name="history", tls=tls, token=token) as client:
            return client.history(stream, key, from_seq, to_seq)

    return await asyncio.to_thread(fetch)
