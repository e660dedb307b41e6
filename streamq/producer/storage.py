"""One storage interface, two engines: what the producer, its log and its retention ask of
the database, whichever it is.

A serving producer talks to its database through three objects, which an engine
(``streamq/engines/sqlite``, ``streamq/engines/postgres``) implements:

- ``Storage``: the database as a whole. It opens the writer and the readers, creates the
  tables, takes the producer's epoch, and tells the producer when other processes commit
  (``watch``).
- ``Writer``: the one connection the producer writes through, and its only owner.
  Transactions, the application's statements, and every write of the log (records,
  streams, retention, compaction, registrations) go through it.
- ``Reader``: a read-only connection from a small pool, for consumers behind the
  in-memory tail, history and seeks.

Engines differ in how appenders are kept in seq order (``Features``): SQLite has one
writer at a time, so the producer catches up with other writers once at BEGIN and numbers
records from memory; on PostgreSQL writers insert records unnumbered, and the serving
producer numbers them once committed.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Awaitable, Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from ..sql import Durability

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """Chosen when a stream is created (``Producer.create_stream``), fixed afterwards."""

    key_index: bool = False  # keys indexed: ``history`` seeks instead of scanning
    compact: bool = False  # compacted periodically: only each key's latest record is kept
    notify_compacted: bool = False  # what compaction removes is published to "<name>.compacted"


@dataclass(frozen=True, slots=True)
class StreamRow:
    id: int
    name: str
    head: int
    low: int
    settings: StreamSettings = StreamSettings()
    max_ts: int | None = None  # the stream's largest timestamp so far (streamq_time)
    compacted: int = 0  # compaction ran up to this seq: seqs up to it may be absent


@dataclass(frozen=True, slots=True)
class Identity:
    producer_id: str
    epoch: int
    created: bool


@dataclass(frozen=True, slots=True)
class Limits:
    """When a registration is dropped (``Producer.register_consumer``): a consumer that
    never comes back must not make retention keep everything for ever. None: no limit."""

    max_idle_ms: int | None = None  # not connected and reporting nothing for this long
    max_bytes: int | None = None  # records it has not applied take more than this

    def __post_init__(self) -> None:
        for name in ("max_idle_ms", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class ConsumerRow:
    """A row of ``streamq_consumers``: a registration, or the last position an unregistered
    consumer reported (kept so that a restart does not make it vanish from status)."""

    consumer: str
    stream: str
    applied: int
    updated_at_ms: int = 0  # when it last reported (or registered, if it never did)
    limits: Limits = NO_LIMITS
    registered: bool = True


def consumer_rows(rows: Iterable[Any]) -> list[ConsumerRow]:
    """Rows as both engines read them: (consumer, stream, applied, updated_at,
    max_idle_ms, max_bytes, registered), oldest report first."""
    return [
        ConsumerRow(str(c), str(s), int(a), int(updated or 0), Limits(idle, size), bool(r))
        for c, s, a, updated, idle, size, r in rows
    ]


class KnownPosition(NamedTuple):
    """A consumer's position as the producer saves it (``Writer.save_positions``)."""

    consumer: str
    stream: str
    applied: int
    updated_at_ms: int  # when the consumer last reported it


@dataclass(frozen=True, slots=True)
class Changes:
    """What is committed, as the serving producer loads it or catches up with it."""

    epoch: int  # the database's epoch now
    streams: list[StreamRow]
    consumers: list[ConsumerRow]
    epoch_rows: list[tuple[int, int, int]]  # (stream id, first seq, epoch), new ones only


@dataclass(frozen=True, slots=True)
class AppendState:
    """A stream as a transaction's appends start from (SQLite: from memory, caught up at
    BEGIN under the database's write lock)."""

    id: int
    head: int
    max_ts: int | None
    last_epoch: int | None  # the epoch of the stream's last segment
    settings: StreamSettings
    epoch: int  # the database's epoch, to stamp the records with
    created: bool  # the stream was created by this transaction


# (stream id, seq, timestamp, encoded record, key or None)
LogRow = tuple[int, int, int, bytes, bytes | None]
# (first seq, count, their encodings back to back): consecutive records as read
Run = tuple[int, int, bytes]
# (stream id, timestamp, seq): the time index ("streamq_time")
TimeRow = tuple[int, int, int]
# (stream id, first seq, epoch): "streamq_epochs"
EpochRow = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Features:
    """What differs between engines, so callers branch on a capability, not a name."""

    # Writers do not number records: they insert them unnumbered, and the serving
    # producer gives them seqs once they committed (PostgreSQL: ``numbering.py``), so
    # ``publish`` returns a ``Receipt``. Otherwise (SQLite: one writer at a time) a
    # record's seq is known when it is published.
    numbered_after_commit: bool
    # One writer at a time (SQLite's write lock): a BEGIN waits while another connection
    # holds it, and that connection may commit meanwhile. Otherwise (PostgreSQL) writers
    # do not wait for each other.
    single_writer: bool
    # Tables' changes can be read from the database's own log and published as streams
    # (PostgreSQL's logical decoding: ``engines/postgres/capture.py``).
    captures: bool = False


# --- numbering after the commit (engines with ``numbered_after_commit``) -------------


@dataclass(slots=True)
class Group:
    """One transaction's records in one stream: consecutive seqs from ``first_seq``."""

    xid: int
    ids: list[int]  # their pending ids, ascending
    first_seq: int


@dataclass(slots=True)
class NumberedStream:
    """What a round gave one stream: seqs ``first`` to ``first + len(records) - 1``."""

    id: int
    name: str
    low: int
    settings: StreamSettings
    first: int
    records: list[bytes]  # their encodings, numbered
    max_ts: int | None  # the stream's largest timestamp after them
    segment: bool  # they start a segment under the round's epoch
    groups: list[Group] = field(default_factory=list)

    @property
    def head(self) -> int:
        return self.first + len(self.records) - 1


@dataclass(slots=True)
class Numbered:
    """One round: the epoch its records carry, and each stream's."""

    epoch: int
    streams: list[NumberedStream]


def group_seqs(group: Group, first_id: int, count: int) -> range | None:
    """The seqs of the ``count`` records from pending id ``first_id``, if ``group`` (of
    their transaction and stream) numbered the first."""
    offset = bisect.bisect_left(group.ids, first_id)
    if offset == len(group.ids) or group.ids[offset] != first_id:
        return None
    start = group.first_seq + offset
    return range(start, start + count)


class Reader(Protocol):
    """A read-only connection: committed records only."""

    async def read_runs(self, stream_id: int, start: int, end: int, limit: int) -> list[Run]:
        """The records with ``start <= seq < end``, in seq order, as runs of consecutive
        ones as stored (cut to the range), until ``limit`` records at least, or the end."""
        ...

    async def read_key_records(
        self, stream_id: int, key: bytes, start: int, end: int, limit: int
    ) -> list[tuple[int, bytes]]:
        """``read_records`` of one key, by the key index."""
        ...

    async def seek_time(self, stream_id: int, timestamp: int) -> int | None:
        """The first seq whose timestamp is >= ``timestamp``; None if no record's is."""
        ...

    async def low_and_compacted(self, stream_id: int) -> tuple[int, int]:
        """A stream's first held seq and compaction point as committed, by anyone."""
        ...

    async def streams(self) -> list[StreamRow]:
        """Every stream as committed (for tools that read a database without serving it)."""
        ...


class WouldWait(Exception):
    """Another connection holds the write lock: begin where waiting for it blocks nobody
    (the writer's own thread, not the event loop's)."""


class BlockingWriter(Protocol):
    """The writer connection on its own thread, for a whole transaction run there as one
    function (``Producer.run_in_transaction``, on a ``ThreadedWriter``)."""

    def begin(self, wait: bool = True) -> int | None:
        """``wait=False``: raise ``WouldWait`` at once rather than wait for the lock."""
        ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    # One member of a commit group at a time (``group_commit``): begun, then released or
    # rolled back to, before the next begins.
    def savepoint(self) -> None: ...

    def rollback_to_savepoint(self) -> None: ...

    def release_savepoint(self) -> None: ...

    def execute(self, sql: str, parameters: Any = ()) -> Any: ...

    def executemany(self, sql: str, parameters: Any) -> Any: ...

    def create_stream(self, name: str, settings: StreamSettings) -> int: ...

    def insert(
        self, rows: Sequence[LogRow], times: Sequence[TimeRow], epochs: Sequence[EpochRow]
    ) -> None: ...


class Session(Protocol):
    """A connection of its own for one thread of a ``SyncProducer``: transactions run on
    the calling thread, appending as ``streamq.publish`` does (nothing kept in memory)."""

    @property
    def in_transaction(self) -> bool: ...

    def begin(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def execute(self, sql: str, parameters: Any = ()) -> Any: ...

    def executemany(self, sql: str, parameters: Any) -> Any: ...

    def append(self, stream: str, records: Sequence[Any], max_record_size: int) -> Any:
        """Append checked records (``records.checked_record``): their seqs (a list), or
        a ``records.Receipt`` where seqs are given after the commit."""
        ...

    def head(self, stream: str) -> int | None:
        """The stream's committed head; None if there is no such stream."""
        ...

    def close(self) -> None: ...


class Writer(Protocol):
    """The producer's writer connection. Every method but ``begin`` runs in the
    transaction ``begin`` opened."""

    @property
    def threaded(self) -> ThreadedWriter | None:
        """This writer, if its connection has a thread of its own that whole
        transactions can run on (``run_in_transaction``, grouped: SQLite); else None."""
        ...

    @property
    def in_transaction(self) -> bool: ...

    async def begin(self) -> int | None:
        """Open a transaction. SQLite: holding the write lock, returns a number that
        changes whenever another connection commits (PRAGMA data_version)."""
        ...

    async def commit(self) -> None: ...

    def commit_here(self) -> bool:
        """COMMIT at once, on the calling thread, where the transaction runs there (SQLite,
        short transactions); False where it does not: ``await commit()`` then."""
        ...

    async def rollback(self) -> None: ...

    async def execute(self, sql: str, parameters: Any = ()) -> Any:
        """The application's statement (its engine's placeholders); a cursor."""
        ...

    async def executemany(self, sql: str, parameters: Any) -> Any: ...

    async def create_stream(self, name: str, settings: StreamSettings) -> int:
        """Insert a stream row; its id."""
        ...

    async def insert(
        self, rows: Sequence[LogRow], times: Sequence[TimeRow], epochs: Sequence[EpochRow]
    ) -> None:
        """Records, their time-index rows and the epoch rows of the segments they start.
        A seq already taken raises ``ConcurrentWriterError``."""
        ...

    async def truncate(self, stream_id: int, before: int) -> None:
        """Delete a stream's records with seq < ``before`` and raise its ``low``."""
        ...

    async def first_seq_since(self, stream_id: int, start: int, end: int, since_ms: int) -> int:
        """The first seq in ``[start, end)`` published at or after ``since_ms`` (``end``
        if none); reads only what it skips."""
        ...

    async def bytes_between(self, stream_id: int, start: int, end: int) -> int:
        """The stored size of the records with ``start <= seq < end``."""
        ...

    async def seq_after_bytes(
        self, stream_id: int, start: int, end: int, excess: int
    ) -> tuple[int, int]:
        """Dropping records from ``start`` until ``excess`` bytes are gone: the first seq
        kept, and the bytes dropped."""
        ...

    async def compaction_candidates(
        self, stream_id: int, low: int, after: int, through: int
    ) -> list[tuple[int, bytes, bytes]]:
        """(seq, key, encoded record) of every held record whose key reappears in
        ``(after, through]``, grouped by key, in seq order within each key."""
        ...

    async def delete_compacted(self, stream_id: int, seqs: list[int], through: int) -> None:
        """Delete what compaction removed, and note how far it ran."""
        ...

    async def register_consumer(
        self, consumer: str, stream: str, applied: int, limits: Limits
    ) -> int:
        """Register with ``limits`` (an existing registration keeps the further position
        and takes the new limits); the position."""
        ...

    async def unregister_consumer(self, consumer: str, stream: str) -> bool:
        """Remove a registration; False if there was none. Its position stays known (an
        unregistered row) if it had applied anything."""
        ...

    async def forget_consumer(self, consumer: str, stream: str) -> bool:
        """Delete the consumer's row, registered or not; False if there was none."""
        ...

    async def save_positions(
        self, positions: Sequence[KnownPosition], forgotten: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Store reported positions (a registration keeps its row and flag; another
        consumer's is inserted unregistered), positions only moving forward; and delete
        the unregistered rows of ``forgotten`` (consumer, stream) pairs."""
        ...


class ThreadedWriter(Writer, Protocol):
    """A writer whose connection has a thread of its own (SQLite's aiosqlite)."""

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(blocking_writer, *args)`` on the connection's own thread (one hop)."""
        ...

    @property
    def inline(self) -> BlockingWriter:
        """The blocking writer, for use on the event loop's thread when nothing is queued
        on its own (a short transaction then costs no hop)."""
        ...


class UnnumberedWriter(Writer, Protocol):
    """The writer of an engine with ``numbered_after_commit``."""

    async def append(self, stream: str, records: Sequence[Any], max_record_size: int) -> Any:
        """Publish checked records (``records.checked_record``) unnumbered: a
        ``records.Receipt``."""
        ...


class Events:
    """What a ``Watch`` is made of: events noted as they come, ``wait`` for the first."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._first_event_at: float | None = None

    def wake(self) -> None:
        """Note an event (a commit this process knows of, or one the watch saw)."""
        if self._first_event_at is None:
            self._first_event_at = time.monotonic()
        self._event.set()

    async def wait(self, timeout: float) -> float | None:
        """Wait for an event, at most ``timeout`` seconds: when the first event since the
        last ``wait`` came (``time.monotonic``), or None after the timeout."""
        if not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._event.wait()
        self._event.clear()
        first, self._first_event_at = self._first_event_at, None
        return first


class Watch(Protocol):
    """Wakes the serving producer when another process may have committed."""

    @property
    def active(self) -> bool:
        """Events come as commits happen; otherwise only ``wait``'s timeout wakes."""
        ...

    async def start(self) -> None: ...

    async def wait(self, timeout: float) -> float | None:
        """The time of the first event within ``timeout`` seconds; None if none came."""
        ...

    def wake(self) -> None:
        """End the current ``wait`` now (this process knows of a commit)."""
        ...

    async def close(self) -> None: ...


class Storage(Protocol):
    """A producer's database."""

    features: Features
    where: str  # names the database in messages: a file, or a server and database

    @property
    def writer(self) -> Writer: ...

    async def open(self, durability: Durability) -> Identity:
        """Open the writer, create or migrate the tables, and take a new epoch, durably."""
        ...

    async def open_readers(self, count: int) -> None: ...

    def reader(self) -> contextlib.AbstractAsyncContextManager[Reader]: ...

    async def load(self) -> Changes:
        """Everything committed: streams, registrations, the epoch, every epoch row."""
        ...

    async def version(self) -> Any:
        """Changes whenever anyone commits (compare with ``==``). Call it holding the
        producer's lock: nothing else is under way on the writer connection then."""
        ...

    async def changes(self, known: dict[int, tuple[int, int]], *, reading: bool = False) -> Changes:
        """What a catch-up needs, given ``known`` ({stream id: (head, last first seq)}):
        every stream and registration, and the epoch rows after the known ones.
        ``reading``: on a read connection, not the writer's (it may be waiting)."""
        ...

    def watch(self) -> Watch: ...

    def session(self, durability: Durability) -> Session:
        """A new connection for the calling thread (blocking)."""
        ...

    async def claim_serving(self) -> None:
        """Become the one process serving this database, or raise ``AlreadyServedError``."""
        ...

    async def serving(self, address: str) -> None:
        """Note where this process serves (for the next one's error message)."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class OpenTransactions:
    """Transactions that published and have not ended, as last looked at: their records
    are numbered once they commit (and nobody else's wait for them)."""

    count: int = 0
    oldest_start: float | None = None  # Unix time the oldest began

    def oldest_age(self, now: float) -> float:
        """Seconds the oldest has been open (0 with none)."""
        return 0.0 if self.oldest_start is None else max(0.0, now - self.oldest_start)


class Numbering(Protocol):
    """The serving producer's numbering of records published unnumbered."""

    unserved: Container[str]  # streams of rounds numbered and not served yet
    armed: bool  # idle, waiting for the doorbell
    idle_check: float  # seconds: armed, a round anyway after this long
    open_transactions: OpenTransactions  # looked at every second or so

    def status(self) -> dict[str, Any]:
        """For ``streamq status``: the publishing path, and why it is that one."""
        ...

    async def run(self) -> None:
        """Number, and serve once flushed, for ever."""
        ...

    async def close(self) -> None: ...


class NumberingStorage(Storage, Protocol):
    """The storage of an engine with ``numbered_after_commit``."""

    def numberer(
        self,
        serve: Callable[[Numbered], None],
        resync: Callable[[], Awaitable[Any]],
        producer_id: str,
    ) -> Numbering:
        """The serving producer's numbering (``engines/postgres/walpath.WalNumberer``):
        ``serve`` is given each round once flushed; ``resync`` is awaited after a
        failure, once what committed is flushed."""
        ...


class CapturingStorage(Storage, Protocol):
    """The storage of an engine with ``captures``."""

    def capture(
        self,
        streams: Mapping[str, str],
        producer_id: str,
        max_record_size: int,
        serve: Callable[[Numbered], None],
        resync: Callable[[], Awaitable[Any]],
        snapshot: bool = False,
    ) -> Capturing:
        """The serving producer's capture of ``streams`` (``{schema.table: stream}``),
        each table's rows first with ``snapshot``; ``serve`` and ``resync`` as for the
        numbering (``NumberingStorage.numberer``): capture numbers its streams itself."""
        ...


class Capturing(Protocol):
    """A capture loop (``engines/postgres/capture.Capture``)."""

    slot: str  # where it reads the changes from (a replication slot's name)
    lsn: int  # every transaction ending at or before it is published
    captured: int  # changes published by this process
    retained_bytes: int  # WAL the slot holds back, as last seen

    def status(self) -> dict[str, Any]:
        """For ``streamq status``."""
        ...

    async def prepare(self) -> Any:
        """Check and make what capture needs; raises saying what is wrong."""
        ...

    async def run(self) -> None:
        """For ever, until cancelled."""
        ...

    async def close(self) -> None: ...
