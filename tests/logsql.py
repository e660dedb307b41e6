"""What a producer's log holds, read straight from its database, either engine: for tests
that check the tables themselves, not what the producer says about them."""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any

import psycopg

from streamq.engines import is_postgres_url
from streamq.engines.sqlite.storage import unpack_rows

SEQ_MASK = (1 << 40) - 1  # SQLite packs (stream id, seq) in its rowid


def _one(database: str, sqlite_sql: str, postgres_sql: str, params: tuple[Any, ...]) -> Any:
    if is_postgres_url(database):
        with psycopg.connect(database) as conn:
            return conn.execute(postgres_sql, params).fetchall()
    with contextlib.closing(sqlite3.connect(database)) as db:
        return db.execute(sqlite_sql, params).fetchall()


def stored_seqs(database: str, stream_id: int = 1) -> list[int]:
    """The seqs a stream's records are stored under, in order (on SQLite, a row holds a
    run of records: ``unpack_rows``; on PostgreSQL, one record)."""
    rows = _one(
        database,
        "SELECT pos, count, record FROM streamq_log WHERE pos >> 40 = ? ORDER BY pos",
        "SELECT seq, 1, ''::bytea FROM streamq_log WHERE stream_id = %s ORDER BY seq",
        (stream_id,),
    )
    return [position & SEQ_MASK for position, _ in unpack_rows(rows)]


def stored_bytes(database: str) -> int:
    """The size of every stored record."""
    ((total,),) = _one(
        database,
        "SELECT coalesce(sum(length(record)), 0) FROM streamq_log",
        "SELECT coalesce(sum(length(record)), 0) FROM streamq_log",
        (),
    )
    return int(total)


def stored_keys(database: str, stream_id: int = 1) -> int:
    """How many of a stream's records have their key stored (the key index)."""
    ((count,),) = _one(
        database,
        "SELECT count(key) FROM streamq_log WHERE pos >> 40 = ?",
        "SELECT count(key) FROM streamq_log WHERE stream_id = %s",
        (stream_id,),
    )
    return int(count)
