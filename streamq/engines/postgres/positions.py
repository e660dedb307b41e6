"""The PostgreSQL engine's consumer positions: ``streamq_positions`` in the consumer's own
PostgreSQL database, and batches applied into it with their position.

The table is SQLite's (``engines/sqlite/positions.py``) in PostgreSQL's types. A row
moves only from the seq a batch follows (``Batch.after``) to the batch's last, and two
processes racing to apply one batch are kept apart by PostgreSQL's locks, under READ
COMMITTED:

- ``UPDATE ... WHERE seq = after`` locks the row. A second updater waits for the first
  transaction to end, then re-reads the row: if the first committed, ``seq`` is no longer
  ``after`` and nothing is updated; if it rolled back, the second goes on.
- The consumer's first batch has no row yet: ``INSERT ... ON CONFLICT DO NOTHING`` waits
  for a concurrent inserter's transaction in the same way, and inserts nothing if it
  committed.

Updating or inserting nothing means another transaction applied the batch (or this one
is out of turn): ``OutOfOrderBatchError``. Under REPEATABLE READ or SERIALIZABLE (the
application's own transaction, in ``save_position``), PostgreSQL raises a serialization
failure instead; either way the second transaction cannot commit. The consumer's own
connections use READ COMMITTED whatever the server's default.

``PostgresPositionStore`` claims the batch's turn at the start of its transaction
(``seq`` from ``after`` to ``after``, which takes the lock), so the loser of a race fails
before running the application's SQL, and moves it to the batch's last seq before COMMIT.
``save_position`` is ``streamq.save_position`` on the application's psycopg connection.

The logic is written once, as generators of statements run by ``append.run`` (psycopg
``Connection``) and ``append.run_async`` (``AsyncConnection``, and the application's
asyncpg connection in ``save_position_async``). psycopg is imported only when a
PostgreSQL database is opened: it is an optional extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ...consumer.batch import Batch
from ...consumer.position_store import DeadLetterSQL, ParkedRecord, lease_lost, out_of_turn
from ...consumer.resharing import Move, StoredPosition, plan
from ...errors import SchemaMissingError
from ...sql import BlockingSQL, Scoped, to_the_end
from .append import UNDEFINED_TABLE, Statement, Steps, describe, in_both, run, run_async
from .driver import (
    connect,
    connect_async,
    connection_lost,
    database,
    in_transaction,
    psycopg_module,
)

if TYPE_CHECKING:
    import psycopg

    from ...sql import Durability

T = TypeVar("T")

Params = Sequence[Any] | Mapping[str, Any] | None

# Two consumers creating the table at once would race on the catalog.
_SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtext('streamq_positions'))"
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS streamq_positions (
        consumer text NOT NULL,
        producer_id text NOT NULL,
        stream text NOT NULL,
        seq bigint NOT NULL,          -- last applied seq
        epoch bigint,                 -- highest producer epoch that wrote up to seq (0: unknown)
        endpoint text NOT NULL,       -- where that producer was last reached
        updated_at bigint NOT NULL,   -- milliseconds since the Unix epoch
        PRIMARY KEY (consumer, producer_id, stream)
    )""",
    "ALTER TABLE streamq_positions ADD COLUMN IF NOT EXISTS epoch bigint",
    # Records a DeadLetter consumer parked: SQLite's table (engines/sqlite/positions.py).
    """CREATE TABLE IF NOT EXISTS streamq_dead_letters (
        consumer text NOT NULL,
        producer_id text NOT NULL,
        stream text NOT NULL,
        seq bigint NOT NULL,
        key bytea,
        value bytea NOT NULL,
        headers bytea NOT NULL,
        timestamp bigint NOT NULL,
        error text NOT NULL,
        attempts integer NOT NULL,
        parked_at bigint NOT NULL,
        retry_requested_at bigint,
        PRIMARY KEY (consumer, producer_id, stream, seq)
    )""",
)
# The tables as this version needs them, found without taking a lock.
SCHEMA_READY = (
    "SELECT to_regclass('streamq_dead_letters') IS NOT NULL AND EXISTS (SELECT 1 FROM "
    "pg_attribute WHERE attrelid = to_regclass('streamq_positions') AND attname = 'epoch' "
    "AND NOT attisdropped)"
)
# The consumer's own connections, whatever the server's defaults: the module docstring.
READ_COMMITTED = "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
SYNCHRONOUS_COMMIT = "SET synchronous_commit = on"  # durability="full"

LOAD = (
    "SELECT producer_id, seq, epoch, endpoint FROM streamq_positions "
    "WHERE consumer = %s AND stream = %s"
)
# Every name's position for a producer's stream (``PositionStore.names_on``).
NAMES_ON = (
    "SELECT consumer, producer_id, seq FROM streamq_positions WHERE stream = %s "
    "AND (producer_id = %s OR endpoint = %s)"
)
ALL_SHARES = (
    "SELECT consumer, producer_id, stream, seq, coalesce(epoch, 0), endpoint "
    "FROM streamq_positions WHERE consumer = %s OR starts_with(consumer, %s) FOR UPDATE"
)
FORGET = "DELETE FROM streamq_positions WHERE consumer = %s AND producer_id = %s AND stream = %s"
# Moving a position: run on the application's connection too (``save_position``), so
# each in psycopg's placeholders and asyncpg's (``in_both``), with positional parameters.
STORED, STORED_DOLLAR = in_both(
    "SELECT seq FROM streamq_positions WHERE consumer = {} AND producer_id = {} AND stream = {}"
)
# A group member's lease is still its own (``Batch.fence``); held until COMMIT.
FENCE, FENCE_DOLLAR = in_both(
    "SELECT 1 FROM streamq_leases WHERE name = {} AND stream = {} AND share = {} AND token = {} "
    "FOR SHARE"
)
ADVANCE, ADVANCE_DOLLAR = in_both(
    "UPDATE streamq_positions SET seq = {}, epoch = {}, endpoint = {}, updated_at = {} "
    "WHERE consumer = {} AND producer_id = {} AND stream = {} AND seq = {} RETURNING seq"
)
FIRST, FIRST_DOLLAR = in_both(
    "INSERT INTO streamq_positions "
    "(consumer, producer_id, stream, seq, epoch, endpoint, updated_at) "
    "VALUES ({}, {}, {}, {}, {}, {}, {}) "
    "ON CONFLICT (consumer, producer_id, stream) DO NOTHING RETURNING seq"
)

_LETTER = "consumer = %s AND producer_id = %s AND stream = %s AND seq = %s"
DEAD_LETTERS = DeadLetterSQL(
    park="INSERT INTO streamq_dead_letters (consumer, producer_id, stream, seq, key, value, "
    "headers, timestamp, error, attempts, parked_at) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
    requested="SELECT seq, timestamp, key, value, headers FROM streamq_dead_letters "
    "WHERE consumer = %s AND producer_id = %s AND stream = %s "
    "AND retry_requested_at IS NOT NULL ORDER BY seq",
    take=f"DELETE FROM streamq_dead_letters WHERE {_LETTER} AND retry_requested_at IS NOT NULL",
    failed_again="UPDATE streamq_dead_letters SET error = %s, attempts = attempts + 1, "
    f"retry_requested_at = NULL WHERE {_LETTER}",
)
_LIST = (
    "SELECT consumer, producer_id, stream, seq, timestamp, key, value, headers, error, "
    "attempts, parked_at, retry_requested_at FROM streamq_dead_letters"
)


def advance_steps(batch: Batch, seq: int, where: str) -> Steps:
    """Move ``batch``'s consumer position from ``batch.after`` to ``seq`` in the open
    transaction; ``OutOfOrderBatchError`` if it is not at ``batch.after`` (or, for the
    consumer's first batch, absent). ``seq == batch.after`` claims the turn only."""
    key = (batch.consumer, batch.producer_id, batch.stream)
    now = int(time.time() * 1000)
    if batch.fence is not None:
        # Locked until COMMIT: a take of the share waits for this transaction to end.
        fence = (batch.fence.group, batch.stream, batch.fence.share, batch.fence.token)
        if (yield Statement(FENCE, fence, True, dollar=FENCE_DOLLAR)) is None:
            raise lease_lost(batch)
    try:
        moved = yield Statement(
            ADVANCE,
            (seq, batch.epoch, batch.endpoint, now, *key, batch.after),
            True,
            dollar=ADVANCE_DOLLAR,
        )
    except Exception as exc:
        if getattr(exc, "sqlstate", None) == UNDEFINED_TABLE:
            raise SchemaMissingError(
                f"{where} has no streamq_positions table: open the Consumer with db= this "
                "database (it creates the table) before applying through it"
            ) from exc
        raise
    if moved is not None:
        return
    first = batch.after == batch.origin  # the consumer's first batch: no row yet
    row = (*key, seq, batch.epoch, batch.endpoint, now)
    if first and (yield Statement(FIRST, row, True, dollar=FIRST_DOLLAR)) is not None:
        return
    # A new statement: under READ COMMITTED it sees what the winner committed.
    stored = yield Statement(STORED, key, True, dollar=STORED_DOLLAR)
    raise out_of_turn(batch, None if stored is None else int(stored[0]))


def session_steps(durability: Durability) -> Steps:
    """The session settings of the consumer's own connections."""
    yield Statement(READ_COMMITTED)
    if durability == "full":
        yield Statement(SYNCHRONOUS_COMMIT)


def setup_steps(durability: Durability) -> Steps:
    """The session settings, and the tables if any is missing. Only then: even ``IF NOT
    EXISTS``, DDL takes an exclusive lock on the table, queued behind every open
    transaction that touched it and ahead of every later one, so one worker starting
    would stall all the others until their batches commit."""
    yield from session_steps(durability)
    ready = yield Statement(SCHEMA_READY, fetch=True)
    if ready is not None and ready[0]:
        return
    yield Statement(_SCHEMA_LOCK)
    for statement in SCHEMA:
        yield Statement(statement)


def save_position(conn: Any, batch: Batch) -> None:
    """``streamq.save_position`` on a psycopg ``Connection``, in its open transaction."""
    run(conn, advance_steps(batch, batch.last_seq, describe(conn)))


async def save_position_async(conn: Any, batch: Batch) -> None:
    """``save_position`` on a psycopg ``AsyncConnection`` or an asyncpg connection."""
    await run_async(conn, advance_steps(batch, batch.last_seq, describe(conn)))


def _filters(consumer: str | None, stream: str | None, seq: int | None) -> tuple[str, list[Any]]:
    given = {"consumer": consumer, "stream": stream, "seq": seq}
    names = [name for name, value in given.items() if value is not None]
    where = " AND ".join(f"{name} = %s" for name in names)
    return (f" WHERE {where}" if where else ""), [given[name] for name in names]


def _undefined_table(exc: Exception) -> bool:
    return getattr(exc, "sqlstate", None) == UNDEFINED_TABLE


def list_dead_letters(url: str, consumer: str | None = None) -> list[ParkedRecord]:
    """The records parked in the consumer database at ``url``, by consumer and seq."""
    psycopg = psycopg_module()
    with connect(url, database(url), application_name="streamq dead-letters") as conn:
        where, params = _filters(consumer, None, None)
        try:
            rows = conn.execute(f"{_LIST}{where} ORDER BY consumer, stream, seq", params)
            return [ParkedRecord.from_row(row) for row in rows.fetchall()]
        except psycopg.Error as exc:
            if _undefined_table(exc):
                return []  # no consumer of this streamq version opened it yet: none parked
            raise


def reshare(url: str, consumer: str, shares: int) -> list[Move]:
    """Move ``consumer``'s positions to a split into ``shares``, in one transaction
    (``streamq.consumer.resharing``); the moves made. Raises ``ReshareRefusedError`` if unsafe."""
    psycopg = psycopg_module()
    conn = connect(url, database(url), application_name="streamq reshare", autocommit=False)
    with conn:  # one transaction, committed at the end of the block
        try:
            # FOR UPDATE: no worker moves a position between the check and the change.
            rows = conn.execute(ALL_SHARES, (consumer, consumer + "[")).fetchall()
        except psycopg.Error as exc:
            if not _undefined_table(exc):
                raise
            rows = []
        moves = plan(consumer, shares, [StoredPosition(*row) for row in rows])
        now = int(time.time() * 1000)
        with conn.cursor() as cursor:
            for m in moves:
                cursor.executemany(FORGET, [(name, m.producer_id, m.stream) for name in m.old])
                cursor.executemany(
                    FIRST,
                    [
                        (name, m.producer_id, m.stream, m.seq, m.epoch, m.endpoint, now)
                        for name in m.new
                    ],
                )
        return moves


def mark_for_retry(
    url: str, consumer: str | None = None, stream: str | None = None, seq: int | None = None
) -> int:
    """Mark the matching parked records for their consumer to re-apply; how many."""
    psycopg = psycopg_module()
    with connect(url, database(url), application_name="streamq dead-letters") as conn:
        where, params = _filters(consumer, stream, seq)
        now = int(time.time() * 1000)
        try:
            cursor = conn.execute(
                f"UPDATE streamq_dead_letters SET retry_requested_at = %s{where}", [now, *params]
            )
        except psycopg.Error as exc:
            if _undefined_table(exc):
                return 0
            raise
        return int(cursor.rowcount)


class AsyncPostgresSQL(Scoped):
    """The application's statements in a consumer transaction, each awaited
    (psycopg placeholders: ``%s``, ``%(name)s``)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    async def execute(self, sql: str, parameters: Params = None) -> psycopg.AsyncCursor[Any]:
        self._check_open()
        return await self._conn.execute(sql, parameters)

    async def executemany(
        self, sql: str, parameters: Iterable[Sequence[Any] | Mapping[str, Any]]
    ) -> psycopg.AsyncCursor[Any]:
        self._check_open()
        cursor = self._conn.cursor()
        await cursor.executemany(sql, parameters)
        return cursor


class PostgresSQL(BlockingSQL):
    """The application's statements in a consumer transaction run by ``apply``, blocking,
    on a worker thread (psycopg placeholders: ``%s``, ``%(name)s``)."""

    _conn: psycopg.Connection[Any]

    def execute(self, sql: str, parameters: Params = None) -> psycopg.Cursor[Any]:
        self._check_open()
        return self._conn.execute(sql, parameters)

    def executemany(
        self, sql: str, parameters: Iterable[Sequence[Any] | Mapping[str, Any]]
    ) -> psycopg.Cursor[Any]:
        self._check_open()
        cursor = self._conn.cursor()
        cursor.executemany(sql, parameters)
        return cursor


class PostgresPositionStore:
    """A consumer's PostgreSQL database: positions, and batches applied with them.

    ``transaction`` runs on a psycopg ``AsyncConnection``; ``apply`` on a blocking
    ``Connection`` of its own, in a worker thread (``asyncio.to_thread``), so the event
    loop goes on meanwhile. That one is opened at the first ``apply``. On PostgreSQL,
    ``durability="normal"`` keeps the server's ``synchronous_commit``; ``"full"`` sets it
    on for these connections.
    """

    dead_letters = DEAD_LETTERS

    def __init__(
        self, url: str, durability: Durability = "normal", *, connect_timeout: float = 10.0
    ) -> None:
        psycopg_module()  # fail early, saying what to install
        self.url = url
        self.where = database(url)
        self._durability = durability
        self._connect_timeout = connect_timeout
        self._aconn: psycopg.AsyncConnection[Any] | None = None
        self._conn: psycopg.Connection[Any] | None = None  # apply's, on worker threads

    @property
    def connection(self) -> psycopg.AsyncConnection[Any]:
        """The asyncio connection (for tests and tools that reach under the interface)."""
        if self._aconn is None:
            raise RuntimeError(f"the consumer's {self.where} is not open")
        return self._aconn

    async def open(self) -> None:
        if self._aconn is None:
            self._aconn = await self._connect()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        conn: psycopg.AsyncConnection[Any] = await connect_async(
            self.url,
            f"the consumer's {self.where}",
            application_name="streamq consumer",
            autocommit=False,
            connect_timeout=self._connect_timeout,
        )
        try:
            await run_async(conn, setup_steps(self._durability))
            await conn.commit()
        except BaseException:
            await conn.close()
            raise
        return conn

    def unavailable(self, error: BaseException) -> bool:
        return connection_lost(error)

    async def _usable(self) -> psycopg.AsyncConnection[Any]:
        """The asyncio connection, opened again if the last one broke (the server
        restarted, say): the transaction that found it broken failed, the next one goes on."""
        conn = self.connection
        if conn.broken or conn.closed:
            await conn.close()
            self._aconn = conn = await self._connect()  # if it fails, the next call retries
        return conn

    async def close(self) -> None:
        aconn, self._aconn = self._aconn, None
        conn, self._conn = self._conn, None
        if conn is not None:
            await asyncio.to_thread(conn.close)
        if aconn is not None:
            await aconn.close()

    async def load(self, consumer: str, stream: str) -> list[tuple[str, int, int, str]]:
        conn = await self._usable()
        try:
            cursor = await conn.execute(LOAD, (consumer, stream))
            rows = await cursor.fetchall()
        finally:
            await _rollback(conn)  # a read only: end its transaction
        return [(str(p), int(seq), int(epoch or 0), str(at)) for p, seq, epoch, at in rows]

    async def names_on(
        self, stream: str, producer_id: str, endpoint: str
    ) -> list[tuple[str, str, int]]:
        conn = await self._usable()
        try:
            cursor = await conn.execute(NAMES_ON, (stream, producer_id, endpoint))
            rows = await cursor.fetchall()
        finally:
            await _rollback(conn)
        return [(str(name), str(producer), int(seq)) for name, producer, seq in rows]

    async def stored(self, consumer: str, producer_id: str, stream: str) -> int | None:
        conn = await self._usable()
        try:
            row = await (await conn.execute(STORED, (consumer, producer_id, stream))).fetchone()
        finally:
            await _rollback(conn)
        return None if row is None else int(row[0])

    @contextlib.asynccontextmanager
    async def transaction(
        self, batch: Batch, committed: Callable[[], None]
    ) -> AsyncIterator[AsyncPostgresSQL]:
        conn = await self._usable()
        tx = AsyncPostgresSQL(conn)
        try:
            await run_async(conn, advance_steps(batch, batch.after, self.where))  # the turn
            yield tx
            tx._closed = True
            await to_the_end(self._commit(conn, batch), committed)
        except BaseException:
            tx._closed = True
            await _rollback(conn)
            raise

    async def _commit(self, conn: psycopg.AsyncConnection[Any], batch: Batch) -> None:
        await run_async(conn, advance_steps(batch, batch.last_seq, self.where))
        await conn.commit()

    async def apply(
        self,
        batch: Batch,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        committed: Callable[[], None],
    ) -> T:
        def applying(tx: PostgresSQL) -> T:
            run(tx._conn, advance_steps(batch, batch.after, self.where))  # the turn
            result = fn(tx, batch, *args)
            run(tx._conn, advance_steps(batch, batch.last_seq, self.where))
            return result

        return await self._on_a_thread(applying, committed)

    async def run_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._on_a_thread(lambda tx: fn(tx, *args), lambda: None)

    async def _on_a_thread(
        self, body: Callable[[PostgresSQL], T], committed: Callable[[], None]
    ) -> T:
        """``body(tx)`` and COMMIT on the blocking connection, in a worker thread; ROLLBACK
        if it raises. What runs on the thread cannot be stopped: it is waited for, even
        if the caller is cancelled, and ``committed`` called if it committed."""

        def transaction() -> T:
            conn = self._blocking_connection()
            tx = PostgresSQL(conn)
            try:
                result = body(tx)
                tx._closed = True
                conn.commit()
            except BaseException:
                if in_transaction(conn):
                    conn.rollback()
                raise
            finally:
                tx._closed = True
            return result

        return await to_the_end(asyncio.to_thread(transaction), committed)

    def _blocking_connection(self) -> psycopg.Connection[Any]:
        """``apply``'s connection, opened at its first use (and again if it broke); on a
        worker thread."""
        if self._conn is not None and (self._conn.broken or self._conn.closed):
            self._conn.close()
            self._conn = None
        if self._conn is None:
            conn = connect(
                self.url,
                f"the consumer's {self.where}",
                application_name="streamq consumer",
                autocommit=False,
                connect_timeout=self._connect_timeout,
            )
            try:
                run(conn, session_steps(self._durability))  # open() made the tables
                conn.commit()
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn


async def _rollback(conn: psycopg.AsyncConnection[Any]) -> None:
    if in_transaction(conn):
        await conn.rollback()
