"""The consumer: records pushed by a producer, applied exactly once into its own database.

A background task reads the socket into a bounded queue of batches; when the
queue is full it stops reading, the socket's buffers fill, and TCP makes the
producer wait. ``Consumer.transaction(batch)`` applies a batch in one SQLite
transaction that also stores the consumer's position (producer id, stream)
-> last seq, so after any crash the consumer resumes right after the last
committed batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, overload

import aiosqlite

from .errors import (
    ConnectionLostError,
    ConsumerPositionError,
    IdleTimeoutError,
    OffsetOutOfRangeError,
    OutOfOrderBatchError,
    ProducerChangedError,
    SeqsReusedError,
    ServerError,
    ShuttingDownError,
    StreamQError,
    TooManyConnectionsError,
    TransactionClosedError,
    error_from_frame,
)
from .protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    Ack,
    ClientConnection,
    ClientHello,
    Error,
    Heartbeat,
    Message,
    Record,
    Records,
    ServerHello,
    Subscribe,
    Subscribed,
)
from .store import Durability

logger = logging.getLogger("streamq.consumer")

_READ_SIZE = 256 * 1024

_POSITIONS_SCHEMA = """
CREATE TABLE IF NOT EXISTS streamq_positions (
    consumer TEXT NOT NULL,
    producer_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    seq INTEGER NOT NULL,         -- last applied seq
    epoch INTEGER,                -- highest producer epoch that wrote up to seq (0: unknown)
    endpoint TEXT NOT NULL,       -- where that producer was last reached
    updated_at INTEGER NOT NULL,  -- milliseconds since the Unix epoch
    PRIMARY KEY (consumer, producer_id, stream)
)"""


def lost_seqs(position: int, head: int, rewritten_from: int) -> range | None:
    """The seqs up to ``position`` that the producer's log no longer holds ("Epochs"): those
    beyond its ``head``, and those from ``rewritten_from`` (if not 0) on; None if none."""
    first = rewritten_from or head + 1
    return range(first, position + 1) if 0 < first <= position else None


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, not {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass(frozen=True, slots=True)
class Batch(Sequence[Record]):
    """Records pushed by a producer, in seq order, to be applied together.

    ``after`` is the seq this batch follows: the consumer's position before it.
    ``epoch`` is the highest producer epoch that wrote any record up to its last (0 if
    unknown), stored with the position so a producer that lost and reused seqs is caught
    ("Epochs").
    """

    stream: str
    producer_id: str
    after: int
    records: tuple[Record, ...]
    epoch: int = 0

    @property
    def first_seq(self) -> int:
        return self.records[0].seq

    @property
    def last_seq(self) -> int:
        return self.records[-1].seq

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    @overload
    def __getitem__(self, index: int) -> Record: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Record]: ...
    def __getitem__(self, index: int | slice) -> Record | Sequence[Record]:
        return self.records[index]


class ConsumerTransaction:
    """One transaction on the consumer's database, committed with the batch's position."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransactionClosedError("this transaction has already committed or rolled back")

    async def execute(self, sql: str, parameters: Any = ()) -> aiosqlite.Cursor:
        self._check_open()
        return await self._conn.execute(sql, parameters)

    async def executemany(self, sql: str, parameters: Any) -> aiosqlite.Cursor:
        self._check_open()
        return await self._conn.executemany(sql, parameters)


_Item = Batch | BaseException

# Failures a reconnect may cure; anything else stops the consumer with its error.
_TRANSIENT = (
    ConnectionLostError,
    ShuttingDownError,
    TooManyConnectionsError,
    IdleTimeoutError,
    OSError,
    TimeoutError,
)


class Consumer:
    """Subscribes to one stream of one producer and yields batches as they are pushed.

    With ``db`` and ``name``, positions persist in that SQLite database and
    ``transaction(batch)`` applies batches exactly once. Without ``db``, the
    consumer starts at ``start_seq`` and keeps its position in memory only
    (for tools such as ``streamq tail``).

    ``durability="normal"`` (SQLite ``synchronous=NORMAL``) is safe for exactly-once here:
    a power loss can only roll back the consumer's last commits, effects and position
    together, and those records are fetched from the producer again. ``"full"`` makes
    every applied batch survive power loss as soon as it commits.
    """

    def __init__(
        self,
        address: str,
        stream: str,
        *,
        db: str | None = None,
        name: str | None = None,
        start_seq: int = 1,
        queue_batches: int = 16,
        max_batch_records: int = 65536,
        reconnect: bool = True,
        reconnect_timeout: float | None = None,
        connect_timeout: float = 10.0,
        heartbeat_timeout: float = 30.0,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        durability: Durability = "normal",
    ) -> None:
        if durability not in ("normal", "full"):
            raise ValueError(f"durability must be 'normal' or 'full', not {durability!r}")
        if db is not None and not name:
            raise ValueError("a consumer with a database needs a name= to store its position under")
        self.address = address
        self.stream = stream
        self.name = name or "anonymous"
        self._host, self._port = parse_address(address)
        self._db_path = db
        self._db: aiosqlite.Connection | None = None
        self._start_seq = start_seq
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=queue_batches)
        self._max_batch_records = max_batch_records
        self._reconnect = reconnect
        self._reconnect_timeout = reconnect_timeout
        self._connect_timeout = connect_timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._max_frame_size = max_frame_size
        self._durability = durability
        self._tx_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn: ClientConnection | None = None
        self._pending_error: BaseException | None = None
        self._closed = False
        self.producer_id: str | None = None
        self.epoch = 0
        self.head = 0  # the producer's head as last reported
        self.received = 0  # last seq read from the socket
        # The highest producer epoch that wrote any record up to ``received`` (0: unknown):
        # a producer that later holds a higher one there lost and re-used seqs ("Epochs").
        self.seen_epoch = 0
        self.applied = 0  # last seq committed (or delivered, without a database)
        self.reconnects = 0

    # --- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Open the database, connect and subscribe; raises if the producer refuses."""
        try:
            if self._db_path is not None:
                self._db = await aiosqlite.connect(self._db_path, isolation_level=None)
                await self._db.execute("PRAGMA journal_mode=WAL")
                await self._db.execute(f"PRAGMA synchronous={self._durability.upper()}")
                await self._db.execute("PRAGMA busy_timeout=10000")
                await self._db.execute(_POSITIONS_SCHEMA)
                columns = await self._db.execute_fetchall("PRAGMA table_info(streamq_positions)")
                if "epoch" not in {column[1] for column in columns}:  # made by an older streamq
                    await self._db.execute("ALTER TABLE streamq_positions ADD COLUMN epoch INTEGER")
            # With a reconnect deadline, a producer that is down (restarting) is waited
            # for, as it would be after a lost connection; without one, fail at once.
            waits = self._reconnect and self._reconnect_timeout is not None
            reader, conn = await (self._connect_retrying() if waits else self._connect())
        except BaseException:
            await self.close()
            raise
        self._task = asyncio.create_task(self._run(reader, conn))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._drop_connection()
        if self._db is not None:
            await self._db.close()

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # --- receiving -----------------------------------------------------------

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Batch:
        if self._closed:
            raise StopAsyncIteration
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        # Merge what else is already queued: fewer, larger transactions.
        records, epoch = item.records, item.epoch
        while len(records) < self._max_batch_records and not self._queue.empty():
            more = self._queue.get_nowait()
            if isinstance(more, BaseException):
                self._pending_error = more
                break
            records += more.records
            epoch = more.epoch
        batch = Batch(item.stream, item.producer_id, item.after, records, epoch)
        if self._db is None:
            self.applied = batch.last_seq
        return batch

    async def _read_message(self, conn: ClientConnection, reader: asyncio.StreamReader) -> Message:
        while (message := conn.next_event()) is None:
            data = await reader.read(_READ_SIZE)
            if not data:
                raise ConnectionLostError(f"producer at {self.address} closed the connection")
            conn.receive_data(data)
        if isinstance(message, Error):
            raise _server_error(message)
        return message

    async def _connect(self) -> tuple[asyncio.StreamReader, ClientConnection]:
        """Connect, check the producer's identity and position, and subscribe."""
        try:
            async with asyncio.timeout(self._connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, limit=_READ_SIZE
                )
        except (OSError, TimeoutError) as exc:
            raise ConnectionLostError(
                f"cannot connect to producer at {self.address}: {exc}"
            ) from exc
        conn = ClientConnection(self._max_frame_size)
        try:
            async with asyncio.timeout(self._connect_timeout):
                writer.write(conn.send(ClientHello(PROTOCOL_VERSION, f"consumer {self.name}")))
                hello = await self._read_message(conn, reader)
                assert isinstance(hello, ServerHello)
                start = await self._start_position(hello.producer_id)
                seen = self.seen_epoch if start - 1 == self.received else 0
                subscribe = Subscribe(self.stream, start, self.name, hello.producer_id, seen)
                writer.write(conn.send(subscribe))
                # The position to check: one this consumer had (stored or received), not
                # a configured start_seq, whose errors are the caller's.
                position = start - 1 if start - 1 == self.received and self.received else 0
                try:
                    subscribed = await self._read_message(conn, reader)
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
        except (OSError, TimeoutError) as exc:
            writer.close()
            raise ConnectionLostError(
                f"handshake with producer at {self.address} failed: {exc!r}"
            ) from exc
        except BaseException:
            writer.close()
            raise
        self.producer_id, self.epoch, self.head = hello.producer_id, hello.epoch, subscribed.head
        if start - 1 != self.received:
            self.seen_epoch = 0
        self.seen_epoch = max(self.seen_epoch, subscribed.after_epoch or 0)
        self.received = start - 1
        self._writer, self._conn = writer, conn
        return reader, conn

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

    async def _start_position(self, producer_id: str) -> int:
        """The first seq to ask for, after checking this is the expected producer."""
        if self.producer_id is not None:
            if producer_id != self.producer_id:
                raise ProducerChangedError(
                    f"producer at {self.address} is now {producer_id}, "
                    f"but this consumer was reading from {self.producer_id}"
                )
            return self.received + 1
        if self._db is None:
            self.applied = self._start_seq - 1
            return self._start_seq
        rows = await self._db.execute_fetchall(
            "SELECT producer_id, seq, epoch FROM streamq_positions "
            "WHERE consumer = ? AND stream = ? AND (producer_id = ? OR endpoint = ?)",
            (self.name, self.stream, producer_id, self.address),
        )
        positions: dict[str, tuple[int, int]] = {str(p): (int(q), int(e or 0)) for p, q, e in rows}
        if producer_id in positions:
            self.received, self.seen_epoch = positions[producer_id]
            self.applied = self.received
        elif positions:
            other, (seq, _) = next(iter(positions.items()))
            raise ProducerChangedError(
                f"{self.address} now serves producer {producer_id}, but consumer {self.name!r} "
                f"applied stream {self.stream!r} there from producer {other} up to seq {seq}: "
                "the producer's database was replaced. Refusing to mix two logs."
            )
        else:
            self.applied = self._start_seq - 1
            return self._start_seq
        return self.received + 1

    async def _run(self, reader: asyncio.StreamReader, conn: ClientConnection) -> None:
        """Read batches into the queue; reconnect after transient failures."""
        while True:
            try:
                await self._pump(reader, conn)
            except _TRANSIENT as exc:
                self._drop_connection()
                if not self._reconnect:
                    await self._queue.put(_lost(exc, self.address))
                    return
                logger.warning("connection to %s lost (%s); reconnecting", self.address, exc)
                try:
                    reader, conn = await self._connect_retrying()
                except BaseException as error:
                    await self._queue.put(error)
                    return
                self.reconnects += 1
            except StreamQError as exc:
                self._drop_connection()
                await self._queue.put(exc)
                return

    async def _connect_retrying(self) -> tuple[asyncio.StreamReader, ClientConnection]:
        """Connect, retrying transient failures with backoff until ``reconnect_timeout``."""
        delay, deadline = 0.05, None
        if self._reconnect_timeout is not None:
            deadline = time.monotonic() + self._reconnect_timeout
        while True:
            try:
                connection = await self._connect()
            except _TRANSIENT as exc:
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise ConnectionLostError(
                        f"no connection to {self.address} within {self._reconnect_timeout:g} s"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            return connection

    async def _pump(self, reader: asyncio.StreamReader, conn: ClientConnection) -> None:
        while True:
            while (message := conn.next_event()) is not None:
                if isinstance(message, Records):
                    if message.records:
                        assert self.producer_id is not None
                        self.seen_epoch = max(self.seen_epoch, message.epoch or 0)
                        batch = Batch(
                            self.stream,
                            self.producer_id,
                            self.received,
                            message.records,
                            self.seen_epoch,
                        )
                        self.received = batch.last_seq
                        self.head = max(self.head, self.received)
                        await self._queue.put(batch)
                elif isinstance(message, Heartbeat):
                    self.head = message.head
                elif isinstance(message, Error):
                    raise _server_error(message)
            try:
                async with asyncio.timeout(self._heartbeat_timeout):
                    data = await reader.read(_READ_SIZE)
            except TimeoutError:
                raise ConnectionLostError(
                    f"nothing from producer at {self.address} for {self._heartbeat_timeout:g} s"
                ) from None
            if not data:
                raise ConnectionLostError(f"producer at {self.address} closed the connection")
            conn.receive_data(data)

    def _drop_connection(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = self._conn = None

    # --- applying ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def transaction(self, batch: Batch) -> AsyncIterator[ConsumerTransaction]:
        """Apply ``batch`` in one transaction that also stores its last seq as the position."""
        if self._db is None:
            raise RuntimeError("this consumer has no database (db=None): nothing to apply into")
        if batch.after != self.applied or batch.producer_id != self.producer_id:
            raise OutOfOrderBatchError(
                f"batch follows seq {batch.after}, but consumer {self.name!r} has applied up "
                f"to {self.applied}: apply every batch once, in the order received"
            )
        async with self._tx_lock:
            await self._db.execute("BEGIN IMMEDIATE")
            tx = ConsumerTransaction(self._db)
            try:
                yield tx
                tx._closed = True
                await self._db.execute(
                    "INSERT OR REPLACE INTO streamq_positions "
                    "(consumer, producer_id, stream, seq, epoch, endpoint, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        self.name,
                        batch.producer_id,
                        self.stream,
                        batch.last_seq,
                        batch.epoch,
                        self.address,
                        int(time.time() * 1000),
                    ),
                )
                await self._db.execute("COMMIT")
            except BaseException:
                tx._closed = True
                if self._db.in_transaction:
                    await self._db.execute("ROLLBACK")
                raise
        self.applied = batch.last_seq
        self._ack(batch.last_seq)

    def _ack(self, seq: int) -> None:
        """Tell the producer this position is durable (informational: status, lag)."""
        if self._writer is not None and self._conn is not None:
            with contextlib.suppress(Exception):
                self._writer.write(self._conn.send(Ack(seq)))


def _server_error(message: Error) -> ServerError:
    return error_from_frame(message.code, message.message, message.details)


def _lost(exc: BaseException, address: str) -> ConnectionLostError:
    if isinstance(exc, ConnectionLostError):
        return exc
    lost = ConnectionLostError(f"connection to producer at {address} failed: {exc!r}")
    lost.__cause__ = exc
    return lost
