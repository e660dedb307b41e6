"""The server embedded in a producer: asyncio I/O around ``protocol.ServerConnection``.

One TCP connection carries either one subscription, pushed until either side
closes, or a sequence of requests (head, range, streams, status). A subscriber
behind the head is pushed by its own task, which awaits the transport's drain after
every frame; at the head, the stream's ``fanout.Fanout`` writes each round's frame to
every subscriber there, and hands back one whose buffer fills: a consumer that stops
reading fills its TCP window and holds at most one frame and the transport's buffer.
Nothing a peer sends can stop the producer or its other connections: every error ends
that one connection with an ERROR frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..errors import (
    ErrorCode,
    IdleTimeoutError,
    MalformedFrameError,
    OffsetOutOfRangeError,
    ProducerMismatchError,
    RemoteProtocolError,
    ServerError,
    TooManyConnectionsError,
    UnknownStreamError,
)
from ..native import build as native_build
from ..protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_OVERHEAD,
    PROTOCOL_VERSION,
    Ack,
    Authenticated,
    ClientHello,
    Error,
    GetHead,
    GetHistory,
    GetRange,
    GetStatus,
    Heartbeat,
    ListStreams,
    RangeEnd,
    ReportPosition,
    SeekTime,
    ServerConnection,
    ServerHello,
    State,
    StatusReport,
    StreamList,
    Subscribe,
    Subscribed,
    TimePosition,
    WatchHead,
)
from ..wire.security import Principal, ServerTLS, TokenAuth, check_admin, check_stream
from ..wire.transport import discard_input, read_message
from .committed_log import NOTHING, Beyond, Log, Packed, Stream
from .consumer_positions import Connected, Positions
from .fanout import Fanout, Subscription, Traffic
from .storage import OpenTransactions

logger = logging.getLogger("streamq.server")

# A connection's StreamReader buffer: asyncio stops reading the socket while it holds more
# than twice this. Reads themselves take up to ``transport.READ_SIZE``.
_BUFFER_LIMIT = 64 * 1024
# Positions keep the consumer names peers report (status, metrics labels); their number is
# capped (positions.MAX_UNREGISTERED), and so is each name's length.
MAX_CONSUMER_NAME = 255
# Record timestamps are stored as signed 64-bit integers; the wire's int goes to 2**64 - 1.
MAX_STORED_TIMESTAMP = 2**63 - 1
_LINGER_SECONDS = 1.0
_LINGER_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ServerSettings:
    """Limits, timings and security of the embedded server; the defaults suit most services.

    ``tls``: serve over TLS 1.3 (with ``ServerTLS(client_ca=...)``, mutual TLS).
    ``auth``: require a token naming the consumer, and check its grants on every request.
    Both off by default: plain TCP, anyone who can connect may read everything.
    """

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_connections: int = 1024
    handshake_timeout: float = 10.0  # from accept to CLIENT_HELLO
    idle_timeout: float = 300.0  # between requests on a request connection
    frame_timeout: float = 30.0  # on a subscription, for the rest of a frame once begun
    heartbeat_interval: float = 5.0  # on a subscription with nothing to send
    # Tell clients the heartbeat interval in SERVER_HELLO; off until every client of the
    # producer understands the field (those before it refuse a 5-field SERVER_HELLO).
    announce_heartbeat: bool = False
    # On a filtered subscription, how long the position may stay behind what was examined
    # when nothing matches: at most one RECORDS frame with only ``through`` per interval.
    progress_interval: float = 0.5
    max_batch_records: int = 8192  # records per RECORDS frame
    max_batch_bytes: int = 1024 * 1024  # bytes per RECORDS frame (at least one record)
    write_buffer_high: int = 1024 * 1024  # transport buffer that makes the pusher wait
    tls: ServerTLS | None = None
    auth: TokenAuth | None = None
    # An unregistered consumer's last position (stored: status and lag survive restarts) is
    # forgotten once it has reported nothing for this long and is not connected: seconds.
    position_expiry: float = 7 * 86_400.0

    def __post_init__(self) -> None:
        if self.max_batch_records < 1 or self.max_connections < 1:
            raise ValueError("max_batch_records and max_connections must be at least 1")
        if not self.position_expiry > 0:
            raise ValueError(
                f"position_expiry must be positive seconds, not {self.position_expiry!r}"
            )
        if self.max_batch_bytes > self.max_frame_size - FRAME_OVERHEAD:
            raise ValueError("max_batch_bytes must leave room for framing within max_frame_size")


# The requests that name a stream: checked against the grants, and that it exists.
_NAMING_A_STREAM = (
    Subscribe,
    GetHead,
    GetRange,
    GetHistory,
    SeekTime,
    ReportPosition,
    WatchHead,
)


class _HeadWatch:
    """A WATCH_HEAD's answer, owed until the head moves beyond the client's, the client
    sends another message, or the heartbeat interval is up: written from a callback
    (``Stream.on_beyond``) while the connection waits for its next request, so a watching
    connection costs no task."""

    def __init__(
        self, conn: ServerConnection, writer: asyncio.StreamWriter, stream: Stream
    ) -> None:
        self._conn, self._writer, self._stream = conn, writer, stream
        self._beyond: Beyond | None = None
        self._answered = False

    def wait(self, head: int, timeout: float) -> None:
        if self._stream.head > head:
            self.answer()
        else:
            self._beyond = self._stream.on_beyond(head, timeout, self.answer)

    def answer(self) -> None:
        if self._answered:
            return
        self._answered = True
        self.cancel()
        if not self._writer.transport.is_closing():  # a client gone: its end is read next
            stream = self._stream
            self._writer.write(self._conn.send(stream.info()))

    def cancel(self) -> None:
        if self._beyond is not None:
            self._beyond.cancel()
            self._beyond = None


def _peer_name(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = f"[{peer[0]}]" if ":" in peer[0] else peer[0]
        return f"{host}:{peer[1]}"
    return str(peer)


def _check_consumer_name(name: str) -> None:
    """ "Limits": at most 255 characters. ``details.length`` tells this refusal apart from a
    frame that does not decode, for which MALFORMED_FRAME's details are empty."""
    if len(name) > MAX_CONSUMER_NAME:
        raise MalformedFrameError(
            f"consumer name of {len(name)} characters: at most {MAX_CONSUMER_NAME} characters",
            {"length": len(name)},
        )


class Server:
    """Accepts consumers and clients for one producer's log."""

    def __init__(
        self,
        log: Log,
        producer_id: str,
        epoch: int,
        settings: ServerSettings,
        positions: Positions | None = None,
    ) -> None:
        self.log = log
        self.producer_id = producer_id
        self.epoch = epoch
        self.settings = settings
        # Durable positions consumers report (ACK, REPORT_POSITION): lag, waits, retention.
        self.positions = positions or Positions()
        self.traffic: dict[str, Traffic] = {}  # stream name -> what was sent from it
        self.subscriptions: set[Subscription] = set()
        self.fanouts: dict[Stream, Fanout] = {}  # the streams someone subscribed to
        self.connections = 0
        self.errors_sent = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = False
        self.address = ""  # host:port, once started
        # Called before answering a request: the producer catches up with commits made
        # by other connections, so a client that saw its commit return finds it here.
        self.refresh: Callable[[], Awaitable[object]] | None = None
        # Where records are numbered after the commit (PostgreSQL): the transactions that
        # published and are still open (``storage.OpenTransactions``), for the status.
        self.open_transactions: Callable[[], OpenTransactions] | None = None
        # Where records are numbered after the commit (PostgreSQL): the publishing path
        # (through the WAL or the pending table) and why, for the status.
        self.publishing: Callable[[], dict[str, Any]] | None = None
        # Where tables are captured (PostgreSQL): what status reports of it.
        self.capture_status: Callable[[], dict[str, Any]] | None = None
        # A stream's retention caps (ms, bytes; None: none), for the status.
        self.retention: Callable[[str], tuple[int | None, int | None]] | None = None
        # Called as a consumer subscribes, with its name, stream and number of shares: the
        # producer forgets its positions under another split (``Producer._resplit``).
        self.resplit: Callable[[str, str, int], Awaitable[None]] | None = None
        # (consumer, stream) -> the number of shares of its latest subscription, while one
        # of its subscriptions is open.
        self._splits: dict[tuple[str, str], int] = {}

    async def start(self, host: str, port: int) -> None:
        tls = self.settings.tls
        # A listen backlog as deep as the connection cap (the kernel caps it at somaxconn):
        # with asyncio's default of 100, a burst of connections overflows the accept queue
        # and every connect beyond it waits for a SYN retransmit (1 s, then 3 s, ...).
        try:
            self._server = await asyncio.start_server(
                self._on_connection,
                host,
                port,
                limit=_BUFFER_LIMIT,
                ssl=None if tls is None else tls.context(),
                # A TLS handshake counts against the same deadline as CLIENT_HELLO.
                ssl_handshake_timeout=None if tls is None else self.settings.handshake_timeout,
                backlog=max(100, self.settings.max_connections),
            )
        except OSError as exc:  # a host that does not resolve, a port taken: say which
            # asyncio's bind errors repeat the address in their text: the errno's is enough.
            why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {why}") from exc
        # uvloop gives a list where asyncio's types say a tuple (which compiled code checks).
        sockets: Sequence[socket.socket] = cast(Any, self._server).sockets
        bound_host, bound_port = sockets[0].getsockname()[:2]
        self.address = (
            f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        )

    async def close(self) -> None:
        """Stop accepting, and close every connection with SHUTTING_DOWN."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        for fanout in self.fanouts.values():
            fanout.close()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        writer.transport.set_write_buffer_limits(high=self.settings.write_buffer_high)
        conn = ServerConnection(self.settings.max_frame_size)
        error: Error | None = None
        try:
            if self.connections > self.settings.max_connections:
                limit = self.settings.max_connections
                raise TooManyConnectionsError(f"producer is at its limit of {limit} connections")
            settings = self.settings
            # "Handshake": the heartbeat interval, announced only when configured to, since
            # clients that predate the field refuse a 5-field SERVER_HELLO.
            interval_ms = None
            if settings.announce_heartbeat:
                interval_ms = math.ceil(settings.heartbeat_interval * 1000)
            hello = ServerHello(
                PROTOCOL_VERSION, self.producer_id, self.epoch, settings.max_frame_size, interval_ms
            )
            writer.write(conn.send(hello))
            await self._serve(conn, reader, writer)
        except RemoteProtocolError as exc:
            error = Error(int(exc.code), str(exc), {})
        except ServerError as exc:
            error = Error(int(exc.code), str(exc), exc.details)
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # Cancelled by close(): end quietly (asyncio logs a cancelled handler task).
            error = Error(int(ErrorCode.SHUTTING_DOWN), "producer is shutting down", {})
        except (ConnectionError, OSError):
            pass  # the peer went away; nothing to tell it
        except RuntimeError:
            # uvloop raises RuntimeError for a write to a transport the peer just closed.
            if not writer.transport.is_closing():
                logger.exception("internal error serving %s", _peer_name(writer))
                error = Error(int(ErrorCode.INTERNAL_ERROR), "internal error; see producer log", {})
        except Exception:
            logger.exception("internal error serving %s", _peer_name(writer))
            error = Error(int(ErrorCode.INTERNAL_ERROR), "internal error; see producer log", {})
        finally:
            self.connections -= 1
            self._handlers.discard(task)
            if error is not None:
                self.errors_sent += 1
                await self._close_with_error(conn, reader, writer, error)
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1)
            except Exception:
                # A peer that reads nothing keeps what is unsent, and with it the transport
                # (and uvloop's ``loop.close()``, which waits for every transport) for ever.
                writer.transport.abort()

    async def _close_with_error(
        self,
        conn: ServerConnection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        error: Error,
    ) -> None:
        """Send ERROR, then read and drop what the peer still sends for a moment.

        Closing a socket with unread input makes the kernel send a reset, which
        can destroy the ERROR frame before the peer reads it ("Errors").
        """
        with contextlib.suppress(Exception):
            writer.write(conn.send(error))
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(_LINGER_SECONDS):
                await writer.drain()
                await discard_input(reader, _LINGER_BYTES)

    async def _next_message(self, conn: ServerConnection, reader: asyncio.StreamReader) -> Any:
        """The next client message, reading as needed; None when the client closed.

        The deadline covers the whole message, so a trickle of bytes cannot
        hold a connection open forever.
        """
        hello_pending = conn.their_state is State.AWAIT_HELLO
        settings = self.settings
        timeout = settings.handshake_timeout if hello_pending else settings.idle_timeout
        try:
            message = await read_message(conn, reader, timeout=timeout)
        except TimeoutError:
            what = "CLIENT_HELLO" if hello_pending else "request"
            raise IdleTimeoutError(f"no complete {what} within {timeout:g} s; closing") from None
        if isinstance(message, Error):
            return None  # the client is closing; "Errors"
        return message

    def _authenticate(self, hello: ClientHello) -> Principal | None:
        """Who the client is (None when this producer does not check tokens)."""
        if self.settings.auth is None:
            return None
        return self.settings.auth.authenticate(hello.token)

    async def _serve(
        self, conn: ServerConnection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # "Authentication": every request is checked against the grants of the consumer
        # the hello's token names; nothing is answered before the token is checked.
        principal: Principal | None = None
        refreshed_at = -1  # conn.received at the last refresh
        watch: _HeadWatch | None = None  # a WATCH_HEAD waiting for its answer
        try:
            while (message := await self._next_message(conn, reader)) is not None:
                if watch is not None:  # another message ends the wait: answered first
                    watch.answer()
                    watch = None
                if isinstance(message, ClientHello):
                    principal = self._authenticate(message)
                    if conn.our_state is State.AUTHENTICATING:
                        name = None if principal is None else principal.name
                        writer.write(conn.send(Authenticated(name)))
                    continue
                if (
                    self.refresh is not None
                    and not isinstance(message, GetStatus)
                    and conn.received != refreshed_at
                ):
                    # Other processes' commits, even those made just now. Once for requests
                    # pipelined together: one whose bytes had all come by the last refresh
                    # was sent before it, so that refresh found every commit its client had
                    # seen.
                    await self.refresh()
                    refreshed_at = conn.received
                if isinstance(message, _NAMING_A_STREAM):
                    check_stream(principal, message.stream)
                    self._check_known(principal, message.stream)
                if isinstance(message, Subscribe):
                    await self._subscription(conn, message, reader, writer, principal)
                    return
                watch = await self._answer(conn, message, writer, principal)
                await writer.drain()
        finally:
            if watch is not None:
                watch.cancel()

    async def _answer(
        self,
        conn: ServerConnection,
        message: Any,
        writer: asyncio.StreamWriter,
        principal: Principal | None,
    ) -> _HeadWatch | None:
        """Answer one request; a WATCH_HEAD's answer may wait (it is returned then)."""
        if isinstance(message, GetHead):
            stream = self.log.stream(message.stream)
            writer.write(conn.send(stream.info()))
        elif isinstance(message, WatchHead):
            watch = _HeadWatch(conn, writer, self.log.stream(message.stream))
            settings = self.settings
            wait = settings.heartbeat_interval
            if message.wait_ms is not None:
                wait = message.wait_ms / 1000
            # "WATCH_HEAD": well within the idle timeout, and at random from half the wait
            # on, so that idle watches sent together (a Spark trigger's) come back spread.
            wait = min(wait, settings.idle_timeout / 2)
            watch.wait(message.head, wait * random.uniform(0.5, 1))
            return watch
        elif isinstance(message, GetRange):
            await self._send_range(conn, message, writer)
        elif isinstance(message, GetHistory):
            await self._send_history(conn, message, writer)
        elif isinstance(message, SeekTime):
            stream = self.log.stream(message.stream)
            # "SEEK_TIME": stored timestamps are signed 64-bit; one beyond them all is
            # later than every record (the database cannot even compare it).
            if message.timestamp > MAX_STORED_TIMESTAMP:
                seq = stream.head + 1
            else:
                seq = await self.log.seek_time(stream, message.timestamp)
            writer.write(conn.send(TimePosition(stream.name, seq, stream.head, stream.low)))
        elif isinstance(message, ListStreams):
            infos = tuple(
                s.info()
                for s in self.log.streams.values()
                if principal is None or principal.may_read(s.name)
            )
            writer.write(conn.send(StreamList(infos)))
        elif isinstance(message, GetStatus):
            check_admin(principal, "the status report")
            writer.write(conn.send(StatusReport(self.status())))
        elif isinstance(message, ReportPosition):
            _check_consumer_name(message.consumer)
            stream = self.log.stream(message.stream)
            reporter = message.consumer if principal is None else principal.name
            # Nothing beyond the head can have been applied: a report claiming more would
            # let retention delete what a registered consumer still needs.
            self.positions.report(reporter, stream.name, min(message.seq, stream.head))
            writer.write(conn.send(stream.info()))
        return None

    def _check_known(self, principal: Principal | None, name: str) -> None:
        """With tokens, the error for an unknown stream names only the streams the consumer
        may read: ``Log.stream``'s names them all, which LIST_STREAMS hides."""
        if principal is not None and name not in self.log.streams:
            granted = sorted(s for s in self.log.streams if principal.may_read(s))
            raise UnknownStreamError(
                f"unknown stream {name!r}; this producer has "
                f"{granted or 'no streams this consumer may read'}",
                {"stream": name},
            )

    def connected(self) -> Connected:
        """The consumers subscribed now, by the name their ACKs move (``reporter``)."""
        subs = list(self.subscriptions)
        return Connected(
            frozenset((s.reporter, s.stream) for s in subs),
            frozenset((s.reporter, s.stream) for s in subs if s.narrowed),
        )

    def status(self) -> dict[str, Any]:
        return {
            "producer_id": self.producer_id,
            "epoch": self.epoch,
            "streams": [
                {
                    "stream": s.name,
                    "head": s.head,
                    "low": s.low,
                    "key_index": s.settings.key_index,
                    "compact": s.settings.compact,
                    "compacted": s.compacted,
                    **self._retention(s.name),
                }
                for s in self.log.streams.values()
            ],
            "consumers": [sub.describe() for sub in self.subscriptions],
            "positions": [
                {**p._asdict(), "updated_at": int(p.updated_at * 1000)}
                for p in self.positions.lags(self.log.streams, self.connected())
            ],
            "sent": {
                name: {"records": t.records, "bytes": t.bytes} for name, t in self.traffic.items()
            },
            "connections": self.connections,
            "errors_sent": self.errors_sent,
            "build": native_build().describe(),
            **self._open_transactions(),
            **({} if self.publishing is None else {"publishing": self.publishing()}),
            **({} if self.capture_status is None else {"capture": self.capture_status()}),
        }

    def _retention(self, stream: str) -> dict[str, int | None]:
        if self.retention is None:
            return {}
        ms, size = self.retention(stream)
        return {"retention_ms": ms, "retention_bytes": size}

    def _open_transactions(self) -> dict[str, Any]:
        if self.open_transactions is None:
            return {}
        found = self.open_transactions()
        return {
            "open_transactions": {
                "count": found.count,
                "oldest_age_ms": int(found.oldest_age(time.time()) * 1000),
            }
        }

    def _check_start(self, stream: Stream, start: int, end: int | None = None) -> None:
        """Reject a start seq, or a range [start, end), outside what the stream holds."""
        details: dict[str, Any] = {
            "stream": stream.name,
            "requested": start,
            "low": stream.low,
            "head": stream.head,
        }
        if end is not None:
            details["end"] = end
        if start < 1:
            raise OffsetOutOfRangeError(f"seqs start at 1, not {start}", details)
        self.log.check_available(stream, start)
        if end is None and start > stream.head + 1:
            raise OffsetOutOfRangeError(
                f"stream {stream.name!r}: cannot start at seq {start}, beyond the head "
                f"({stream.head}); the next record will be seq {stream.head + 1}",
                details,
            )
        if end is not None and not start <= end <= stream.head + 1:
            raise OffsetOutOfRangeError(
                f"stream {stream.name!r}: range [{start}, {end}) is not within [{stream.low}, "
                f"{stream.head + 1}) (the head is {stream.head})",
                details,
            )

    async def _send_range(
        self, conn: ServerConnection, request: GetRange, writer: asyncio.StreamWriter
    ) -> None:
        """The records of [start, end), then RANGE_END. With epochs ("Epochs"): frames never
        span two segments and carry their writer's epoch, and RANGE_END vouches for the seqs
        the client read up to ``start - 1``; if they were rewritten, it comes alone."""
        stream = self.log.stream(request.stream)
        epochs = stream.epochs
        with_epochs = request.seen_epoch is not None
        after_epoch = rewritten = 0
        if with_epochs:
            after_epoch, rewritten = epochs.vouch(
                request.start - 1, stream.head, request.seen_epoch or 0
            )
        try:
            self._check_start(stream, request.start, request.end)
        except OffsetOutOfRangeError as exc:
            if rewritten:
                exc.details["rewritten_from"] = rewritten
            raise
        if rewritten:
            writer.write(conn.send(RangeEnd(after_epoch, rewritten)))
            return
        traffic = self.traffic.setdefault(stream.name, Traffic())
        settings = self.settings
        seq, wanted = request.start, request.filter
        while seq < request.end:
            end = min(request.end, epochs.segment_end(seq)) if with_epochs else request.end
            packed, last = await self.log.read(
                stream, seq, end, settings.max_batch_records, settings.max_batch_bytes
            )
            if wanted is not None:
                packed = Packed.of(wanted.select(packed.records()))
            if packed.count:  # none when compaction removed the rest of the range, or a filter
                epoch = epochs.epoch_of(seq) if with_epochs else None
                frame = conn.send_records(
                    packed.parts, epoch, None if wanted is None else last, packed.count
                )
                writer.write(frame)
                traffic.records += packed.count
                traffic.bytes += len(frame)
                await writer.drain()
            seq = last + 1
        writer.write(conn.send(RangeEnd(after_epoch, 0) if with_epochs else RangeEnd()))

    async def _send_history(
        self, conn: ServerConnection, request: GetHistory, writer: asyncio.StreamWriter
    ) -> None:
        """One key's records held in [start, min(end, head + 1)), then RANGE_END."""
        stream = self.log.stream(request.stream)
        if request.start < 1:
            raise OffsetOutOfRangeError(
                f"seqs start at 1, not {request.start}",
                {"stream": stream.name, "requested": 0, "low": stream.low, "head": stream.head},
            )
        seq, end = request.start, min(request.end, stream.head + 1)
        settings = self.settings
        while seq < end:
            records, seq = await self.log.history(
                stream, request.key, seq, end, settings.max_batch_records, settings.max_batch_bytes
            )
            if records:
                writer.write(conn.send_records(records))
                await writer.drain()
        writer.write(conn.send(RangeEnd()))

    async def _subscription(
        self,
        conn: ServerConnection,
        request: Subscribe,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        principal: Principal | None,
    ) -> None:
        if request.producer_id is not None and request.producer_id != self.producer_id:
            raise ProducerMismatchError(
                f"this is producer {self.producer_id}, not {request.producer_id}",
                {"producer_id": self.producer_id, "expected": request.producer_id},
            )
        _check_consumer_name(request.consumer)
        stream = self.log.stream(request.stream)
        position = request.start_seq - 1
        with_epochs = request.seen_epoch is not None
        # "Epochs": the epoch that wrote the client's position here, and where this log
        # stops holding what the client read.
        after_epoch, rewritten = stream.epochs.vouch(position, stream.head, request.seen_epoch or 0)
        try:
            self._check_start(stream, request.start_seq)
        except OffsetOutOfRangeError as exc:
            if rewritten:
                exc.details["rewritten_from"] = rewritten
            raise
        if with_epochs:
            subscribed = Subscribed(stream.name, stream.head, stream.low, after_epoch, rewritten)
        else:
            subscribed = Subscribed(stream.name, stream.head, stream.low)
        writer.write(conn.send(subscribed))
        sub = Subscription(
            request.consumer,
            stream.name,
            _peer_name(writer),
            position,
            position,
            writer.transport,
            principal=None if principal is None else principal.name,
            filter=request.filter,
            epochs=with_epochs,
        )
        await self._forget_other_splits(sub)
        self.subscriptions.add(sub)
        push = asyncio.create_task(self._push(conn, stream, sub, writer))
        acks = asyncio.create_task(self._read_acks(conn, reader, sub))
        try:
            done, _ = await asyncio.wait({push, acks}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.subscriptions.discard(sub)
            for task in (push, acks):
                task.cancel()
            await asyncio.gather(push, acks, return_exceptions=True)
            if not self._closing:
                await self._forget_other_splits(sub, leaving=True)
        for task in done:
            task.result()  # re-raise what ended the subscription

    async def _forget_other_splits(self, sub: Subscription, leaving: bool = False) -> None:
        """Have the producer forget the positions of ``sub``'s consumer under another split
        into shares than its latest subscription's: ``sub``'s, as it subscribes; as it
        leaves, if a later one came with another split (a worker of the old split that
        acknowledged after the new split subscribed: its position goes with it)."""
        split = sub.split
        if self.resplit is None or split is None:
            return
        consumer, shares = split
        key = (consumer, sub.stream)
        if leaving:
            latest = self._splits.get(key, shares)
            if not any(
                s.stream == sub.stream and s.reports_for(consumer) for s in self.subscriptions
            ):
                self._splits.pop(key, None)  # kept only while one of its subscriptions is
            if latest == shares:
                return
            shares = latest
        else:
            self._splits[key] = shares
        try:
            await self.resplit(consumer, sub.stream, shares)
        except Exception:  # status may show stale shares; serving goes on
            logger.exception("could not forget %r's positions under another split", consumer)

    async def _read_acks(
        self, conn: ServerConnection, reader: asyncio.StreamReader, sub: Subscription
    ) -> None:
        """Read the consumer's ACKs until it closes; anything else is a protocol error.

        A subscription may be quiet for ever, but a frame once begun must be complete
        within ``frame_timeout``: a trickle of bytes cannot hold a buffer for ever.
        """
        frame_timeout = self.settings.frame_timeout
        while True:
            try:
                message = await read_message(conn, reader, frame_timeout=frame_timeout)
            except TimeoutError:
                raise IdleTimeoutError(
                    f"incomplete frame for {frame_timeout:g} s; closing"
                ) from None
            if message is None or isinstance(message, Error):
                return
            if isinstance(message, Ack):
                seq = min(message.seq, sub.sent)  # it cannot have applied what it was not sent
                sub.acked = max(sub.acked, seq)
                self.positions.report(sub.reporter, sub.stream, seq)

    def _fanout(self, stream: Stream) -> Fanout:
        fanout = self.fanouts.get(stream)
        if fanout is None:
            settings = self.settings
            fanout = self.fanouts[stream] = Fanout(
                self.log,
                stream,
                self.traffic.setdefault(stream.name, Traffic()),
                max_records=settings.max_batch_records,
                max_bytes=settings.max_batch_bytes,
                high_water=settings.write_buffer_high,
            )
        return fanout

    async def _push(
        self,
        conn: ServerConnection,
        stream: Stream,
        sub: Subscription,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Catch up from the database or memory up to the stream's fan-out position, then
        let the fan-out serve it (``fanout.Fanout``) until its buffer fills; meanwhile,
        its heartbeats, and with a filter its progress.

        With epochs, a frame never spans two epochs' segments: it carries its writer's epoch.
        With a filter ("Filters"), frames carry only the matching records and ``through``,
        the last seq examined; when nothing matches, a frame with ``through`` alone goes at
        most once per ``progress_interval``, so the consumer's position still moves.
        """
        settings = self.settings
        traffic = self.traffic.setdefault(stream.name, Traffic())
        fanout = self._fanout(stream)
        epochs = stream.epochs
        wanted = sub.filter
        loop = asyncio.get_running_loop()
        sub.sent_at = loop.time()

        def frame(packed: Packed, through: int) -> bytes:
            # A read never spans two segments, so ``through``'s epoch is every record's.
            epoch = epochs.epoch_of(through) if sub.epochs else None
            frame = conn.send_records(
                packed.parts, epoch, None if wanted is None else through, packed.count
            )
            traffic.records += packed.count
            traffic.bytes += len(frame)
            sub.sent, sub.sent_at = through, loop.time()
            return frame

        try:
            while True:
                seq = sub.examined + 1
                if seq > fanout.position:  # caught up: served by the fan-out from here
                    progress = wanted is not None and sub.examined > sub.sent
                    due = sub.sent_at + settings.heartbeat_interval
                    if progress:
                        due = min(due, sub.sent_at + settings.progress_interval)
                    if await fanout.follow(sub, max(0.0, due - loop.time())):
                        await writer.drain()  # handed back: a full buffer
                    elif loop.time() >= due:
                        if progress:
                            writer.write(frame(NOTHING, sub.examined))
                        else:
                            writer.write(conn.send(Heartbeat(stream.head)))
                            sub.sent_at = loop.time()
                    continue
                end = min(seq + settings.max_batch_records, fanout.position + 1)
                if sub.epochs:
                    end = min(end, epochs.segment_end(seq))
                packed, last = await self.log.read(
                    stream, seq, end, settings.max_batch_records, settings.max_batch_bytes
                )
                sub.examined = last  # past a compacted stream's gap too: nothing lost
                if wanted is not None:
                    selected = Packed.of(wanted.select(packed.records()))
                    if selected.count or loop.time() >= sub.sent_at + settings.progress_interval:
                        writer.write(frame(selected, last))
                        await writer.drain()
                elif packed.count:
                    writer.write(frame(packed, last))
                    await writer.drain()
        finally:
            fanout.leave(sub)
