"""A consumer's subscription: the connection to one producer's stream, kept up.

``Subscription`` connects (the handshake, ``transport.client_handshake``), subscribes from
where the consumer stands and checks that the producer still holds what it read
("Epochs"), decodes the pushed frames as each read arrives (``PushReader``) into a
bounded inbox of batches (when it is full, reading stops, the socket's buffers fill, and
TCP makes the producer wait), and reconnects after transient failures, with backoff. It
also acknowledges the consumer's durable position to the producer (``ACK``), at most
once per ``ack_interval``.

Where to start with a producer it has not read yet is the consumer's to say
(``resume``): its stored position, or the configured start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from ..errors import (
    ConnectionLostError,
    ConsumerPositionError,
    IdleTimeoutError,
    OffsetOutOfRangeError,
    ProducerChangedError,
    SeqsReusedError,
    ServerError,
    ShuttingDownError,
    StreamQError,
    TooManyConnectionsError,
    error_from_frame,
)
from ..protocol import (
    Ack,
    ClientConnection,
    Error,
    Heartbeat,
    Message,
    Record,
    Records,
    SeekTime,
    ServerHello,
    Subscribe,
    Subscribed,
    TimePosition,
    lost_seqs,
)
from ..wire.transport import (
    PushReader,
    client_handshake,
    closed_by_producer,
    handshake,
    open_connection,
    producer_errors,
    read_message,
    silent_peer,
)
from .resharing import Floors
from .settings import ConsumerSettings

logger = logging.getLogger("streamq.consumer")

# Without heartbeat_timeout=: the connection counts as lost after this many of the
# producer's announced heartbeat intervals of silence, and never sooner than the floor
# (timers slip on a busy machine); 30 s from a producer that announces none.
HEARTBEAT_MISSES = 6
MIN_HEARTBEAT_TIMEOUT = 2.0
DEFAULT_HEARTBEAT_TIMEOUT = 30.0

# Failures a reconnect may cure; anything else stops the consumer with its error.
TRANSIENT = (
    ConnectionLostError,
    ShuttingDownError,
    TooManyConnectionsError,
    IdleTimeoutError,
    OSError,
    TimeoutError,
)

# Reconnect backoff: the first retry after FIRST_DELAY, doubling up to MAX_DELAY. A
# connection that lived STABLE_CONNECTION seconds resets it (the next reconnect is at once).
FIRST_DELAY = 0.05
MAX_DELAY = 2.0
STABLE_CONNECTION = 1.0


def heartbeat_timeout(given: float | None, interval_ms: int | None) -> float:
    """The silence after which a subscription is treated as lost ("Handshake",
    ``heartbeat_interval_ms``): the caller's own value if given, else a few of the
    producer's intervals, so a producer with slow heartbeats is not taken for dead."""
    if given is not None:
        return given
    if interval_ms is None:
        return DEFAULT_HEARTBEAT_TIMEOUT
    return max(HEARTBEAT_MISSES * interval_ms / 1000, MIN_HEARTBEAT_TIMEOUT)


class Resume(NamedTuple):
    """Where a subscription starts with a producer it has not read yet: after seq
    ``after``, a position the consumer ``stored`` (its ``epoch`` the highest that wrote up
    to it), or the configured start's (checked by no one: errors there are the caller's)."""

    after: int
    stored: bool = False
    epoch: int = 0


# The consumer's answer, given the producer's id and a way to find the first seq at a
# time on this connection (``start_time``).
Resumer = Callable[[str, Callable[[int], Awaitable[int]]], Awaitable[Resume]]


class Received(NamedTuple):
    """Records received, and what they move the consumer's position to: the consumer
    makes them its ``Batch`` (a tuple here: one frame, one light object)."""

    producer_id: str
    after: int  # the position before them
    records: tuple[Record, ...]
    epoch: int  # the highest epoch that wrote up to them (0: unknown)
    last_seq: int  # the position after them (with a filter: the producer's ``through``)


_Item = Received | BaseException


class Subscription:
    """The consumer ``name``'s subscription to ``stream`` at ``address``: ``open``, then
    ``next`` for batches, ``acknowledge`` the position ``durable()`` (0: none) as it
    moves, ``close``."""

    def __init__(
        self,
        address: str,
        stream: str,
        name: str,
        settings: ConsumerSettings,
        resume: Resumer,
        durable: Callable[[], int],
    ) -> None:
        self.address, self.stream, self.name = address, stream, name
        self._settings = settings
        self._filter = settings.subscribed
        self._resume = resume
        self._durable = durable  # the position to acknowledge (0: none)
        self._ssl = None if settings.tls is None else settings.tls.context()
        # Batches received and not yet taken, and what ended the subscription; past
        # ``queue_batches`` the connection stops reading until ``next`` takes some.
        self._inbox: deque[_Item] = deque()
        self._inbox_waiter: asyncio.Future[None] | None = None  # ``next`` waiting for one
        self._reader: PushReader | None = None  # while streaming: paused when the inbox is full
        self._paused = False
        # Until a producer announces its interval (and for one that does not): 30 s.
        self.heartbeat_timeout = heartbeat_timeout(settings.heartbeat_timeout, None)
        self.producer_id: str | None = None
        self.epoch = 0
        self.head = 0  # the producer's head as last reported
        self.received = 0  # last seq read from the socket
        # The highest producer epoch that wrote any record up to ``received`` (0: unknown):
        # a producer that later holds a higher one there lost and re-used seqs ("Epochs").
        self.seen_epoch = 0
        self.reconnects = 0
        # Records applied under a group's earlier splits, by producer id (``resharing``).
        self.floors: dict[str, Floors] = {}
        self._skip: Floors | None = None  # this producer's, skipped as they arrive
        self._skip_through = 0  # no record after this seq is skipped
        self._task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn: ClientConnection | None = None
        self._pending_error: BaseException | None = None
        # A failure of the consumer's own background work, for the next ``next`` to raise
        # when batches were waiting already.
        self._failed: BaseException | None = None
        self._acked_at = -math.inf  # the event loop's time of the last ACK sent
        self._ack_timer: asyncio.TimerHandle | None = None  # an ACK due at the interval's end
        self._loop: asyncio.AbstractEventLoop | None = None  # once an ACK was sent

    # --- lifecycle -----------------------------------------------------------

    async def open(self) -> None:
        """Connect and subscribe; raises if the producer refuses. With a reconnect deadline,
        a producer that is down (restarting) is waited for, as it would be after a lost
        connection; without one, fail at once."""
        settings = self._settings
        waits = settings.reconnect and settings.reconnect_timeout is not None
        reader, conn = await (self._connect_retrying() if waits else self._connect())
        self._task = asyncio.create_task(self._run(reader, conn))

    async def close(self) -> None:
        """Stop receiving, send the last position due, and close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._ack_timer is not None:  # the last position, before the connection goes
            self._ack_now()
        self._drop_connection()

    # --- receiving -----------------------------------------------------------

    async def next(self, max_records: int) -> Received:
        """The next batch received, merged with those already queued behind it (up to
        ``max_records`` records): fewer, larger transactions. Raises what stopped the
        subscription, or what ``fail`` reported."""
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        if self._failed is not None:
            error, self._failed = self._failed, None
            raise error
        inbox = self._inbox
        if not inbox:
            waiter = self._inbox_waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._inbox_waiter = None
        item = inbox.popleft()
        if isinstance(item, BaseException):
            raise item
        if inbox and len(item.records) < max_records:
            item = self._merged(item, max_records)
        if self._paused and len(inbox) < self._settings.queue_batches:
            self._paused = False
            if self._reader is not None:
                self._reader.resume()
        return item

    def _merged(self, first: Received, max_records: int) -> Received:
        """``first`` and the batches queued behind it, up to ``max_records`` records, as
        one; an error queued among them stops there, raised by the next call."""
        inbox = self._inbox
        parts, count, last = [first.records], len(first.records), first
        while count < max_records and inbox:
            more = inbox.popleft()
            if isinstance(more, BaseException):
                self._pending_error = more
                break
            parts.append(more.records)
            count += len(more.records)
            last = more
        # One tuple made once: adding each batch to the last would copy it again each time.
        records = tuple(itertools.chain.from_iterable(parts))
        return Received(first.producer_id, first.after, records, last.epoch, last.last_seq)

    def _put(self, item: _Item) -> None:
        """``item`` into the inbox; reading pauses once it holds ``queue_batches``."""
        self._inbox.append(item)
        waiter = self._inbox_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if len(self._inbox) >= self._settings.queue_batches and not self._paused:
            self._paused = True
            if self._reader is not None:
                self._reader.pause()

    def fail(self, error: BaseException) -> None:
        """Raise ``error`` from the next batch asked for: the failure of work the consumer
        did by itself, which no call of the application's saw. On a quiet stream, a wait
        for the next batch is woken with it."""
        if not self._inbox:
            self._put(error)
        elif self._failed is None:
            self._failed = error

    async def _run(self, reader: PushReader, conn: ClientConnection) -> None:
        """Read batches into the queue; reconnect after transient failures.

        A connection lost soon after it was made (a link that resets every connection,
        say) is not retried at once: the wait before reconnecting doubles each time, as
        for failed connects, so a flapping link is not hammered with reconnects.
        """
        connected_at, flap_delay = time.monotonic(), 0.0
        while True:
            try:
                await self._pump(reader, conn)
            except TRANSIENT as exc:
                self._drop_connection()
                if not self._settings.reconnect:
                    self._put(_lost(exc, self.address))
                    return
                logger.warning("connection to %s lost (%s); reconnecting", self.address, exc)
                if time.monotonic() - connected_at >= STABLE_CONNECTION:
                    flap_delay = 0.0
                else:
                    flap_delay = min(max(flap_delay * 2, FIRST_DELAY), MAX_DELAY)
                try:
                    reader, conn = await self._connect_retrying(flap_delay)
                except BaseException as error:
                    self._put(error)
                    return
                connected_at = time.monotonic()
                self.reconnects += 1
            except StreamQError as exc:
                self._drop_connection()
                self._put(exc)
                return

    async def _pump(self, reader: PushReader, conn: ClientConnection) -> None:
        """Receive the subscription's frames into the inbox until the connection fails:
        each read is decoded where it arrives (``PushReader``), and the silence of a
        producer that stops sending (heartbeats included) is found by one timer, moved on
        at most once per ``heartbeat_timeout`` rather than set for every read."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[BaseException] = loop.create_future()
        heard = loop.time()  # the last read, or the last resume: the silence starts there
        timer: asyncio.TimerHandle | None = None

        def end(error: BaseException) -> None:
            reader.stop_pushing()
            if not ended.done():
                ended.set_result(error)

        def receive(data: bytes) -> None:
            nonlocal heard
            heard = loop.time()
            try:
                conn.receive_data(data)
                while (message := conn.next_event()) is not None:
                    self._received(message)
            except Exception as exc:  # a malformed frame, the producer's ERROR
                end(exc)

        def closed(exc: BaseException | None) -> None:
            if exc is None:
                exc = ConnectionLostError(f"producer at {self.address} closed the connection")
            end(exc)

        def check_silence() -> None:
            nonlocal heard, timer
            now = loop.time()
            if self._paused:
                heard = now  # not read while the inbox is full: no silence of the producer's
            if now - heard >= self.heartbeat_timeout:
                end(
                    ConnectionLostError(
                        f"nothing from producer at {self.address} for {self.heartbeat_timeout:g} s"
                    )
                )
            else:
                timer = loop.call_at(heard + self.heartbeat_timeout, check_silence)

        self._reader = reader
        if self._paused:  # the inbox filled on an earlier connection, and is full still
            reader.pause()
        timer = loop.call_at(heard + self.heartbeat_timeout, check_silence)
        try:
            receive(reader.push_to(receive, closed))  # what came with the handshake first
            raise await ended
        finally:
            if timer is not None:
                timer.cancel()
            reader.stop_pushing()
            self._reader = None

    def _received(self, message: Message) -> None:
        """One message from the producer, while streaming."""
        if isinstance(message, Records):
            if message.records or message.through is not None:
                assert self.producer_id is not None
                if message.epoch is not None and message.epoch > self.seen_epoch:
                    self.seen_epoch = message.epoch
                records, through = message.records, message.through or 0
                skip = self._skip
                if skip is not None and records and records[0].seq <= self._skip_through:
                    through = through or records[-1].seq
                    records = tuple(r for r in records if not skip.applied(r.key, r.seq))
                last = through or records[-1].seq
                self._put(Received(self.producer_id, self.received, records, self.seen_epoch, last))
                self.received = last
                if last > self.head:
                    self.head = last
        elif isinstance(message, Heartbeat):
            self.head = message.head
        elif isinstance(message, Error):
            raise _server_error(message)

    # --- connecting ----------------------------------------------------------

    async def _connect_retrying(self, delay: float = 0.0) -> tuple[PushReader, ClientConnection]:
        """Connect, retrying transient failures with backoff until ``reconnect_timeout``.

        ``delay``: wait this long before the first attempt (0: try at once).
        """
        timeout = self._settings.reconnect_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        error: BaseException | None = None
        while True:
            if delay:
                if deadline is not None and time.monotonic() + delay > deadline:
                    last = "" if error is None else f": {error}"
                    raise ConnectionLostError(
                        f"no connection to {self.address} within {timeout:g} s{last}"
                    ) from error
                await asyncio.sleep(delay)
            try:
                return await self._connect()
            except TRANSIENT as exc:
                error = exc
                delay = min(max(delay * 2, FIRST_DELAY), MAX_DELAY)

    async def _connect(self) -> tuple[PushReader, ClientConnection]:
        """Connect: the handshake, then the subscription and its position check."""
        settings = self._settings
        reader, writer = await open_connection(
            self.address, settings.tls, self._ssl, settings.connect_timeout
        )
        conn = ClientConnection(settings.max_frame_size)

        async def receive() -> Message:
            return await self._read_message(conn, reader)

        def send(message: Message) -> None:
            if writer.is_closing():  # the producer went (uvloop's write would raise)
                raise ConnectionResetError("the connection closed")
            writer.write(conn.send(message))

        hello: ServerHello | None = None
        try:
            with producer_errors(self.address, "handshake with"):
                try:
                    async with asyncio.timeout(settings.connect_timeout) as limit:
                        steps = client_handshake(
                            self.address, f"consumer {self.name}", settings.token, settings.tls
                        )
                        hello, _ = await handshake(steps, send, receive)
                        self.heartbeat_timeout = heartbeat_timeout(
                            settings.heartbeat_timeout, hello.heartbeat_interval_ms
                        )
                        start, subscribed = await self._subscribe(send, receive, hello, limit)
                except TimeoutError:
                    if hello is None:
                        raise silent_peer(self.address, settings.connect_timeout) from None
                    raise
        except BaseException:
            writer.close()
            raise
        self.producer_id, self.epoch, self.head = hello.producer_id, hello.epoch, subscribed.head
        self._skip = self.floors.get(hello.producer_id)
        self._skip_through = 0 if self._skip is None else self._skip.highest  # once, not a frame
        if start - 1 != self.received:
            self.seen_epoch = 0
        self.seen_epoch = max(self.seen_epoch, subscribed.after_epoch or 0)
        self.received = start - 1
        self._writer, self._conn = writer, conn
        if self._durable() > 0:
            self._ack_now()  # the producer learns where this consumer stands at once
        return reader, conn

    async def _read_message(self, conn: ClientConnection, reader: asyncio.StreamReader) -> Message:
        message = await read_message(conn, reader)
        if message is None:
            raise closed_by_producer(self.address, conn)
        if isinstance(message, Error):
            raise _server_error(message)
        return message

    async def _subscribe(
        self,
        send: Callable[[Message], None],
        receive: Callable[[], Awaitable[Message]],
        hello: ServerHello,
        limit: asyncio.Timeout,
    ) -> tuple[int, Subscribed]:
        """SUBSCRIBE from this consumer's position, and check that the producer still
        holds what it applied ("Epochs"); the first seq asked for, and SUBSCRIBED.
        ``limit``, the connect timeout, does not run while the consumer reads its
        database: that waits by its own bound (``db_reconnect_timeout``)."""
        connect_timeout = self._settings.connect_timeout

        async def seek(timestamp: int) -> int:
            async with asyncio.timeout(connect_timeout):
                send(SeekTime(self.stream, timestamp))
                position = await receive()
            assert isinstance(position, TimePosition)
            return position.seq

        if self.producer_id is not None:
            if hello.producer_id != self.producer_id:
                raise ProducerChangedError(
                    f"producer at {self.address} is now {hello.producer_id}, "
                    f"but this consumer was reading from {self.producer_id}"
                )
            start = self.received + 1
        else:
            limit.reschedule(None)
            resume = await self._resume(hello.producer_id, seek)
            limit.reschedule(asyncio.get_running_loop().time() + connect_timeout)
            if resume.stored:
                self.received, self.seen_epoch = resume.after, resume.epoch
            start = resume.after + 1
        seen = self.seen_epoch if start - 1 == self.received else 0
        send(Subscribe(self.stream, start, self.name, hello.producer_id, seen, self._filter))
        # The position to check: one this consumer had (stored or received), not a
        # configured start_seq, whose errors are the caller's.
        position = start - 1 if start - 1 == self.received and self.received else 0
        try:
            subscribed = await receive()
        except OffsetOutOfRangeError as exc:
            details = exc.details
            head = details.get("head", start)
            lost = lost_seqs(position, head, details.get("rewritten_from", 0))
            if lost is not None:
                raise self._lost(lost, head) from exc
            raise
        assert isinstance(subscribed, Subscribed)
        rewritten = subscribed.rewritten_from if seen else 0
        lost = lost_seqs(max(position, start - 1), subscribed.head, rewritten or 0)
        if lost is not None:
            raise self._lost(lost, subscribed.head)
        return start, subscribed

    def _lost(self, lost: range, head: int) -> ConsumerPositionError:
        """The error for a producer whose log no longer holds the seqs ``lost`` that this
        consumer has: ``SeqsReusedError`` if it holds other records under some of them."""
        first, applied = lost[0], lost[-1]
        if first <= head:
            return SeqsReusedError(
                f"producer at {self.address} lost commits of stream {self.stream!r} and re-used "
                f"their seqs: consumer {self.name!r} already applied up to seq {applied}, but "
                f"the producer's log no longer holds seqs {first}..{applied} as it read them "
                f"(head {head}; other records now stand under seqs {first}..{min(head, applied)})."
                " A power loss rolled back commits that were not synced (durability='normal')."
                " Refusing to skip or re-apply records; reset this consumer's position to go on.",
                lost,
            )
        return ConsumerPositionError(
            f"producer at {self.address} has head {head} for stream {self.stream!r}, "
            f"but consumer {self.name!r} already applied up to seq {applied}: seqs "
            f"{first}..{applied} are no longer in the producer's log. The producer's database "
            "was restored from an older copy or lost commits. Refusing to skip or re-apply "
            "records; reset this consumer's position to go on.",
            lost,
        )

    def _drop_connection(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = self._conn = None

    # --- acknowledging -------------------------------------------------------

    def acknowledge(self) -> None:
        """Tell the producer the consumer's durable position (informational: status, lag):
        now, or once ``ack_interval`` has passed since the last ``ACK``."""
        if self._ack_timer is not None:
            return  # it sends the newest position
        loop = self._running_loop()
        due = self._acked_at + self._settings.ack_interval
        if loop.time() >= due:
            self._ack_now()
        else:
            self._ack_timer = loop.call_at(due, self._ack_now)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The consumer's event loop, asked once (each ask is a system call on 3.11)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _ack_now(self) -> None:
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        self._acked_at = self._running_loop().time()
        if self._writer is not None and self._conn is not None:
            with contextlib.suppress(Exception):
                self._writer.write(self._conn.send(Ack(self._durable())))


def _server_error(message: Error) -> ServerError:
    return error_from_frame(message.code, message.message, message.details)


def _lost(exc: BaseException, address: str) -> ConnectionLostError:
    if isinstance(exc, ConnectionLostError):
        return exc
    lost = ConnectionLostError(f"connection to producer at {address} failed: {exc!r}")
    lost.__cause__ = exc
    return lost
