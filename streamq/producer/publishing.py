"""Publishing through the application's own connection, inside its own transaction.

``streamq.publish(conn, "orders", b"...")`` appends a record to the producer database
that ``conn`` is connected to, in the transaction ``conn`` has open: it commits with the
application's writes, and a rollback publishes nothing. ``conn`` is whatever the
application holds (``app_connection.resolve_engine``): a ``sqlite3.Connection``, a psycopg
``Connection``, a SQLAlchemy ``Connection`` or ``Session``, Django's ``connection``;
``publish_async`` takes aiosqlite, psycopg's, asyncpg's and SQLAlchemy's asyncio ones.

Each engine keeps its own SQL, and says why its seqs are dense and in commit order
(``engines.sqlite``: SQLite's one writer; ``engines.postgres``: records inserted
unnumbered, numbered by the serving producer once committed, so ``publish`` returns a
``Receipt`` there); this module only checks the records and hands them to the
connection's engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..engines import for_connection, for_connection_async
from ..engines.app_connection import CREATE_TABLES
from ..records import (
    DEFAULT_MAX_RECORD_SIZE,
    CheckedRecord,
    Receipt,
    check_stream_name,
    checked_record,
    seq_range,
    values_only,
)


def publish(
    conn: Any,
    stream: str,
    value: bytes,
    *,
    key: bytes | None = None,
    headers: Mapping[str, bytes] | None = None,
    timestamp: int | None = None,
) -> int | Receipt:
    """Append a record to ``stream`` in ``conn``'s open transaction; returns its seq
    (SQLite), or a ``Receipt`` (PostgreSQL: seqs are given after the commit, by the
    serving producer).

    Consumers see it once the application's transaction commits; a rollback publishes
    nothing. The stream is created if it does not exist. The database needs the log
    tables (``streamq init DB``, or any ``Producer`` started on it once).
    """
    checked = checked_record(value, key, headers, timestamp)
    published = _append(conn, check_stream_name(stream), [checked])
    return published if isinstance(published, Receipt) else published[0]


def publish_many(conn: Any, stream: str, values: Iterable[bytes]) -> range | Receipt:
    """Append one record per value (no key, no headers) in ``conn``'s open transaction;
    returns their seqs (or a ``Receipt``, as ``publish``)."""
    published = _append(conn, check_stream_name(stream), values_only(values))
    return published if isinstance(published, Receipt) else seq_range(published)


def _append(conn: Any, stream: str, records: Sequence[CheckedRecord]) -> list[int] | Receipt:
    """``append`` on the engine ``conn`` is connected to."""
    engine, dbapi = for_connection(conn)
    return engine.append(dbapi, stream, records, max_record_size=DEFAULT_MAX_RECORD_SIZE)


async def publish_async(
    conn: Any,
    stream: str,
    value: bytes,
    *,
    key: bytes | None = None,
    headers: Mapping[str, bytes] | None = None,
    timestamp: int | None = None,
) -> int | Receipt:
    """``publish`` for asyncio connections: aiosqlite, psycopg's ``AsyncConnection``,
    asyncpg's ``Connection`` (or a pool's), SQLAlchemy's ``AsyncConnection`` and
    ``AsyncSession``. The same statements, run where the connection runs them."""
    checked = checked_record(value, key, headers, timestamp)
    published = await _append_async(conn, check_stream_name(stream), [checked])
    return published if isinstance(published, Receipt) else published[0]


async def publish_many_async(conn: Any, stream: str, values: Iterable[bytes]) -> range | Receipt:
    """``publish_many`` for asyncio connections (those of ``publish_async``)."""
    published = await _append_async(conn, check_stream_name(stream), values_only(values))
    return published if isinstance(published, Receipt) else seq_range(published)


async def _append_async(
    conn: Any, stream: str, records: Sequence[CheckedRecord]
) -> list[int] | Receipt:
    engine, dbapi = await for_connection_async(conn)
    return await engine.append_async(
        dbapi, stream, records, max_record_size=DEFAULT_MAX_RECORD_SIZE
    )


def create_tables(conn: Any) -> None:
    """Create the log tables (or migrate older ones) in ``conn``'s open transaction: for
    a schema migration, e.g. Django's ``RunPython`` with ``schema_editor.connection``, or
    Alembic's ``op.get_bind()``. ``streamq init DB`` does the same from the shell (SQLite)."""
    engine, dbapi = for_connection(conn, CREATE_TABLES)
    engine.create_schema(dbapi)


async def create_tables_async(conn: Any) -> None:
    """``create_tables`` for asyncio connections (those of ``publish_async``). Through
    SQLAlchemy's, ``await conn.run_sync(streamq.create_tables)`` does the same, as an
    Alembic migration of the async template does."""
    engine, dbapi = await for_connection_async(conn, CREATE_TABLES)
    await engine.create_schema_async(dbapi)
