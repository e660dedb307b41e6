"""A producer's transactions: seqs assigned at publish, rows inserted at commit.

``Transaction`` (awaited calls on the producer's writer), ``BlockingTransaction`` (one
function on the writer's thread: ``Producer.run_in_transaction``) and ``SyncTransaction``
(a thread's own session: ``SyncProducer``, ``run_in_transaction`` on PostgreSQL). The
first two share ``_Pending``: each stream appended to, as found under its lock, and the
rows awaiting their INSERT; the producer hands what committed to its log
(``Producer._after_commit``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import count, islice, repeat
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .blocking import AsyncSQL, BlockingSQL, to_the_end
from .errors import RecordTooLargeError
from .log import RECORD_OVERHEAD
from .protocol import encode_record, encode_values
from .records import (
    MAX_SEQ,
    CheckedRecord,
    Receipt,
    as_bytes,
    check_stream_name,
    checked_record,
    checked_timestamp,
    seq_range,
    values_only,
)
from .storage import (
    AppendState,
    BlockingWriter,
    EpochRow,
    LogRow,
    Session,
    StreamSettings,
    TimeRow,
    UnnumberedWriter,
)

if TYPE_CHECKING:
    from .producer import Producer

T = TypeVar("T")


@dataclass(slots=True)
class _Appending:
    """One stream a transaction appends to: as found holding its lock, then what this
    transaction appended to it."""

    id: int
    start: int  # its head when this transaction locked it
    head: int  # the last seq published here (``start`` until the first)
    max_ts: int | None  # its largest timestamp so far
    last_epoch: int | None  # of its last segment, as found
    settings: StreamSettings
    created: bool  # by this transaction
    # The streamq_epochs row of the segment this transaction starts in it, if the
    # database's epoch is not that of the stream's last segment.
    segment: EpochRow | None
    kept: list[bytes] | None = field(default_factory=list)  # for the tail; None: too big
    kept_bytes: int = 0

    @property
    def appended(self) -> bool:
        """This transaction published to it (it may only have locked or created it)."""
        return self.head > self.start


class _Pending:
    """A transaction's records: seqs assigned at publish, rows awaiting their INSERT, and
    what the log learns at commit. Bookkeeping only, shared by both kinds of transaction."""

    def __init__(self, producer: Producer, carried: Mapping[str, _Appending] | None = None) -> None:
        self._producer = producer
        # Streams as the transactions before this one in its commit group left them.
        self._carried = carried or {}
        self.rows: list[LogRow] = []  # not yet inserted
        self.times: list[TimeRow] = []  # streamq_time rows not yet inserted
        self.streams: dict[str, _Appending] = {}  # in the order this transaction took them

    def stream_id(self, stream: str) -> int | None:
        """The id of ``stream`` if this transaction holds it already."""
        found = self.streams.get(stream)
        return None if found is None else found.id

    def start(self, stream: str, state: AppendState) -> int:
        """The stream, as found holding its lock: the next seqs follow its head."""
        segment = None
        if state.last_epoch != state.epoch:
            segment = (state.id, state.head + 1, state.epoch)
        self.streams[stream] = _Appending(
            state.id,
            state.head,
            state.head,
            state.max_ts,
            state.last_epoch,
            state.settings,
            state.created,
            segment,
        )
        return state.id

    def continued(self, stream: str) -> int | None:
        """Take ``stream`` as an earlier transaction of this one's commit group left it
        (as ``start`` would, without the round trip through an ``AppendState``); its id,
        or None if none of them took it."""
        before = self._carried.get(stream)
        if before is None:
            return None
        # A segment begun before, with nothing appended to it yet, is still to begin.
        segment = before.segment if not before.appended else None
        last_epoch = before.last_epoch if segment is not None else self._producer.epoch
        self.streams[stream] = _Appending(
            before.id,
            before.head,
            before.head,
            before.max_ts,
            last_epoch,
            before.settings,
            False,
            segment,
        )
        return before.id

    def next_seq(self, stream: str) -> int:
        return self.streams[stream].head + 1

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
        appending = self.streams[stream]
        seq = appending.head + 1
        record = encode_record(seq, ts, key, value, headers)
        size = len(record)
        self._check(stream, size, seq)
        self.rows.append(
            (stream_id, seq, ts, record, key if appending.settings.key_index else None)
        )
        self._advance(appending, ts, [record], size)
        return seq

    def _check(self, stream: str, largest: int, last_seq: int) -> None:
        """Records whose largest is ``largest`` bytes may take seqs up to ``last_seq``."""
        limit = self._producer.max_record_size
        if largest > limit:
            raise RecordTooLargeError(
                f"record of {largest} bytes exceeds the limit of {limit} "
                "(max_frame_size minus framing)"
            )
        if last_seq > MAX_SEQ:
            raise OverflowError(f"stream {stream!r} has reached the last seq")

    def _advance(self, appending: _Appending, ts: int, records: list[bytes], nbytes: int) -> None:
        """The stream past ``records`` (its next seqs, ``nbytes`` in all, stamped ``ts``),
        their rows buffered: the time index and the tail follow."""
        first = appending.head + 1
        if appending.max_ts is None or ts > appending.max_ts:  # "streamq_time": a new largest
            appending.max_ts = ts
            self.times.append((appending.id, ts, first))
        appending.head = first + len(records) - 1
        kept = appending.kept
        if kept is not None:
            kept_bytes = appending.kept_bytes + nbytes + RECORD_OVERHEAD * len(records)
            if kept_bytes > self._producer.log.tail_bytes:
                appending.kept = None
            else:
                kept += records
                appending.kept_bytes = kept_bytes

    @property
    def full(self) -> bool:
        """Enough rows buffered to insert them now (bounds a huge transaction's memory)."""
        return len(self.rows) >= self._producer.flush_records

    def segment_rows(self) -> dict[str, EpochRow]:
        """The streamq_epochs rows this transaction adds: one per segment it appended to."""
        return {
            name: s.segment
            for name, s in self.streams.items()
            if s.segment is not None and s.appended
        }

    def append_many(self, stream: str, stream_id: int, values: Iterable[bytes]) -> Iterator[None]:
        """``append`` each value (no key, no headers, one timestamp), as many at once as
        fit before ``full``, each such chunk checked whole before any of it is taken;
        yields whenever ``full``, so the caller inserts the buffered rows before going on."""
        ts = checked_timestamp(None)
        appending = self.streams[stream]
        producer = self._producer
        remaining = iter(values)
        while chunk := list(islice(remaining, max(1, producer.flush_records - len(self.rows)))):
            if len(chunk) == 1:  # the one-record path costs less
                self.append(stream, stream_id, as_bytes(chunk[0], "value"), None, {}, ts)
            else:
                if set(map(type, chunk)) != {bytes}:
                    chunk = [as_bytes(value, "value") for value in chunk]
                first = appending.head + 1
                records = encode_values(first, ts, chunk)
                self._check(stream, max(map(len, records)), first + len(records) - 1)
                self.rows += zip(repeat(stream_id), count(first), repeat(ts), records, repeat(None))
                self._advance(appending, ts, records, sum(map(len, records)))
            if self.full:
                yield

    def absorb(self, later: _Pending) -> None:
        """Take in what ``later``, the next transaction of this one's commit group,
        appended: the log learns the group's commits at once, as if one transaction's."""
        for name, after in later.streams.items():
            mine = self.streams.get(name)
            if mine is None:
                self.streams[name] = after
                continue
            if mine.kept is not None and after.kept is not None:
                size = mine.kept_bytes + after.kept_bytes
                if size > self._producer.log.tail_bytes:
                    mine.kept = None
                else:
                    mine.kept += after.kept
                    mine.kept_bytes = size
            else:
                mine.kept = None
            if mine.segment is None or not mine.appended:
                mine.segment = after.segment
            mine.head, mine.max_ts = after.head, after.max_ts

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
        # Where records are numbered after the commit (PostgreSQL), the writer that
        # publishes them unnumbered.
        self._unnumbered: UnnumberedWriter | None = None
        if producer.storage.features.numbered_after_commit:
            self._unnumbered = cast(UnnumberedWriter, producer._writer)
        self.last_receipt: Receipt | None = None  # of the last unnumbered publish
        self.committed = False  # set once COMMIT returned, even to a cancelled caller

    async def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> int | Receipt:
        """Append a record to ``stream``; returns its seq (SQLite), or a ``Receipt``
        where seqs are given after the commit (PostgreSQL). Visible to consumers at
        commit."""
        self._check_open()
        checked = checked_record(value, key, headers, timestamp)
        if self._unnumbered is not None:
            return await self._publish_unnumbered(stream, [checked])
        stream_id = await self._stream_id(stream)
        seq = self._pending.append(stream, stream_id, *checked)
        if self._pending.full:
            await self._flush()
        return seq

    async def _publish_unnumbered(self, stream: str, records: list[CheckedRecord]) -> Receipt:
        assert self._unnumbered is not None
        limit = self._producer.max_record_size
        receipt: Receipt = await self._unnumbered.append(check_stream_name(stream), records, limit)
        self.last_receipt = receipt
        return receipt

    async def publish_many(self, stream: str, values: Iterable[bytes]) -> range | Receipt:
        """Append one record per value (no key, no headers); returns their seqs (or a
        ``Receipt``, as ``publish``)."""
        self._check_open()
        if self._unnumbered is not None:
            return await self._publish_unnumbered(stream, values_only(values))
        stream_id = await self._stream_id(stream)
        first = self._pending.next_seq(stream)
        for _ in self._pending.append_many(stream, stream_id, values):
            await self._flush()
        return range(first, self._pending.next_seq(stream))

    async def _stream_id(self, stream: str, settings: StreamSettings | None = None) -> int:
        """The stream's id, taking its lock at its first append here, and creating it
        (with ``settings``) if it is new."""
        stream_id = self._pending.stream_id(stream)
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
        stream_id = self._pending.stream_id(stream)
        if stream_id is None:
            stream_id = self._pending.continued(stream)
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

    def _run_member(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """``fn(self, *args)``; the caller inserts the records it left buffered (those of
        a whole commit group at once) and commits."""
        try:
            return fn(self, *args)
        finally:
            self._closed = True


class SyncTransaction(BlockingSQL):
    """A transaction on a connection of a thread's own (``storage.Session``): a
    ``SyncProducer``'s, and ``run_in_transaction``'s on PostgreSQL. ``execute`` runs the
    application's SQL (the driver's plain cursor); ``publish`` appends as
    ``streamq.publish`` does. Both commit together."""

    def __init__(self, session: Session, max_record_size: int) -> None:
        super().__init__(session)
        self._session = session
        self._max_record_size = max_record_size
        self.last_receipt: Receipt | None = None  # of the last unnumbered publish

    def publish(
        self,
        stream: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> int | Receipt:
        """Append a record to ``stream``; returns its seq, or a ``Receipt`` where seqs
        are given after the commit (PostgreSQL). Visible to consumers at commit."""
        self._check_open()
        checked = checked_record(value, key, headers, timestamp)
        published = self._append(stream, [checked])
        return published if isinstance(published, Receipt) else published[0]

    def publish_many(self, stream: str, values: Iterable[bytes]) -> range | Receipt:
        """Append one record per value (no key, no headers); returns their seqs (or a
        ``Receipt``, as ``publish``)."""
        self._check_open()
        published = self._append(stream, values_only(values))
        return published if isinstance(published, Receipt) else seq_range(published)

    def _append(self, stream: str, records: list[CheckedRecord]) -> list[int] | Receipt:
        name = check_stream_name(stream)
        published: list[int] | Receipt = self._session.append(name, records, self._max_record_size)
        if isinstance(published, Receipt):
            self.last_receipt = published
        return published


class _OthersCommitted(Exception):
    """BEGIN found commits by other writers: catch up before running the transaction."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version
