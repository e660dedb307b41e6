"""The SQLite engine's consumer positions: ``streamq_positions`` in the consumer's own
database file, and batches applied into that file with their position.

One row per (consumer, producer id, stream) holds the last applied seq; records a
``DeadLetter`` consumer parked are rows of ``streamq_dead_letters``, written in the
transaction that moves the position past them. It moves only
from the seq a batch follows (``Batch.after``) to the batch's last, in the transaction
that applies the batch, under SQLite's write lock (``BEGIN IMMEDIATE``, or the first
write of the application's own transaction): two processes applying the same batch
cannot both find the position it follows, so the second gets ``OutOfOrderBatchError``.

``SQLitePositionStore`` is what a ``Consumer`` with ``db=PATH`` talks to (the interface
is ``position_store.PositionStore``); ``save_position`` is ``streamq.save_position`` on a
DB-API connection to a SQLite database (sqlite3, under SQLAlchemy or Django).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import aiosqlite

from ...consumer.batch import Batch
from ...consumer.position_store import DeadLetterSQL, ParkedRecord, lease_lost, out_of_turn
from ...consumer.resharing import Move, StoredPosition, plan
from ...errors import DatabaseOpenError, SchemaMissingError
from ...producer.storage import WouldWait
from ...sql import (
    AsyncSQL,
    BlockingSQL,
    InlineBudget,
    in_transaction,
    raw_connection,
    run_on_thread,
    to_the_end,
)
from .checkpoints import Checkpointer, take_over
from .storage import begin_at_once, busy, connect, database_file, journal_mode_wal

if TYPE_CHECKING:
    from ...sql import Durability

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS streamq_positions (
    consumer TEXT NOT NULL,
    producer_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    seq INTEGER NOT NULL,         -- last applied seq
    epoch INTEGER,                -- highest producer epoch that wrote up to seq (0: unknown)
    endpoint TEXT NOT NULL,       -- where that producer was last reached
    updated_at INTEGER NOT NULL,  -- milliseconds since the Unix epoch
    PRIMARY KEY (consumer, producer_id, stream)
)"""
LOAD = (
    "SELECT producer_id, seq, epoch, endpoint FROM streamq_positions "
    "WHERE consumer = ? AND stream = ?"
)
# A consumer's positions under its own name and as shares of it (``name[i/n]``).
NAMES_ON = (
    "SELECT consumer, producer_id, seq FROM streamq_positions WHERE stream = ? "
    "AND (producer_id = ? OR endpoint = ?)"
)
ALL_SHARES = (
    "SELECT consumer, producer_id, stream, seq, coalesce(epoch, 0), endpoint "
    "FROM streamq_positions WHERE consumer = ? OR substr(consumer, 1, ?) = ?"
)
FORGET = "DELETE FROM streamq_positions WHERE consumer = ? AND producer_id = ? AND stream = ?"
STORED = "SELECT seq FROM streamq_positions WHERE consumer = ? AND producer_id = ? AND stream = ?"
# A group member's lease is still its own (``Batch.fence``).
FENCE = "SELECT 1 FROM streamq_leases WHERE name = ? AND stream = ? AND share = ? AND token = ?"
ADVANCE = (
    "UPDATE streamq_positions SET seq = ?, epoch = ?, endpoint = ?, updated_at = ? "
    "WHERE consumer = ? AND producer_id = ? AND stream = ? AND seq = ?"
)
FIRST = (
    "INSERT INTO streamq_positions "
    "(consumer, producer_id, stream, seq, epoch, endpoint, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
DEAD_LETTERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS streamq_dead_letters (
    consumer TEXT NOT NULL,
    producer_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    seq INTEGER NOT NULL,
    key BLOB,
    value BLOB NOT NULL,
    headers BLOB NOT NULL,         -- msgpack map of name -> bytes
    timestamp INTEGER NOT NULL,    -- the record's, ms since the Unix epoch
    error TEXT NOT NULL,           -- the application's last exception, with its traceback
    attempts INTEGER NOT NULL,     -- tries of the record that failed
    parked_at INTEGER NOT NULL,    -- ms since the Unix epoch
    retry_requested_at INTEGER,    -- set by `streamq dead-letters retry`
    PRIMARY KEY (consumer, producer_id, stream, seq)
)"""
_LETTER = "consumer = ? AND producer_id = ? AND stream = ? AND seq = ?"
DEAD_LETTERS = DeadLetterSQL(
    park="INSERT INTO streamq_dead_letters (consumer, producer_id, stream, seq, key, value, "
    "headers, timestamp, error, attempts, parked_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    requested="SELECT seq, timestamp, key, value, headers FROM streamq_dead_letters "
    "WHERE consumer = ? AND producer_id = ? AND stream = ? AND retry_requested_at IS NOT NULL "
    "ORDER BY seq",
    take=f"DELETE FROM streamq_dead_letters WHERE {_LETTER} AND retry_requested_at IS NOT NULL",
    failed_again="UPDATE streamq_dead_letters SET error = ?, attempts = attempts + 1, "
    f"retry_requested_at = NULL WHERE {_LETTER}",
)
_LIST = (
    "SELECT consumer, producer_id, stream, seq, timestamp, key, value, headers, error, "
    "attempts, parked_at, retry_requested_at FROM streamq_dead_letters"
)


async def open_database(path: str, durability: Durability) -> aiosqlite.Connection:
    """A consumer's database connection, with the positions table."""
    db = await connect(path, any_thread=True)  # a path that is no database: DatabaseOpenError
    try:
        await journal_mode_wal(db)
        await db.execute(f"PRAGMA synchronous={durability.upper()}")
        await db.execute(SCHEMA)
        await db.execute(DEAD_LETTERS_SCHEMA)
        columns = await db.execute_fetchall("PRAGMA table_info(streamq_positions)")
        if "epoch" not in {column[1] for column in columns}:  # made by an older streamq
            await db.execute("ALTER TABLE streamq_positions ADD COLUMN epoch INTEGER")
    except BaseException:
        await db.close()
        raise
    return db


def advance(dbapi: Any, batch: Batch, seq: int) -> None:
    """Move ``batch``'s consumer position from ``batch.after`` to ``seq``, in ``dbapi``'s
    open transaction; ``OutOfOrderBatchError`` if it is not at ``batch.after`` (or, for
    the consumer's first batch, absent). ``seq == batch.after`` claims the turn only."""
    key = (batch.consumer, batch.producer_id, batch.stream)
    now = int(time.time() * 1000)
    cursor = dbapi.cursor()
    try:
        try:
            # The UPDATE takes the write lock before it reads: two processes applying one
            # batch cannot both find the position it follows.
            cursor.execute(ADVANCE, (seq, batch.epoch, batch.endpoint, now, *key, batch.after))
        except Exception as exc:
            if "no such table: streamq_positions" in str(exc):
                raise SchemaMissingError(
                    f"{database_file(cursor)} has no streamq_positions table: open the "
                    "Consumer with db= this database (it creates the table) before applying "
                    "through it"
                ) from exc
            raise
        moved = cursor.rowcount == 1
        if batch.fence is not None:  # under the write lock the UPDATE took: no take meanwhile
            cursor.execute(FENCE, (batch.fence.group, batch.stream, *batch.fence[1:]))
            if cursor.fetchone() is None:
                raise lease_lost(batch)
        if moved:
            return
        # Holding the write lock since the UPDATE: what is stored cannot change meanwhile.
        cursor.execute(STORED, key)
        row = cursor.fetchone()
        stored = None if row is None else int(row[0])
        if stored is None and batch.after == batch.origin:  # the consumer's first batch
            cursor.execute(FIRST, (*key, seq, batch.epoch, batch.endpoint, now))
            return
    finally:
        cursor.close()
    raise out_of_turn(batch, stored)


def save_position(dbapi: Any, batch: Batch) -> None:
    """``streamq.save_position`` on a DB-API connection to a SQLite database."""
    advance(dbapi, batch, batch.last_seq)


async def save_position_async(conn: aiosqlite.Connection, batch: Batch) -> None:
    """``save_position`` on an aiosqlite connection, on its thread (one hop)."""
    await run_on_thread(conn, advance, raw_connection(conn), batch, batch.last_seq)


def _filters(consumer: str | None, stream: str | None, seq: int | None) -> tuple[str, list[Any]]:
    given = {"consumer": consumer, "stream": stream, "seq": seq}
    names = [name for name, value in given.items() if value is not None]
    where = " AND ".join(f"{name} = ?" for name in names)
    return (f" WHERE {where}" if where else ""), [given[name] for name in names]


def _dead_letters_connection(path: str) -> sqlite3.Connection:
    """A connection for the command line: the file must exist (never created here)."""
    try:
        return sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10, isolation_level=None)
    except sqlite3.OperationalError as exc:
        raise DatabaseOpenError(f"cannot open SQLite database {path!r}: {exc}") from exc


def list_dead_letters(path: str, consumer: str | None = None) -> list[ParkedRecord]:
    """The records parked in the consumer database at ``path``, by consumer and seq."""
    conn = _dead_letters_connection(path)
    try:
        where, params = _filters(consumer, None, None)
        try:
            rows = conn.execute(f"{_LIST}{where} ORDER BY consumer, stream, seq", params)
            return [ParkedRecord.from_row(row) for row in rows.fetchall()]
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return []  # no consumer of this streamq version opened it yet: none parked
            raise
    finally:
        conn.close()


def reshare(path: str, consumer: str, shares: int) -> list[Move]:
    """Move ``consumer``'s positions to a split into ``shares``, in one transaction
    (``streamq.consumer.resharing``); the moves made. Raises ``ReshareRefusedError`` if unsafe."""
    conn = _dead_letters_connection(path)
    try:
        conn.execute("BEGIN IMMEDIATE")  # no worker commits between the check and the change
        prefix = consumer + "["
        try:
            rows = conn.execute(ALL_SHARES, (consumer, len(prefix), prefix)).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise
            rows = []
        moves = plan(consumer, shares, [StoredPosition(*row) for row in rows])
        now = int(time.time() * 1000)
        for m in moves:
            conn.executemany(FORGET, [(name, m.producer_id, m.stream) for name in m.old])
            conn.executemany(
                FIRST,
                [
                    (name, m.producer_id, m.stream, m.seq, m.epoch, m.endpoint, now)
                    for name in m.new
                ],
            )
        conn.execute("COMMIT")
        return moves
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()


def mark_for_retry(
    path: str, consumer: str | None = None, stream: str | None = None, seq: int | None = None
) -> int:
    """Mark the matching parked records for their consumer to re-apply; how many."""
    conn = _dead_letters_connection(path)
    try:
        where, params = _filters(consumer, stream, seq)
        now = int(time.time() * 1000)
        try:
            cursor = conn.execute(
                f"UPDATE streamq_dead_letters SET retry_requested_at = ?{where}", [now, *params]
            )
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return 0
            raise
        return int(cursor.rowcount)
    finally:
        conn.close()


class SQLitePositionStore:
    """A consumer's SQLite database: positions, and batches applied with them.

    One aiosqlite connection: ``transaction`` awaits each statement on its thread,
    ``apply`` runs a whole transaction as one function: on the event loop's thread while
    transactions are short and the write lock is free (``sql.InlineBudget``; the
    caller holds the consumer's transaction lock, so nothing is under way on the
    connection's own thread), else there (one hop).
    """

    dead_letters = DEAD_LETTERS

    def __init__(self, path: str, durability: Durability = "normal") -> None:
        self.path = path
        self.where = f"SQLite database {path!r}"
        self._durability = durability
        self._db: aiosqlite.Connection | None = None
        self._owned = True
        self._budget = InlineBudget()
        self._checkpointer: Checkpointer | None = None

    @classmethod
    def shared(cls, db: aiosqlite.Connection, path: str) -> SQLitePositionStore:
        """A store on ``db``, opened (and closed) by someone else: ``FanInConsumer``."""
        positions = cls(path)
        positions._db, positions._owned = db, False
        return positions

    @property
    def connection(self) -> aiosqlite.Connection:
        """The aiosqlite connection (for tests and tools that reach under the interface)."""
        if self._db is None:
            raise RuntimeError(f"the consumer's {self.where} is not open")
        return self._db

    async def open(self) -> None:
        if self._db is None:
            self._db = await open_database(self.path, self._durability)
            self._checkpointer = await take_over(self._db, self.path, self._durability)

    def unavailable(self, error: BaseException) -> bool:
        return busy(error)

    async def close(self) -> None:
        if self._checkpointer is not None:
            await self._checkpointer.close()
            self._checkpointer = None
        db, self._db = self._db, None
        if db is not None and self._owned:
            await db.close()

    async def load(self, consumer: str, stream: str) -> list[tuple[str, int, int, str]]:
        rows = await self.connection.execute_fetchall(LOAD, (consumer, stream))
        return [(str(p), int(seq), int(epoch or 0), str(at)) for p, seq, epoch, at in rows]

    async def names_on(
        self, stream: str, producer_id: str, endpoint: str
    ) -> list[tuple[str, str, int]]:
        rows = await self.connection.execute_fetchall(NAMES_ON, (stream, producer_id, endpoint))
        return [(str(name), str(producer), int(seq)) for name, producer, seq in rows]

    async def stored(self, consumer: str, producer_id: str, stream: str) -> int | None:
        rows = list(await self.connection.execute_fetchall(STORED, (consumer, producer_id, stream)))
        return int(rows[0][0]) if rows else None

    @contextlib.asynccontextmanager
    async def transaction(
        self, batch: Batch, committed: Callable[[], None]
    ) -> AsyncIterator[AsyncSQL]:
        db = self.connection
        conn = raw_connection(db)
        tx = AsyncSQL(db)
        try:
            # BEGIN and the turn in one hop, waited for even if cancelled: a BEGIN left
            # to run after the ROLLBACK below would leave the connection in a transaction.
            await to_the_end(run_on_thread(db, _begin, conn, batch), lambda: None)
            yield tx
            tx._closed = True
            await to_the_end(run_on_thread(db, _commit, conn, batch), committed)
        except BaseException:
            tx._closed = True
            if db.in_transaction:
                await db.execute("ROLLBACK")
            raise

    async def apply(
        self,
        batch: Batch,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        committed: Callable[[], None],
    ) -> T:
        db = self.connection
        conn = raw_connection(db)

        def body(wait: bool) -> T:
            tx = BlockingSQL(conn)
            try:
                _begin(conn, batch, wait)
                started = time.perf_counter()  # from BEGIN: waiting for the lock is not its cost
                result = fn(tx, batch, *args)
                tx._closed = True
                _commit(conn, batch)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            finally:
                tx._closed = True
            self._budget.note(time.perf_counter() - started)
            return result

        if self._budget.fits:
            try:
                result = body(wait=False)
            except WouldWait:
                pass  # another connection writes: wait for it on the connection's thread
            else:
                committed()
                return result
        return await to_the_end(run_on_thread(db, body, True), committed)

    async def run_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        db = self.connection
        conn = raw_connection(db)

        def body() -> T:
            tx = BlockingSQL(conn)
            try:
                return in_transaction(conn, lambda: fn(tx, *args))
            finally:
                tx._closed = True

        return await to_the_end(run_on_thread(db, body), lambda: None)


def _begin(conn: sqlite3.Connection, batch: Batch, wait: bool = True) -> None:
    """BEGIN IMMEDIATE (the write lock) and claim ``batch``'s turn. A batch out of turn
    is refused before the application's SQL runs. ``wait=False`` (on the event loop's
    thread): ``WouldWait`` at once if another connection holds the write lock."""
    if wait:
        conn.execute("BEGIN IMMEDIATE")
    else:
        begin_at_once(conn)
    try:
        advance(conn, batch, batch.after)
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _commit(conn: sqlite3.Connection, batch: Batch) -> None:
    """Store ``batch``'s last seq as the position, and COMMIT; on the connection's thread."""
    advance(conn, batch, batch.last_seq)
    conn.execute("COMMIT")
