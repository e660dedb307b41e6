"""The producer: business writes and publishes in one database transaction, served over TCP.

A ``Producer`` owns its database (``storage.Storage``: a SQLite file or a PostgreSQL
database) and its one writer connection. ``Transaction.publish`` assigns the next seq at
once and buffers the record; the records reach ``streamq_log`` in one insert at commit
(or every ``flush_records`` for very large transactions). Only after COMMIT returns are
the records handed to the ``Log``, which wakes the subscribers: a rolled-back
transaction publishes nothing. Seqs are dense and in commit order: on SQLite, appenders
never overlap (one writer at a time, each catching up at BEGIN with what other
connections committed: ``Writing.begin``); on PostgreSQL, writers publish records unnumbered
and the serving producer numbers them once committed (``storage.Features``,
``engines/postgres/numbering.py``), so ``Transaction.publish`` returns a ``Receipt``
there and ``wait_served`` tells its seqs.

The ``Producer`` is the facade: its lifecycle and the consumers' registrations. The
rest is in parts of one job each, which take the writing core (``writing.Writing``: the
writer, BEGIN and its catch-up, what committed) instead of the producer:
``transactions`` (what a transaction appends), ``group_commit``, ``commit_watcher``
(noticing other writers' commits), ``retention.RetentionPasses`` and
``compaction.Compactor`` (deleting, on request and periodically), ``server.Server``
(serving) and ``committed_log.Log`` (what is committed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar, cast

from ..captured import capture_streams
from ..engines import open_storage
from ..filters import names_for
from ..metrics import ConsumerCollector, MetricsServer
from ..protocol import FRAME_OVERHEAD, Record, decode_record
from ..records import (
    Receipt,
    as_bytes,
    check_stream_name,
)
from ..sql import Durability, to_the_end
from .commit_watcher import watch_commits
from .committed_log import Log, Stream
from .compaction import Compacted, Compactor, OnCompacted
from .consumer_positions import NOBODY, Connected, ConsumerLag, Position, Positions
from .group_commit import GroupCommit
from .metrics import ProducerCollector
from .retention import Retention, RetentionPasses, RetentionPolicy, Truncation
from .server import Server, ServerSettings
from .storage import (
    Capturing,
    CapturingStorage,
    EpochRow,
    Limits,
    Numbered,
    Numbering,
    NumberingStorage,
    Session,
    StreamRow,
    StreamSettings,
)
from .transactions import (
    BlockingTransaction,
    SyncTransaction,
    Transaction,
    create_stream,
    transaction,
)
from .writing import Writing

logger = logging.getLogger("streamq.producer")

T = TypeVar("T")


# Read-only connections serving consumers behind the in-memory tail, history and seeks.
_READERS = 2
# How often a serving producer saves the positions consumers reported (and forgets the
# expired ones): a write at most this often, never one per report.
SAVE_INTERVAL = 1.0
SAVE_IDLE = 8.0  # s between looks while no position changes (_save_periodically)


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

    ``capture`` (PostgreSQL): tables whose every committed change, read from the
    write-ahead log, this producer publishes to a stream of each (table names, or a map
    of table names to stream names; docs/guides/capture.md); with ``snapshot``, each
    table's rows first, as of a snapshot consistent with where its changes start (once
    per table).
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
        capture: Sequence[str] | Mapping[str, str] | None = None,
        snapshot: bool = False,
    ) -> None:
        if durability not in ("normal", "full"):
            raise ValueError(f"durability must be 'normal' or 'full', not {durability!r}")
        self.path = str(path)
        self.storage = open_storage(self.path)
        # Tables whose changes this producer publishes ({schema.table: stream}).
        self.captured = {} if capture is None else capture_streams(capture)
        if self.captured and not self.storage.features.captures:
            raise ValueError(
                "capture reads PostgreSQL's write-ahead log: it needs a PostgreSQL "
                f"database (postgresql://...), not {self.path!r}"
            )
        if snapshot and not self.captured:
            raise ValueError("snapshot= streams captured tables' rows first: it needs capture=")
        self._snapshot = snapshot
        self._capture: Capturing | None = None
        self.durability: Durability = durability
        self.settings = settings or ServerSettings()
        self.max_record_size = self.settings.max_frame_size - FRAME_OVERHEAD
        self.flush_records = flush_records
        self.log = Log(self.storage, tail_bytes=tail_bytes)
        self._host, self._port, self._serve = host, port, serve
        self._watch_interval = watch_interval
        self.positions = Positions()
        self.writing = Writing(
            self.storage,
            self.log,
            self.positions,
            durability=durability,
            max_record_size=self.max_record_size,
            flush_records=flush_records,
        )
        self.groups = GroupCommit(self.writing)  # run_in_transaction's commits, shared
        self.retention = Retention(RetentionPolicy(retention_ms, retention_bytes))
        self.retention_passes = RetentionPasses(
            self.writing, self.retention, self._connected, retention_interval
        )
        self.compactor = Compactor(self.writing, compact_interval, on_compacted)
        self._metrics_port, self._metrics_host = metrics_port, metrics_host
        self._metrics: MetricsServer | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the watcher, retention, compaction
        self._session: Session | None = None  # run_in_transaction's, where it needs one
        self._session_lock = asyncio.Lock()
        self._server: Server | None = None
        self.producer_id = ""
        self._started = False
        self._closing = False
        self._closed = False

    async def start(self) -> None:
        """Open the database, load its streams and start serving (``async with`` does it)."""
        try:
            if self._serve:
                await self.storage.claim_serving()
            identity = await self.storage.open(self.durability)
            self.producer_id, self.writing.epoch = identity.producer_id, identity.epoch
            await self.storage.open_readers(_READERS)
            # The version before loading the streams: any later commit by another process is seen.
            self.writing.version = await self.storage.version()
            if self._serve:
                watch = self.writing.watch = self.storage.watch()
                await watch.start()
            loaded = await self.storage.load()
            for row in loaded.streams:
                self.log.add(row)
            self._add_epochs(loaded.epoch_rows)
            self.positions.apply_rows(loaded.consumers)
            if self._serve:
                self._server = Server(
                    self.log, self.producer_id, self.epoch, self.settings, self.positions
                )
                self._server.refresh = self.writing.before_request
                self._server.resplit = self._resplit
                self._server.retention = self._retention_caps
                await self._server.start(self._host, self._port)
                await self.storage.serving(self._server.address)
            if self._metrics_port is not None:
                self._metrics = MetricsServer(
                    self._metrics_host, self._metrics_port, producer=ProducerCollector(self)
                )
            if self.writing.watch is not None:
                watching = watch_commits(self.writing, self.writing.watch, self._watch_interval)
                self._tasks.append(asyncio.create_task(watching))
            if self._serve and self.storage.features.numbered_after_commit:
                storage = cast(NumberingStorage, self.storage)
                self.writing.numberer = numberer = storage.numberer(
                    self._numbered, self._resync, self.producer_id
                )
                if self._watch_interval is not None:
                    numberer.idle_check = self._watch_interval
                if self._server is not None:
                    self._server.open_transactions = lambda: numberer.open_transactions
                    self._server.publishing = numberer.status
                self._tasks.append(asyncio.create_task(numberer.run()))
            if self.captured:
                await self._start_capture()
            if self._serve:
                self._tasks.append(asyncio.create_task(self._save_periodically()))
            self._tasks.append(asyncio.create_task(self.retention_passes.run()))
            self._tasks.append(asyncio.create_task(self.compactor.run()))
        except BaseException:
            await self.close()
            raise
        self._started = True

    async def _start_capture(self) -> None:
        """Check and make what capture needs, its streams (keys indexed: a row's history),
        and, serving, its loop (``engines/postgres/capture.py``): with ``serve=False``
        nothing is captured, but all is ready (``streamq init --capture``)."""
        storage = cast(CapturingStorage, self.storage)
        capture = storage.capture(
            self.captured,
            self.producer_id,
            self.max_record_size,
            self._numbered,
            self._resync,
            self._snapshot,
        )
        self._capture = capture
        await capture.prepare()
        for stream in self.captured.values():
            if stream not in self.log.streams:
                await create_stream(self.writing, stream, StreamSettings(key_index=True))
        if self._serve:
            if self._server is not None:
                self._server.capture_status = capture.status
            self._tasks.append(asyncio.create_task(capture.run()))

    @property
    def capture(self) -> Capturing | None:
        """The capture of tables' changes (None without ``capture=``)."""
        return self._capture

    async def close(self) -> None:
        """Stop serving and the periodic work, save positions, close the database."""
        if self._closed or self._closing:
            return
        self._closing = True
        for task in self._tasks:
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
        if self.writing.watch is not None:
            await self.writing.watch.close()
        if self.numberer is not None:
            await self.numberer.close()
        if self._capture is not None:
            await self._capture.close()
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
        """The embedded server (None with ``serve=False``)."""
        return self._server

    @property
    def metrics_address(self) -> str:
        """``host:port`` of the Prometheus endpoint (``/metrics``)."""
        if self._metrics is None:
            raise RuntimeError("this producer serves no metrics (metrics_port=None)")
        return self._metrics.address

    @property
    def epoch(self) -> int:
        """The database's epoch, as this producer last saw it (docs/protocol.md)."""
        return self.writing.epoch

    @property
    def numberer(self) -> Numbering | None:
        """Where seqs are given after the commit (PostgreSQL): the serving producer's
        numbering; None elsewhere."""
        return self.writing.numberer

    @property
    def beginning(self) -> object | None:
        """A BEGIN of this producer's waiting for another connection's write lock."""
        return self.writing.beginning

    @property
    def streams(self) -> Mapping[str, Stream]:
        """The streams, as committed."""
        return self.log.streams

    @property
    def watching_commits(self) -> bool:
        """Other writers' commits wake this serving producer at once (inotify on SQLite,
        NOTIFY on PostgreSQL); False: it checks every ``watch_interval`` instead."""
        watch = self.writing.watch
        return watch is not None and watch.active

    @property
    def consumer_collector(self) -> ConsumerCollector | None:
        """Where consumers given ``metrics=producer`` report (None without metrics_port)."""
        return None if self._metrics is None else self._metrics.consumers

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """One transaction: the application's SQL and its publishes commit together.
        When the block ends, its records are served (where seqs are given after the
        commit, once this serving producer has numbered them)."""
        self._check_running()
        async with transaction(self.writing) as tx:
            yield tx

    async def run_in_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(tx, *args)`` as one transaction on the writer's thread; returns its result.

        ``tx`` is a ``BlockingTransaction``: the same calls as ``Transaction``, not
        awaited. The whole transaction costs one thread hop, so prefer this on hot
        paths. ``fn`` must not touch the event loop; if it raises, nothing commits.
        On PostgreSQL ``fn`` runs on a worker thread, on a connection of its own.
        """
        self._check_running()
        if self.writing.writer.threaded is None:
            return await self._run_in_session(fn, args)
        return await self.groups.run(fn, args)

    async def _run_in_session(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """``run_in_transaction`` where the writer has no thread of its own (PostgreSQL):
        ``fn`` runs on a worker thread, on a session of this producer's, appending as
        ``streamq.publish`` does (``tx`` is a ``SyncTransaction``); then the producer
        catches up, and serves what it committed."""
        async with self._session_lock:
            if self._session is None:
                self._session = await asyncio.to_thread(self.storage.session, self.durability)
            session = self._session

            def run() -> tuple[T, Receipt | None]:
                with SyncTransaction(session, self.max_record_size) as tx:
                    result = fn(tx, *args)
                return result, tx.last_receipt

            # What runs on the thread cannot be stopped: wait for it, even if cancelled.
            result, last = await to_the_end(asyncio.to_thread(run), lambda: None)
        await self.writing.check()
        await self.writing.served(last)
        return result

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("the producer is not running: use 'async with Producer(...)'")

    async def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> int | Receipt:
        """A transaction holding just this publish; returns the record's seq (where seqs
        are given after the commit, once it is served; with ``serve=False`` there, its
        ``Receipt``)."""
        seq: int | Receipt
        if self.writing.writer.threaded is not None:  # one hop at most, grouped
            seq = await self.run_in_transaction(_publish_one, stream, value, key, headers)
        else:
            async with self.transaction() as tx:
                seq = await tx.publish(stream, value, key=key, headers=headers)
        if isinstance(seq, Receipt) and self.numberer is not None:
            return (await self.wait_served(seq))[0]
        return seq

    async def wait_served(self, receipt: Receipt, *, timeout: float | None = None) -> range:
        """The seqs of a receipt's records (``Transaction.publish`` on PostgreSQL), once
        this serving producer has numbered and served them. Raises ``TimeoutError`` after
        ``timeout``, and ``RuntimeError`` where this producer does not number records
        (SQLite, or ``serve=False``)."""
        if self.numberer is None:
            raise RuntimeError(
                "only the serving producer of a PostgreSQL database numbers records: "
                "wait_served needs Producer(url) with serve=True"
            )
        async with asyncio.timeout(timeout):
            return await self.writing.receipts.wait(receipt)

    async def _resync(self) -> None:
        await self.writing.check(heads=True)

    def _numbered(self, done: Numbered) -> None:
        """A numbering round, flushed: its records to the log (which wakes subscribers),
        then to those waiting for their receipts."""
        for numbered in done.streams:
            stream = self.log.streams.get(numbered.name)
            if stream is None:
                row = StreamRow(numbered.id, numbered.name, numbered.first - 1, numbered.low)
                stream = self.log.add(replace(row, settings=numbered.settings))
            if numbered.segment:
                stream.epochs.add(numbered.first, done.epoch)  # before subscribers wake
            stream.max_ts = numbered.max_ts
            if numbered.first == stream.head + 1:
                self.log.committed(stream, numbered.head, numbered.records)
            elif numbered.head > stream.head:  # after a lost round: read from the database
                self.log.committed(stream, numbered.head, None)
        self.writing.epoch = done.epoch
        self.writing.receipts.served(done)

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
        publish 3.5-4x; one record per transaction: within the noise; ``bench/tools/key_index.py``).
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
        self._check_running()
        settings = StreamSettings(key_index, compact, notify_compacted)
        await create_stream(self.writing, name, settings)

    def _add_epochs(self, rows: list[EpochRow]) -> None:
        """streamq_epochs rows into memory, before subscribers are woken."""
        by_id = {s.id: s for s in self.log.streams.values()}
        for stream_id, first_seq, epoch in rows:
            if stream_id in by_id:
                by_id[stream_id].epochs.add(first_seq, epoch)

    def head(self, stream: str) -> int:
        """The last committed seq of ``stream`` (0 if none yet), as this producer knows
        it: its own commits at once, other connections' within ``commit_watcher.IDLE_CHECK``
        (50 ms) while no consumer waits, at once while one does."""
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
                await self.writing.writer.truncate(target.id, before)
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
        """Every consumer that reported a position or is registered, with its lag. Positions
        are stored: one reported before a restart shows after it (``updated_at`` says when),
        until ``forget_consumer`` or ``ServerSettings.position_expiry``. Only a consumer
        subscribed now has a current position (``connected``); the others' figures are as of
        their last report."""
        return self.positions.lags(self.log.streams, self._connected_now())

    def _connected_now(self) -> Connected:
        server = self._server
        return NOBODY if server is None else server.connected()

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
            applied = await self.writing.writer.register_consumer(
                consumer, stream, known.applied if known else 0, limits
            )
        self.positions.register(consumer, stream, applied, limits, time.time())

    async def unregister_consumer(self, consumer: str, stream: str) -> bool:
        """Stop keeping records for ``consumer``; False if it was not registered. Its
        position stays known (status, lag) if it had applied anything."""
        async with self.transaction():
            removed = await self.writing.writer.unregister_consumer(consumer, stream)
        self.positions.unregister(consumer, stream)
        return removed

    async def forget_consumer(self, consumer: str, stream: str) -> bool:
        """Forget ``consumer`` on ``stream``: its registration, if any, and its last known
        position, so status and metrics stop showing it (a consumer gone for good); False
        if neither was known. If it reports again, it shows again."""
        async with self.transaction():
            removed = await self.writing.writer.forget_consumer(consumer, stream)
        position = self.positions.forget(consumer, stream)
        if position is not None:
            position.stored = False  # the row is deleted already
        return removed or position is not None

    async def _save_positions(self) -> bool:
        """Store what consumers reported since the last save, and delete the rows of the
        positions forgotten since: one transaction, none if nothing changed (False)."""
        positions = self.positions
        if not (positions.unsaved() or positions.forgotten()):
            return False
        async with self.transaction():  # its BEGIN may catch up: what to save, read after it
            unsaved, forgotten = positions.unsaved(), positions.forgotten()
            await self.writing.writer.save_positions(unsaved, forgotten)
        positions.mark_saved(unsaved, forgotten)
        return True

    async def _save_periodically(self) -> None:
        """The serving producer's saves, every ``SAVE_INTERVAL``: positions survive a
        restart, and a consumer not heard of for ``position_expiry`` is forgotten. A failure
        (the database away) is logged once, not every second until it is back."""
        failing = False
        wait = SAVE_INTERVAL
        while True:
            await asyncio.sleep(wait)
            try:
                self._expire_positions()
                saved = await self._save_positions()
                # Nothing to save: look less often, up to SAVE_IDLE (idle producers by the
                # hundred in a process would otherwise each wake every second).
                wait = SAVE_INTERVAL if saved else min(wait * 2, SAVE_IDLE)
            except Exception:
                if not failing:
                    logger.exception("saving consumer positions failed; trying every second")
                failing = True
            else:
                if failing:
                    logger.warning("saving consumer positions works again")
                failing = False

    def _expire_positions(self) -> None:
        """Forget unregistered consumers not heard of for ``position_expiry``: a consumer
        gone for good must not alert for ever. A connected one is not gone."""
        connected = self._connected_now().keys
        before = time.time() - self.settings.position_expiry
        for position in self.positions.expire(
            before, lambda p: (p.consumer, p.stream) in connected
        ):
            logger.info(
                "forgot consumer %r on %r (at seq %d): not heard of for %.0f s",
                position.consumer,
                position.stream,
                position.applied,
                self.settings.position_expiry,
            )

    def _connected(self, consumer: str, stream: str) -> bool:
        """``consumer`` has a subscription to ``stream`` open now."""
        return (consumer, stream) in self._connected_now().keys

    async def _resplit(self, consumer: str, stream: str, shares: int) -> None:
        """``consumer`` subscribed to ``stream`` split into ``shares`` (1: unshared). Its
        positions under another split mean nothing now (``streamq reshare`` moved it:
        resharing.py), and their lag would grow for ever: forgotten, here and in the
        database (at the next save).

        A registration is not dropped with them: it says retention keeps what this
        consumer has not applied. Dropped, retention would delete records the new split
        has not applied as soon as the other registered consumers have (or stop deleting
        anything); kept under the old names, it would hold records for nobody, for ever.
        So it moves: every name of the new split is registered (unless it is already), at
        the lowest position of the old registrations (nothing beyond it is known to be
        applied by every key) with their loosest limits, and the old registrations are
        removed, in one transaction, with one line in the log."""
        positions = self.positions
        if not positions.other_splits(consumer, stream, shares):
            return
        moved: dict[str, int] = {}  # new name -> its registered position
        limits = Limits()
        registered: list[Position] = []
        if any(p.registered for p in positions.other_splits(consumer, stream, shares)):
            async with self.transaction():
                # Again, holding the writer: another share's subscription may have moved them.
                registered = [
                    p for p in positions.other_splits(consumer, stream, shares) if p.registered
                ]
                if registered:
                    applied = min(p.applied for p in registered)
                    limits = _loosest([p.limits for p in registered])
                    for p in registered:
                        await self.writing.writer.forget_consumer(p.consumer, stream)
                    for name in names_for(consumer, shares):
                        known = positions.get(name, stream)
                        if known is None or not known.registered:
                            moved[name] = await self.writing.writer.register_consumer(
                                name, stream, applied, limits
                            )
        for p in registered:
            p.stored = False  # its row is deleted already
        old = positions.other_splits(consumer, stream, shares)
        for p in old:
            positions.forget(p.consumer, p.stream)
        now = time.time()
        for name, applied in moved.items():
            positions.register(name, stream, applied, limits, now)
        forgotten = ", ".join(sorted(p.consumer for p in old))
        if registered:
            logger.warning(
                "consumer %r now reads %r as %d share(s): forgot %s (another split) and moved "
                "their registration to %s, from seq %d",
                consumer,
                stream,
                shares,
                forgotten,
                ", ".join(moved) or "the names already registered",
                min(p.applied for p in registered),
            )
        elif old:
            logger.info(
                "consumer %r now reads %r as %d share(s): forgot %s (another split)",
                consumer,
                stream,
                shares,
                forgotten,
            )

    # --- retention -----------------------------------------------------------------

    def set_retention(
        self, stream: str, *, ms: int | None = None, bytes: int | None = None
    ) -> None:
        """Caps for ``stream`` (age in milliseconds, stored bytes) instead of the producer's."""
        self.retention.per_stream[check_stream_name(stream)] = RetentionPolicy(ms, bytes)

    def _retention_caps(self, stream: str) -> tuple[int | None, int | None]:
        policy = self.retention.policy(stream)
        return policy.ms, policy.bytes

    async def apply_retention(self) -> list[Truncation]:
        """Delete what retention allows now, and save consumers' reported positions.

        Returns what was deleted from each stream that lost records.
        """
        return await self.retention_passes.apply()

    @property
    def registrations_dropped(self) -> int:
        """Registrations their limits dropped (``register_consumer``)."""
        return self.retention_passes.registrations_dropped

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
        return await self.compactor.compact(stream)

    async def refresh(self) -> None:
        """Catch up now with what other connections and processes committed (they are
        also noticed on their own, within milliseconds on Linux)."""
        self._check_running()
        await self.writing.check()


def _publish_one(
    tx: BlockingTransaction,
    stream: str,
    value: bytes,
    key: bytes | None,
    headers: Mapping[str, bytes] | None,
) -> int:
    return tx.publish(stream, value, key=key, headers=headers)


def _loosest(limits: list[Limits]) -> Limits:
    """The limits that drop a registration no sooner than any of ``limits`` would."""
    idle = [x.max_idle_ms for x in limits]
    size = [x.max_bytes for x in limits]
    return Limits(
        None if None in idle else max(i for i in idle if i is not None),
        None if None in size else max(b for b in size if b is not None),
    )
