"""The producer: business writes and publishes in one database transaction, served over TCP.

A ``Producer`` owns its database (``storage.Storage``: a SQLite file or a PostgreSQL
database) and its one writer connection. ``Transaction.publish`` assigns the next seq at
once and buffers the record; the records reach ``streamq_log`` in one insert at commit
(or every ``flush_records`` for very large transactions). Only after COMMIT returns are
the records handed to the ``Log``, which wakes the subscribers: a rolled-back
transaction publishes nothing. Seqs are dense and in commit order because appenders to
a stream never overlap: on SQLite, one writer at a time, each catching up at BEGIN with
what other connections committed (``_begin``); on PostgreSQL, a lock on the stream's
row from its first append in the transaction to the commit, its head read under it
(``storage.Features``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

from .blocking import AsyncSQL, BlockingSQL, to_the_end
from .compaction import NOTIFICATION_SUFFIX, Compacted, superseded
from .engines import open_storage
from .errors import RecordTooLargeError
from .log import RECORD_OVERHEAD, Log, Stream
from .metrics import MetricsServer
from .positions import ConsumerLag, Position, Positions
from .protocol import FRAME_OVERHEAD, Record, decode_record, encode_record
from .records import (
    CheckedRecord,
    as_bytes,
    check_stream_name,
    checked_record,
    checked_timestamp,
    seq_range,
    values_only,
)
from .retention import Retention, RetentionPolicy, Truncation
from .server import Server, ServerSettings
from .storage import (
    NO_LIMITS,
    AppendState,
    BlockingWriter,
    ConsumerRow,
    Durability,
    EpochRow,
    Limits,
    LogRow,
    Session,
    StreamRow,
    StreamSettings,
    TimeRow,
    Watch,
    Writer,
)

logger = logging.getLogger("streamq.producer")

T = TypeVar("T")

# Seqs compacted per transaction: bounds the records one compaction step holds in memory
# and how long it keeps the writer.
_COMPACTION_WINDOW = 100_000

# Told what compaction removed from a stream, once the deletion has committed.
OnCompacted = Callable[[str, list[Compacted]], Awaitable[None] | None]

# Read-only connections serving consumers behind the in-memory tail, history and seeks.
_READERS = 2
MAX_SEQ = (1 << 40) - 1  # the largest seq either engine stores (SQLite packs it in 40 bits)


class _Pending:
    """A transaction's records: seqs assigned at publish, rows awaiting their INSERT, and
    what the log learns at commit. Bookkeeping only, shared by both kinds of transaction."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self.rows: list[LogRow] = []  # not yet inserted
        self.times: list[TimeRow] = []  # streamq_time rows not yet inserted
        self.ids: dict[str, int] = {}  # stream name -> id, for the streams appended to
        self.starts: dict[str, int] = {}  # stream name -> its head when this one locked it
        self.heads: dict[str, int] = {}  # stream name -> last seq published here
        self.max_ts: dict[str, int | None] = {}  # stream name -> largest timestamp so far
        self.settings: dict[str, StreamSettings] = {}  # stream name -> its settings
        self.new_streams: set[str] = set()  # created by this transaction
        self.kept: dict[str, list[bytes] | None] = {}  # for the tail; None once too big
        self._kept_bytes: dict[str, int] = {}
        # stream name -> the streamq_epochs row of the segment this transaction starts in
        # it, if the database's epoch is not that of the stream's last segment
        self._segments: dict[str, EpochRow] = {}

    def start(self, stream: str, state: AppendState) -> int:
        """The stream, as found holding its lock: the next seqs follow its head."""
        self.ids[stream] = state.id
        self.starts[stream] = state.head
        self.heads[stream] = state.head
        self.max_ts[stream] = state.max_ts
        self.settings[stream] = state.settings
        if state.created:
            self.new_streams.add(stream)
        if state.last_epoch != state.epoch:
            self._segments[stream] = (state.id, state.head + 1, state.epoch)
        return state.id

    def next_seq(self, stream: str) -> int:
        return self.heads[stream] + 1

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
        if seq > MAX_SEQ:
            raise OverflowError(f"stream {stream!r} has reached the last seq")
        self.rows.append(
            (stream_id, seq, ts, record, key if self.settings[stream].key_index else None)
        )
        max_ts = self.max_ts[stream]
        if max_ts is None or ts > max_ts:  # "streamq_time": a new largest timestamp
            self.max_ts[stream] = ts
            self.times.append((stream_id, ts, seq))
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

    def segment_rows(self) -> dict[str, EpochRow]:
        """The streamq_epochs rows this transaction adds: one per segment it appended to."""
        return {name: row for name, row in self._segments.items() if self.heads[name] >= row[1]}

    def append_many(self, stream: str, stream_id: int, values: Iterable[bytes]) -> Iterator[None]:
        """``append`` each value (no key, no headers, one timestamp); yields whenever
        ``full``, so the caller inserts the buffered rows before going on."""
        ts = checked_timestamp(None)
        for value in values:
            self.append(stream, stream_id, as_bytes(value, "value"), None, {}, ts)
            if self.full:
                yield

    def take_inserts(
        self, closing: bool = False
    ) -> tuple[list[LogRow], list[TimeRow], list[EpochRow]]:
        """The rows due now: the buffered log and time-index rows and, when ``closing``
        (just before COMMIT), the epoch rows of the segments this transaction started."""
        rows, times = self.rows, self.times
        self.rows, self.times = [], []
        epochs = list(self.segment_rows().values()) if closing else []
        return rows, times, epochs


class Transaction(AsyncSQL):
    """One transaction on the producer's database.

    Use ``execute`` for the application's own SQL (its database's placeholders: ``?`` on
    SQLite, ``%s`` on PostgreSQL) and ``publish`` for records; both commit together or
    not at all. Valid only inside its ``async with``.
    """

    def __init__(self, producer: Producer) -> None:
        super().__init__(producer._writer)
        self._producer = producer
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

    async def _stream_id(self, stream: str, settings: StreamSettings | None = None) -> int:
        """The stream's id, taking its lock at its first append here, and creating it
        (with ``settings``) if it is new."""
        stream_id = self._pending.ids.get(stream)
        if stream_id is None:
            state = await self._producer._append_state(stream, settings)
            stream_id = self._pending.start(stream, state)
        return stream_id

    async def _flush(self, closing: bool = False) -> None:
        await self._producer._writer.insert(*self._pending.take_inserts(closing))

    async def _commit(self) -> None:
        # Heads need no write of their own (the last seq in the log); epoch rows are written
        # only by a transaction that starts a segment, and commit with its records.
        await self._flush(closing=True)
        await to_the_end(self._producer._writer.commit(), self._mark_committed)

    def _mark_committed(self) -> None:
        self.committed = True


class BlockingTransaction(BlockingSQL):
    """A transaction run as one plain function on the writer's thread.

    ``await producer.run_in_transaction(fn)`` calls ``fn(tx)`` there, between
    BEGIN and COMMIT, so a transaction of many statements costs one thread hop
    instead of one per statement. The same calls as ``Transaction``, not awaited;
    ``execute`` returns the driver's plain cursor.
    """

    def __init__(self, producer: Producer, writer: BlockingWriter, pending: _Pending) -> None:
        super().__init__(writer)
        self._writer = writer
        self._producer = producer
        self._pending = pending

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
        stream_id = self._pending.ids.get(stream)
        if stream_id is None:
            state = self._producer._memory_state(stream)
            if state is None:
                settings = StreamSettings()
                created = self._writer.create_stream(check_stream_name(stream), settings)
                state = self._producer._created_state(created, settings)
            stream_id = self._pending.start(stream, state)
        return stream_id

    def _flush(self, closing: bool = False) -> None:
        self._writer.insert(*self._pending.take_inserts(closing))

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], version: int | None) -> T:
        """``fn(self, *args)`` and the buffered records, in one transaction.

        With ``version``, BEGIN first; if another writer committed since the producer's
        ``version``, raise ``_OthersCommitted`` holding the transaction open (the producer
        catches up, then calls again with None: the transaction is already begun).
        """
        if version is not None:
            seen = self._writer.begin()
            if seen is not None and seen != version:
                raise _OthersCommitted(seen)
        try:
            result = fn(self, *args)
            self._flush(closing=True)
            self._writer.commit()
        except BaseException:
            self._writer.rollback()
            raise
        finally:
            self._closed = True
        return result


class SyncTransaction(BlockingSQL):
    """A transaction on a connection of a thread's own (``storage.Session``): a
    ``SyncProducer``'s, and ``run_in_transaction``'s on PostgreSQL. ``execute`` runs the
    application's SQL (the driver's plain cursor); ``publish`` appends as
    ``streamq.publish`` does. Both commit together."""

    def __init__(self, session: Session, max_record_size: int) -> None:
        super().__init__(session)
        self._session = session
        self._max_record_size = max_record_size

    def publish(
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
        return self._append(stream, [checked])[0]

    def publish_many(self, stream: str, values: Iterable[bytes]) -> range:
        """Append one record per value (no key, no headers); returns their seqs."""
        self._check_open()
        return seq_range(self._append(stream, values_only(values)))

    def _append(self, stream: str, records: list[CheckedRecord]) -> list[int]:
        return self._session.append(check_stream_name(stream), records, self._max_record_size)


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
        self.storage = open_storage(self.path)
        self.durability: Durability = durability
        self.settings = settings or ServerSettings()
        self.max_record_size = self.settings.max_frame_size - FRAME_OVERHEAD
        self.flush_records = flush_records
        self.log = Log(self.storage, tail_bytes=tail_bytes)
        self._host, self._port, self._serve = host, port, serve
        self._watch: Watch | None = None
        self._watch_interval = watch_interval
        self._in_transaction = False  # holding the writer for a transaction of its own
        self._version: Any = None  # storage.version() when last caught up with other writers
        self.positions = Positions()
        self.retention = Retention(RetentionPolicy(retention_ms, retention_bytes))
        self._retention_interval = retention_interval
        self._retention_task: asyncio.Task[None] | None = None
        self._metrics_port, self._metrics_host = metrics_port, metrics_host
        self._metrics: MetricsServer | None = None
        self._compact_interval = compact_interval
        self._on_compacted = on_compacted
        self._compactor: asyncio.Task[None] | None = None
        self.registrations_dropped = 0  # by their limits (register_consumer)
        self._session: Session | None = None  # run_in_transaction's, where it needs one
        self._session_lock = asyncio.Lock()
        self._lock = asyncio.Lock()
        self._server: Server | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.producer_id = ""
        self.epoch = 0
        self._started = False
        self._closing = False
        self._closed = False

    async def start(self) -> None:
        try:
            if self._serve:
                await self.storage.claim_serving()
            identity = await self.storage.open(self.durability)
            self.producer_id, self.epoch = identity.producer_id, identity.epoch
            await self.storage.open_readers(_READERS)
            # The version before loading the streams: any later commit by another process is seen.
            self._version = await self.storage.version()
            if self._serve:
                self._watch = self.storage.watch()
                await self._watch.start()
            loaded = await self.storage.load()
            for row in loaded.streams:
                self.log.add(row)
            self._add_epochs(loaded.epoch_rows)
            self._apply_registrations(loaded.consumers)
            if self._serve:
                self._server = Server(
                    self.log, self.producer_id, self.epoch, self.settings, self.positions
                )
                self._server.refresh = self._refresh_for_request
                await self._server.start(self._host, self._port)
                await self.storage.serving(self._server.address)
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
            except Exception:
                logger.exception("could not save consumer positions at close")
        self._closed = True
        if self._watch is not None:
            await self._watch.close()
        if self._session is not None:
            await asyncio.to_thread(self._session.close)
        await self.storage.close()

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
                    self._after_blocking_commit(tx._pending)
                else:
                    await self._writer.rollback()
                raise
            tx._closed = True
            if self._after_commit(tx._pending):
                await self._catch_up(await self.storage.version())

    async def run_in_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(tx, *args)`` as one transaction on the writer's thread; returns its result.

        ``tx`` is a ``BlockingTransaction``: the same calls as ``Transaction``, not
        awaited. The whole transaction costs one thread hop, so prefer this on hot
        paths. ``fn`` must not touch the event loop; if it raises, nothing commits.
        On PostgreSQL ``fn`` runs on a worker thread, on a connection of its own.
        """
        self._check_running()
        if not self.storage.features.blocking_transactions:
            return await self._run_in_session(fn, args)
        async with self._writing():
            version: int | None = self._version
            try:
                while True:
                    # One hop: BEGIN, fn and COMMIT, unless another writer committed since
                    # this producer last looked (then it catches up and fn runs after).
                    pending = _Pending(self)
                    try:
                        return await to_the_end(
                            self._writer.run_blocking(
                                self._run_blocking, pending, fn, args, version
                            ),
                            functools.partial(self._after_blocking_commit, pending),
                        )
                    except _OthersCommitted as others:
                        await self._catch_up(others.version)
                        version = None
            except BaseException:
                await self._writer.rollback()  # begun, then caught up or cancelled: not run
                raise

    async def _run_in_session(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """``run_in_transaction`` where the writer has no thread of its own (PostgreSQL):
        ``fn`` runs on a worker thread, on a session of this producer's, appending as
        ``streamq.publish`` does (``tx`` is a ``SyncTransaction``); then the producer
        catches up, and serves what it committed."""
        async with self._session_lock:
            if self._session is None:
                self._session = await asyncio.to_thread(self.storage.session, self.durability)
            session = self._session

            def run() -> T:
                session.begin()
                tx = SyncTransaction(session, self.max_record_size)
                try:
                    result = fn(tx, *args)
                    session.commit()
                except BaseException:
                    session.rollback()
                    raise
                finally:
                    tx._closed = True
                return result

            # What runs on the thread cannot be stopped: wait for it, even if cancelled.
            result = await to_the_end(asyncio.to_thread(run), lambda: None)
        await self._check_others()
        return result

    def _run_blocking(
        self,
        writer: BlockingWriter,
        pending: _Pending,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        version: int | None,
    ) -> T:
        """On the writer's thread: ``fn`` in a ``BlockingTransaction`` filling ``pending``."""
        return BlockingTransaction(self, writer, pending)._run(fn, args, version)

    @contextlib.asynccontextmanager
    async def _writing(self) -> AsyncIterator[None]:
        """The writer connection, for one transaction of this producer's."""
        async with self._lock:
            self._in_transaction = True
            try:
                yield
            finally:
                self._in_transaction = False

    @property
    def _writer(self) -> Writer:
        return self.storage.writer

    async def _begin(self) -> None:
        """BEGIN. On SQLite, holding the write lock, catch up with what other writers
        committed: seqs continue from what is committed, never from a stale head. (On
        PostgreSQL each stream's head is read under its lock: ``_append_state``.)"""
        version = await self._writer.begin()
        if version is not None and version != self._version:
            try:
                await self._catch_up(version)
            except BaseException:
                await self._writer.rollback()
                raise

    async def _append_state(self, stream: str, settings: StreamSettings | None) -> AppendState:
        """``stream`` as this transaction's appends start from: locked and read from the
        database (PostgreSQL), or from memory, caught up at BEGIN (SQLite)."""
        if self.storage.features.stream_locks:
            if stream not in self.log.streams:
                check_stream_name(stream)
            return await self._writer.lock_stream(stream, settings)
        state = self._memory_state(stream)
        if state is None:
            settings = settings or StreamSettings()
            stream_id = await self._writer.create_stream(check_stream_name(stream), settings)
            state = self._created_state(stream_id, settings)
        return state

    def _memory_state(self, stream: str) -> AppendState | None:
        existing = self.log.streams.get(stream)
        if existing is None:
            return None
        return AppendState(
            existing.id,
            existing.head,
            existing.max_ts,
            existing.epochs.last_epoch,
            existing.settings,
            self.epoch,
            created=False,
        )

    def _created_state(self, stream_id: int, settings: StreamSettings) -> AppendState:
        return AppendState(stream_id, 0, None, None, settings, self.epoch, created=True)

    def wake(self) -> None:
        """Look for other connections' commits now (one in this process just committed)."""
        if self._watch is not None:
            self._watch.wake()

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("the producer is not running: use 'async with Producer(...)'")

    def _after_blocking_commit(self, pending: _Pending) -> None:
        """``_after_commit`` where nothing can be awaited: the watch catches up."""
        if self._after_commit(pending):
            self.wake()

    def _after_commit(self, pending: _Pending) -> bool:
        """Hand a committed transaction's records to the log; True if the log must catch
        up first instead (the caller then does, or wakes the watch).

        That is when another writer committed to a stream after this producer last caught
        up and before this transaction locked it (PostgreSQL): its records come before
        these, and so may its epoch rows. Taking this transaction's head and segments
        alone would skip those rows, and serve the other writer's seqs under the wrong
        epoch; the catch-up reads every row after the last one known, and the records.
        """
        for name, stream_id in pending.ids.items():  # in the order they were created
            if name in pending.new_streams:
                self.log.add(StreamRow(stream_id, name, 0, 1, pending.settings[name]))
        behind = any(
            name not in self.log.streams or start > self.log.streams[name].head
            for name, start in pending.starts.items()
        )
        if behind:
            return True
        for name, (_, first, epoch) in pending.segment_rows().items():
            self.log.streams[name].epochs.add(first, epoch)  # before subscribers wake
        for name, head in pending.heads.items():
            stream = self.log.streams[name]
            if head > stream.head:  # a later seq may be known already, from another writer
                stream.max_ts = pending.max_ts[name]
                self.log.committed(stream, head, pending.kept.get(name, []))
        return False

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
        settings = StreamSettings(key_index, compact, notify_compacted)
        async with self.transaction() as tx:
            await tx._stream_id(name, settings)

    def _add_epochs(self, rows: list[EpochRow]) -> None:
        """streamq_epochs rows into memory, before subscribers are woken."""
        by_id = {s.id: s for s in self.log.streams.values()}
        for stream_id, first_seq, epoch in rows:
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
                await self._writer.truncate(target.id, before)
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

    async def register_consumer(
        self,
        consumer: str,
        stream: str,
        *,
        max_idle_ms: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """Keep ``stream``'s records until ``consumer`` has applied them (see retention).

        A consumer that never comes back would make retention keep everything for ever:
        with ``max_idle_ms``, the registration is dropped once the consumer has been
        neither connected nor reporting for that long; with ``max_bytes``, once the records
        it has not applied take more than that. A dropped registration is logged, counted
        (``streamq_registrations_dropped``) and shown in status; retention then treats the
        consumer as unregistered, and if it comes back for records deleted meanwhile it
        gets the gone-seqs error. Registering again replaces the limits.
        """
        if not consumer:
            raise ValueError("a registered consumer needs a name")
        check_stream_name(stream)
        limits = Limits(max_idle_ms, max_bytes)
        known = self.positions.get(consumer, stream)
        async with self.transaction():
            applied = await self._writer.register_consumer(
                consumer, stream, known.applied if known else 0, limits
            )
        self.positions.register(consumer, stream, applied, limits, time.time())

    async def unregister_consumer(self, consumer: str, stream: str) -> bool:
        """Stop keeping records for ``consumer``; False if it was not registered."""
        async with self.transaction():
            removed = await self._writer.unregister_consumer(consumer, stream)
        self.positions.unregister(consumer, stream)
        return removed

    def _apply_registrations(self, rows: list[ConsumerRow]) -> None:
        """Registrations in the database, which other processes may change (the CLI)."""
        stored = {(row.consumer, row.stream) for row in rows}
        for position in self.positions.all():
            if position.registered and (position.consumer, position.stream) not in stored:
                self.positions.unregister(position.consumer, position.stream)
        for row in rows:
            seen_at = row.updated_at_ms / 1000
            self.positions.register(row.consumer, row.stream, row.applied, row.limits, seen_at)

    async def _save_positions(self) -> None:
        unsaved = self.positions.unsaved()
        if unsaved:
            async with self.transaction():
                await self._writer.save_positions(unsaved)
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
        dropped: list[tuple[Position, str]] = []
        tx: Transaction | None = None
        try:
            async with self.transaction() as tx:
                dropped = await self._drop_stale_registrations(now)
                for stream in list(self.log.streams.values()):
                    registered = self.positions.registered(stream.name)
                    plan = await self.retention.plan(self._writer, stream, registered, now)
                    plans.append((stream, stream.low, stream.head, plan))
                    if plan.before > stream.low:
                        await self._writer.truncate(stream.id, plan.before)
                        stream.low = plan.before  # before COMMIT, as in truncate
                await self._writer.save_positions(unsaved)
        except BaseException:
            if tx is None or not tx.committed:
                for stream, low, _, _ in plans:
                    stream.low = low
                for position, _ in dropped:
                    position.registered = True  # not dropped after all
            raise
        for position, reason in dropped:
            self.positions.unregister(position.consumer, position.stream)
            position.dropped = reason
            self.registrations_dropped += 1
            logger.warning(
                "dropped the registration of consumer %r on %r: %s; retention no longer "
                "keeps its records",
                position.consumer,
                position.stream,
                reason,
            )
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

    async def _drop_stale_registrations(self, now_ms: int) -> list[tuple[Position, str]]:
        """In the retention pass's transaction: delete the registrations past their limits;
        each with why. They stop holding records back in this very pass."""
        dropped = []
        for position in self.positions.all():
            limits, stream = position.limits, self.log.streams.get(position.stream)
            if not position.registered or limits == NO_LIMITS or stream is None:
                continue
            reason = ""
            away_ms = now_ms - position.updated_at * 1000
            if (
                limits.max_idle_ms is not None
                and away_ms > limits.max_idle_ms
                and not self._connected(position.consumer, position.stream)
            ):
                reason = (
                    f"not connected and silent for {away_ms / 1000:.0f} s, over its "
                    f"max_idle_ms={limits.max_idle_ms}"
                )
            elif limits.max_bytes is not None:
                held = await self.retention.held(self._writer, stream, position)
                if held > limits.max_bytes:
                    reason = (
                        f"{held} bytes of records it has not applied, over its "
                        f"max_bytes={limits.max_bytes}"
                    )
            if reason:
                await self._writer.unregister_consumer(position.consumer, position.stream)
                position.registered = False  # this pass plans without it
                dropped.append((position, reason))
        return dropped

    def _connected(self, consumer: str, stream: str) -> bool:
        """``consumer`` has a subscription to ``stream`` open now."""
        server = self._server
        return server is not None and any(
            sub.reporter == consumer and sub.stream == stream for sub in server.subscriptions
        )

    async def _retain_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._retention_interval)
            try:
                await self.apply_retention()
            except Exception:
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
                candidates = await self._writer.compaction_candidates(
                    target.id, target.low, target.compacted, through
                )
                removed = superseded(target.name, candidates)
                await self._writer.delete_compacted(
                    target.id, [entry.old_seq for entry in removed], through
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

        Woken by the storage's watch (SQLite: writes to the WAL; PostgreSQL: NOTIFY), or
        every ``watch_interval`` seconds as a fallback. This producer's own transactions
        catch up at BEGIN (``_begin``); the watch is for serving, so a producer that does
        not serve runs none.
        """
        watch = self._watch
        assert watch is not None
        interval = self._watch_interval
        if interval is None:
            interval = _FALLBACK_CHECK if watch.active else _POLL_INTERVAL
        while True:
            event_at = await watch.wait(interval)
            try:
                await self._look_for_commits(watch, event_at)
            except Exception:  # the database away (a server restarting): look again later
                logger.exception("checking for other writers' commits failed")

    async def _look_for_commits(self, watch: Watch, event_at: float | None) -> None:
        delay = _RECHECK
        while not await self._check_others() and event_at is not None:
            # A write not yet visible as a commit (or this producer's own): look again,
            # later each time, sooner after another write; at most one look per _RECHECK.
            if delay > _RECHECK_LAST:
                break
            await asyncio.sleep(_RECHECK)
            if await watch.wait(delay - _RECHECK) is not None:
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
            version = await self.storage.version()
            if version == self._version:
                return False
            await self._catch_up(version)
            return True

    async def _catch_up(self, version: Any) -> None:
        """Load what other writers committed up to ``version`` (the caller holds the lock):
        heads, lows, epochs, the database's epoch, registrations, read in one thread hop.
        Their records are served from the database; this producer's next seqs continue
        after theirs."""
        known = {s.id: (s.head, s.epochs.last_first_seq) for s in self.log.streams.values()}
        changes = await self.storage.changes(known)
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
