"""The producer: business writes and publishes in one SQLite transaction, served over TCP.

A ``Producer`` owns one writer connection to its database. Each transaction
holds it from BEGIN IMMEDIATE to COMMIT; ``Transaction.publish`` assigns the
next seq at once and buffers the record, and the records reach ``streamq_log``
in one ``executemany`` at commit (or every ``flush_records`` for very large
transactions). Only after COMMIT returns are the records handed to the
``Log``, which wakes the subscribers: a rolled-back transaction publishes
nothing, and seqs stay dense because transactions never overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from types import TracebackType
from typing import Any

import aiosqlite

from . import store
from .errors import ConcurrentWriterError, RecordTooLargeError, TransactionClosedError
from .log import RECORD_OVERHEAD, Log, Stream
from .protocol import FRAME_OVERHEAD, encode_record
from .server import Server, ServerSettings
from .store import Durability

_MAX_STREAM_NAME = 255


def _as_bytes(value: Any, what: str) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    hint = "; encode it first, e.g. value.encode()" if isinstance(value, str) else ""
    raise TypeError(f"{what} must be bytes, not {type(value).__name__}{hint}")


def _check_headers(headers: Mapping[str, Any] | None) -> dict[str, bytes]:
    if not headers:
        return {}
    if not isinstance(headers, Mapping):
        raise TypeError(f"headers must be a mapping of str to bytes, not {type(headers).__name__}")
    checked = {}
    for name, value in headers.items():
        if not isinstance(name, str):
            raise TypeError(f"header names must be str, not {type(name).__name__}")
        checked[name] = _as_bytes(value, f"header {name!r}")
    return checked


def check_stream_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"stream name must be str, not {type(name).__name__}")
    if not name or len(name) > _MAX_STREAM_NAME:
        raise ValueError(f"stream name must have 1 to {_MAX_STREAM_NAME} characters: {name!r}")
    return name


class Transaction:
    """One SQLite transaction on the producer's database.

    Use ``execute`` for the application's own SQL and ``publish`` for records;
    both commit together or not at all. Valid only inside its ``async with``.
    """

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self._conn = producer._conn
        self._closed = False
        self._rows: list[tuple[int, int, bytes]] = []  # not yet inserted
        self._heads: dict[str, int] = {}  # stream name -> last seq published here
        self._new_streams: dict[str, int] = {}  # stream name -> id, created here
        self._kept: dict[str, list[bytes] | None] = {}  # for the tail; None once too big
        self._kept_bytes: dict[str, int] = {}
        # stream name -> (id, first seq) where this transaction starts a segment of this
        # producer's epoch (see store.py, streamq_epochs), if it appends to that stream
        self._segments: dict[str, tuple[int, int]] = {}

    def _check_open(self) -> None:
        if self._closed:
            raise TransactionClosedError("this transaction has already committed or rolled back")

    async def execute(self, sql: str, parameters: Iterable[Any] = ()) -> aiosqlite.Cursor:
        """Run the application's SQL inside this transaction."""
        self._check_open()
        return await self._conn.execute(sql, parameters)

    async def executemany(self, sql: str, parameters: Iterable[Iterable[Any]]) -> aiosqlite.Cursor:
        self._check_open()
        return await self._conn.executemany(sql, parameters)

    async def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> int:
        """Append a record to ``stream``; returns its seq. Visible to consumers at commit."""
        self._check_open()
        value = _as_bytes(value, "value")
        key = None if key is None else _as_bytes(key, "key")
        checked_headers = _check_headers(headers)
        stream_id, seq = await self._next_seq(stream)
        if timestamp is None:
            ts = int(time.time() * 1000)
        elif type(timestamp) is int:
            ts = timestamp
        else:
            raise TypeError(f"timestamp must be int milliseconds, not {type(timestamp).__name__}")
        record = encode_record(seq, ts, key, value, checked_headers)
        self._append(stream, stream_id, seq, ts, record)
        if len(self._rows) >= self._producer.flush_records:
            await self._flush()
        return seq

    async def publish_many(self, stream: str, values: Iterable[bytes]) -> range:
        """Append one record per value (no key, no headers); returns their seqs."""
        self._check_open()
        stream_id, first = await self._next_seq(stream)
        ts = int(time.time() * 1000)
        seq = first - 1
        for value in values:
            seq += 1
            record = encode_record(seq, ts, None, _as_bytes(value, "value"), {})
            self._append(stream, stream_id, seq, ts, record)
            if len(self._rows) >= self._producer.flush_records:
                await self._flush()
        self._heads[stream] = seq
        return range(first, seq + 1)

    async def _next_seq(self, stream: str) -> tuple[int, int]:
        """The stream's id and the seq its next record gets, creating the stream if new."""
        head = self._heads.get(stream)
        if head is not None:
            existing = self._producer.log.streams.get(stream)
            return (existing.id if existing else self._new_streams[stream]), head + 1
        existing = self._producer.log.streams.get(stream)
        if existing is not None:
            self._heads[stream] = existing.head
            if self._producer._appended.get(stream) != existing.head:
                # The head was appended by another producer (or before this one started).
                self._segments[stream] = (existing.id, existing.head + 1)
            return existing.id, existing.head + 1
        check_stream_name(stream)
        self._new_streams[stream] = await store.create_stream(self._conn, stream)
        self._heads[stream] = 0
        self._segments[stream] = (self._new_streams[stream], 1)
        return self._new_streams[stream], 1

    def _segment_rows(self) -> dict[str, tuple[int, int, int]]:
        """The streamq_epochs rows this transaction adds: one per segment it appended to."""
        epoch = self._producer.epoch
        return {
            name: (stream_id, first, epoch)
            for name, (stream_id, first) in self._segments.items()
            if self._heads[name] >= first
        }

    def _append(self, stream: str, stream_id: int, seq: int, ts: int, record: bytes) -> None:
        if len(record) > self._producer.max_record_size:
            raise RecordTooLargeError(
                f"record of {len(record)} bytes exceeds the limit of "
                f"{self._producer.max_record_size} (max_frame_size minus framing)"
            )
        if seq > store.MAX_STORED_SEQ:
            raise OverflowError(f"stream {stream!r} has reached the last seq")
        self._rows.append((store.pos(stream_id, seq), ts, record))
        self._heads[stream] = seq
        kept = self._kept.setdefault(stream, [])
        if kept is not None:
            size = self._kept_bytes.get(stream, 0) + len(record) + RECORD_OVERHEAD
            if size > self._producer.log.tail_bytes:
                self._kept[stream] = None
            else:
                kept.append(record)
                self._kept_bytes[stream] = size

    async def _flush(self, segments: Iterable[tuple[int, int, int]] = ()) -> None:
        rows, self._rows = self._rows, []
        try:
            if rows:
                await self._conn.executemany(store.INSERT_RECORDS, rows)
            if segments:
                await self._conn.executemany(store.INSERT_EPOCHS, segments)
        except sqlite3.IntegrityError as exc:
            raise ConcurrentWriterError(
                "another process appended to this producer's log during the transaction"
            ) from exc

    async def _commit(self) -> None:
        # Heads need no write of their own (see store.load_streams); epoch rows are written
        # only by a transaction that starts a segment, and commit with its records.
        await self._flush(list(self._segment_rows().values()))
        await self._conn.execute("COMMIT")


class Producer:
    """A service's own stream producer: its SQLite database, and a server pushing from it.

    ``async with Producer("orders.db") as producer`` opens (or creates) the
    database and starts serving; ``producer.address`` says where.
    Set ``serve=False`` to write without serving (e.g. a batch job).
    """

    def __init__(
        self,
        path: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        serve: bool = True,
        durability: Durability = "normal",
        settings: ServerSettings | None = None,
        tail_bytes: int = 16 * 1024 * 1024,
        flush_records: int = 10_000,
        watch_interval: float = 0.2,
    ) -> None:
        if durability not in ("normal", "full"):
            raise ValueError(f"durability must be 'normal' or 'full', not {durability!r}")
        self.path = str(path)
        self.durability: Durability = durability
        self.settings = settings or ServerSettings()
        self.max_record_size = self.settings.max_frame_size - FRAME_OVERHEAD
        self.flush_records = flush_records
        self.log = Log(self.path, tail_bytes=tail_bytes)
        self._host, self._port, self._serve = host, port, serve
        self._watch_interval = watch_interval
        self._conn: aiosqlite.Connection
        self._lock = asyncio.Lock()
        self._server: Server | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.producer_id = ""
        self.epoch = 0
        self._appended: dict[str, int] = {}  # stream -> last seq this producer appended
        self._started = False
        self._closed = False

    async def start(self) -> None:
        self._conn = await store.open_writer(self.path, self.durability)
        try:
            identity = await store.initialize(self._conn, self.durability)
            self.producer_id, self.epoch = identity.producer_id, identity.epoch
            # The version before loading the streams: any later commit by another process is seen.
            version = await store.data_version(self._conn)
            await self.log.open(await store.load_streams(self._conn))
            await self._load_epochs()
            if self._serve:
                self._server = Server(self.log, self.producer_id, self.epoch, self.settings)
                await self._server.start(self._host, self._port)
            self._watcher = asyncio.create_task(self._watch_other_writers(version))
        except BaseException:
            await self.close()
            raise
        self._started = True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._server is not None:
            await self._server.close()
        await self.log.close()
        with contextlib.suppress(AttributeError):
            await self._conn.close()

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def address(self) -> str:
        """``host:port`` where consumers connect."""
        if self._server is None:
            raise RuntimeError("this producer is not serving (serve=False or not started)")
        return self._server.address

    @property
    def server(self) -> Server | None:
        return self._server

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """One transaction: the application's SQL and its publishes commit together."""
        if not self._started or self._closed:
            raise RuntimeError("the producer is not running: use 'async with Producer(...)'")
        async with self._lock:
            await self._conn.execute("BEGIN IMMEDIATE")
            tx = Transaction(self)
            try:
                yield tx
                await tx._commit()
            except BaseException:
                tx._closed = True
                if self._conn.in_transaction:
                    await self._conn.execute("ROLLBACK")
                raise
            tx._closed = True
            self._after_commit(tx)

    def _after_commit(self, tx: Transaction) -> None:
        for name, stream_id in tx._new_streams.items():
            self.log.add(store.StreamRow(stream_id, name, 0, 1))
        for name, (_, first, epoch) in tx._segment_rows().items():
            self.log.streams[name].epochs.add(first, epoch)  # before subscribers wake
        for name, head in tx._heads.items():
            if name in tx._kept:
                self._appended[name] = head
            self.log.committed(self.log.streams[name], head, tx._kept.get(name, []))

    async def _load_epochs(self) -> None:
        """Load every streamq_epochs row into memory."""
        by_id = {s.id: s for s in self.log.streams.values()}
        for stream_id, first_seq, epoch in await store.load_epochs(self._conn):
            if stream_id in by_id:
                by_id[stream_id].epochs.add(first_seq, epoch)

    async def _load_new_epochs(self, row: store.StreamRow) -> Stream:
        """The stream of ``row`` (added if new) with the epoch rows other processes wrote."""
        known = self.log.streams.get(row.name)
        after = known.epochs.last_first_seq if known is not None else 0
        rows = await store.load_epochs(self._conn, row.id, after)
        stream = self.log.streams.get(row.name) or self.log.add(row)
        for _, first_seq, epoch in rows:
            stream.epochs.add(first_seq, epoch)
        return stream

    async def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> int:
        """A transaction holding just this publish; returns the record's seq."""
        async with self.transaction() as tx:
            return await tx.publish(stream, value, key=key, headers=headers)

    async def create_stream(self, name: str) -> None:
        """Make ``name`` exist (head 0) so consumers can subscribe before the first publish."""
        check_stream_name(name)
        if name in self.log.streams:
            return
        async with self.transaction() as tx:
            await tx._next_seq(name)

    def head(self, stream: str) -> int:
        """The last committed seq of ``stream`` (0 if none yet)."""
        return self.log.stream(stream).head

    async def truncate(self, stream: str, before: int) -> None:
        """Delete ``stream``'s records with seq < ``before`` (retention).

        Consumers that still need them get an error saying which seqs are gone.
        """
        target = self.log.stream(stream)
        before = min(before, target.head + 1)
        if before <= target.low:
            return
        async with self.transaction() as tx:
            await store.truncate(tx._conn, target.id, before)
        target.low = before

    async def _watch_other_writers(self, seen: int) -> None:
        """Notice commits made to this database by other processes (e.g. ``streamq publish``).

        ``PRAGMA data_version`` on the writer connection changes only when another
        connection commits, so this producer's own commits cost the watch nothing.
        Other writers' records are served from SQLite; this producer's next
        transaction continues after their seqs.
        """
        while True:
            await asyncio.sleep(self._watch_interval)
            async with self._lock:
                version = await store.data_version(self._conn)
                if version == seen:
                    continue
                seen = version
                for row in await store.load_streams(self._conn):
                    stream = self.log.streams.get(row.name)
                    if stream is None or row.head > stream.head:
                        # Their epoch rows first: subscribers woken next send epochs.
                        stream = await self._load_new_epochs(row)
                    stream.low = max(stream.low, row.low)
                    if row.head > stream.head:
                        self.log.committed(stream, row.head, None)
