"""The SQL behind the log, in the producer's own SQLite database.

Six tables, all prefixed ``streamq_`` so they sit beside the application's own:

- ``streamq_meta``: the producer's stable id (made once, when the database is
  created) and its epoch (bumped at every start).
- ``streamq_streams``: one row per stream with its ``low`` (first seq still
  held) and its settings (``key_index``). The head is derived, never written per
  commit: the last seq in the log, or ``low - 1`` when retention emptied the
  stream, so seqs are never reused.
- ``streamq_log``: the records. ``pos`` packs (stream id, seq) into SQLite's
  rowid, so appends and range scans are rowid b-tree operations with no second
  index (measured: ~25 % faster inserts than a composite primary key). ``record``
  holds the record's wire encoding (``protocol.encode_record``), sent as is.
  ``key`` repeats the record's key for streams created with ``key_index`` (NULL
  otherwise), and a partial index on it finds one key's records (``history``)
  without a scan. Opt-in per stream: each keyed record dirties a random index
  page, which costs a bulk keyed publish ~4x (``bench/key_index.py``).
- ``streamq_time``: a sparse time index. A row (stream, ts, pos) is written each
  time a record's timestamp exceeds every earlier one of its stream, so the
  first row with ``ts >= T`` names the first seq whose timestamp reaches T:
  one b-tree seek (``seek_time``), a handful of rows per millisecond at most.
- ``streamq_consumers``: registered consumers, whose unapplied records retention
  keeps, with the last position each reported (saved lazily, never per commit).
  Added after the first release: ``CREATE TABLE IF NOT EXISTS`` adds it to older
  databases when a producer starts, or when a registration is first made.
- ``streamq_epochs``: under which epoch which seqs were appended. A row (stream,
  first_seq, epoch) says: from ``first_seq`` up to the next row's, that stream's records
  were appended under ``epoch``. Every writer stamps its records with the database's
  current epoch (``streamq_meta``), read holding the write lock, and writes a row in the
  same transaction as its first record when the stream's last row has another one. So a
  row exists exactly when its record does: a power loss that rolls back records rolls back
  their rows too, and the seqs re-used after it get a row of a newer epoch (a producer
  start takes one, synced; so does the first writer of a new boot, ``boot_id``). That is
  how a consumer that remembers (epoch, seq) tells a re-used seq from the one it applied
  (docs/protocol.md, "Epochs").
"""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import aiosqlite

from .blocking import run_on_thread
from .errors import DatabaseOpenError, SchemaMissingError

SCHEMA_VERSION = 2
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
        low INTEGER NOT NULL DEFAULT 1,
        key_index INTEGER NOT NULL DEFAULT 0,  -- 1: records' keys are indexed (history)
        compact INTEGER NOT NULL DEFAULT 0,    -- 1: compacted periodically
        notify_compacted INTEGER NOT NULL DEFAULT 0,  -- 1: removals go to "<name>.compacted"
        compacted INTEGER NOT NULL DEFAULT 0   -- compaction ran up to this seq: gaps below
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_log (
        pos INTEGER PRIMARY KEY,  -- stream id << 40 | seq
        ts INTEGER NOT NULL,      -- milliseconds since the Unix epoch
        record BLOB NOT NULL,     -- protocol.encode_record(...)
        key BLOB                  -- the record's key if its stream has key_index, else NULL
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_epochs (
        stream_id INTEGER NOT NULL,
        first_seq INTEGER NOT NULL,  -- this epoch appended from here to the next row
        epoch INTEGER NOT NULL,
        PRIMARY KEY (stream_id, first_seq)
    ) WITHOUT ROWID""",
    CONSUMERS_SCHEMA,
)
# After the migration from version 1, which adds the columns these need.
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS streamq_log_key ON streamq_log (key) WHERE key IS NOT NULL",
    """CREATE TABLE IF NOT EXISTS streamq_time (
        stream_id INTEGER NOT NULL,
        ts INTEGER NOT NULL,      -- a timestamp above every earlier one of the stream
        pos INTEGER NOT NULL,     -- the first record that reached it
        PRIMARY KEY (stream_id, ts)
    ) WITHOUT ROWID""",
)

INSERT_RECORDS = "INSERT INTO streamq_log (pos, ts, record, key) VALUES (?, ?, ?, ?)"
INSERT_TIMES = "INSERT INTO streamq_time (stream_id, ts, pos) VALUES (?, ?, ?)"
INSERT_EPOCHS = "INSERT INTO streamq_epochs (stream_id, first_seq, epoch) VALUES (?, ?, ?)"

# Each stream's id, name, low and head, the head derived as the docstring says. Plain SQL,
# so tools reading a producer's file with sqlite3 get the same answer.
STREAMS_QUERY = f"""
SELECT id, name, low, max(low - 1, coalesce(
    (SELECT max(pos) FROM streamq_log
     WHERE pos > (id << {SEQ_BITS}) AND pos < ((id + 1) << {SEQ_BITS})),
    0) & {(1 << SEQ_BITS) - 1}) AS head,
    key_index, compact, notify_compacted, compacted,
    (SELECT max(ts) FROM streamq_time WHERE stream_id = id) AS max_ts
FROM streamq_streams"""
HEAD_QUERY = f"SELECT head FROM ({STREAMS_QUERY}) WHERE name = ?"

# --- appending through any connection (streamq.publish, SyncProducer) ------------------
# A writer that keeps no heads in memory takes the write lock first, then reads what it
# appends after: seqs come from what is committed, under the lock, so writers in any
# number of processes and connections commit dense seqs in commit order.

# Takes the database's write lock (as the first write of a transaction does) and writes
# nothing: no page changes, so the commit costs nothing more.
TAKE_WRITE_LOCK = "DELETE FROM streamq_streams WHERE 0"

# One row, whether the stream exists or not: the database's epoch, the boot it was made
# in and the schema version; then the stream's id, key_index, head, largest timestamp
# and the epoch of its last segment (all NULL for a stream not created yet).
APPEND_STATE_QUERY = f"""
SELECT m.epoch, m.boot_id, m.schema_version, s.id, s.key_index,
    max(s.low - 1, coalesce(
        (SELECT max(pos) FROM streamq_log
         WHERE pos > (s.id << {SEQ_BITS}) AND pos < ((s.id + 1) << {SEQ_BITS})),
        0) & {(1 << SEQ_BITS) - 1}),
    (SELECT max(ts) FROM streamq_time WHERE stream_id = s.id),
    (SELECT epoch FROM streamq_epochs WHERE stream_id = s.id ORDER BY first_seq DESC LIMIT 1)
FROM (SELECT
        (SELECT value FROM streamq_meta WHERE key = 'epoch') AS epoch,
        (SELECT value FROM streamq_meta WHERE key = 'boot_id') AS boot_id,
        (SELECT value FROM streamq_meta WHERE key = 'schema_version') AS schema_version
    ) AS m
LEFT JOIN streamq_streams AS s ON s.name = ?"""
CREATE_DEFAULT_STREAM = "INSERT INTO streamq_streams (name) VALUES (?)"
SET_META = "INSERT OR REPLACE INTO streamq_meta (key, value) VALUES (?, ?)"
META_EPOCH_QUERY = "SELECT value FROM streamq_meta WHERE key = 'epoch'"


def boot_id() -> str:
    """Changes at every boot of this machine, so at every power loss.

    The first writer of a boot that finds the database's epoch made in another boot
    starts a new epoch (docs/protocol.md, "Epochs"). ``STREAMQ_BOOT_ID`` overrides it:
    tests simulate a reboot with it.
    """
    return os.environ.get("STREAMQ_BOOT_ID") or _machine_boot_id()


@functools.cache
def _machine_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:  # Linux
            return file.read().strip()
    except OSError:
        pass
    # Elsewhere: the boot time, from the wall clock minus the time since boot.
    since_boot = time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))
    return f"boot@{round(time.time() - since_boot, -1):.0f}"


def pos(stream_id: int, seq: int) -> int:
    """The rowid of a stream's record."""
    return (stream_id << SEQ_BITS) | seq


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


async def connect(path: str, *, read_only: bool = False) -> aiosqlite.Connection:
    """An aiosqlite connection to ``path`` (transactions managed by hand), or a
    ``DatabaseOpenError`` naming the file.

    A refused open stops aiosqlite's thread before returning: left running, it would
    report to an event loop that may be closed by then ("Event loop is closed").
    """
    target, uri = (f"file:{path}?mode=ro", True) if read_only else (path, False)
    conn = aiosqlite.connect(target, uri=uri, isolation_level=None)
    try:
        await conn
    except sqlite3.Error as exc:
        await asyncio.to_thread(conn._thread.join)
        raise DatabaseOpenError(_cannot_open(path, exc)) from exc
    try:
        await conn.execute("PRAGMA busy_timeout=10000")
        await conn.execute_fetchall("SELECT count(*) FROM sqlite_schema")  # a database at all?
    except BaseException as exc:
        await conn.close()
        if isinstance(exc, sqlite3.DatabaseError):
            raise DatabaseOpenError(_cannot_open(path, exc)) from exc
        raise
    return conn


def _cannot_open(path: str, exc: sqlite3.Error) -> str:
    if not os.path.exists(path):
        where = os.path.dirname(os.path.abspath(path))
        reason = f"no such directory {where!r}" if not os.path.isdir(where) else str(exc)
    elif os.path.isdir(path):
        reason = "it is a directory"
    else:
        reason = str(exc)
    return f"cannot open SQLite database {path!r}: {reason}"


async def open_writer(path: str, durability: Durability) -> aiosqlite.Connection:
    """The producer's one writer connection, in WAL mode, transactions managed by hand."""
    conn = await connect(path)
    try:
        async with conn.execute("PRAGMA journal_mode=WAL") as cursor:
            row = await cursor.fetchone()
        if row is None or str(row[0]).lower() != "wal":
            raise DatabaseOpenError(f"{path}: SQLite refused WAL mode (got {row!r})")
        await conn.execute(f"PRAGMA synchronous={durability.upper()}")
    except BaseException:
        await conn.close()
        raise
    return conn


async def open_reader(path: str) -> aiosqlite.Connection:
    """A read-only connection: WAL lets it read while the writer commits."""
    return await connect(path, read_only=True)


async def initialize(conn: aiosqlite.Connection, durability: Durability) -> Identity:
    """Create the tables if needed and bump the epoch, committed with a full sync.

    The producer id is made once, when the database is created, so consumers
    can tell a restarted producer (same id) from a replaced database (new id).
    """
    await conn.execute("PRAGMA synchronous=FULL")  # cannot change inside a transaction
    await conn.execute("BEGIN IMMEDIATE")
    try:
        meta, created = await run_on_thread(conn, create_schema, conn._conn)
        meta["epoch"] = int(meta["epoch"]) + 1
        meta["boot_id"] = boot_id()
        await conn.executemany(SET_META, meta.items())
        await conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            await conn.execute("ROLLBACK")
        raise
    finally:
        await conn.execute(f"PRAGMA synchronous={durability.upper()}")
    return Identity(str(meta["producer_id"]), int(meta["epoch"]), created)


def create_schema(dbapi: Any) -> tuple[dict[str, Any], bool]:
    """Create the log tables, or migrate older ones, in the connection's open transaction;
    returns the meta rows and whether the database is new (a producer id was made)."""
    cursor = dbapi.cursor()
    for statement in _SCHEMA:
        cursor.execute(statement)
    cursor.execute("SELECT key, value FROM streamq_meta")
    meta: dict[str, Any] = {str(key): value for key, value in cursor.fetchall()}
    created = "producer_id" not in meta
    if created:
        meta = {
            "producer_id": uuid.uuid4().hex,
            "schema_version": SCHEMA_VERSION,
            "created_at": int(time.time() * 1000),
            "epoch": 0,
        }
    elif meta.get("schema_version") == 1:
        _migrate_from_1(cursor)
        meta["schema_version"] = SCHEMA_VERSION
    elif meta.get("schema_version") != SCHEMA_VERSION:
        raise SchemaMissingError(
            f"database has streamq schema version {meta.get('schema_version')!r}, "
            f"this streamq needs {SCHEMA_VERSION}"
        )
    for statement in _INDEXES:
        cursor.execute(statement)
    cursor.executemany(SET_META, list(meta.items()))
    return meta, created


def _migrate_from_1(cursor: Any) -> None:
    """Version 1 had no key column and no time index: add both. Its streams keep no key
    index (the default); the time index is filled from the records."""
    cursor.execute("ALTER TABLE streamq_log ADD COLUMN key BLOB")
    for column in ("key_index", "compact", "notify_compacted", "compacted"):
        cursor.execute(
            f"ALTER TABLE streamq_streams ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0"
        )
    cursor.execute(_INDEXES[1])
    max_ts: dict[int, int] = {}
    last = -1
    while True:
        cursor.execute(
            "SELECT pos, ts FROM streamq_log WHERE pos > ? ORDER BY pos LIMIT 10000", (last,)
        )
        rows = cursor.fetchall()
        if not rows:
            return
        times = []
        for p, ts in rows:
            stream_id = p >> SEQ_BITS
            if ts > max_ts.get(stream_id, ts - 1):
                max_ts[stream_id] = ts
                times.append((stream_id, ts, p))
        cursor.executemany(INSERT_TIMES, times)
        last = rows[-1][0]


async def load_streams(conn: aiosqlite.Connection) -> list[StreamRow]:
    return _stream_rows(await conn.execute_fetchall(STREAMS_QUERY))


def _stream_rows(rows: Iterable[Any]) -> list[StreamRow]:
    return [
        StreamRow(
            stream_id, name, head, low, StreamSettings(bool(k), bool(c), bool(n)), max_ts, compacted
        )
        for stream_id, name, low, head, k, c, n, compacted, max_ts in rows
    ]


@dataclass(frozen=True, slots=True)
class Changes:
    """What other writers committed, as the serving producer catches up with it."""

    epoch: int  # the database's epoch now
    streams: list[StreamRow]
    consumers: list[ConsumerRow]
    epoch_rows: list[tuple[int, int, int]]  # (stream id, first seq, epoch), new ones only


def read_changes(conn: sqlite3.Connection, known: dict[int, tuple[int, int]]) -> Changes:
    """Everything a catch-up needs, read on the connection's thread in one go: streams,
    registrations, the epoch, and the epoch rows after ``known`` ({stream id: (head, last
    first seq)}) of the streams that grew or are new."""
    epoch = int(conn.execute(META_EPOCH_QUERY).fetchone()[0])
    streams = _stream_rows(conn.execute(STREAMS_QUERY))
    consumers = [
        ConsumerRow(str(c), str(s), int(a))
        for c, s, a in conn.execute("SELECT consumer, stream, applied FROM streamq_consumers")
    ]
    epoch_rows: list[tuple[int, int, int]] = []
    for row in streams:
        head, after = known.get(row.id, (-1, 0))
        if row.head > head:
            epoch_rows += conn.execute(
                "SELECT stream_id, first_seq, epoch FROM streamq_epochs "
                "WHERE stream_id = ? AND first_seq > ? ORDER BY first_seq",
                (row.id, after),
            )
    return Changes(epoch, streams, consumers, epoch_rows)


async def load_epochs(conn: aiosqlite.Connection) -> list[tuple[int, int, int]]:
    """Every (stream id, first seq, epoch) row, in seq order per stream."""
    rows = await conn.execute_fetchall(
        "SELECT stream_id, first_seq, epoch FROM streamq_epochs ORDER BY stream_id, first_seq"
    )
    return [(int(s), int(f), int(e)) for s, f, e in rows]


async def data_version(conn: aiosqlite.Connection) -> int:
    """Changes whenever another connection commits to the database."""
    async with conn.execute("PRAGMA data_version") as cursor:
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


_CREATE_STREAM = (
    "INSERT INTO streamq_streams (name, key_index, compact, notify_compacted) VALUES (?, ?, ?, ?)"
)


def _stream_row(name: str, settings: StreamSettings) -> tuple[Any, ...]:
    return (name, settings.key_index, settings.compact, settings.notify_compacted)


async def create_stream(conn: aiosqlite.Connection, name: str, settings: StreamSettings) -> int:
    """Insert a stream row inside the caller's transaction; returns its id."""
    cursor = await conn.execute(_CREATE_STREAM, _stream_row(name, settings))
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def create_stream_blocking(conn: sqlite3.Connection, name: str, settings: StreamSettings) -> int:
    """``create_stream`` on the connection's own thread."""
    cursor = conn.execute(_CREATE_STREAM, _stream_row(name, settings))
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


async def read_key_records(
    conn: aiosqlite.Connection, stream_id: int, key: bytes, start: int, end: int, limit: int
) -> list[tuple[int, bytes]]:
    """Up to ``limit`` (seq, encoded record) pairs of ``key`` with ``start <= seq < end``.

    A seek in the partial index ``streamq_log_key`` (key, then rowid): no scan.
    """
    rows = await conn.execute_fetchall(
        KEY_RECORDS_QUERY, (key, pos(stream_id, start), pos(stream_id, end), limit)
    )
    return [(p & MAX_STORED_SEQ, record) for p, record in rows]


KEY_RECORDS_QUERY = (
    "SELECT pos, record FROM streamq_log WHERE key = ? AND pos >= ? AND pos < ? "
    "ORDER BY pos LIMIT ?"
)
SEEK_TIME_QUERY = "SELECT pos FROM streamq_time WHERE stream_id = ? AND ts >= ? ORDER BY ts LIMIT 1"


async def seek_time(conn: aiosqlite.Connection, stream_id: int, timestamp: int) -> int | None:
    """The first seq whose timestamp is >= ``timestamp``, None if no record's is.

    Timestamps are read as a running maximum, as Kafka's time index does: a record
    stamped earlier than one before it never moves the answer back.
    """
    async with conn.execute(SEEK_TIME_QUERY, (stream_id, timestamp)) as cursor:
        row = await cursor.fetchone()
    return None if row is None else int(row[0]) & MAX_STORED_SEQ


async def truncate(conn: aiosqlite.Connection, stream_id: int, before: int) -> None:
    """Delete a stream's records with seq < ``before`` inside the caller's transaction."""
    await conn.execute(
        "DELETE FROM streamq_log WHERE pos >= ? AND pos < ?",
        (pos(stream_id, 0), pos(stream_id, before)),
    )
    # Time rows of deleted records go too, but the last of them: it holds the largest
    # timestamp before ``before``, which seeks need (they clamp it to ``low``) and later
    # records must exceed to be indexed.
    await conn.execute(
        "DELETE FROM streamq_time WHERE stream_id = ?1 AND pos < ?2 AND ts < "
        "(SELECT max(ts) FROM streamq_time WHERE stream_id = ?1 AND pos < ?2)",
        (stream_id, pos(stream_id, before)),
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


# Every held record of the keys written in (lo, hi], oldest first per key: what a
# compaction of those seqs must look at. One index seek per key.
_COMPACTION_QUERY = """
WITH dirty(key) AS (
    SELECT DISTINCT key FROM streamq_log WHERE pos > ?1 AND pos <= ?2 AND key IS NOT NULL)
SELECT l.pos, l.key, l.record FROM dirty JOIN streamq_log AS l
    ON l.key = dirty.key AND l.pos >= ?3 AND l.pos <= ?2
ORDER BY l.key, l.pos"""


async def compaction_candidates(
    conn: aiosqlite.Connection, stream_id: int, low: int, after: int, through: int
) -> list[tuple[int, bytes, bytes]]:
    """(seq, key, encoded record) of every held record whose key reappears in
    ``(after, through]``, grouped by key, in seq order within each key."""
    rows = await conn.execute_fetchall(
        _COMPACTION_QUERY, (pos(stream_id, after), pos(stream_id, through), pos(stream_id, low))
    )
    return [(p & MAX_STORED_SEQ, key, record) for p, key, record in rows]


async def low_and_compacted(conn: aiosqlite.Connection, stream_id: int) -> tuple[int, int]:
    """A stream's first held seq and compaction point as committed, by any process."""
    rows = await conn.execute_fetchall(
        "SELECT low, compacted FROM streamq_streams WHERE id = ?", (stream_id,)
    )
    for low, compacted in rows:
        return int(low), int(compacted)
    raise LookupError(f"no stream with id {stream_id}")


async def delete_compacted(
    conn: aiosqlite.Connection, stream_id: int, seqs: list[int], through: int
) -> None:
    """Delete records compaction removed, and note how far it ran, in the caller's transaction."""
    await conn.executemany(
        "DELETE FROM streamq_log WHERE pos = ?", [(pos(stream_id, seq),) for seq in seqs]
    )
    await conn.execute(
        "UPDATE streamq_streams SET compacted = max(compacted, ?) WHERE id = ?",
        (through, stream_id),
    )
