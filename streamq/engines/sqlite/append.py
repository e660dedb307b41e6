"""The SQLite engine's append path: records appended through any connection to a SQLite
producer database, in its open transaction.

Nothing is cached between calls: each append numbers its records from what is committed,
holding the database's write lock. That is what lets any number of processes and
connections publish into one database at once: SQLite admits one writer at a time, so
seqs are dense and in commit order, by construction.

One statement does it all (``APPEND``): an INSERT of the records, unnumbered, whose pos
(hence seqs) comes from the stream's ``max(pos)``. A write statement takes the write lock
before it reads, so the head it reads is never stale, whatever began the transaction. It
inserts nothing unless the append needs nothing else: the stream exists, the database's
epoch is the stream's last segment's, that epoch was made in this boot, and the schema is
this version's. Then the full path runs (``append_from``): the lock, the state
(``storage.APPEND_STATE_QUERY``), a new epoch or stream if needed, numbered records. The
time index of unnumbered rows is written by a trigger, in the same statement
(``storage``). Encoding needs no seq, so the lock is held for one statement.

Epochs ("Epochs" in docs/protocol.md): records are stamped with the database's current
epoch. A ``Producer`` starting makes a new one, synced to disk; the first writer of a
boot that finds the epoch made in an earlier boot makes one in its own transaction.
Either way, seqs written again after a power loss carry a higher epoch than the ones
lost, which a consumer that applied the lost ones detects. The rest of the SQLite
engine's SQL is in ``storage.py``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from ...errors import SchemaMissingError
from ...producer.append_rule import append_rows, check_last_seq, segment_row
from ...producer.storage import LogRow, TimeRow
from ...protocol import SEQ_GROWTH, encode_record
from ...records import (
    DEFAULT_MAX_RECORD_SIZE,
    MAX_SEQ,
    CheckedRecord,
    Unnumbered,
    encode_checked,
    encode_unnumbered,
)
from ...sql import Durability, run_on_thread
from . import storage
from .checkpoints import WRITER_AUTOCHECKPOINT

# A row of ``storage.APPEND_STATE_QUERY``: the database's epoch, the boot it was made in
# and the schema version; the stream's id, key_index, head, largest timestamp and the
# epoch of its last segment.
AppendState = tuple[Any, Any, Any, Any, Any, int, Any, Any]
# What an append needs of a stream, checked holding the write lock: its id, key_index,
# head and largest timestamp, the database's epoch and that of the stream's last segment.
Known = tuple[int, bool, int, int | None, int, int | None]

_BITS, _MASK = storage.SEQ_BITS, storage.MAX_STORED_SEQ
_STREAM_ID = "(SELECT id FROM streamq_streams WHERE name = ?1)"
_HEAD = f"""(SELECT max(low - 1, coalesce((SELECT max(pos) FROM streamq_log
        WHERE pos > (id << {_BITS}) AND pos < ((id + 1) << {_BITS})), 0) & {_MASK})
    FROM streamq_streams WHERE name = ?1)"""
_META = "(SELECT value FROM streamq_meta WHERE key = '{}')"
# The one-statement append (module docstring): ?1 the stream, ?2 the number of records,
# ?3 this process's boot id, ?4 their largest timestamp, ?5 the records unnumbered, back
# to back, ?6 the key of a lone record. A row whose timestamp is NULL is not inserted
# (OR IGNORE): that is how it inserts nothing where the full path must run. VALUES, not
# SELECT: an INSERT ... SELECT that reads its own table goes through a temporary table.
APPEND = f"""INSERT OR IGNORE INTO streamq_log (pos, ts, record, key, count) VALUES (
    ({_STREAM_ID} << {_BITS}) | ({_HEAD} + ?2),
    CASE WHEN {_HEAD} <= {MAX_SEQ} - ?2
        AND {_META.format("epoch")} = (SELECT epoch FROM streamq_epochs
            WHERE stream_id = {_STREAM_ID} ORDER BY first_seq DESC LIMIT 1)
        AND {_META.format("boot_id")} = ?3
        AND {_META.format("schema_version")} = {storage.SCHEMA_VERSION}
    THEN ?4 END,
    ?5,
    CASE WHEN ?6 IS NOT NULL AND (SELECT key_index FROM streamq_streams WHERE name = ?1)
        THEN ?6 END,
    ?2)"""


def append(
    dbapi: Any,
    stream: str,
    records: Sequence[CheckedRecord],
    *,
    max_record_size: int = DEFAULT_MAX_RECORD_SIZE,
) -> list[int]:
    """Append ``records`` to ``stream`` through a DB-API connection to a SQLite producer
    database, in its open transaction; returns their seqs (none for no records)."""
    if not records:
        return []
    seqs = _append_at_once(dbapi, stream, records, max_record_size)
    if seqs is not None:
        return seqs
    cursor = dbapi.cursor()
    try:
        return append_from(cursor, stream, records, max_record_size)[0]
    finally:
        cursor.close()


def _append_at_once(
    dbapi: Any, stream: str, records: Sequence[CheckedRecord], max_record_size: int
) -> list[int] | None:
    """``APPEND``: the seqs, or None where the full path must run (nothing written)."""
    count = len(records)
    if count == 1:  # a publish: the path to keep short
        value, key, headers, ts = records[0]
        record = encode_record(0, ts, key, value, headers)
        if len(record) + SEQ_GROWTH > max_record_size:
            return None  # the full path refuses it
    else:
        key, ts = None, records[0][3]
        if count > storage.BATCH_RECORDS or any(r[1] is not None or r[3] != ts for r in records):
            return None  # keyed records may need rows of their own; the trigger indexes a
            # row's first record, for one timestamp
        record = b"".join(encode_unnumbered(records, max_record_size))
        if len(record) > storage.BATCH_BYTES:
            return None
    try:
        cursor = dbapi.execute(APPEND, (stream, count, storage.boot_id(), ts, record, key))
    except sqlite3.OperationalError as exc:
        if storage.busy(exc):
            raise
        return None  # no tables, or an older version's: the full path says what to do
    if cursor.rowcount != 1:
        return None
    last = cursor.lastrowid & _MASK
    return [last] if count == 1 else list(range(last - count + 1, last + 1))


def append_from(
    cursor: Any, stream: str, records: Sequence[CheckedRecord], max_record_size: int
) -> tuple[list[int], Known]:
    """``append`` on a cursor of the connection, from the state read here holding the
    write lock; returns the seqs and the state the append leaves (``append_known``)."""
    return append_known(cursor, stream, records, max_record_size, _known(cursor, stream))


def append_unnumbered(dbapi: Any, stream: str, records: Unnumbered) -> range:
    """Append records encoded already (``records.Unnumbered``) to ``stream`` through a
    DB-API connection to a SQLite producer database, in its open transaction; returns
    their seqs. They are stored as they are, unnumbered (``storage.unnumbered_rows``):
    no step a record here but cutting their runs into rows."""
    cursor = dbapi.cursor()
    try:
        stream_id, key_index, head, _, epoch, last_epoch = _known(cursor, stream)
        first = head + 1
        check_last_seq(stream, first + len(records) - 1)
        segment = segment_row(stream_id, first, last_epoch, epoch)
        if records and segment is not None:
            cursor.execute(storage.INSERT_EPOCHS, segment)
        rows = storage.unnumbered_rows(stream_id, first, records, key_index)
        storage.insert(cursor, storage.INSERT_RECORDS, rows)
        return range(first, first + len(records))
    finally:
        cursor.close()


def _known(cursor: Any, stream: str) -> Known:
    """What an append needs of ``stream``, read taking the write lock; with a new epoch
    where none was made in this boot, and the stream created where it did not exist
    (both in the open transaction)."""
    try:
        cursor.execute(storage.TAKE_WRITE_LOCK)
        cursor.execute(storage.APPEND_STATE_QUERY, (stream,))
        row: AppendState = cursor.fetchone()
    except Exception as exc:
        if "no such table: streamq_" in str(exc):
            raise SchemaMissingError(_no_tables(cursor)) from exc
        raise
    epoch, boot, version, stream_id, key_index, head, max_ts, last_epoch = row
    if version != storage.SCHEMA_VERSION:
        raise SchemaMissingError(_old_schema(cursor, version))
    epoch = int(epoch)
    if boot != storage.boot_id():
        # The first writer since the machine booted: a new epoch, committed with the
        # first records that use it (see the module docstring).
        epoch = storage.next_epoch(epoch)
        cursor.executemany(storage.SET_META, [("epoch", epoch), ("boot_id", storage.boot_id())])
    if stream_id is None:
        cursor.execute(storage.CREATE_DEFAULT_STREAM, (stream,))
        stream_id, key_index, head = cursor.lastrowid, 0, 0
    return (stream_id, bool(key_index), head, max_ts, epoch, last_epoch)


def append_known(
    cursor: Any, stream: str, records: Sequence[CheckedRecord], max_record_size: int, known: Known
) -> tuple[list[int], Known]:
    """``records`` numbered from ``known`` (read holding the write lock, or left by this
    connection's own appends since, while nobody else committed) and inserted; the seqs
    and the state they leave. A session's every transaction runs this, so one record
    takes no step that a run of them needs."""
    stream_id, key_index, head, max_ts, epoch, last_epoch = known
    first, last = head + 1, head + len(records)
    check_last_seq(stream, last)
    encoded = encode_checked(range(first, last + 1), records, max_record_size)
    rows: list[LogRow] = []
    times: list[TimeRow] = []
    if len(records) == 1:
        _, key, _, ts = records[0]
        stamps: Sequence[int] = (ts,)
        keys: Sequence[bytes | None] = (key,)
    else:
        stamps = [ts for _, _, _, ts in records]
        keys = [key for _, key, _, _ in records]
    max_ts = append_rows(rows, times, stream_id, first, max_ts, key_index, encoded, stamps, keys)
    segment = segment_row(stream_id, first, last_epoch, epoch)
    if segment is not None:
        cursor.execute(storage.INSERT_EPOCHS, segment)
    storage.insert(cursor, storage.INSERT_RECORDS, storage.stored_rows(rows))
    if times:
        timed = [(s, ts, storage.pos(s, seq)) for s, ts, seq in times]
        storage.insert(cursor, storage.INSERT_TIMES, timed)
    return list(range(first, last + 1)), (stream_id, key_index, last, max_ts, epoch, epoch)


class SQLiteSession(storage.SQLiteBlockingWriter):
    """One thread's own connection to a producer database (``storage.Session``). It sees
    its own COMMIT and ROLLBACK, so it keeps each stream's append state as its committed
    appends left it, while ``PRAGMA data_version`` says no other connection committed:
    then an append is one INSERT of rows numbered here. Once another connection has
    committed, it appends as ``streamq.publish`` does (``APPEND``), and reads the state
    again (the full path) in its next transaction that finds nobody else committed.

    ``checkpointed``: the producer's ``Checkpointer`` copies the WAL back, so this
    connection's COMMITs leave that to it, as the producer's writer does
    (``checkpoints.take_over``): one COMMIT in a few hundred would otherwise wait for the
    checkpoint's two fsyncs (measured: 5 µs an order of about 30, one thread at full
    speed)."""

    def __init__(self, path: str, durability: Durability, *, checkpointed: bool = False) -> None:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA synchronous={durability.upper()}")
        conn.execute(f"PRAGMA busy_timeout={storage.BUSY_TIMEOUT_MS}")
        if checkpointed:
            conn.execute(f"PRAGMA wal_autocheckpoint={WRITER_AUTOCHECKPOINT}")
        super().__init__(conn)
        self._committed: dict[str, Known] = {}  # as of ``_version``
        self._appended: dict[str, Known] = {}  # by the open transaction
        self._version: int | None = None  # PRAGMA data_version when last read

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def begin(self) -> None:  # type: ignore[override]  # no version: data_version at append
        self._own.execute("BEGIN IMMEDIATE")  # the write lock, held to COMMIT

    def append(
        self, stream: str, records: Sequence[CheckedRecord], max_record_size: int
    ) -> list[int]:
        if not records:
            return []
        known = self._appended.get(stream)
        if known is None:
            version = self._own.execute("PRAGMA data_version").fetchone()[0]
            if version != self._version:  # another connection committed: what we kept is old
                self._committed.clear()
                self._version = version
                seqs = _append_at_once(self.conn, stream, records, max_record_size)
                if seqs is not None:
                    return seqs
            known = self._committed.get(stream)
            if known is None:
                seqs, self._appended[stream] = append_from(
                    self._own, stream, records, max_record_size
                )
                return seqs
        seqs, self._appended[stream] = append_known(
            self._own, stream, records, max_record_size, known
        )
        return seqs

    def commit(self) -> None:
        try:
            super().commit()
        except BaseException:
            self._forget()
            raise
        self._committed.update(self._appended)
        self._appended.clear()

    def rollback(self) -> None:
        self._forget()
        super().rollback()

    def _forget(self) -> None:
        self._committed.clear()
        self._appended.clear()

    def head(self, stream: str) -> int | None:
        row = self.conn.execute(storage.HEAD_QUERY, (stream,)).fetchone()
        return None if row is None else int(row[0])

    def close(self) -> None:
        self.conn.close()


async def append_async(
    conn: Any,
    stream: str,
    records: Sequence[CheckedRecord],
    *,
    max_record_size: int = DEFAULT_MAX_RECORD_SIZE,
) -> list[int]:
    """``append`` through an aiosqlite connection, on its thread (one hop)."""
    seqs: list[int] = await run_on_thread(
        conn, lambda: append(conn._conn, stream, records, max_record_size=max_record_size)
    )
    return seqs


def _no_tables(cursor: Any) -> str:
    return (
        f"{storage.database_file(cursor)} has no streamq log tables: create them once with "
        "'streamq init DB', by starting a Producer on it, or in a migration with "
        "streamq.create_tables(conn) (docs/guides/producing.md)"
    )


def _old_schema(cursor: Any, version: Any) -> str:
    return (
        f"{storage.database_file(cursor)} has streamq schema version {version!r}, this streamq "
        f"writes version {storage.SCHEMA_VERSION}: start a Producer on it once to migrate"
    )
