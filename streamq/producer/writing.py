"""The writing core of a producer: what every feature that writes needs, and nothing else.

A producer's transactions (``transactions``), group commit (``group_commit``), retention,
compaction and the commit watcher all write through one connection, under one lock, and
hand what committed to one ``Log``. ``Writing`` holds that state and those steps: the
writer lock, BEGIN with its catch-up, the streams as appends start from them, the
commit hand-over, and catching up with other writers' commits. It imports none of the
features, and they take it instead of the ``Producer`` (the facade, which owns the
lifecycle and the consumers' registrations): a change to one feature cannot reach into
another's state.

``Pending`` is one transaction's bookkeeping: seqs assigned at publish (``plan_append``'s
rule), rows awaiting their INSERT, and what the log learns at commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ..errors import RecordTooLargeError
from ..protocol import encode_record, encode_values
from ..records import Receipt, as_bytes, check_stream_name, checked_timestamp
from ..sql import Durability
from .append_rule import append_rows, check_last_seq, segment_row
from .committed_log import RECORD_OVERHEAD, Log
from .consumer_positions import Positions
from .receipts import ServedReceipts
from .storage import (
    AppendState,
    Changes,
    EpochRow,
    LogRow,
    Numbering,
    Storage,
    StreamRow,
    StreamSettings,
    TimeRow,
    Watch,
    Writer,
)


class OthersCommitted(Exception):
    """BEGIN found commits by other writers: catch up before running the transaction."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


class Holding:
    """``Writing.holding()``: the writer's lock held, and ``in_transaction`` set, for one
    transaction. A class, not a generator: the compiled path has no async generators."""

    __slots__ = ("_writing",)

    def __init__(self, writing: Writing) -> None:
        self._writing = writing

    async def __aenter__(self) -> None:
        await self._writing._lock.acquire()
        self._writing.in_transaction = True

    async def __aexit__(self, *exc: object) -> None:
        self._writing.in_transaction = False
        self._writing._lock.release()


class Writing:
    """One producer's writer connection and what it knows of the database's commits.

    ``version`` is the storage's version when it last caught up; ``epoch`` the
    database's; ``numberer`` and ``receipts`` where seqs are given after the commit
    (PostgreSQL: the serving producer numbers records once committed).
    """

    def __init__(
        self,
        storage: Storage,
        log: Log,
        positions: Positions,
        *,
        durability: Durability,
        max_record_size: int,
        flush_records: int,
    ) -> None:
        self.storage = storage
        self.log = log
        self.positions = positions  # registrations other writers change, caught up here
        self.durability: Durability = durability
        self.max_record_size = max_record_size
        self.flush_records = flush_records
        self.epoch = 0
        self.version: Any = None
        self.watch: Watch | None = None  # the serving producer's, woken after commits
        self.numberer: Numbering | None = None
        self.receipts = ServedReceipts()
        self._lock = asyncio.Lock()
        self.in_transaction = False  # holding the writer for a transaction of its own
        # The BEGIN of this producer's that waits for another connection's write lock
        # (SQLite), a token of its own per BEGIN; None when none waits. That connection
        # may commit meanwhile: requests read its commits on a read connection
        # (``read_ahead``).
        self.beginning: object | None = None
        self.looks = 0  # times ``check`` looked for other connections' commits
        self.caught = 0  # records that catch-ups found committed by others, in all

    @property
    def writer(self) -> Writer:
        return self.storage.writer

    # --- the writer, for one transaction ---------------------------------------------

    def holding(self) -> Holding:
        """The writer connection, for one transaction of this producer's
        (``async with writing.holding():``)."""
        return Holding(self)

    @contextlib.contextmanager
    def waiting_to_begin(self) -> Iterator[None]:
        """Around a BEGIN that may wait for another connection's write lock (engines
        with ``single_writer``); what runs BEGIN on a thread clears ``beginning`` there
        once it has the lock."""
        if not self.storage.features.single_writer:
            yield
            return
        self.beginning = object()
        try:
            yield
        finally:
            self.beginning = None

    async def begin(self) -> None:
        """BEGIN, holding the writer. On SQLite, holding the write lock, catch up with
        what other writers committed: seqs continue from what is committed, never from a
        stale head. (On PostgreSQL each stream's head is read under its lock.)"""
        with self.waiting_to_begin():
            version = await self.writer.begin()
        if version is not None and version != self.version:
            try:
                await self.catch_up(version)
            except BaseException:
                await self.writer.rollback()
                raise

    async def append_state(self, stream: str, settings: StreamSettings | None) -> AppendState:
        """``stream`` as this transaction's appends start from: from memory, caught up at
        BEGIN (SQLite); created (with ``settings``) if it is new."""
        state = self.memory_state(stream)
        if state is None:
            settings = settings or StreamSettings()
            stream_id = await self.writer.create_stream(check_stream_name(stream), settings)
            state = self.created_state(stream_id, settings)
        return state

    def memory_state(self, stream: str) -> AppendState | None:
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

    def created_state(self, stream_id: int, settings: StreamSettings) -> AppendState:
        return AppendState(stream_id, 0, None, None, settings, self.epoch, created=True)

    # --- what committed -------------------------------------------------------------

    def after_blocking_commit(self, pending: Pending) -> None:
        """``after_commit`` where nothing can be awaited: the watch catches up."""
        if self.after_commit(pending):
            self.wake()

    def after_commit(self, pending: Pending) -> bool:
        """Hand a committed transaction's records to the log; True if the log must catch
        up first instead (the caller then does, or wakes the watch).

        That is when another writer committed to a stream after this producer last caught
        up and before this transaction locked it (PostgreSQL): its records come before
        these, and so may its epoch rows. Taking this transaction's head and segments
        alone would skip those rows, and serve the other writer's seqs under the wrong
        epoch; the catch-up reads every row after the last one known, and the records.
        """
        for name, s in pending.streams.items():  # in the order they were created
            if s.created:
                self.log.add(StreamRow(s.id, name, 0, 1, s.settings))
        behind = any(
            name not in self.log.streams or s.start > self.log.streams[name].head
            for name, s in pending.streams.items()
        )
        if behind:
            return True
        for name, (_, first, epoch) in pending.segment_rows().items():
            self.log.streams[name].epochs.add(first, epoch)  # before subscribers wake
        for name, s in pending.streams.items():
            stream = self.log.streams[name]
            if s.head > stream.head:  # a later seq may be known already, from another writer
                stream.max_ts = s.max_ts
                self.log.committed(stream, s.head, s.kept)
        return False

    async def served(self, last: Receipt | None) -> None:
        """Wait until a committed transaction's records are served, given the receipt
        of its last publish (numbered after all the others); nothing to wait for where
        seqs are given at publish, or where this producer does not number."""
        if last is not None and self.numberer is not None:
            await self.receipts.wait(last)

    def wake(self) -> None:
        """Look for other connections' commits now (one in this process just committed)."""
        if self.watch is not None:
            self.watch.wake()

    # --- other writers' commits -----------------------------------------------------

    async def before_request(self) -> None:
        """Before a request is answered: catch up, so a client that saw its commit return
        finds it served. Not while the producer's transaction holds the write lock: then
        nobody else commits, and its BEGIN caught up (a request does not wait for the
        application's work); while that BEGIN still waits for the lock, ``read_ahead``."""
        if self.beginning is not None:
            await self.read_ahead()
        elif not self.in_transaction:
            await self.check()

    async def check(self, *, heads: bool | None = None) -> bool:
        """Catch up if another connection committed; True if one had. While the
        producer's BEGIN waits for another connection's write lock, ``read_ahead``."""
        self.looks += 1
        if self.beginning is not None and not heads:
            return await self.read_ahead()
        async with self._lock:
            version = await self.storage.version()
            if version == self.version and not heads:
                return False
            await self.catch_up(version, heads=heads)
            return True

    async def catch_up(self, version: Any, *, heads: bool | None = None) -> None:
        """Load what other writers committed up to ``version`` (the caller holds the
        writer's lock): heads, lows, epochs, the database's epoch, registrations, read
        in one hop. Their records are served from the database; the producer's next seqs
        continue after theirs.

        Where the producer numbers records itself (PostgreSQL), heads move when a
        numbering round is served, after its flush: a catch-up takes no head from the
        database (its rounds may not be flushed yet) unless ``heads`` says so (the
        numbering, resuming after a failure, flushed first), and adds a stream it does
        not know only if no round is serving it."""
        if heads is None:
            heads = self.numberer is None
        changes = await self.storage.changes(self._known())
        self.epoch = changes.epoch
        self.positions.apply_rows(changes.consumers)
        self._apply(changes, heads)
        self.version = version

    async def read_ahead(self) -> bool:
        """While the producer's BEGIN waits for another connection's write lock (SQLite),
        catch up with that connection's commits from a read connection (the writer's is
        the one waiting): streams, heads and epoch rows, forward only; True if a head
        moved. Dropped if the BEGIN went through meanwhile: then it caught up itself, and
        what was read may hold the producer's own commit, not yet in memory. The version
        stays: the BEGIN compares its own."""
        waiting = self.beginning
        changes = await self.storage.changes(self._known(), reading=True)
        if waiting is None or self.beginning is not waiting:
            return False
        return self._apply(changes, heads=True)

    def _known(self) -> dict[int, tuple[int, int]]:
        """{stream id: (head, first seq of the last epoch segment)}, as the log has them."""
        return {s.id: (s.head, s.epochs.last_first_seq) for s in self.log.streams.values()}

    def _apply(self, changes: Changes, heads: bool) -> bool:
        """Hand ``changes`` to the log: new streams, epoch rows, lows and compaction, and
        (``heads``) heads that moved, which wakes their subscribers; True if one did."""
        numberer = self.numberer
        log = self.log
        moved = False
        new_epochs: dict[int, list[tuple[int, int]]] = {}
        for stream_id, first_seq, epoch in changes.epoch_rows:
            new_epochs.setdefault(stream_id, []).append((first_seq, epoch))
        for row in changes.streams:
            stream = log.streams.get(row.name)
            if stream is None:
                if numberer is not None and row.name in numberer.unserved:
                    continue
                stream = log.add(row)
            # Their epoch rows first: subscribers woken next send epochs.
            for first_seq, epoch in new_epochs.get(row.id, ()):
                stream.epochs.add(first_seq, epoch)
            stream.low = max(stream.low, row.low)
            stream.max_ts = row.max_ts
            if row.compacted > stream.compacted:  # its tail may hold removed records
                stream.compacted = row.compacted
                stream.tail.reset(stream.head + 1)
            if heads and row.head > stream.head:
                self.caught += row.head - stream.head
                log.committed(stream, row.head, None)
                moved = True
        return moved


@dataclass(slots=True)
class Appending:
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


class Pending:
    """A transaction's records: seqs assigned at publish, rows awaiting their INSERT, and
    what the log learns at commit. Bookkeeping only, shared by both kinds of transaction."""

    def __init__(self, writing: Writing, carried: Mapping[str, Appending] | None = None) -> None:
        self._writing = writing
        # Streams as the transactions before this one in its commit group left them.
        self._carried = carried or {}
        self.rows: list[LogRow] = []  # not yet inserted
        self.times: list[TimeRow] = []  # streamq_time rows not yet inserted
        self.streams: dict[str, Appending] = {}  # in the order this transaction took them

    def stream_id(self, stream: str) -> int | None:
        """The id of ``stream`` if this transaction holds it already."""
        found = self.streams.get(stream)
        return None if found is None else found.id

    def start(self, stream: str, state: AppendState) -> int:
        """The stream, as found holding its lock: the next seqs follow its head."""
        segment = segment_row(state.id, state.head + 1, state.last_epoch, state.epoch)
        self.streams[stream] = Appending(
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
        last_epoch = before.last_epoch if segment is not None else self._writing.epoch
        self.streams[stream] = Appending(
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
        appending.max_ts = append_rows(
            self.rows,
            self.times,
            stream_id,
            seq,
            appending.max_ts,
            appending.settings.key_index,
            (record,),
            (ts,),
            (key,),
        )
        self._advance(appending, [record], size)
        return seq

    def _check(self, stream: str, largest: int, last_seq: int) -> None:
        """Records whose largest is ``largest`` bytes may take seqs up to ``last_seq``."""
        limit = self._writing.max_record_size
        if largest > limit:
            raise RecordTooLargeError(
                f"record of {largest} bytes exceeds the limit of {limit} "
                "(max_frame_size minus framing)"
            )
        check_last_seq(stream, last_seq)

    def _advance(self, appending: Appending, records: list[bytes], nbytes: int) -> None:
        """The stream past ``records`` (its next seqs, ``nbytes`` in all), their rows
        buffered: the tail follows."""
        appending.head += len(records)
        kept = appending.kept
        if kept is not None:
            kept_bytes = appending.kept_bytes + nbytes + RECORD_OVERHEAD * len(records)
            if kept_bytes > self._writing.log.tail_bytes:
                appending.kept = None
            else:
                kept += records
                appending.kept_bytes = kept_bytes

    @property
    def full(self) -> bool:
        """Enough rows buffered to insert them now (bounds a huge transaction's memory)."""
        return len(self.rows) >= self._writing.flush_records

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
        writing = self._writing
        remaining = iter(values)
        while chunk := list(islice(remaining, max(1, writing.flush_records - len(self.rows)))):
            if len(chunk) == 1:  # the one-record path costs less
                self.append(stream, stream_id, as_bytes(chunk[0], "value"), None, {}, ts)
            else:
                if set(map(type, chunk)) != {bytes}:
                    chunk = [as_bytes(value, "value") for value in chunk]
                first = appending.head + 1
                records = encode_values(first, ts, chunk)
                self._check(stream, max(map(len, records)), first + len(records) - 1)
                appending.max_ts = append_rows(
                    self.rows, self.times, stream_id, first, appending.max_ts, False, records, ts
                )
                self._advance(appending, records, sum(map(len, records)))
            if self.full:
                yield

    def absorb(self, later: Pending) -> None:
        """Take in what ``later``, the next transaction of this one's commit group,
        appended: the log learns the group's commits at once, as if one transaction's."""
        for name, after in later.streams.items():
            mine = self.streams.get(name)
            if mine is None:
                self.streams[name] = after
                continue
            if mine.kept is not None and after.kept is not None:
                size = mine.kept_bytes + after.kept_bytes
                if size > self._writing.log.tail_bytes:
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
