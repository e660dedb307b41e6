"""Publishing through the application's own connection, inside its own transaction.

``streamq.publish(conn, "orders", b"...")`` appends a record to the producer database
that ``conn`` is connected to, in the transaction ``conn`` has open: it commits with the
application's writes, and a rollback publishes nothing. ``conn`` is whatever the
application holds (``connections.resolve_engine``): a ``sqlite3.Connection``, a psycopg
``Connection``, a SQLAlchemy ``Connection`` or ``Session``, Django's ``connection``;
``publish_async`` takes aiosqlite, psycopg's and SQLAlchemy's asyncio ones. SQLite
databases are appended to here; PostgreSQL ones by ``engines.postgres``, whose docstring
says how it keeps seqs dense and in commit order with a per-stream lock.

Nothing is cached between calls: each publish takes the database's write lock, then
reads the stream's committed head under it (``store.APPEND_STATE_QUERY``). That is what
lets any number of processes and connections publish into one database at once: SQLite
admits one writer at a time, so seqs are dense and in commit order, by construction.

Epochs ("Epochs" in docs/protocol.md): records are stamped with the database's current
epoch. A ``Producer`` starting makes a new one, synced to disk; the first writer of a
boot that finds the epoch made in an earlier boot makes one in its own transaction.
Either way, seqs written again after a power loss carry a higher epoch than the ones
lost, which a consumer that applied the lost ones detects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import store
from .connections import resolve_async, resolve_engine, resolve_postgres_async
from .engines import postgres
from .errors import SchemaMissingError
from .protocol import DEFAULT_MAX_FRAME_SIZE, FRAME_OVERHEAD
from .records import (
    CheckedRecord,
    check_stream_name,
    checked_record,
    encode_checked,
    values_only,
)

DEFAULT_MAX_RECORD_SIZE = DEFAULT_MAX_FRAME_SIZE - FRAME_OVERHEAD


def publish(
    conn: Any,
    stream: str,
    value: bytes,
    *,
    key: bytes | None = None,
    headers: Mapping[str, bytes] | None = None,
    timestamp: int | None = None,
) -> int:
    """Append a record to ``stream`` in ``conn``'s open transaction; returns its seq.

    Consumers see it once the application's transaction commits; a rollback publishes
    nothing. The stream is created if it does not exist. The database needs the log
    tables (``streamq init DB``, or any ``Producer`` started on it once).
    """
    checked = checked_record(value, key, headers, timestamp)
    return _append(conn, check_stream_name(stream), [checked])[0]


def publish_many(conn: Any, stream: str, values: Iterable[bytes]) -> range:
    """Append one record per value (no key, no headers) in ``conn``'s open transaction;
    returns their seqs."""
    return seq_range(_append(conn, check_stream_name(stream), values_only(values)))


def _append(conn: Any, stream: str, records: Sequence[CheckedRecord]) -> list[int]:
    """``append`` on the engine ``conn`` is connected to."""
    resolved = resolve_engine(conn)
    if resolved.engine == "postgresql":
        return postgres.append(
            resolved.dbapi, stream, records, max_record_size=DEFAULT_MAX_RECORD_SIZE
        )
    return append(resolved.dbapi, stream, records)


def seq_range(seqs: list[int]) -> range:
    """Consecutive seqs as a range (empty: none were appended)."""
    return range(seqs[0], seqs[-1] + 1) if seqs else range(0)


async def publish_async(
    conn: Any,
    stream: str,
    value: bytes,
    *,
    key: bytes | None = None,
    headers: Mapping[str, bytes] | None = None,
    timestamp: int | None = None,
) -> int:
    """``publish`` for asyncio connections: aiosqlite, psycopg's ``AsyncConnection``,
    SQLAlchemy's ``AsyncConnection`` and ``AsyncSession``. The same statements, run where
    the connection runs them."""
    checked = checked_record(value, key, headers, timestamp)
    name = check_stream_name(stream)
    pg = await resolve_postgres_async(conn)
    if pg is not None:
        seqs = await postgres.append_async(
            pg, name, [checked], max_record_size=DEFAULT_MAX_RECORD_SIZE
        )
    else:
        seqs = await resolve_async(conn, lambda dbapi: append(dbapi, name, [checked]))
    return seqs[0]


def create_tables(conn: Any) -> None:
    """Create the log tables (or migrate older ones) in ``conn``'s open transaction: for
    a schema migration, e.g. Django's ``RunPython`` with ``schema_editor.connection``, or
    Alembic's ``op.get_bind()``. ``streamq init DB`` does the same from the shell (SQLite)."""
    resolved = resolve_engine(conn)
    if resolved.engine == "postgresql":
        postgres.create_schema(resolved.dbapi)
    else:
        store.create_schema(resolved.dbapi)


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
