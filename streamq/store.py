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
- ``streamq_epochs``: which producer instance (epoch) appended which seqs. A row
  (stream, first_seq, epoch) says: from ``first_seq`` up to the next row's, that
  stream's records were appended by the producer that started with ``epoch``. An
  instance writes a row in the same transaction as its first record after a record it
  did not append itself (after its start, or another process's records), so a row
  exists exactly when its record does: a power loss that rolls back records rolls back
  their rows too, and the seqs re-used after it get the new epoch's row. That is how a
  consumer that remembers (epoch, seq) tells a re-used seq from the one it applied
  (docs/protocol.md, "Epochs"). Rows are not written at start: another process
  starting while this one serves would then claim seqs it never wrote.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import aiosqlite

SCHEMA_VERSION = 1
SEQ_BITS = 40
MAX_STORED_SEQ = (1 << SEQ_BITS) - 1

Durability = Literal["normal", "full"]

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
    """CREATE TABLE IF NOT EXISTS streamq_epochs (
        stream_id INTEGER NOT NULL,
        first_seq INTEGER NOT NULL,  -- this epoch appended from here to the next row
        epoch INTEGER NOT NULL,
        PRIMARY KEY (stream_id, first_seq)
    ) WITHOUT ROWID""",
)

INSERT_RECORDS = "INSERT INTO streamq_log (pos, ts, record) VALUES (?, ?, ?)"
INSERT_EPOCHS = "INSERT INTO streamq_epochs (stream_id, first_seq, epoch) VALUES (?, ?, ?)"

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


async def load_epochs(
    conn: aiosqlite.Connection, stream_id: int | None = None, after: int = 0
) -> list[tuple[int, int, int]]:
    """(stream id, first seq, epoch) rows in seq order: every stream's, or one stream's
    rows with first seq > ``after``."""
    if stream_id is None:
        sql = "SELECT stream_id, first_seq, epoch FROM streamq_epochs ORDER BY stream_id, first_seq"
        rows = await conn.execute_fetchall(sql)
    else:
        rows = await conn.execute_fetchall(
            "SELECT stream_id, first_seq, epoch FROM streamq_epochs "
            "WHERE stream_id = ? AND first_seq > ? ORDER BY first_seq",
            (stream_id, after),
        )
    return [(int(s), int(f), int(e)) for s, f, e in rows]


async def data_version(conn: aiosqlite.Connection) -> int:
    """Changes whenever another connection commits to the database."""
    async with conn.execute("PRAGMA data_version") as cursor:
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def create_stream(conn: aiosqlite.Connection, name: str) -> int:
    """Insert a stream row inside the caller's transaction; returns its id."""
    cursor = await conn.execute("INSERT INTO streamq_streams (name) VALUES (?)", (name,))
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
