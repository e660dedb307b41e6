"""The SQL behind the log, in the producer's own SQLite database.

Four tables, all prefixed ``streamq_`` so they sit beside the application's own:

- ``streamq_meta``: the producer's stable id (made once, when the database is
  created) and its epoch (bumped at every start).
- ``streamq_streams``: one row per stream with its ``low`` (first seq still
  held). The head is derived, never written per commit: the last seq in the log,
  or ``low - 1`` when retention emptied the stream, so seqs are never reused.
- ``streamq_log``: the records. ``pos`` packs (stream id, seq) into SQLite's
  rowid, so appends and range scans are rowid b-tree operations with no second
  index (measured: ~25 % faster inserts than a composite primary key). ``record``
  holds the record's wire encoding (``protocol.encode_record``), sent as is.
- ``streamq_consumers``: registered consumers, whose unapplied records retention
  keeps, with the last position each reported (saved lazily, never per commit).
  Added after the first release: ``CREATE TABLE IF NOT EXISTS`` adds it to older
  databases when a producer starts, or when a registration is first made.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import aiosqlite

SCHEMA_VERSION = 1
SEQ_BITS = 40
MAX_STORED_SEQ = (1 << SEQ_BITS) - 1

Durability = Literal["normal", "full"]

CONSUMERS_SCHEMA = """CREATE TABLE IF NOT EXISTS streamq_consumers (
    consumer TEXT NOT NULL,
    stream TEXT NOT NULL,
    applied INTEGER NOT NULL DEFAULT 0,  -- last seq the consumer reported applied
    registered_at INTEGER NOT NULL,      -- milliseconds since the Unix epoch
    updated_at INTEGER NOT NULL,         -- when applied was last saved
    PRIMARY KEY (consumer, stream)
)"""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS streamq_meta (key TEXT PRIMARY KEY, value NOT NULL)",
    """CREATE TABLE IF NOT EXISTS streamq_streams (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        low INTEGER NOT NULL DEFAULT 1
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_log (
        pos INTEGER PRIMARY KEY,  -- stream id << 40 | seq
        ts INTEGER NOT NULL,      -- milliseconds since the Unix epoch
        record BLOB NOT NULL      -- protocol.encode_record(...)
    )""",
    CONSUMERS_SCHEMA,
)

INSERT_RECORDS = "INSERT INTO streamq_log (pos, ts, record) VALUES (?, ?, ?)"

# Each stream's id, name, low and head, the head derived as the docstring says. Plain SQL,
# so tools reading a producer's file with sqlite3 get the same answer.
STREAMS_QUERY = f"""
SELECT id, name, low, max(low - 1, coalesce(
    (SELECT max(pos) FROM streamq_log
     WHERE pos > (id << {SEQ_BITS}) AND pos < ((id + 1) << {SEQ_BITS})),
    0) & {(1 << SEQ_BITS) - 1}) AS head
FROM streamq_streams"""
HEAD_QUERY = f"SELECT head FROM ({STREAMS_QUERY}) WHERE name = ?"


def pos(stream_id: int, seq: int) -> int:
    """The rowid of a stream's record."""
    return (stream_id << SEQ_BITS) | seq


@dataclass(frozen=True, slots=True)
class StreamRow:
    id: int
    name: str
    head: int
    low: int


@dataclass(frozen=True, slots=True)
class Identity:
    producer_id: str
    epoch: int
    created: bool


async def open_writer(path: str, durability: Durability) -> aiosqlite.Connection:
    """The producer's one writer connection, in WAL mode, transactions managed by hand."""
    conn = await aiosqlite.connect(path, isolation_level=None)
    try:
        async with conn.execute("PRAGMA journal_mode=WAL") as cursor:
            row = await cursor.fetchone()
        if row is None or str(row[0]).lower() != "wal":
            raise OSError(f"{path}: SQLite refused WAL mode (got {row!r})")
        await conn.execute(f"PRAGMA synchronous={durability.upper()}")
        await conn.execute("PRAGMA busy_timeout=10000")
    except BaseException:
        await conn.close()
        raise
    return conn


async def open_reader(path: str) -> aiosqlite.Connection:
    """A read-only connection: WAL lets it read while the writer commits."""
    conn = await aiosqlite.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    await conn.execute("PRAGMA busy_timeout=10000")
    return conn


async def initialize(conn: aiosqlite.Connection, durability: Durability) -> Identity:
    """Create the tables if needed and bump the epoch, committed with a full sync.

    The producer id is made once, when the database is created, so consumers
    can tell a restarted producer (same id) from a replaced database (new id).
    """
    await conn.execute("PRAGMA synchronous=FULL")  # cannot change inside a transaction
    await conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in _SCHEMA:
            await conn.execute(statement)
        rows = await conn.execute_fetchall("SELECT key, value FROM streamq_meta")
        meta: dict[str, Any] = {str(key): value for key, value in rows}
        created = "producer_id" not in meta
        if created:
            meta = {
                "producer_id": uuid.uuid4().hex,
                "schema_version": SCHEMA_VERSION,
                "created_at": int(time.time() * 1000),
                "epoch": 0,
            }
        elif meta.get("schema_version") != SCHEMA_VERSION:
            raise OSError(
                f"database has streamq schema version {meta.get('schema_version')!r}, "
                f"this streamq needs {SCHEMA_VERSION}"
            )
        meta["epoch"] = int(meta["epoch"]) + 1
        await conn.executemany(
            "INSERT OR REPLACE INTO streamq_meta (key, value) VALUES (?, ?)", meta.items()
        )
        await conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            await conn.execute("ROLLBACK")
        raise
    finally:
        await conn.execute(f"PRAGMA synchronous={durability.upper()}")
    return Identity(str(meta["producer_id"]), int(meta["epoch"]), created)


async def load_streams(conn: aiosqlite.Connection) -> list[StreamRow]:
    rows = await conn.execute_fetchall(STREAMS_QUERY)
    return [StreamRow(stream_id, name, head, low) for stream_id, name, low, head in rows]


async def data_version(conn: aiosqlite.Connection) -> int:
    """Changes whenever another connection commits to the database."""
    async with conn.execute("PRAGMA data_version") as cursor:
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


_CREATE_STREAM = "INSERT INTO streamq_streams (name) VALUES (?)"


async def create_stream(conn: aiosqlite.Connection, name: str) -> int:
    """Insert a stream row inside the caller's transaction; returns its id."""
    cursor = await conn.execute(_CREATE_STREAM, (name,))
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def create_stream_blocking(conn: sqlite3.Connection, name: str) -> int:
    """``create_stream`` on the connection's own thread."""
    cursor = conn.execute(_CREATE_STREAM, (name,))
    assert cursor.lastrowid is not None
    return cursor.lastrowid


async def read_records(
    conn: aiosqlite.Connection, stream_id: int, start: int, end: int, limit: int
) -> list[tuple[int, bytes]]:
    """Up to ``limit`` (seq, encoded record) pairs with ``start <= seq < end``."""
    rows = await conn.execute_fetchall(
        "SELECT pos, record FROM streamq_log WHERE pos >= ? AND pos < ? ORDER BY pos LIMIT ?",
        (pos(stream_id, start), pos(stream_id, end), limit),
    )
    return [(p & MAX_STORED_SEQ, record) for p, record in rows]


async def truncate(conn: aiosqlite.Connection, stream_id: int, before: int) -> None:
    """Delete a stream's records with seq < ``before`` inside the caller's transaction."""
    await conn.execute(
        "DELETE FROM streamq_log WHERE pos >= ? AND pos < ?",
        (pos(stream_id, 0), pos(stream_id, before)),
    )
    await conn.execute(
        "UPDATE streamq_streams SET low = max(low, ?) WHERE id = ?", (before, stream_id)
    )


# --- registered consumers -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConsumerRow:
    consumer: str
    stream: str
    applied: int


async def load_consumers(conn: aiosqlite.Connection) -> list[ConsumerRow]:
    rows = await conn.execute_fetchall("SELECT consumer, stream, applied FROM streamq_consumers")
    return [ConsumerRow(str(c), str(s), int(a)) for c, s, a in rows]


async def register_consumer(
    conn: aiosqlite.Connection, consumer: str, stream: str, applied: int
) -> int:
    """Register inside the caller's transaction; returns the stored position (an existing
    registration keeps its own, or ``applied`` if that is further)."""
    await conn.execute(CONSUMERS_SCHEMA)  # a database made before registrations existed
    now = int(time.time() * 1000)
    await conn.execute(
        "INSERT INTO streamq_consumers (consumer, stream, applied, registered_at, updated_at) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (consumer, stream) DO UPDATE "
        "SET applied = max(applied, excluded.applied)",
        (consumer, stream, applied, now, now),
    )
    rows = await conn.execute_fetchall(
        "SELECT applied FROM streamq_consumers WHERE consumer = ? AND stream = ?",
        (consumer, stream),
    )
    return int(next(iter(rows))[0])


async def unregister_consumer(conn: aiosqlite.Connection, consumer: str, stream: str) -> bool:
    """Remove a registration inside the caller's transaction; False if there was none."""
    await conn.execute(CONSUMERS_SCHEMA)
    cursor = await conn.execute(
        "DELETE FROM streamq_consumers WHERE consumer = ? AND stream = ?", (consumer, stream)
    )
    return cursor.rowcount > 0


async def save_positions(conn: aiosqlite.Connection, positions: list[tuple[str, str, int]]) -> None:
    """Store reported (consumer, stream, applied) positions of registered consumers.

    An UPDATE, never an insert: a registration removed by another process stays removed.
    """
    now = int(time.time() * 1000)
    await conn.executemany(
        "UPDATE streamq_consumers SET applied = max(applied, ?), updated_at = ? "
        "WHERE consumer = ? AND stream = ?",
        [(applied, now, consumer, stream) for consumer, stream, applied in positions],
    )


# --- retention ------------------------------------------------------------------


async def first_seq_since(
    conn: aiosqlite.Connection, stream_id: int, start: int, end: int, since_ms: int
) -> int:
    """The first seq in ``[start, end)`` published at or after ``since_ms`` (``end`` if none).

    Reads forward from ``start`` and stops at the first young record, so it costs
    what retention deletes, not the stream's size.
    """
    rows = await conn.execute_fetchall(
        "SELECT pos FROM streamq_log WHERE pos >= ? AND pos < ? AND ts >= ? ORDER BY pos LIMIT 1",
        (pos(stream_id, start), pos(stream_id, end), since_ms),
    )
    for (found,) in rows:
        return int(found) & MAX_STORED_SEQ
    return end


async def bytes_between(conn: aiosqlite.Connection, stream_id: int, start: int, end: int) -> int:
    """The stored size of the records with ``start <= seq < end``."""
    rows = await conn.execute_fetchall(
        "SELECT coalesce(sum(length(record)), 0) FROM streamq_log WHERE pos >= ? AND pos < ?",
        (pos(stream_id, start), pos(stream_id, end)),
    )
    return int(next(iter(rows))[0])


async def seq_after_bytes(
    conn: aiosqlite.Connection, stream_id: int, start: int, end: int, excess: int
) -> tuple[int, int]:
    """Dropping records from ``start`` until at least ``excess`` bytes are gone: the first
    seq kept, and the bytes dropped. Reads only the records it drops (plus a few)."""
    dropped, seq = 0, start
    async with conn.execute(
        "SELECT pos, length(record) FROM streamq_log WHERE pos >= ? AND pos < ? ORDER BY pos",
        (pos(stream_id, start), pos(stream_id, end)),
    ) as cursor:
        while dropped < excess:
            rows = await cursor.fetchmany(1024)
            if not rows:
                return end, dropped
            for position, size in rows:
                if dropped >= excess:
                    return int(position) & MAX_STORED_SEQ, dropped
                dropped += int(size)
                seq = (int(position) & MAX_STORED_SEQ) + 1
    return seq, dropped
