"""The SQLite engine's append path: records appended through any connection to a SQLite
producer database, in its open transaction.

On the application's connection nothing is cached between calls: each append takes the
database's write lock, then reads the stream's committed head under it
(``storage.APPEND_STATE_QUERY``). That is what lets any number of processes and
connections publish into one database at once: SQLite admits one writer at a time, so
seqs are dense and in commit order, by construction. A ``SQLiteSession`` (a
``SyncProducer``'s connection for one thread), which sees its own COMMIT and ROLLBACK,
keeps what its committed appends left instead, and reads it again only when ``PRAGMA
data_version`` says another connection committed since.

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
from ...records import DEFAULT_MAX_RECORD_SIZE, CheckedRecord, encode_checked
from ...sql import Durability, run_on_thread
from . import storage

# A row of ``storage.APPEND_STATE_QUERY``: the database's epoch, the boot it was made in
# and the schema version; the stream's id, key_index, head, largest timestamp and the
# epoch of its last segment.
AppendState = tuple[Any, Any, Any, Any, Any, int, Any, Any]


def append(
    dbapi: Any,
    stream: str,
    records: Sequence[CheckedRecord],
    *,
    max_record_size: int = DEFAULT_MAX_RECORD_SIZE,
) -> list[int]:
    """Append ``records`` to ``stream`` through a DB-API connection to a SQLite producer
    database, in its open transaction; returns their seqs."""
    cursor = dbapi.cursor()
    try:
        return append_from(cursor, stream, records, max_record_size, None)[0]
    finally:
        cursor.close()


def append_from(
    cursor: Any,
    stream: str,
    records: Sequence[CheckedRecord],
    max_record_size: int,
    state: AppendState | None,
) -> tuple[list[int], AppendState]:
    """``append`` on a cursor of the connection, from ``state`` when the caller knows it
    holding the write lock (else read here); returns the seqs and the state the append
    leaves."""
    row: Any = state  # a plain row read here: None where a stream has no records yet
    if row is None:
        try:
            cursor.execute(storage.TAKE_WRITE_LOCK)
            cursor.execute(storage.APPEND_STATE_QUERY, (stream,))
            row = cursor.fetchone()
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
        boot = storage.boot_id()
        cursor.executemany(storage.SET_META, [("epoch", epoch), ("boot_id", boot)])
    if stream_id is None:
        cursor.execute(storage.CREATE_DEFAULT_STREAM, (stream,))
        stream_id, key_index, head = cursor.lastrowid, 0, 0
    first = head + 1
    check_last_seq(stream, first + len(records) - 1)
    seqs = list(range(first, first + len(records)))
    encoded = encode_checked(seqs, records, max_record_size)
    rows: list[LogRow] = []
    times: list[TimeRow] = []
    stamps = [ts for _, _, _, ts in records]
    keys = [key for _, key, _, _ in records]
    max_ts = append_rows(
        rows, times, stream_id, first, max_ts, bool(key_index), encoded, stamps, keys
    )
    segment = segment_row(stream_id, first, last_epoch, epoch)
    if rows and segment is not None:
        cursor.execute(storage.INSERT_EPOCHS, segment)
        last_epoch = epoch
    _insert(cursor, storage.INSERT_RECORDS, storage.stored_rows(rows))
    _insert(cursor, storage.INSERT_TIMES, [(s, ts, storage.pos(s, seq)) for s, ts, seq in times])
    left = (epoch, boot, version, stream_id, key_index, head + len(seqs), max_ts, last_epoch)
    return seqs, left


def _insert(cursor: Any, sql: str, rows: Sequence[Sequence[Any]]) -> None:
    """``rows`` inserted; one (a one-record transaction's) without ``executemany``'s setup."""
    if len(rows) == 1:
        cursor.execute(sql, rows[0])
    elif rows:
        cursor.executemany(sql, rows)


class SQLiteSession(storage.SQLiteBlockingWriter):
    """One thread's own connection to a producer database (``storage.Session``). Keeps
    each stream's append state as its committed appends left it (module docstring)."""

    def __init__(self, path: str, durability: Durability) -> None:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA synchronous={durability.upper()}")
        conn.execute("PRAGMA busy_timeout=10000")
        super().__init__(conn)
        self._committed: dict[str, AppendState] = {}  # as of ``_version``
        self._appended: dict[str, AppendState] = {}  # by the open transaction
        self._version: int | None = None  # PRAGMA data_version when last read

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def begin(self) -> None:  # type: ignore[override]  # no version: data_version at append
        self._own.execute("BEGIN IMMEDIATE")  # the write lock, held to COMMIT

    def append(
        self, stream: str, records: Sequence[CheckedRecord], max_record_size: int
    ) -> list[int]:
        state = self._appended.get(stream)
        if state is None:
            version = self._own.execute("PRAGMA data_version").fetchone()[0]
            if version != self._version:  # another connection committed: read again
                self._committed.clear()
                self._version = version
            state = self._committed.get(stream)
        seqs, self._appended[stream] = append_from(
            self._own, stream, records, max_record_size, state
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
