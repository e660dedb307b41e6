"""The producer: business writes and publishes in one SQLite transaction, served over TCP.

A ``Producer`` owns one writer connection to its database. Each transaction
holds it from BEGIN IMMEDIATE to COMMIT; ``Transaction.publish`` assigns the
next seq at once and buffers the record, and the records reach ``streamq_log``
in one ``executemany`` at commit (or every ``flush_records`` for very large
transactions). Only after COMMIT returns are the records handed to the
``Log``, which wakes the subscribers: a rolled-back transaction publishes
nothing, and seqs stay dense because transactions never overlap: SQLite has one
writer at a time, and each transaction, holding the write lock from BEGIN IMMEDIATE,
first catches up with what other connections committed (``_begin``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import aiosqlite

from . import store
from .blocking import (
    AsyncSQL,
    BlockingSQL,
    in_transaction,
    raw_connection,
    run_on_thread,
    to_the_end,
)
from .compaction import NOTIFICATION_SUFFIX, Compacted, superseded
from .errors import ConcurrentWriterError, RecordTooLargeError
from .log import RECORD_OVERHEAD, Log, Stream
from .metrics import MetricsServer
from .positions import ConsumerLag, Positions
from .protocol import FRAME_OVERHEAD, Record, decode_record, encode_record
from .records import as_bytes, check_stream_name, checked_record, checked_timestamp
from .retention import Retention, RetentionPolicy, Truncation
from .servelock import ServeLock
from .server import Server, ServerSettings
from .store import Durability
from .walwatch import WalWatch

logger = logging.getLogger("streamq.producer")

T = TypeVar("T")

# Seqs compacted per transaction: bounds the records one compaction step holds in memory
# and how long it keeps the writer.
_COMPACTION_WINDOW = 100_000

# Told what compaction removed from a stream, once the deletion has committed.
OnCompacted = Callable[[str, list[Compacted]], Awaitable[None] | None]


class _Pending:
    """A transaction's records: seqs assigned at publish, rows awaiting their INSERT, and
    what the log learns at commit. Bookkeeping only, shared by both kinds of transaction."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self.rows: list[tuple[int, int, bytes, bytes | None]] = []  # not yet inserted
        self.times: list[tuple[int, int, int]] = []  # streamq_time rows not yet inserted
        self.heads: dict[str, int] = {}  # stream name -> last seq published here
        self.max_ts: dict[str, int | None] = {}  # stream name -> largest timestamp so far
        self.settings: dict[str, store.StreamSettings] = {}  # stream name -> its settings
        self.new_streams: dict[str, int] = {}  # stream name -> id, created here
        self.kept: dict[str, list[bytes] | None] = {}  # for the tail; None once too big
        self._kept_bytes: dict[str, int] = {}
        # stream name -> (id, first seq) where this transaction starts a segment of this
        # producer's epoch (see store.py, streamq_epochs), if it appends to that stream
        self._segments: dict[str, tuple[int, int]] = {}

    def stream_id(self, stream: str) -> int | None:
        """The stream's id, or None when it does not exist yet (the caller creates it)."""
        if stream in self.new_streams:
            return self.new_streams[stream]
        existing = self._producer.log.streams.get(stream)
        return None if existing is None else existing.id

    def created(self, stream: str, stream_id: int, settings: store.StreamSettings) -> None:
        self.new_streams[stream] = stream_id
        self.heads[stream] = 0
        self.max_ts[stream] = None
        self.settings[stream] = settings
        self._segments[stream] = (stream_id, 1)

    def next_seq(self, stream: str) -> int:
        head = self.heads.get(stream)
        if head is None:
            existing = self._producer.log.streams[stream]
            head = self.heads[stream] = existing.head
            self.max_ts[stream] = existing.max_ts
            self.settings[stream] = existing.settings
            if existing.epochs.last_epoch != self._producer.epoch:
                # The database's epoch changed since the stream's last record: a new segment.
                self._segments[stream] = (existing.id, head + 1)
        return head + 1

    def append(
        self,
        stream: str,
        stream_id: int,
        value: bytes,
        key: bytes | None,
        headers: dict[str, bytes],
        ts: int,
    ) -> int:
        """Encode the record under the stream's next seq and buffer its row; returns the seq."""
        seq = self.next_seq(stream)
        record = encode_record(seq, ts, key, value, headers)
        if len(record) > self._producer.max_record_size:
            raise RecordTooLargeError(
                f"record of {len(record)} bytes exceeds the limit of "
                f"{self._producer.max_record_size} (max_frame_size minus framing)"
            )
        if seq > store.MAX_STORED_SEQ:
            raise OverflowError(f"stream {stream!r} has reached the last seq")
        position = store.pos(stream_id, seq)
        self.rows.append((position, ts, record, key if self.settings[stream].key_index else None))
        max_ts = self.max_ts[stream]
        if max_ts is None or ts > max_ts:  # "streamq_time" in store: a new largest timestamp
            self.max_ts[stream] = ts
            self.times.append((stream_id, ts, position))
        self.heads[stream] = seq
        kept = self.kept.setdefault(stream, [])
        if kept is not None:
            size = self._kept_bytes.get(stream, 0) + len(record) + RECORD_OVERHEAD
            if size > self._producer.log.tail_bytes:
                self.kept[stream] = None
            else:
                kept.append(record)
                self._kept_bytes[stream] = size
        return seq

    @property
    def full(self) -> bool:
        """Enough rows buffered to insert them now (bounds a huge transaction's memory)."""
        return len(self.rows) >= self._producer.flush_records

    def segment_rows(self) -> dict[str, tuple[int, int, int]]:
        """The streamq_epochs rows this transaction adds: one per segment it appended to."""
        epoch = self._producer.epoch
        return {
            name: (stream_id, first, epoch)
            for name, (stream_id, first) in self._segments.items()
            if self.heads[name] >= first
        }

    def append_many(self, stream: str, stream_id: int, values: Iterable[bytes]) -> Iterator[None]:
        """``append`` each value (no key, no headers, one timestamp); yields whenever
        ``full``, so the caller inserts the buffered rows before going on."""
        ts = checked_timestamp(None)
        for value in values:
            self.append(stream, stream_id, as_bytes(value, "value"), None, {}, ts)
            if self.full:
                yield

    def take_inserts(self, closing: bool = False) -> list[tuple[str, list[Any]]]:
        """The INSERTs due now: the buffered log and time-index rows and, when ``closing``
        (just before COMMIT), the epoch rows of the segments this transaction started."""
        inserts: list[tuple[str, list[Any]]] = []
        if self.rows:
            inserts += [(store.INSERT_RECORDS, self.rows), (store.INSERT_TIMES, self.times)]
            self.rows, self.times = [], []
        if closing and (segments := list(self.segment_rows().values())):
            inserts.append((store.INSERT_EPOCHS, segments))
        return inserts


_CONCURRENT_WRITER = "another process appended to this producer's log during the transaction"


class Transaction(AsyncSQL):
    """One SQLite transaction on the producer's database.

    Use ``execute`` for the application's own SQL and ``publish`` for records;
    both commit together or not at all. Valid only inside its ``async with``.
    """

    def __init__(self, producer: Producer) -> None:
        super().__init__(producer._conn)
        self._pending = _Pending(producer)
        self.committed = False  # set once COMMIT returned, even to a cancelled caller

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
        checked = checked_record(value, key, headers, timestamp)
        stream_id = await self._stream_id(stream)
        seq = self._pending.append(stream, stream_id, *checked)
        if self._pending.full:
            await self._flush()
        return seq

    async def publish_many(self, stream: str, values: Iterable[bytes]) -> range:
        """Append one record per value (no key, no headers); returns their seqs."""
        self._check_open()
        stream_id = await self._stream_id(stream)
        first = self._pending.next_seq(stream)
        for _ in self._pending.append_many(stream, stream_id, values):
            await self._flush()
        return range(first, self._pending.next_seq(stream))

    async def _stream_id(self, stream: str, settings: store.StreamSettings | None = None) -> int:
        """The stream's id, creating the stream (with ``settings``) if it is new."""
        stream_id = self._pending.stream_id(stream)
        if stream_id is None:
            check_stream_name(stream)
            settings = settings or store.StreamSettings()
            stream_id = await store.create_stream(self._conn, stream, settings)
            self._pending.created(stream, stream_id, settings)
        return stream_id

    async def _flush(self, closing: bool = False) -> None:
        try:
            for sql, rows in self._pending.take_inserts(closing):
                await self._conn.executemany(sql, rows)
        except sqlite3.IntegrityError as exc:
            raise ConcurrentWriterError(_CONCURRENT_WRITER) from exc

    async def _commit(self) -> None:
        # Heads need no write of their own (see store.load_streams); epoch rows are written
        # only by a transaction that starts a segment, and commit with its records.
        await self._flush(closing=True)
        await to_the_end(self._conn.execute("COMMIT"), self._mark_committed)

    def _mark_committed(self) -> None:
        self.committed = True


class BlockingTransaction(BlockingSQL):
    """A transaction run as one plain function on the writer's thread.

    ``await producer.run_in_transaction(fn)`` calls ``fn(tx)`` there, between
    BEGIN and COMMIT, so a transaction of many statements costs one thread hop
    instead of one per statement. The same calls as ``Transaction``, not awaited;
    ``execute`` returns a plain ``sqlite3.Cursor``.
    """

    def __init__(self, producer: Producer, conn: sqlite3.Connection) -> None:
        super().__init__(conn)
        self._pending = _Pending(producer)

    def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> int:
        """As ``Transaction.publish``."""
        self._check_open()
        checked = checked_record(value, key, headers, timestamp)
        stream_id = self._stream_id(stream)
        seq = self._pending.append(stream, stream_id, *checked)
        if self._pending.full:
            self._flush()
        return seq

    def publish_many(self, stream: str, values: Iterable[bytes]) -> range:
        """As ``Transaction.publish_many``."""
        self._check_open()
        stream_id = self._stream_id(stream)
        first = self._pending.next_seq(stream)
        for _ in self._pending.append_many(stream, stream_id, values):
            self._flush()
        return range(first, self._pending.next_seq(stream))

    def _stream_id(self, stream: str) -> int:
        stream_id = self._pending.stream_id(stream)
        if stream_id is None:
            check_stream_name(stream)
            settings = store.StreamSettings()
            stream_id = store.create_stream_blocking(self._conn, stream, settings)
            self._pending.created(stream, stream_id, settings)
        return stream_id

    def _flush(self, closing: bool = False) -> None:
        try:
            for sql, rows in self._pending.take_inserts(closing):
                self._conn.executemany(sql, rows)
        except sqlite3.IntegrityError as exc:
            raise ConcurrentWriterError(_CONCURRENT_WRITER) from exc

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], version: int | None) -> T:
        """``fn(self, *args)`` and the buffered records, in one transaction.

        With ``version``, BEGIN first; if another writer committed since the producer's
        ``version``, raise ``_OthersCommitted`` holding the transaction open (the producer
        catches up, then calls again with None: the transaction is already begun).
        """
        if version is not None:
            seen = begin_immediate(self._conn)
            if seen != version:
                raise _OthersCommitted(seen)

        def body() -> T:
            result = fn(self, *args)
            self._flush(closing=True)
            return result

        try:
            return in_transaction(self._conn, body, begun=True)
        finally:
            self._closed = True


class Producer:
    """A service's own stream producer: its SQLite database, and a server pushing from it.

    ``async with Producer("orders.db") as producer`` opens (or creates) the
    database and starts serving; ``producer.address`` says where. One process serves a
    database (a second gets ``AlreadyServedError``); any number write into it, with
    ``serve=False`` (a worker, a batch job) or ``streamq.publish`` on their own connection.
    The serving one notices their commits when the WAL is written (Linux), checking every
    ``watch_interval`` seconds besides (default 1 s; 50 ms without inotify).

    ``retention_ms`` / ``retention_bytes`` cap every stream (``set_retention`` per
    stream); retention runs every ``retention_interval`` seconds and on
    ``apply_retention()``. ``metrics_port`` serves Prometheus metrics on
    ``metrics_host`` (loopback by default; 0 picks a free port).
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
        watch_interval: float | None = None,
        retention_ms: int | None = None,
        retention_bytes: int | None = None,
        retention_interval: float = 30.0,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        compact_interval: float = 60.0,
        on_compacted: OnCompacted | None = None,
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
        self._watch = WalWatch(self.path)
        self._watch_interval = watch_interval
        self._serve_lock: ServeLock | None = None
        self._in_transaction = False  # holding the writer for a transaction of its own
        self._version = 0  # PRAGMA data_version when last caught up with other writers
        self.positions = Positions()
        self.retention = Retention(RetentionPolicy(retention_ms, retention_bytes))
        self._retention_interval = retention_interval
        self._retention_task: asyncio.Task[None] | None = None
        self._metrics_port, self._metrics_host = metrics_port, metrics_host
        self._metrics: MetricsServer | None = None
        self._compact_interval = compact_interval
        self._on_compacted = on_compacted
        self._compactor: asyncio.Task[None] | None = None
        self._conn: aiosqlite.Connection
        self._lock = asyncio.Lock()
        self._server: Server | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.producer_id = ""
        self.epoch = 0
        self._started = False
        self._closing = False
        self._closed = False

    async def start(self) -> None:
        if self._serve:
            self._serve_lock = ServeLock.claim(self.path)
        try:
            self._conn = await store.open_writer(self.path, self.durability)
        except BaseException:
            await self.close()
            raise
        try:
            identity = await store.initialize(self._conn, self.durability)
            self.producer_id, self.epoch = identity.producer_id, identity.epoch
            # The version before loading the streams: any later commit by another process is seen.
            self._version = await store.data_version(self._conn)
            if self._serve:
                self._watch.start()
            await self.log.open(await store.load_streams(self._conn))
            await self._load_epochs()
            await self._load_registrations()
            if self._serve:
                self._server = Server(
                    self.log, self.producer_id, self.epoch, self.settings, self.positions
                )
                self._server.refresh = self._refresh_for_request
                await self._server.start(self._host, self._port)
                assert self._serve_lock is not None
                self._serve_lock.serving(self._server.address)
            if self._metrics_port is not None:
                self._metrics = MetricsServer(self, self._metrics_host, self._metrics_port)
            if self._serve:
                self._watcher = asyncio.create_task(self._watch_other_writers())
            self._retention_task = asyncio.create_task(self._retain_periodically())
            self._compactor = asyncio.create_task(self._compact_periodically())
        except BaseException:
            await self.close()
            raise
        self._started = True

    async def close(self) -> None:
        if self._closed or self._closing:
            return
        self._closing = True
        for task in (self._watcher, self._retention_task, self._compactor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._metrics is not None:
            await asyncio.to_thread(self._metrics.close)  # waits for its serving thread
        if self._server is not None:
            await self._server.close()
        if self._started:
            try:
                await self._save_positions()
            except (sqlite3.Error, ValueError):
                logger.exception("could not save consumer positions at close")
        self._closed = True
        self._watch.close()
        await self.log.close()
        with contextlib.suppress(AttributeError):
            await self._conn.close()
        if self._serve_lock is not None:
            self._serve_lock.release()

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

    @property
    def metrics_address(self) -> str:
        """``host:port`` of the Prometheus endpoint (``/metrics``)."""
        if self._metrics is None:
            raise RuntimeError("this producer serves no metrics (metrics_port=None)")
        return self._metrics.address

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """One transaction: the application's SQL and its publishes commit together."""
        self._check_running()
        async with self._writing():
            await self._begin()
            tx = Transaction(self)
            try:
                yield tx
                await tx._commit()
            except BaseException:
                tx._closed = True
                if tx.committed:  # cancelled while COMMIT ran: it committed all the same
                    self._after_commit(tx._pending)
                elif self._conn.in_transaction:
                    await self._conn.execute("ROLLBACK")
                raise
            tx._closed = True
            self._after_commit(tx._pending)

    async def run_in_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(tx, *args)`` as one transaction on the writer's thread; returns its result.

        ``tx`` is a ``BlockingTransaction``: the same calls as ``Transaction``, not
        awaited. The whole transaction costs one thread hop, so prefer this on hot
        paths. ``fn`` must not touch the event loop; if it raises, nothing commits.
        """
        self._check_running()
        async with self._writing():
            version: int | None = self._version
            try:
                while True:
                    # One hop: BEGIN, fn and COMMIT, unless another writer committed since
                    # this producer last looked (then it catches up and fn runs after).
                    tx = BlockingTransaction(self, raw_connection(self._conn))
                    try:
                        return await to_the_end(
                            run_on_thread(self._conn, tx._run, fn, args, version),
                            functools.partial(self._after_commit, tx._pending),
                        )
                    except _OthersCommitted as others:
                        await self._catch_up(others.version)
                        version = None
            except BaseException:
                if self._conn.in_transaction:  # begun, then caught up or cancelled: not run
                    await self._conn.execute("ROLLBACK")
                raise

    @contextlib.asynccontextmanager
    async def _writing(self) -> AsyncIterator[None]:
        """The writer connection, for one transaction of this producer's."""
        async with self._lock:
            self._in_transaction = True
            try:
                yield
            finally:
                self._in_transaction = False

    async def _begin(self) -> None:
        """BEGIN IMMEDIATE, then, holding the write lock, catch up with what other writers
        committed: seqs continue from what is committed, never from a stale head."""
        version = await run_on_thread(self._conn, begin_immediate, raw_connection(self._conn))
        if version != self._version:
            try:
                await self._catch_up(version)
            except BaseException:
                await self._conn.execute("ROLLBACK")
                raise

    def wake(self) -> None:
        """Look for other connections' commits now (one in this process just committed)."""
        self._watch.wake()

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("the producer is not running: use 'async with Producer(...)'")

    def _after_commit(self, pending: _Pending) -> None:
        for name, stream_id in pending.new_streams.items():
            self.log.add(store.StreamRow(stream_id, name, 0, 1, pending.settings[name]))
        for name, (_, first, epoch) in pending.segment_rows().items():
            self.log.streams[name].epochs.add(first, epoch)  # before subscribers wake
        for name, head in pending.heads.items():
            stream = self.log.streams[name]
            stream.max_ts = pending.max_ts[name]
            self.log.committed(stream, head, pending.kept.get(name, []))

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

    async def create_stream(
        self,
        name: str,
        *,
        key_index: bool = False,
        compact: bool = False,
        notify_compacted: bool = False,
    ) -> None:
        """Make ``name`` exist (head 0) so consumers can subscribe before the first publish.

        ``key_index=True`` indexes its records' keys: ``history`` seeks instead of
        scanning the stream, and publishing keyed records costs more (a bulk keyed
        publish 3.5-4x; one record per transaction: within the noise; ``bench/key_index.py``).
        ``compact=True`` has it compacted every ``compact_interval`` (``compact``);
        ``notify_compacted=True`` publishes what compaction removes to
        ``"<name>.compacted"``. Compaction needs the key index. Settings are fixed
        when the stream is created.
        """
        check_stream_name(name)
        if (compact or notify_compacted) and not key_index:
            raise ValueError(
                "compaction finds each key's records through the key index: "
                "create the stream with key_index=True"
            )
        if name in self.log.streams:
            return
        settings = store.StreamSettings(key_index, compact, notify_compacted)
        async with self.transaction() as tx:
            await tx._stream_id(name, settings)

    async def _load_epochs(self) -> None:
        """Load every streamq_epochs row into memory."""
        by_id = {s.id: s for s in self.log.streams.values()}
        for stream_id, first_seq, epoch in await store.load_epochs(self._conn):
            if stream_id in by_id:
                by_id[stream_id].epochs.add(first_seq, epoch)

    def head(self, stream: str) -> int:
        """The last committed seq of ``stream`` (0 if none yet)."""
        return self.log.stream(stream).head

    async def history(self, stream: str, key: bytes, from_seq: int | None = None) -> list[Record]:
        """The records of ``stream`` with this ``key``, in seq order, from ``from_seq`` on
        (default: the first held): an entity's events without reading the whole stream."""
        if from_seq is not None and from_seq < 1:
            raise ValueError(f"seqs start at 1, not {from_seq}")
        encoded = await self.log.full_history(
            self.log.stream(stream), as_bytes(key, "key"), from_seq or 1
        )
        return [decode_record(record) for record in encoded]

    async def seek_time(self, stream: str, timestamp: int) -> int:
        """The first seq of ``stream`` whose timestamp is >= ``timestamp`` (ms since the
        epoch), or the head + 1 if none is; an index seek, never a scan."""
        return await self.log.seek_time(self.log.stream(stream), timestamp)

    async def truncate(self, stream: str, before: int) -> None:
        """Delete ``stream``'s records with seq < ``before`` (retention).

        Consumers that still need them get an error saying which seqs are gone.
        """
        target = self.log.stream(stream)
        before = min(before, target.head + 1)
        if before <= target.low:
            return
        low = target.low
        tx: Transaction | None = None
        try:
            async with self.transaction() as tx:
                await store.truncate(tx._conn, target.id, before)
                # Raised before COMMIT: a reader that sees the deletion also sees the new
                # low, and reports the seqs as lost rather than as a compaction gap.
                target.low = before
        except BaseException:
            if tx is None or not tx.committed:
                target.low = low
            raise
        for position in self.positions.registered(stream):
            if max(low, position.applied + 1) < before:
                position.lost += before - max(low, position.applied + 1)

    # --- consumers: positions, lag, registrations --------------------------------

    def consumer_lags(self) -> list[ConsumerLag]:
        """Every consumer that reported a position or is registered, with its lag."""
        return self.positions.lags(self.log.streams)

    async def wait_applied(
        self, consumer: str, stream: str, seq: int, *, timeout: float | None = None
    ) -> int:
        """Wait until ``consumer`` reports ``stream`` applied up to ``seq`` (read your writes
        across services); returns its position. Raises ``TimeoutError`` after ``timeout``."""
        async with asyncio.timeout(timeout):
            return await self.positions.wait(consumer, stream, seq)

    async def register_consumer(self, consumer: str, stream: str) -> None:
        """Keep ``stream``'s records until ``consumer`` has applied them (see retention)."""
        if not consumer:
            raise ValueError("a registered consumer needs a name")
        check_stream_name(stream)
        known = self.positions.get(consumer, stream)
        async with self.transaction() as tx:
            applied = await store.register_consumer(
                tx._conn, consumer, stream, known.applied if known else 0
            )
        self.positions.register(consumer, stream, applied)

    async def unregister_consumer(self, consumer: str, stream: str) -> bool:
        """Stop keeping records for ``consumer``; False if it was not registered."""
        async with self.transaction() as tx:
            removed = await store.unregister_consumer(tx._conn, consumer, stream)
        self.positions.unregister(consumer, stream)
        return removed

    async def _load_registrations(self) -> None:
        """Registrations in the database, which other processes may change (the CLI)."""
        self._apply_registrations(await store.load_consumers(self._conn))

    def _apply_registrations(self, rows: list[store.ConsumerRow]) -> None:
        stored = {(row.consumer, row.stream) for row in rows}
        for position in self.positions.all():
            if position.registered and (position.consumer, position.stream) not in stored:
                self.positions.unregister(position.consumer, position.stream)
        for row in rows:
            self.positions.register(row.consumer, row.stream, row.applied)

    async def _save_positions(self) -> None:
        unsaved = self.positions.unsaved()
        if unsaved:
            async with self.transaction() as tx:
                await store.save_positions(tx._conn, unsaved)
            self.positions.mark_saved(unsaved)

    # --- retention -----------------------------------------------------------------

    def set_retention(
        self, stream: str, *, ms: int | None = None, bytes: int | None = None
    ) -> None:
        """Caps for ``stream`` (age in milliseconds, stored bytes) instead of the producer's."""
        self.retention.per_stream[check_stream_name(stream)] = RetentionPolicy(ms, bytes)

    async def apply_retention(self) -> list[Truncation]:
        """Delete what retention allows now, and save consumers' reported positions.

        Returns what was deleted from each stream that lost records.
        """
        now = int(time.time() * 1000)
        unsaved = self.positions.unsaved()
        done: list[Truncation] = []
        capped = self.retention.default != RetentionPolicy() or self.retention.per_stream
        if not (capped or unsaved or any(p.registered for p in self.positions.all())):
            return done  # nothing to delete, nothing to save: no transaction
        plans: list[tuple[Stream, int, int, Any]] = []  # stream, its low before, head, plan
        tx: Transaction | None = None
        try:
            async with self.transaction() as tx:
                for stream in list(self.log.streams.values()):
                    registered = self.positions.registered(stream.name)
                    plan = await self.retention.plan(tx._conn, stream, registered, now)
                    plans.append((stream, stream.low, stream.head, plan))
                    if plan.before > stream.low:
                        await store.truncate(tx._conn, stream.id, plan.before)
                        stream.low = plan.before  # before COMMIT, as in truncate
                await store.save_positions(tx._conn, unsaved)
        except BaseException:
            if tx is None or not tx.committed:
                for stream, low, _, _ in plans:
                    stream.low = low
            raise
        self.positions.mark_saved(unsaved)
        for stream, low, head, plan in plans:
            deleted = max(0, plan.before - low)
            self.retention.committed(stream, head, plan.size_after)
            if deleted > 0:
                done.append(Truncation(stream.name, stream.low, deleted, plan.lost))
            for consumer, count in plan.lost.items():
                self.positions.lost(consumer, stream.name, count)
                logger.warning(
                    "retention deleted %d record(s) of %r before registered consumer %r "
                    "applied them (first held is now %d)",
                    count,
                    stream.name,
                    consumer,
                    stream.low,
                )
        return done

    async def _retain_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._retention_interval)
            try:
                await self.apply_retention()
            except (sqlite3.Error, ConcurrentWriterError):
                logger.exception("retention pass failed; trying again next interval")

    # --- compaction ------------------------------------------------------------------

    async def compact(self, stream: str) -> list[Compacted]:
        """Keep only the latest record of each key of ``stream``; returns what was removed.

        Records without a key are kept. The removed records' seqs become gaps:
        consumers and range reads skip them (seqs stay numbered as they were), while
        seqs deleted by ``truncate`` are still reported as lost. What was removed goes,
        in the same transaction as the deletion, to ``"<stream>.compacted"`` if the
        stream was created with ``notify_compacted=True``, and, once committed, to
        ``on_compacted`` (whose exceptions propagate here; what was compacted stays
        compacted). Long streams are compacted 100,000 seqs per transaction.
        """
        target = self.log.stream(stream)
        if not target.settings.key_index:
            raise ValueError(
                f"stream {stream!r} has no key index; compaction needs one "
                "(create_stream(..., key_index=True))"
            )
        removed: list[Compacted] = []
        end = target.head
        while target.compacted < end:
            removed += await self._compact_window(target, _COMPACTION_WINDOW)
        return removed

    async def _compact_window(self, target: Stream, window: int) -> list[Compacted]:
        """Compact the next ``window`` seqs after the compaction point, in one transaction:
        it looks only at the keys written there (and their older records)."""
        compacted = target.compacted
        tx: Transaction | None = None
        try:
            async with self.transaction() as tx:
                through = min(target.head, target.compacted + window)
                candidates = await store.compaction_candidates(
                    tx._conn, target.id, target.low, target.compacted, through
                )
                removed = superseded(target.name, candidates)
                await store.delete_compacted(
                    tx._conn, target.id, [entry.old_seq for entry in removed], through
                )
                if target.settings.notify_compacted:
                    notifications = target.name + NOTIFICATION_SUFFIX
                    for entry in removed:
                        await tx.publish(notifications, entry.to_value(), key=entry.key)
                target.compacted = through  # before COMMIT, as truncate does with low
        except BaseException:
            if tx is None or not tx.committed:
                target.compacted = compacted
            raise
        finally:
            if tx is not None and tx.committed:
                target.tail.reset(target.head + 1)  # it may hold removed records
                self.retention.forget(target.name)  # its size shrank
        if removed and self._on_compacted is not None:
            result = self._on_compacted(target.name, removed)
            if inspect.isawaitable(result):
                await result
        return removed

    async def _compact_periodically(self) -> None:
        """Compact the streams created with ``compact=True`` that have new records."""
        while True:
            await asyncio.sleep(self._compact_interval)
            for stream in list(self.log.streams.values()):
                if stream.settings.compact and stream.head > stream.compacted:
                    try:
                        await self.compact(stream.name)
                    except Exception:
                        logger.exception("compacting stream %r failed", stream.name)

    async def _watch_other_writers(self) -> None:
        """Notice commits made to this database by other processes and connections.

        Woken by writes to the WAL (``WalWatch``), or every ``watch_interval`` seconds
        as a fallback. This producer's own transactions catch up at BEGIN (``_begin``);
        the watch is for serving, so a producer that does not serve runs none.
        """
        interval = self._watch_interval
        if interval is None:
            interval = _FALLBACK_CHECK if self._watch.active else _POLL_INTERVAL
        while True:
            event_at = await self._watch.wait(interval)
            delay = _RECHECK
            while not await self._check_others() and event_at is not None:
                # A write not yet visible as a commit (or this producer's own): look again,
                # later each time, sooner after another write; at most one look per _RECHECK.
                if delay > _RECHECK_LAST:
                    break
                await asyncio.sleep(_RECHECK)
                if await self._watch.wait(delay - _RECHECK) is not None:
                    delay = _RECHECK
                else:
                    delay *= 2

    async def refresh(self) -> None:
        """Catch up now with what other connections and processes committed (they are
        also noticed on their own, within milliseconds on Linux)."""
        self._check_running()
        await self._check_others()

    async def _refresh_for_request(self) -> None:
        """Before a request is answered: catch up unless this producer is in a transaction
        (its next BEGIN catches up; a request does not wait for the application's work)."""
        if not self._in_transaction:
            await self._check_others()

    async def _check_others(self) -> bool:
        """Catch up if another connection committed; True if one had."""
        async with self._lock:
            version = await store.data_version(self._conn)
            if version == self._version:
                return False
            await self._catch_up(version)
            return True

    async def _catch_up(self, version: int) -> None:
        """Load what other writers committed up to ``version`` (the caller holds the lock):
        heads, lows, epochs, the database's epoch, registrations, read in one thread hop.
        Their records are served from SQLite; this producer's next seqs continue after theirs."""
        known = {s.id: (s.head, s.epochs.last_first_seq) for s in self.log.streams.values()}
        changes = await run_on_thread(
            self._conn, store.read_changes, raw_connection(self._conn), known
        )
        self.epoch = changes.epoch
        self._apply_registrations(changes.consumers)
        new_epochs: dict[int, list[tuple[int, int]]] = {}
        for stream_id, first_seq, epoch in changes.epoch_rows:
            new_epochs.setdefault(stream_id, []).append((first_seq, epoch))
        for row in changes.streams:
            stream = self.log.streams.get(row.name) or self.log.add(row)
            # Their epoch rows first: subscribers woken next send epochs.
            for first_seq, epoch in new_epochs.get(row.id, ()):
                stream.epochs.add(first_seq, epoch)
            stream.low = max(stream.low, row.low)
            stream.max_ts = row.max_ts
            if row.compacted > stream.compacted:  # its tail may hold removed records
                stream.compacted = row.compacted
                stream.tail.reset(stream.head + 1)
                self.retention.forget(stream.name)
            if row.head > stream.head:
                self.log.committed(stream, row.head, None)
        self._version = version


# Where no event wakes the producer (not Linux), how often it checks for other writers'
# commits; where events do, the slow check that catches a missed one.
_POLL_INTERVAL = 0.05
_FALLBACK_CHECK = 1.0
# After a write event that found no new commit: looks again after _RECHECK, doubling
# up to _RECHECK_LAST (a commit becomes visible after its WAL writes, and a slow sync
# holds it back longer).
_RECHECK = 0.002
_RECHECK_LAST = 0.256


class _OthersCommitted(Exception):
    """BEGIN found commits by other writers: catch up before running the transaction."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


def begin_immediate(conn: sqlite3.Connection) -> int:
    """BEGIN IMMEDIATE on the connection's thread; returns ``PRAGMA data_version`` as seen
    holding the write lock."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        return int(conn.execute("PRAGMA data_version").fetchone()[0])
    except BaseException:
        conn.execute("ROLLBACK")
        raise
