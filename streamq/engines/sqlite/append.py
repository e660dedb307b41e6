"""The SQLite engine's append path: records appended through any connection to a SQLite
producer database, in its open transaction.

Nothing is cached between calls: each append takes the database's write lock, then reads
the stream's committed head under it (``store.APPEND_STATE_QUERY``). That is what lets
any number of processes and connections publish into one database at once: SQLite
admits one writer at a time, so seqs are dense and in commit order, by construction.

Epochs ("Epochs" in docs/protocol.md): records are stamped with the database's current
epoch. A ``Producer`` starting makes a new one, synced to disk; the first writer of a
boot that finds the epoch made in an earlier boot makes one in its own transaction.
Either way, seqs written again after a power loss carry a higher epoch than the ones
lost, which a consumer that applied the lost ones detects. The rest of the SQLite
engine's SQL is in ``store.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ... import store
from ...blocking import run_on_thread
from ...errors import SchemaMissingError
from ...protocol import DEFAULT_MAX_FRAME_SIZE, FRAME_OVERHEAD
from ...records import CheckedRecord, encode_checked

DEFAULT_MAX_RECORD_SIZE = DEFAULT_MAX_FRAME_SIZE - FRAME_OVERHEAD
create_schema = store.create_schema


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
        try:
            cursor.execute(store.TAKE_WRITE_LOCK)
            cursor.execute(store.APPEND_STATE_QUERY, (stream,))
            state = cursor.fetchone()
        except Exception as exc:
            if "no such table: streamq_" in str(exc):
                raise SchemaMissingError(_no_tables(dbapi)) from exc
            raise
        epoch, boot, version, stream_id, key_index, head, max_ts, last_epoch = state
        if version != store.SCHEMA_VERSION:
            raise SchemaMissingError(_old_schema(dbapi, version))
        epoch = int(epoch)
        if boot != store.boot_id():
            # The first writer since the machine booted: a new epoch, committed with the
            # first records that use it (see the module docstring).
            epoch += 1
            cursor.executemany(store.SET_META, [("epoch", epoch), ("boot_id", store.boot_id())])
        if stream_id is None:
            cursor.execute(store.CREATE_DEFAULT_STREAM, (stream,))
            stream_id, key_index, head = cursor.lastrowid, 0, 0
        rows, times = [], []
        seqs = list(range(head + 1, head + 1 + len(records)))
        if seqs and seqs[-1] > store.MAX_STORED_SEQ:
            raise OverflowError(f"stream {stream!r} has reached the last seq")
        encoded = encode_checked(seqs, records, max_record_size)
        for seq, (_, key, _, ts), record in zip(seqs, records, encoded, strict=True):
            position = store.pos(stream_id, seq)
            rows.append((position, ts, record, key if key_index else None))
            if max_ts is None or ts > max_ts:  # "streamq_time" in store.py
                max_ts = ts
                times.append((stream_id, ts, position))
        if rows and last_epoch != epoch:
            cursor.execute(store.INSERT_EPOCHS, (stream_id, seqs[0], epoch))
        cursor.executemany(store.INSERT_RECORDS, rows)
        if times:
            cursor.executemany(store.INSERT_TIMES, times)
        return seqs
    finally:
        cursor.close()


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


def _database_file(dbapi: Any) -> str:
    """The main database's file, for error messages."""
    try:
        cursor = dbapi.cursor()
        cursor.execute("PRAGMA database_list")
        for _, name, file in cursor.fetchall():
            if name == "main":
                return repr(file or ":memory:")
    except Exception:  # a message helper: never hide the real error
        pass
    return "this database"


def _no_tables(dbapi: Any) -> str:
    return (
        f"{_database_file(dbapi)} has no streamq log tables: create them once with "
        "'streamq init DB', by starting a Producer on it, or by the migration in the "
        "README ('Publishing from your own connection')"
    )


def _old_schema(dbapi: Any, version: Any) -> str:
    return (
        f"{_database_file(dbapi)} has streamq schema version {version!r}, this streamq "
        f"writes version {store.SCHEMA_VERSION}: start a Producer on it once to migrate"
    )
