"""The SQLite engine's storage: the log in the producer's own SQLite database file.

Six tables, all prefixed ``streamq_`` so they sit beside the application's own:

- ``streamq_meta``: the producer's stable id (made once, when the database is
  created) and its epoch (bumped at every start).
- ``streamq_streams``: one row per stream with its ``low`` (first seq still
  held) and its settings (``key_index``). The head is derived, never written per
  commit: the last seq in the log, or ``low - 1`` when retention emptied the
  stream, so seqs are never reused.
- ``streamq_log``: the records. A row holds one record or a run of consecutive
  records of one stream written by one insert (a transaction's, or a commit group's):
  ``count`` of them, up to ``BATCH_RECORDS`` and ``BATCH_BYTES``, so a transaction
  costs one row per stream, not one per record. ``pos`` packs (stream id, the row's
  LAST seq) into SQLite's rowid, so appends and range scans are rowid b-tree
  operations with no second index (measured: ~25 % faster inserts than a composite
  primary key), the head is ``max(pos)``, and the row holding a seq is the first with
  ``pos`` at or after it. ``record`` holds the records' wire encodings
  (``protocol.encode_record``) back to back, sent as they are once apart again
  (``protocol.split_records``); ``ts`` is the largest of their timestamps.
  A row written by the one-statement append (``append.py``: ``streamq.publish``,
  ``SyncProducer``) holds its records unnumbered (seq 0, ``protocol.UNNUMBERED_PREFIX``):
  that statement takes the seq from ``max(pos)`` as it inserts, so nothing in the row
  could know it before. Readers number them from ``pos`` (``protocol.numbered_run``), so
  every reader gets the same bytes either way.
  ``key`` repeats the record's key for streams created with ``key_index`` (NULL
  otherwise), and a partial index on it finds one key's records (``history``)
  without a scan. Opt-in per stream: each keyed record dirties a random index
  page, which costs a bulk keyed publish ~4x (``bench/tools/key_index.py``). A keyed
  record of such a stream has a row of its own, so compaction deletes records, never
  parts of rows; retention deletes rows wholly below ``low`` (a row it cuts through
  stays until the rest of it is, and reads skip the seqs before ``low``).
- ``streamq_time``: a sparse time index. A row (stream, ts, pos) is written each
  time a record's timestamp exceeds every earlier one of its stream, so the
  first row with ``ts >= T`` names the first seq whose timestamp reaches T:
  one b-tree seek (``seek_time``), a handful of rows per millisecond at most. A
  trigger writes the rows of the one-statement append's rows, in its statement.
- ``streamq_consumers``: registered consumers, whose unapplied records retention
  keeps, and the consumers that reported a position without a registration
  (``registered`` 0), each with the last position it reported (saved lazily, at most
  about once a second, never per commit), so status and lag survive a restart.
  Added after the first release: ``CREATE TABLE IF NOT EXISTS`` adds it to older
  databases when a producer starts, and the columns added since then (rows already
  there are registrations).
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
import contextlib
import functools
import operator
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import aiosqlite

from ...errors import ConcurrentWriterError, DatabaseOpenError, SchemaMissingError
from ...producer.storage import (
    Changes,
    EpochRow,
    Identity,
    KnownPosition,
    Limits,
    LogRow,
    Run,
    StreamRow,
    StreamSettings,
    TimeRow,
    WouldWait,
    consumer_rows,
)
from ...protocol import numbered_records, numbered_run, slice_records
from ...records import Unnumbered
from ...sql import Durability, InlineBudget, raw_connection, run_on_thread
from .checkpoints import Checkpointer, take_over
from .engine import ENGINE
from .servelock import ServeLock
from .walwatch import WalWatch

T = TypeVar("T")

SCHEMA_VERSION = 4
SEQ_BITS = 40
MAX_STORED_SEQ = (1 << SEQ_BITS) - 1
# At most this many records, and bytes, share a log row: a read that starts inside a row
# reads all of it, and a row is the unit retention deletes.
BATCH_RECORDS = 1024
BATCH_BYTES = 1 << 20

CONSUMERS_SCHEMA = """CREATE TABLE IF NOT EXISTS streamq_consumers (
    consumer TEXT NOT NULL,
    stream TEXT NOT NULL,
    applied INTEGER NOT NULL DEFAULT 0,  -- last seq the consumer reported applied
    registered_at INTEGER NOT NULL,      -- milliseconds since the Unix epoch
    updated_at INTEGER NOT NULL,         -- when it last reported (or registered)
    max_idle_ms INTEGER,                 -- dropped after this long away (NULL: never)
    max_bytes INTEGER,                   -- dropped when held back records exceed this
    registered INTEGER NOT NULL DEFAULT 1,  -- 0: a position reported, no registration
    PRIMARY KEY (consumer, stream)
)"""
# Tables made before these columns existed get them at a producer's start.
_ADDED_COLUMNS = {
    "max_idle_ms": "INTEGER",
    "max_bytes": "INTEGER",
    "registered": "INTEGER NOT NULL DEFAULT 1",
}
CONSUMERS_QUERY = (
    "SELECT consumer, stream, applied, updated_at, max_idle_ms, max_bytes, registered "
    "FROM streamq_consumers ORDER BY updated_at"
)
# A reported position: inserted unregistered, or moved forward (the flag untouched).
SAVE_POSITION = (
    "INSERT INTO streamq_consumers (consumer, stream, applied, registered_at, updated_at, "
    "registered) VALUES (?, ?, ?, ?, ?, 0) ON CONFLICT (consumer, stream) DO UPDATE SET "
    "applied = max(applied, excluded.applied), updated_at = max(updated_at, excluded.updated_at)"
)
FORGET_UNREGISTERED = (
    "DELETE FROM streamq_consumers WHERE consumer = ? AND stream = ? AND registered = 0"
)
# Unregistering: a consumer that applied nothing leaves no row; one that did stays known.
UNREGISTER_UNKNOWN = (
    "DELETE FROM streamq_consumers WHERE consumer = ? AND stream = ? AND registered AND applied = 0"
)
UNREGISTER = (
    "UPDATE streamq_consumers SET registered = 0 WHERE consumer = ? AND stream = ? AND registered"
)

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
        pos INTEGER PRIMARY KEY,  -- stream id << 40 | the last seq of the row
        ts INTEGER NOT NULL,      -- milliseconds since the Unix epoch
        record BLOB NOT NULL,     -- protocol.encode_record(...) of each record, back to back
        key BLOB,                 -- the record's key if its stream has key_index, else NULL
        count INTEGER NOT NULL DEFAULT 1  -- records in the row: seqs pos - count + 1 .. pos
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
    # The time index of rows stored unnumbered (the one-statement append's), in the
    # statement that inserts them; the other writers insert their time rows themselves.
    f"""CREATE TRIGGER IF NOT EXISTS streamq_time_of_unnumbered AFTER INSERT ON streamq_log
    WHEN substr(NEW.record, 1, 2) = x'9500' AND NEW.ts > coalesce(
        (SELECT max(ts) FROM streamq_time WHERE stream_id = NEW.pos >> {SEQ_BITS}), -1)
    BEGIN
        INSERT INTO streamq_time (stream_id, ts, pos)
        VALUES (NEW.pos >> {SEQ_BITS}, NEW.ts, NEW.pos - NEW.count + 1);
    END""",
)

INSERT_RECORDS = "INSERT INTO streamq_log (pos, ts, record, key, count) VALUES (?, ?, ?, ?, ?)"
# ``INSERT_RECORDS`` unless a row holds a seq at or after the row's first, in its stream:
# then (another process appended: the writer's seqs were stale) it inserts nothing, as on
# a clash of pos. One statement for the check and the insert. A row's timestamp NULL is
# not inserted (OR IGNORE); rows of one stream go in ascending order, so a row's check
# never finds the rows inserted before it.
INSERT_RECORDS_CHECKED = f"""INSERT OR IGNORE INTO streamq_log (pos, ts, record, key, count)
VALUES (?1, CASE WHEN NOT EXISTS (SELECT 1 FROM streamq_log
    WHERE pos > ?1 - ?5 AND pos < ((?1 >> {SEQ_BITS}) + 1) << {SEQ_BITS}) THEN ?2 END,
    ?3, ?4, ?5)"""
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

# --- appending through any connection (streamq.publish, SyncProducer: append.py) -------
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
_CREATE_STREAM = (
    "INSERT INTO streamq_streams (name, key_index, compact, notify_compacted) VALUES (?, ?, ?, ?)"
)
# Rows from a pos on, in order: the records of every seq from it (``read_runs``).
RANGE_QUERY = "SELECT pos, count, record FROM streamq_log WHERE pos >= ? AND pos < ? ORDER BY pos"
KEY_RECORDS_QUERY = (
    "SELECT pos, record FROM streamq_log WHERE key = ? AND pos >= ? AND pos < ? "
    "ORDER BY pos LIMIT ?"
)
SEEK_TIME_QUERY = "SELECT pos FROM streamq_time WHERE stream_id = ? AND ts >= ? ORDER BY ts LIMIT 1"
# Every held record of the keys written in (lo, hi], oldest first per key: what a
# compaction of those seqs must look at. One index seek per key.
COMPACTION_QUERY = """
WITH dirty(key) AS (
    SELECT DISTINCT key FROM streamq_log WHERE pos > ?1 AND pos <= ?2 AND key IS NOT NULL)
SELECT l.pos, l.key, l.record FROM dirty JOIN streamq_log AS l
    ON l.key = dirty.key AND l.pos >= ?3 AND l.pos <= ?2
ORDER BY l.key, l.pos"""


@functools.cache  # read once per process: every append compares it
def boot_id() -> str:
    """Changes at every boot of this machine, so at every power loss.

    The first writer of a boot that finds the database's epoch made in another boot
    starts a new epoch (docs/protocol.md, "Epochs"). ``STREAMQ_BOOT_ID`` in a process's
    environment overrides it: a process started with another one acts as after a reboot.
    """
    return os.environ.get("STREAMQ_BOOT_ID") or _machine_boot_id()


def _machine_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:  # Linux
            return file.read().strip()
    except OSError:
        pass
    # Elsewhere: the boot time, from the wall clock minus the time since boot.
    since_boot = time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))
    return f"boot@{round(time.time() - since_boot, -1):.0f}"


def database_file(cursor: Any) -> str:
    """The main database's file, for error messages, found through any cursor of the
    connection (an application's DB-API connection included)."""
    try:
        cursor.execute("PRAGMA database_list")
        for _, name, file in cursor.fetchall():
            if name == "main":
                return f"SQLite database {file or ':memory:'!r}"
    except Exception:  # a message helper: never hide the real error
        pass
    return "this SQLite database"


def pos(stream_id: int, seq: int) -> int:
    """The rowid of a stream's record (of the row whose last record it is)."""
    return (stream_id << SEQ_BITS) | seq


# A streamq_log row as inserted: pos, ts, record(s), key, count.
StoredRow = tuple[int, int, bytes, bytes | None, int]


def stored_rows(rows: Sequence[LogRow]) -> list[StoredRow]:
    """``rows`` (one per record) as streamq_log rows: each run of consecutive records of
    one stream with no indexed key shares one row (the module docstring)."""
    if len(rows) == 1:  # a one-record transaction's, without the checks below
        stream_id, seq, ts, record, key = rows[0]
        return [(pos(stream_id, seq), ts, record, key, 1)]
    streams = set(map(_STREAM_OF, rows))
    if len(streams) == 1 and _one_run(rows):
        stream_id, last = rows[-1][:2]
        return [_run_row(stream_id, last, max(map(_TS_OF, rows)), list(map(_RECORD_OF, rows)))]
    if len(streams) > 1:  # one run per stream; sorted() is stable
        rows = sorted(rows, key=_STREAM_OF)
    stored: list[StoredRow] = []
    run: list[bytes] = []
    stream_id = last = max_ts = size = 0
    for s, seq, ts, record, key in rows:
        joins = key is None and run and s == stream_id and seq == last + 1
        if joins and len(run) < BATCH_RECORDS and size + len(record) <= BATCH_BYTES:
            run.append(record)
            last, size, max_ts = seq, size + len(record), max(max_ts, ts)
            continue
        if run:
            stored.append(_run_row(stream_id, last, max_ts, run))
            run = []
        if key is None:
            run, stream_id, last, max_ts, size = [record], s, seq, ts, len(record)
        else:
            stored.append((pos(s, seq), ts, record, key, 1))
    if run:
        stored.append(_run_row(stream_id, last, max_ts, run))
    return stored


def _run_row(stream_id: int, last: int, max_ts: int, records: list[bytes]) -> StoredRow:
    """The row of a run of unkeyed records ending at seq ``last``."""
    return pos(stream_id, last), max_ts, b"".join(records), None, len(records)


_STREAM_OF, _SEQ_OF, _TS_OF, _RECORD_OF, _KEY_OF = map(operator.itemgetter, range(5))


def unnumbered_rows(
    stream_id: int, first: int, records: Unnumbered, key_index: bool
) -> list[StoredRow]:
    """``records``, appended from seq ``first``, as streamq_log rows stored unnumbered,
    as the one-statement append stores them: runs of consecutive records of one
    timestamp, each in a row up to ``BATCH_RECORDS`` and ``BATCH_BYTES``, a keyed record
    of a stream with ``key_index`` in a row of its own. One timestamp a row is what lets
    the trigger write their time index (``streamq_time_of_unnumbered``: a row's first
    record). A run of records all alike is cut with no Python step per record."""
    encoded, stamps, keys = records.encoded, records.timestamps, records.keys
    rows: list[StoredRow] = []
    start, count = 0, len(encoded)
    while start < count:
        ts, end = stamps[start], min(start + BATCH_RECORDS, count)
        alike = (
            stamps[start:end].count(ts) == end - start
            and (not key_index or keys[start:end].count(None) == end - start)
            and sum(map(len, encoded[start:end])) <= BATCH_BYTES
        )
        if not alike:  # one step a record, to where the run ends
            keyed = key_index and keys[start] is not None
            end, size = start + 1, len(encoded[start])
            while not keyed and end < count and end - start < BATCH_RECORDS:
                size += len(encoded[end])
                keyed = key_index and keys[end] is not None
                if keyed or stamps[end] != ts or size > BATCH_BYTES:
                    break
                end += 1
        last = first + end - 1
        key = keys[start] if key_index and end - start == 1 else None
        rows.append((pos(stream_id, last), ts, b"".join(encoded[start:end]), key, end - start))
        start = end
    return rows


def _one_run(rows: Sequence[LogRow]) -> bool:
    """``rows``, all of one stream, fit one streamq_log row: consecutive seqs, no indexed
    key, within a row's limits (checked without a Python step per row)."""
    first = rows[0][1]
    return (
        len(rows) <= BATCH_RECORDS
        and set(map(_KEY_OF, rows)) == {None}
        and list(map(_SEQ_OF, rows)) == list(range(first, first + len(rows)))
        and sum(map(len, map(_RECORD_OF, rows))) <= BATCH_BYTES
    )


def unpack_rows(rows: Iterable[tuple[int, int, bytes]]) -> Iterator[tuple[int, bytes]]:
    """(pos, count, record) rows of streamq_log, in pos order, as (pos, record) per record:
    what a tool reading a producer's file with sqlite3 needs."""
    for position, count, record in rows:
        first = position - count + 1
        record = numbered_run(first & MAX_STORED_SEQ, count, record)
        yield from numbered_records(first, count, record)


def _numbered_row(position: int, record: bytes) -> tuple[int, bytes]:
    """A one-record row (a keyed record's) as (seq, its encoding, numbered)."""
    seq = position & MAX_STORED_SEQ
    return seq, numbered_run(seq, 1, record)


def rows_upper_bound(stream_id: int, end: int) -> int:
    """A pos past every row that holds a seq below ``end``: a row's records end at its pos
    and number at most ``BATCH_RECORDS``."""
    return min(pos(stream_id, end) + BATCH_RECORDS, pos(stream_id + 1, 0))


def read_runs(
    conn: sqlite3.Connection, stream_id: int, start: int, end: int, limit: int
) -> list[Run]:
    """``SQLiteReader.read_runs`` on the connection's thread: a run per row, as stored,
    the rows at either end cut to ``[start, end)``. Rows whose last seq reaches ``end``
    may hold seqs below it: read up to the longest row beyond it."""
    runs: list[Run] = []
    taken = 0
    cursor = conn.execute(RANGE_QUERY, (pos(stream_id, start), rows_upper_bound(stream_id, end)))
    try:
        for position, count, record in cursor:
            last = position & MAX_STORED_SEQ
            first = last - count + 1
            if first >= end:
                break
            if first < start or last >= end:
                skip, stop = max(start - first, 0), min(last, end - 1) - first + 1
                record = slice_records(record, count, skip, stop - skip)
                first, count = first + skip, stop - skip
            runs.append((first, count, numbered_run(first, count, record)))
            taken += count
            if taken >= limit:
                break
    finally:
        cursor.close()
    return runs


# --- opening ----------------------------------------------------------------------------


async def connect(
    path: str, *, read_only: bool = False, any_thread: bool = False
) -> aiosqlite.Connection:
    """An aiosqlite connection to ``path`` (transactions managed by hand), or a
    ``DatabaseOpenError`` naming the file. ``any_thread``: usable on the event loop's
    thread too, between the calls queued to its own (the writer's short transactions).

    A refused open stops aiosqlite's thread before returning: left running, it would
    report to an event loop that may be closed by then ("Event loop is closed").
    """
    target, uri = (f"file:{path}?mode=ro", True) if read_only else (path, False)
    conn = aiosqlite.connect(
        target, uri=uri, isolation_level=None, check_same_thread=not any_thread
    )
    try:
        await conn
    except sqlite3.Error as exc:
        await asyncio.to_thread(conn._thread.join)
        raise DatabaseOpenError(_cannot_open(path, exc)) from exc
    try:
        await conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
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


async def journal_mode_wal(conn: aiosqlite.Connection) -> str:
    """``PRAGMA journal_mode=WAL``; the journal mode the database is in after it.

    Connections that switch a new database to WAL at the same moment (worker processes
    starting, consumers sharing a database) can each hold the lock the other needs;
    SQLite refuses one of them at once ("database is locked") instead of waiting the busy
    timeout. Asked again a moment later, it finds the database switched, or gets its turn.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            async with conn.execute("PRAGMA journal_mode=WAL") as cursor:
                row = await cursor.fetchone()
            return "" if row is None else str(row[0]).lower()
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.01)


async def open_writer(path: str, durability: Durability) -> aiosqlite.Connection:
    """The producer's one writer connection, in WAL mode, transactions managed by hand."""
    conn = await connect(path, any_thread=True)
    try:
        mode = await journal_mode_wal(conn)
        if mode != "wal":
            raise DatabaseOpenError(f"{path}: SQLite refused WAL mode (got {mode!r})")
        await conn.execute(f"PRAGMA synchronous={durability.upper()}")
    except BaseException:
        await conn.close()
        raise
    return conn


async def open_reader(path: str) -> aiosqlite.Connection:
    """A read-only connection: WAL lets it read while the writer commits."""
    return await connect(path, read_only=True)


# --- the schema ---------------------------------------------------------------------------


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
    elif meta.get("schema_version") in (1, 2, 3):
        if meta["schema_version"] == 1:
            _migrate_from_1(cursor)
        if meta["schema_version"] in (1, 2):
            cursor.execute("ALTER TABLE streamq_log ADD COLUMN count INTEGER NOT NULL DEFAULT 1")
        # 3 to 4: unnumbered rows and their trigger (``_INDEXES``). A new epoch: writers
        # that checked the version before hold the old epoch (``append.py``) and read again.
        meta["schema_version"] = SCHEMA_VERSION
        meta["epoch"] = next_epoch(int(meta["epoch"]))
    elif meta.get("schema_version") != SCHEMA_VERSION:
        raise SchemaMissingError(
            f"database has streamq schema version {meta.get('schema_version')!r}, "
            f"this streamq needs {SCHEMA_VERSION}"
        )
    for statement in _INDEXES:
        cursor.execute(statement)
    cursor.execute("PRAGMA table_info(streamq_consumers)")
    columns = {row[1] for row in cursor.fetchall()}
    for column, definition in _ADDED_COLUMNS.items():
        if column not in columns:
            cursor.execute(f"ALTER TABLE streamq_consumers ADD COLUMN {column} {definition}")
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


def next_epoch(current: int) -> int:
    """The epoch after ``current``: one more, and at least the time in milliseconds. Epochs
    only grow, and each producer instance's is its own even when the database was
    restored from an older copy (whose stored epoch comes back): the epoch after it is
    later than every epoch taken before the restore, including the lost records'
    ("Epochs" in docs/protocol.md)."""
    return max(current + 1, time.time_ns() // 1_000_000)


async def create_schema_async(conn: aiosqlite.Connection) -> tuple[dict[str, Any], bool]:
    """``create_schema`` on an aiosqlite connection, on its thread."""
    return await run_on_thread(conn, create_schema, conn._conn)


async def initialize(conn: aiosqlite.Connection, durability: Durability) -> Identity:
    """Create the tables if needed and bump the epoch, committed with a full sync.

    The producer id is made once, when the database is created, so consumers
    can tell a restarted producer (same id) from a replaced database (new id).
    """
    await conn.execute("PRAGMA synchronous=FULL")  # cannot change inside a transaction
    await conn.execute("BEGIN IMMEDIATE")
    try:
        meta, created = await create_schema_async(conn)
        meta["epoch"] = next_epoch(int(meta["epoch"]))
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


# --- reading what is committed ------------------------------------------------------------


def stream_rows(rows: Iterable[Any]) -> list[StreamRow]:
    return [
        StreamRow(
            stream_id, name, head, low, StreamSettings(bool(k), bool(c), bool(n)), max_ts, compacted
        )
        for stream_id, name, low, head, k, c, n, compacted, max_ts in rows
    ]


async def load_streams(conn: aiosqlite.Connection) -> list[StreamRow]:
    return stream_rows(await conn.execute_fetchall(STREAMS_QUERY))


def read_changes(conn: sqlite3.Connection, known: dict[int, tuple[int, int]]) -> Changes:
    """Everything a catch-up needs, read on the connection's thread in one go: streams,
    registrations, the epoch, and the epoch rows after ``known`` ({stream id: (head, last
    first seq)}) of the streams that grew or are new."""
    epoch = int(conn.execute(META_EPOCH_QUERY).fetchone()[0])
    streams = stream_rows(conn.execute(STREAMS_QUERY))
    consumers = consumer_rows(conn.execute(CONSUMERS_QUERY))
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


class SQLiteReader:
    """A read-only connection to the producer's file (``storage.Reader``)."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.conn = conn

    async def read_runs(self, stream_id: int, start: int, end: int, limit: int) -> list[Run]:
        return await run_on_thread(
            self.conn, read_runs, raw_connection(self.conn), stream_id, start, end, limit
        )

    async def read_key_records(
        self, stream_id: int, key: bytes, start: int, end: int, limit: int
    ) -> list[tuple[int, bytes]]:
        """A seek in the partial index ``streamq_log_key`` (key, then rowid): no scan."""
        rows = await self.conn.execute_fetchall(
            KEY_RECORDS_QUERY, (key, pos(stream_id, start), pos(stream_id, end), limit)
        )
        return [_numbered_row(p, record) for p, record in rows]

    async def seek_time(self, stream_id: int, timestamp: int) -> int | None:
        """Timestamps are read as a running maximum, as Kafka's time index does: a record
        stamped earlier than one before it never moves the answer back."""
        async with self.conn.execute(SEEK_TIME_QUERY, (stream_id, timestamp)) as cursor:
            row = await cursor.fetchone()
        return None if row is None else int(row[0]) & MAX_STORED_SEQ

    async def streams(self) -> list[StreamRow]:
        return await load_streams(self.conn)

    async def low_and_compacted(self, stream_id: int) -> tuple[int, int]:
        rows = await self.conn.execute_fetchall(
            "SELECT low, compacted FROM streamq_streams WHERE id = ?", (stream_id,)
        )
        for low, compacted in rows:
            return int(low), int(compacted)
        raise LookupError(f"no stream with id {stream_id}")


# --- writing --------------------------------------------------------------------------------


def create_stream_blocking(conn: sqlite3.Connection, name: str, settings: StreamSettings) -> int:
    """Insert a stream row in the open transaction, on the connection's own thread."""
    row = (name, settings.key_index, settings.compact, settings.notify_compacted)
    cursor = conn.execute(_CREATE_STREAM, row)
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def insert_blocking(
    conn: sqlite3.Connection,
    rows: Sequence[LogRow],
    times: Sequence[TimeRow],
    epochs: Sequence[EpochRow],
) -> None:
    """``SQLiteWriter.insert`` on the connection's own thread."""
    try:
        if rows:
            stored = stored_rows(rows)
            if insert(conn, INSERT_RECORDS_CHECKED, stored) != len(stored):
                raise ConcurrentWriterError(_CONCURRENT_WRITER)
        if times:
            insert(conn, INSERT_TIMES, [(s, ts, pos(s, seq)) for s, ts, seq in times])
        if epochs:
            insert(conn, INSERT_EPOCHS, epochs)
    except sqlite3.IntegrityError as exc:
        raise ConcurrentWriterError(_CONCURRENT_WRITER) from exc


def insert(conn: Any, sql: str, rows: Sequence[Sequence[Any]]) -> int:
    """``rows`` inserted through a connection or cursor; how many were. One (a one-record
    transaction's) without ``executemany``'s setup."""
    if len(rows) == 1:
        return int(conn.execute(sql, rows[0]).rowcount)
    if rows:
        return int(conn.executemany(sql, rows).rowcount)
    return 0


_CONCURRENT_WRITER = "another process appended to this producer's log during the transaction"


BUSY_TIMEOUT_MS = 10_000  # how long a connection waits for another's write lock


def busy(error: BaseException) -> bool:
    """``error`` is SQLite's "database is locked": another connection held the lock this
    one needed for longer than the busy timeout (any of SQLITE_BUSY's extended codes)."""
    return (
        isinstance(error, sqlite3.OperationalError)
        and error.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
    )


def begin_immediate(conn: sqlite3.Connection) -> int:
    """BEGIN IMMEDIATE on the connection's thread; returns ``PRAGMA data_version`` as seen
    holding the write lock."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        return int(conn.execute("PRAGMA data_version").fetchone()[0])
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def begin_at_once(conn: sqlite3.Connection) -> int:
    """``begin_immediate`` without waiting for another connection's write lock (on the
    event loop's thread): ``WouldWait`` at once instead. The connection waits as before
    for everything else."""
    conn.execute("PRAGMA busy_timeout=0")
    try:
        return begin_immediate(conn)
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode == sqlite3.SQLITE_BUSY:
            raise WouldWait from exc
        raise
    finally:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")


class SQLiteBlockingWriter:
    """The writer's sqlite3 connection, on its own thread or, for a short transaction
    while nothing is queued there, on the event loop's (``storage.BlockingWriter``)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        # Statements go straight to the driver, with no call of ours in between: a
        # commit group runs several per transaction.
        self.execute: Callable[..., sqlite3.Cursor] = conn.execute
        self.executemany: Callable[..., sqlite3.Cursor] = conn.executemany
        # COMMIT, ROLLBACK and each member's savepoint, on one cursor: ``conn.execute``
        # makes a cursor per call, and a commit group runs two savepoint statements a member.
        self._own = conn.cursor()

    def begin(self, wait: bool = True) -> int:
        return begin_immediate(self.conn) if wait else begin_at_once(self.conn)

    def commit(self) -> None:
        self._own.execute("COMMIT")

    def rollback(self) -> None:
        if self.conn.in_transaction:
            self._own.execute("ROLLBACK")

    def savepoint(self) -> None:
        self._own.execute("SAVEPOINT streamq_member")

    def rollback_to_savepoint(self) -> None:
        self._own.execute("ROLLBACK TO streamq_member")

    def release_savepoint(self) -> None:
        self._own.execute("RELEASE streamq_member")

    def create_stream(self, name: str, settings: StreamSettings) -> int:
        return create_stream_blocking(self.conn, name, settings)

    def insert(
        self, rows: Sequence[LogRow], times: Sequence[TimeRow], epochs: Sequence[EpochRow]
    ) -> None:
        insert_blocking(self.conn, rows, times, epochs)


class _Cursor(aiosqlite.Cursor):
    """aiosqlite's cursor over a statement of the writer's transaction: it fetches where
    that transaction runs its statements (``SQLiteWriter._call``)."""

    def __init__(self, writer: SQLiteWriter, cursor: sqlite3.Cursor) -> None:
        super().__init__(writer.conn, cursor)
        self._writer = writer

    async def _execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await self._writer._call(functools.partial(fn, *args, **kwargs))


class SQLiteWriter:
    """The producer's writer connection (``storage.Writer``). Every write but the
    application's own runs on the connection's thread in one hop."""

    def __init__(self, conn: aiosqlite.Connection, durability: Durability = "normal") -> None:
        self.conn = conn
        self.blocking = SQLiteBlockingWriter(raw_connection(conn))
        # A transaction that began on the event loop's thread runs its statements there
        # too while they run short (``begin``); never with durability="full", whose
        # COMMIT waits for an fsync.
        self._budget = InlineBudget()
        self._full = durability == "full"
        self._here = False
        self._unyielded = 0.0  # seconds run here since the loop last ran its other tasks

    @property
    def raw(self) -> sqlite3.Connection:
        """The sqlite3 connection: only on its own thread (``run``)."""
        return raw_connection(self.conn)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the connection's thread, after what is queued there."""
        return await run_on_thread(self.conn, fn, *args)

    @property
    def threaded(self) -> SQLiteWriter:
        return self

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.run(fn, self.blocking, *args)

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    @property
    def inline(self) -> SQLiteBlockingWriter:
        return self.blocking

    def _noted(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, its time noted against the budget, wherever it runs."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._budget.note(time.perf_counter() - started)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` where this transaction's statements run: all on the event loop's
        thread if it began there (the caller holds the producer's lock: nothing runs on
        the connection's own thread meanwhile, and its cursors fetch here too, so no two
        threads use the connection at once), else all on that one."""
        if not self._here:
            return await self.run(self._noted, fn, *args)
        started = time.perf_counter()
        result = self._noted(fn, *args)
        self._unyielded += time.perf_counter() - started
        if self._unyielded > self._budget.seconds:  # many short statements: the loop's
            self._unyielded = 0.0  # other tasks run between them, about every budget
            await asyncio.sleep(0)
        return result

    async def begin(self) -> int:
        """BEGIN IMMEDIATE: the database's write lock, held to COMMIT. On the event loop's
        thread where that costs no wait (another connection holding the lock: on the
        connection's own, ``begin_at_once``), while statements run short, as
        ``group_commit`` does: a hop to the thread and back costs more than a short
        statement, and each is paid holding the lock."""
        if self._budget.fits and not self._full:
            try:
                version = self._noted(self.blocking.begin, False)
            except WouldWait:
                pass
            else:
                self._here, self._unyielded = True, 0.0
                return version
        version = await self.run(begin_immediate, self.raw)  # waiting for the lock: not noted
        return version

    def commit_here(self) -> bool:
        """COMMIT now, on this thread, if the transaction runs here (no await: no cancel
        lands in it); False if it does not (``commit``)."""
        if not self._here or self._full:
            return False
        self._here = False
        self._noted(self.blocking.commit)
        return True

    async def commit(self) -> None:
        """On the connection's thread, as ``SQLiteBlockingWriter.commit``: every COMMIT of
        the writer's is that one call (``bench.tools.lock_hold`` times it)."""
        if not self.commit_here():
            self._here = False
            await self.run(self._noted, self.blocking.commit)

    async def rollback(self) -> None:
        here, self._here = self._here, False
        if not self.conn.in_transaction:
            return
        if here:
            self.blocking.rollback()
        else:
            await self.run(self.blocking.rollback)

    async def execute(self, sql: str, parameters: Any = ()) -> aiosqlite.Cursor:
        return _Cursor(self, await self._call(self.raw.execute, sql, parameters))

    async def executemany(self, sql: str, parameters: Any) -> aiosqlite.Cursor:
        return _Cursor(self, await self._call(self.raw.executemany, sql, parameters))

    async def create_stream(self, name: str, settings: StreamSettings) -> int:
        return await self._call(create_stream_blocking, self.raw, name, settings)

    async def insert(
        self, rows: Sequence[LogRow], times: Sequence[TimeRow], epochs: Sequence[EpochRow]
    ) -> None:
        await self._call(insert_blocking, self.raw, rows, times, epochs)

    async def truncate(self, stream_id: int, before: int) -> None:
        await self.conn.execute(
            "DELETE FROM streamq_log WHERE pos >= ? AND pos < ?",
            (pos(stream_id, 0), pos(stream_id, before)),
        )
        # Time rows of deleted records go too, but the last of them: it holds the largest
        # timestamp before ``before``, which seeks need (they clamp it to ``low``) and later
        # records must exceed to be indexed.
        await self.conn.execute(
            "DELETE FROM streamq_time WHERE stream_id = ?1 AND pos < ?2 AND ts < "
            "(SELECT max(ts) FROM streamq_time WHERE stream_id = ?1 AND pos < ?2)",
            (stream_id, pos(stream_id, before)),
        )
        await self.conn.execute(
            "UPDATE streamq_streams SET low = max(low, ?) WHERE id = ?", (before, stream_id)
        )

    async def first_seq_since(self, stream_id: int, start: int, end: int, since_ms: int) -> int:
        """A row's ``ts`` is its newest record's: the whole row is kept for it."""
        rows = await self.conn.execute_fetchall(
            "SELECT pos - count + 1 FROM streamq_log WHERE pos >= ? AND pos < ? AND ts >= ? "
            "AND pos - count < ? ORDER BY pos LIMIT 1",
            (
                pos(stream_id, start),
                rows_upper_bound(stream_id, end),
                since_ms,
                pos(stream_id, end) - 1,
            ),
        )
        for (found,) in rows:
            return max(start, int(found) & MAX_STORED_SEQ)
        return end

    async def bytes_between(self, stream_id: int, start: int, end: int) -> int:
        rows = await self.conn.execute_fetchall(
            "SELECT coalesce(sum(length(record)), 0) FROM streamq_log WHERE pos >= ? AND pos < ?",
            (pos(stream_id, start), pos(stream_id, end)),
        )
        return int(next(iter(rows))[0])

    async def seq_after_bytes(
        self, stream_id: int, start: int, end: int, excess: int
    ) -> tuple[int, int]:
        """Whole rows: a row of several records goes at once (they were one insert)."""
        dropped, seq = 0, start
        async with self.conn.execute(
            "SELECT pos, count, length(record) FROM streamq_log WHERE pos >= ? AND pos < ? "
            "ORDER BY pos",
            (pos(stream_id, start), pos(stream_id, end)),
        ) as cursor:
            while dropped < excess:
                rows = await cursor.fetchmany(1024)
                if not rows:
                    return end, dropped
                for position, count, size in rows:
                    last = int(position) & MAX_STORED_SEQ
                    if dropped >= excess:
                        return max(start, last - int(count) + 1), dropped
                    dropped += int(size)
                    seq = last + 1
        return seq, dropped

    async def compaction_candidates(
        self, stream_id: int, low: int, after: int, through: int
    ) -> list[tuple[int, bytes, bytes]]:
        rows = await self.conn.execute_fetchall(
            COMPACTION_QUERY,
            (pos(stream_id, after), pos(stream_id, through), pos(stream_id, low)),
        )
        numbered = [(_numbered_row(p, record), key) for p, key, record in rows]
        return [(seq, key, record) for (seq, record), key in numbered]

    async def delete_compacted(self, stream_id: int, seqs: list[int], through: int) -> None:
        await self.conn.executemany(
            "DELETE FROM streamq_log WHERE pos = ?", [(pos(stream_id, seq),) for seq in seqs]
        )
        await self.conn.execute(
            "UPDATE streamq_streams SET compacted = max(compacted, ?) WHERE id = ?",
            (through, stream_id),
        )

    async def register_consumer(
        self, consumer: str, stream: str, applied: int, limits: Limits
    ) -> int:
        now = int(time.time() * 1000)
        await self.conn.execute(
            "INSERT INTO streamq_consumers (consumer, stream, applied, registered_at, updated_at,"
            " max_idle_ms, max_bytes) VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (consumer, stream) DO UPDATE SET applied = max(applied, "
            "excluded.applied), max_idle_ms = excluded.max_idle_ms, "
            "max_bytes = excluded.max_bytes, registered = 1, registered_at = "
            "CASE WHEN registered THEN registered_at ELSE excluded.registered_at END",
            (consumer, stream, applied, now, now, limits.max_idle_ms, limits.max_bytes),
        )
        rows = await self.conn.execute_fetchall(
            "SELECT applied FROM streamq_consumers WHERE consumer = ? AND stream = ?",
            (consumer, stream),
        )
        return int(next(iter(rows))[0])

    async def unregister_consumer(self, consumer: str, stream: str) -> bool:
        key = (consumer, stream)
        deleted = await self.conn.execute(UNREGISTER_UNKNOWN, key)
        kept = await self.conn.execute(UNREGISTER, key)
        return deleted.rowcount + kept.rowcount > 0

    async def forget_consumer(self, consumer: str, stream: str) -> bool:
        cursor = await self.conn.execute(
            "DELETE FROM streamq_consumers WHERE consumer = ? AND stream = ?", (consumer, stream)
        )
        return cursor.rowcount > 0

    async def save_positions(
        self, positions: Sequence[KnownPosition], forgotten: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Never sets ``registered``: a registration removed by another process stays
        removed."""
        if positions:
            now = int(time.time() * 1000)
            await self.conn.executemany(
                SAVE_POSITION, [(c, s, applied, now, at) for c, s, applied, at in positions]
            )
        if forgotten:
            await self.conn.executemany(FORGET_UNREGISTERED, forgotten)


class SQLiteStorage:
    """A producer's SQLite database file (``storage.Storage``)."""

    features = ENGINE.features

    def __init__(self, path: str) -> None:
        self.path = path
        self.where = repr(path)
        self._writer: SQLiteWriter | None = None
        self._readers: asyncio.Queue[SQLiteReader] = asyncio.Queue()
        self._all_readers: list[aiosqlite.Connection] = []
        self._serve_lock: ServeLock | None = None
        self.checkpointer: Checkpointer | None = None

    @property
    def writer(self) -> SQLiteWriter:
        assert self._writer is not None, "storage not open"
        return self._writer

    async def open(self, durability: Durability) -> Identity:
        conn = await open_writer(self.path, durability)
        self._writer = SQLiteWriter(conn, durability)
        identity = await initialize(conn, durability)
        self.checkpointer = await take_over(conn, self.path, durability)
        return identity

    async def open_readers(self, count: int) -> None:
        for _ in range(count):
            conn = await open_reader(self.path)
            self._all_readers.append(conn)  # closed by close(), even if a later open fails
            self._readers.put_nowait(SQLiteReader(conn))

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[SQLiteReader]:
        reader = await self._readers.get()
        try:
            yield reader
        finally:
            self._readers.put_nowait(reader)

    async def load(self) -> Changes:
        changes: Changes = await self.writer.run(read_changes, self.writer.raw, {})
        return changes

    async def version(self) -> int:
        # Read on the event loop's thread: callers hold the producer's lock, so nothing is
        # under way on the connection's own, and the hop would cost more than the pragma
        # (the watch asks after every commit, this producer's own included).
        return int(self.writer.raw.execute("PRAGMA data_version").fetchone()[0])

    async def changes(self, known: dict[int, tuple[int, int]], *, reading: bool = False) -> Changes:
        if not reading:
            # On the event loop's thread, as ``version``: the caller holds the producer's
            # lock, and the hop would cost about what the queries do.
            return read_changes(self.writer.raw, known)
        async with self.reader() as reader:
            read: Changes = await run_on_thread(
                reader.conn, read_changes, raw_connection(reader.conn), known
            )
        return read

    def watch(self) -> WalWatch:
        return WalWatch(self.path)

    def session(self, durability: Durability) -> Any:
        from .append import SQLiteSession  # append.py builds on this module

        return SQLiteSession(self.path, durability, checkpointed=self.checkpointer is not None)

    async def claim_serving(self) -> None:
        self._serve_lock = ServeLock.claim(self.path)

    async def serving(self, address: str) -> None:
        if self._serve_lock is not None:
            self._serve_lock.serving(address)

    async def close(self) -> None:
        if self.checkpointer is not None:
            await self.checkpointer.close()
            self.checkpointer = None
        for conn in self._all_readers:
            await conn.close()
        self._all_readers.clear()
        if self._writer is not None:
            await self._writer.conn.close()
            self._writer = None
        if self._serve_lock is not None:
            self._serve_lock.release()
            self._serve_lock = None
