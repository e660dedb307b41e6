"""The PostgreSQL engine's storage: what a serving producer does with its database.

One writer connection (autocommit, transactions begun and ended by hand), a pool of
readers (psycopg_pool), a connection that LISTENs for other processes' commits, and one
that holds the serving lock. The tables, the append path and why its seqs are dense and
in commit order are in ``append.py``.

- **Appending.** The producer's transactions publish as every other process's
  ``streamq.publish`` does: records inserted unnumbered (``append.py``), numbered by the
  serving producer once committed (``numbering.py``, on a connection of its own).
- **Catching up.** What else other processes change (registrations, retention) is read
  when the watch hears ``NOTIFY streamq``, and by a slow periodic check comparing
  ``pg_current_snapshot()``, which changes whenever any transaction commits.
- **One serving process.** ``pg_try_advisory_lock`` on a connection held while serving;
  a second server is told which process (its ``application_name``) holds it.
- **Durability.** ``durability="full"`` sets ``synchronous_commit=on`` on the writer;
  ``"normal"`` keeps the server's setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from ...errors import AlreadyServedError, DatabaseOpenError
from ...producer.storage import (
    Changes,
    EpochRow,
    Events,
    Identity,
    KnownPosition,
    Limits,
    LogRow,
    Numbered,
    Run,
    StreamRow,
    StreamSettings,
    TimeRow,
    consumer_rows,
)
from ...records import CheckedRecord, Receipt, Unnumbered
from ...sql import Durability
from .append import (
    CHANNEL,
    PostgresSession,
    Steps,
    append_steps,
    create_schema_steps,
    insert_statement,
    new_epoch_steps,
    path_of,
    run_async,
)
from .capture import Capture
from .driver import cannot_open, connect_async, database, in_transaction, psycopg_module
from .engine import ENGINE
from .walpath import WalNumberer

T = TypeVar("T")

logger = logging.getLogger("streamq.postgres")

# Between attempts to connect again (the watch, the writer) while the server is away.
_RECONNECT_DELAY = 1.0

STREAMS_QUERY = """
SELECT s.id, s.name, s.low,
    greatest(s.low - 1, coalesce((SELECT max(seq) FROM streamq_log WHERE stream_id = s.id), 0))
        AS head,
    s.key_index, s.compact, s.notify_compacted, s.compacted,
    (SELECT max(ts) FROM streamq_time WHERE stream_id = s.id) AS max_ts
FROM streamq_streams AS s ORDER BY s.id"""
# What a catch-up reads, in one statement (one snapshot, one round trip): the epoch, every
# stream, every registration, and the epoch rows after the last one known of each stream
# (all of them for streams not known yet), each as a JSON array of rows.
CHANGES_QUERY = f"""
WITH streams AS ({STREAMS_QUERY}),
known AS (SELECT * FROM unnest(%(ids)s::bigint[], %(afters)s::bigint[]) AS k(stream_id, after))
SELECT (SELECT value FROM streamq_meta WHERE key = 'epoch'),
    (SELECT coalesce(json_agg(json_build_array(s.id, s.name, s.low, s.head, s.key_index,
        s.compact, s.notify_compacted, s.compacted, s.max_ts) ORDER BY s.id), '[]')
     FROM streams AS s),
    (SELECT coalesce(json_agg(json_build_array(c.consumer, c.stream, c.applied, c.updated_at,
        c.max_idle_ms, c.max_bytes, c.registered) ORDER BY c.updated_at), '[]')
     FROM streamq_consumers AS c),
    (SELECT coalesce(json_agg(json_build_array(e.stream_id, e.first_seq, e.epoch)
                              ORDER BY e.stream_id, e.first_seq), '[]')
     FROM streamq_epochs AS e LEFT JOIN known AS k ON k.stream_id = e.stream_id
     WHERE e.first_seq > coalesce(k.after, 0))"""
# A seek in streamq_log_key_seq: one key's records in seq order, no sort.
KEY_RECORDS_QUERY = (
    "SELECT seq, record FROM streamq_log WHERE stream_id = %s AND key = %s "
    "AND seq >= %s AND seq < %s ORDER BY seq LIMIT %s"
)
SEEK_TIME_QUERY = (
    "SELECT seq FROM streamq_time WHERE stream_id = %s AND ts >= %s ORDER BY ts LIMIT 1"
)
# Changes whenever a transaction that wrote anything commits (its xid leaves the list of
# running ones, or xmax moved past it): PostgreSQL's PRAGMA data_version.
VERSION_QUERY = "SELECT pg_current_snapshot()::text"
# The serving lock: an advisory lock (per database) with two int4 keys, "strq" and 1,
# which pg_locks shows as classid, objid and objsubid 2.
SERVE_LOCK = "1937011313, 1"
SERVE_LOCK_HOLDER = """
SELECT a.application_name, a.pid FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 1937011313 AND l.objid = 1
    AND l.objsubid = 2 AND l.database = (SELECT oid FROM pg_database
                                         WHERE datname = current_database())"""
COMPACTION_QUERY = """
WITH dirty AS (
    SELECT DISTINCT key FROM streamq_log
    WHERE stream_id = %(id)s AND seq > %(after)s AND seq <= %(through)s AND key IS NOT NULL)
SELECT l.seq, l.key, l.record FROM dirty JOIN streamq_log AS l
    ON l.stream_id = %(id)s AND l.key = dirty.key AND l.seq >= %(low)s AND l.seq <= %(through)s
ORDER BY l.key, l.seq"""


CREATE_STREAM = (
    "INSERT INTO streamq_streams (name, key_index, compact, notify_compacted) "
    "VALUES (%s, %s, %s, %s) ON CONFLICT (name) DO NOTHING"
)


def settings_row(settings: StreamSettings) -> tuple[bool, bool, bool]:
    return settings.key_index, settings.compact, settings.notify_compacted


def _stream_rows(rows: Sequence[Any]) -> list[StreamRow]:
    return [
        StreamRow(i, name, head, low, StreamSettings(k, c, n), max_ts, compacted)
        for i, name, low, head, k, c, n, compacted, max_ts in rows
    ]


class PostgresReader:
    """A pooled read-only use of a connection (``storage.Reader``)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def _rows(self, sql: str, params: Any) -> list[Any]:
        cursor = await self.conn.execute(sql, params)
        rows: list[Any] = await cursor.fetchall()
        return rows

    async def read_runs(self, stream_id: int, start: int, end: int, limit: int) -> list[Run]:
        rows = await self._rows(  # a row per record here: runs of one
            "SELECT seq, record FROM streamq_log WHERE stream_id = %s AND seq >= %s "
            "AND seq < %s ORDER BY seq LIMIT %s",
            (stream_id, start, end, limit),
        )
        return [(seq, 1, bytes(record)) for seq, record in rows]

    async def read_key_records(
        self, stream_id: int, key: bytes, start: int, end: int, limit: int
    ) -> list[tuple[int, bytes]]:
        rows = await self._rows(KEY_RECORDS_QUERY, (stream_id, key, start, end, limit))
        return [(seq, bytes(record)) for seq, record in rows]

    async def seek_time(self, stream_id: int, timestamp: int) -> int | None:
        rows = await self._rows(SEEK_TIME_QUERY, (stream_id, timestamp))
        return int(rows[0][0]) if rows else None

    async def low_and_compacted(self, stream_id: int) -> tuple[int, int]:
        rows = await self._rows(
            "SELECT low, compacted FROM streamq_streams WHERE id = %s", (stream_id,)
        )
        if not rows:
            raise LookupError(f"no stream with id {stream_id}")
        return int(rows[0][0]), int(rows[0][1])

    async def streams(self) -> list[StreamRow]:
        return _stream_rows(await self._rows(STREAMS_QUERY, None))


class PostgresWriter:
    """The producer's writer connection (``storage.Writer``): autocommit, so BEGIN and
    COMMIT are the producer's to send."""

    def __init__(self, conn: Any, url: str, where: str, durability: Durability) -> None:
        self.conn = conn
        self.url, self.where = url, where
        self.backend_pid: int = conn.info.backend_pid
        self.durability = durability

    @property
    def in_transaction(self) -> bool:
        return in_transaction(self.conn)

    @property
    def threaded(self) -> None:
        return None  # psycopg's asyncio connection: no thread of its own

    async def _steps(self, steps: Steps) -> Any:
        return await run_async(self.conn, steps)

    async def _rows(self, sql: str, params: Any = None) -> list[Any]:
        cursor = await self.conn.execute(sql, params)
        rows: list[Any] = await cursor.fetchall() if cursor.description else []
        return rows

    async def begin(self) -> None:
        """BEGIN; if the session is gone (the server restarted, or ended it), a new
        session first: nothing was in the transaction yet, so nothing is lost."""
        if not (self.conn.broken or self.conn.closed):
            try:
                await self.conn.execute("BEGIN")
                return
            except psycopg_module().OperationalError:
                if not self.conn.broken:
                    raise
        self.conn = await connect_async(self.url, self.where, application_name="streamq producer")
        self.backend_pid = self.conn.info.backend_pid
        await self.configure()
        await self.conn.execute("BEGIN")

    async def configure(self) -> None:
        """``durability="full"``: every commit synced on the server before it returns,
        whatever the server's default (``"normal"`` keeps that default)."""
        if self.durability == "full":
            await self.conn.execute("SET synchronous_commit = on")

    async def commit(self) -> None:
        await self.conn.execute("COMMIT")

    def commit_here(self) -> bool:
        return False  # a round trip to the server: awaited

    async def rollback(self) -> None:
        if self.in_transaction:
            await self.conn.execute("ROLLBACK")

    async def execute(self, sql: str, parameters: Any = ()) -> Any:
        return await self.conn.execute(sql, parameters or None)

    async def executemany(self, sql: str, parameters: Any) -> Any:
        cursor = self.conn.cursor()
        await cursor.executemany(sql, parameters)
        return cursor

    async def create_stream(self, name: str, settings: StreamSettings) -> int:
        await self.conn.execute(CREATE_STREAM, (name, *settings_row(settings)))
        (row,) = await self._rows("SELECT id FROM streamq_streams WHERE name = %s", (name,))
        return int(row[0])

    async def append(
        self, stream: str, records: Sequence[CheckedRecord], max_record_size: int
    ) -> Receipt:
        """Publish ``records`` unnumbered (``append.py``)."""
        where = self.where
        unnumbered = Unnumbered.of(records, max_record_size)
        steps = append_steps(stream, unnumbered, where=lambda: where, path=path_of(self.conn))
        receipt: Receipt = await self._steps(steps)
        return receipt

    async def insert(
        self, rows: Sequence[LogRow], times: Sequence[TimeRow], epochs: Sequence[EpochRow]
    ) -> None:
        if rows or epochs:
            statement = insert_statement(rows, times, epochs)
            await self.conn.execute(statement.sql, statement.params)

    async def truncate(self, stream_id: int, before: int) -> None:
        # Time rows of deleted records go too, but the last of them (as on SQLite: seeks
        # clamp it to ``low``, and later records must exceed it to be indexed).
        await self.conn.execute(
            """
            WITH records AS (
                DELETE FROM streamq_log WHERE stream_id = %(id)s AND seq < %(before)s),
            times AS (
                DELETE FROM streamq_time WHERE stream_id = %(id)s AND seq < %(before)s
                AND ts < (SELECT max(ts) FROM streamq_time
                          WHERE stream_id = %(id)s AND seq < %(before)s))
            UPDATE streamq_streams SET low = greatest(low, %(before)s) WHERE id = %(id)s""",
            {"id": stream_id, "before": before},
        )

    async def first_seq_since(self, stream_id: int, start: int, end: int, since_ms: int) -> int:
        rows = await self._rows(
            "SELECT seq FROM streamq_log WHERE stream_id = %s AND seq >= %s AND seq < %s "
            "AND ts >= %s ORDER BY seq LIMIT 1",
            (stream_id, start, end, since_ms),
        )
        return int(rows[0][0]) if rows else end

    async def bytes_between(self, stream_id: int, start: int, end: int) -> int:
        rows = await self._rows(
            "SELECT coalesce(sum(length(record)), 0) FROM streamq_log "
            "WHERE stream_id = %s AND seq >= %s AND seq < %s",
            (stream_id, start, end),
        )
        return int(rows[0][0])

    async def seq_after_bytes(
        self, stream_id: int, start: int, end: int, excess: int
    ) -> tuple[int, int]:
        dropped, seq = 0, start
        while dropped < excess and seq < end:
            rows = await self._rows(
                "SELECT seq, length(record) FROM streamq_log WHERE stream_id = %s "
                "AND seq >= %s AND seq < %s ORDER BY seq LIMIT 1024",
                (stream_id, seq, end),
            )
            if not rows:
                return end, dropped
            for found, size in rows:
                if dropped >= excess:
                    return int(found), dropped
                dropped += int(size)
                seq = int(found) + 1
        return (seq if dropped >= excess else end), dropped

    async def compaction_candidates(
        self, stream_id: int, low: int, after: int, through: int
    ) -> list[tuple[int, bytes, bytes]]:
        rows = await self._rows(
            COMPACTION_QUERY, {"id": stream_id, "after": after, "through": through, "low": low}
        )
        return [(int(seq), bytes(key), bytes(record)) for seq, key, record in rows]

    async def delete_compacted(self, stream_id: int, seqs: list[int], through: int) -> None:
        await self.conn.execute(
            """
            WITH removed AS (DELETE FROM streamq_log
                WHERE stream_id = %(id)s AND seq = ANY(%(seqs)s::bigint[]))
            UPDATE streamq_streams SET compacted = greatest(compacted, %(through)s)
            WHERE id = %(id)s""",
            {"id": stream_id, "seqs": seqs, "through": through},
        )

    async def register_consumer(
        self, consumer: str, stream: str, applied: int, limits: Limits
    ) -> int:
        now = int(time.time() * 1000)
        rows = await self._rows(
            "INSERT INTO streamq_consumers (consumer, stream, applied, registered_at, updated_at, "
            "max_idle_ms, max_bytes) VALUES (%s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (consumer, stream) DO UPDATE "
            "SET applied = greatest(streamq_consumers.applied, EXCLUDED.applied), "
            "max_idle_ms = EXCLUDED.max_idle_ms, max_bytes = EXCLUDED.max_bytes, "
            "registered = true, registered_at = CASE WHEN streamq_consumers.registered "
            "THEN streamq_consumers.registered_at ELSE EXCLUDED.registered_at END "
            "RETURNING applied",
            (consumer, stream, applied, now, now, limits.max_idle_ms, limits.max_bytes),
        )
        return int(rows[0][0])

    async def unregister_consumer(self, consumer: str, stream: str) -> bool:
        """A consumer that applied nothing leaves no row; one that did stays known."""
        rows = await self._rows(
            """
            WITH gone AS (DELETE FROM streamq_consumers WHERE consumer = %(c)s
                    AND stream = %(s)s AND registered AND applied = 0 RETURNING 1),
                kept AS (UPDATE streamq_consumers SET registered = false WHERE consumer = %(c)s
                    AND stream = %(s)s AND registered AND applied > 0 RETURNING 1)
            SELECT * FROM gone UNION ALL SELECT * FROM kept""",
            {"c": consumer, "s": stream},
        )
        return bool(rows)

    async def forget_consumer(self, consumer: str, stream: str) -> bool:
        rows = await self._rows(
            "DELETE FROM streamq_consumers WHERE consumer = %s AND stream = %s RETURNING 1",
            (consumer, stream),
        )
        return bool(rows)

    async def save_positions(
        self, positions: Sequence[KnownPosition], forgotten: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Never sets ``registered``: a registration removed elsewhere stays removed."""
        if positions:
            consumers, streams, applied, updated = map(list, zip(*positions, strict=True))
            await self.conn.execute(
                """
                INSERT INTO streamq_consumers AS c
                    (consumer, stream, applied, registered_at, updated_at, registered)
                SELECT p.consumer, p.stream, p.applied, %s, p.updated_at, false
                FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::bigint[])
                    AS p(consumer, stream, applied, updated_at)
                ON CONFLICT (consumer, stream) DO UPDATE
                SET applied = greatest(c.applied, EXCLUDED.applied),
                    updated_at = greatest(c.updated_at, EXCLUDED.updated_at)""",
                (int(time.time() * 1000), consumers, streams, applied, updated),
            )
        if forgotten:
            consumers, streams = map(list, zip(*forgotten, strict=True))
            await self.conn.execute(
                """
                DELETE FROM streamq_consumers AS c
                USING unnest(%s::text[], %s::text[]) AS f(consumer, stream)
                WHERE c.consumer = f.consumer AND c.stream = f.stream AND NOT c.registered""",
                (consumers, streams),
            )


class PostgresWatch(Events):
    """Wakes on ``NOTIFY streamq`` from any connection but the producer's own writer."""

    def __init__(self, url: str, where: str, writer: PostgresWriter) -> None:
        super().__init__()
        self._url, self._where, self._writer = url, where, writer
        self._conn: Any = None
        self._task: Any = None

    @property
    def active(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        await self._connect()
        self._task = asyncio.create_task(self._listen())

    async def _connect(self) -> None:
        self._conn = await connect_async(self._url, self._where, application_name="streamq watch")
        await self._conn.execute(f"LISTEN {CHANNEL}")

    async def _listen(self) -> None:
        """Forever: a lost connection (the server restarting) is made again, a second
        apart at most, with a wake-up each time since notifications may have been missed."""
        while True:
            try:
                async for notify in self._conn.notifies():
                    if notify.pid != self._writer.backend_pid:
                        self.wake()
            except Exception:
                logger.warning("lost the LISTEN connection to %s; reconnecting", self._where)
            self.wake()
            await self._conn.close()
            while True:
                await asyncio.sleep(_RECONNECT_DELAY)
                try:
                    await self._connect()
                    break
                except DatabaseOpenError:
                    continue

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._conn is not None:
            await self._conn.close()


class PostgresStorage:
    """A producer's PostgreSQL database (``storage.Storage``)."""

    features = ENGINE.features

    def __init__(self, url: str) -> None:
        self.url = url
        psycopg_module()  # fail early, saying what to install
        self.where = database(url)
        self._writer: PostgresWriter | None = None
        self._pool: Any = None
        self._serve_conn: Any = None

    @property
    def writer(self) -> PostgresWriter:
        assert self._writer is not None, "storage not open"
        return self._writer

    async def open(self, durability: Durability) -> Identity:
        conn = await connect_async(self.url, self.where, application_name="streamq producer")
        self._writer = PostgresWriter(conn, self.url, self.where, durability)
        await self._writer.configure()
        async with conn.transaction():
            meta, created = await run_async(conn, create_schema_steps())
            epoch = await run_async(conn, new_epoch_steps(if_not_booted=False))
        return Identity(str(meta["producer_id"]), epoch, created)

    async def open_readers(self, count: int) -> None:
        from psycopg_pool import AsyncConnectionPool

        self._pool = AsyncConnectionPool(
            self.url,
            min_size=count,
            max_size=count,
            kwargs={"autocommit": True, "application_name": "streamq reader"},
            # A connection is checked as it is taken: after a server restart, a reader gets a
            # new session instead of the dead one's error.
            check=AsyncConnectionPool.check_connection,
            open=False,
        )
        try:
            await self._pool.open(wait=True, timeout=30)
        except Exception as exc:
            raise cannot_open(self.where, self.url, exc) from exc

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[PostgresReader]:
        async with self._pool.connection() as conn:
            yield PostgresReader(conn)

    async def load(self) -> Changes:
        return await self.changes({})

    async def version(self) -> str:
        async with self._pool.connection() as conn:
            cursor = await conn.execute(VERSION_QUERY)
            row = await cursor.fetchone()
        return str(row[0])

    async def changes(self, known: dict[int, tuple[int, int]], *, reading: bool = False) -> Changes:
        """One statement (``CHANGES_QUERY``): streams, registrations, the epoch, and the
        epoch rows after the last known one of each stream (always on a pooled reader)."""
        params = {"ids": list(known), "afters": [after for _, after in known.values()]}
        async with self._pool.connection() as conn:
            cursor = await conn.execute(CHANGES_QUERY, params)
            epoch, streams, consumers, epoch_rows = await cursor.fetchone()
        return Changes(
            int(epoch),
            _stream_rows(streams),
            consumer_rows(consumers),
            [(int(s), int(f), int(e)) for s, f, e in epoch_rows],
        )

    def watch(self) -> PostgresWatch:
        return PostgresWatch(self.url, self.where, self.writer)

    def numberer(
        self,
        serve: Callable[[Numbered], None],
        resync: Callable[[], Awaitable[Any]],
        producer_id: str,
    ) -> WalNumberer:
        """The serving producer's numbering of what writers published: through the WAL
        where the server allows it, else through the pending table (``walpath.py``)."""
        return WalNumberer(self.url, self.where, producer_id, serve, resync)

    def capture(
        self,
        streams: Mapping[str, str],
        producer_id: str,
        max_record_size: int,
        serve: Callable[[Numbered], None],
        resync: Callable[[], Awaitable[Any]],
        snapshot: bool = False,
    ) -> Capture:
        """The serving producer's capture of tables' changes (``capture.py``)."""
        return Capture(
            self.url, self.where, producer_id, streams, max_record_size, serve, resync, snapshot
        )

    def session(self, durability: Durability) -> PostgresSession:
        return PostgresSession(self.url, durability)

    async def claim_serving(self) -> None:
        conn = await connect_async(self.url, self.where, application_name=_serving_name(None))
        cursor = await conn.execute(f"SELECT pg_try_advisory_lock({SERVE_LOCK})")
        (locked,) = await cursor.fetchone()
        if not locked:
            cursor = await conn.execute(SERVE_LOCK_HOLDER)
            row = await cursor.fetchone()
            await conn.close()
            holder = f"{row[0]!r} (backend pid {row[1]})" if row else "another process"
            raise AlreadyServedError(
                f"{self.where} is already served by {holder}: one process serves a producer "
                "database; the others publish with Producer(..., serve=False) or "
                "streamq.publish(conn, ...)"
            )
        self._serve_conn = conn

    async def serving(self, address: str) -> None:
        if self._serve_conn is not None:
            await self._serve_conn.execute(
                "SELECT set_config('application_name', %s, false)", (_serving_name(address),)
            )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._serve_conn is not None:
            # Released now: a closed session's locks go only once its backend has exited,
            # after close() returns, and a restart would find the lock still held.
            with contextlib.suppress(Exception):
                await self._serve_conn.execute(f"SELECT pg_advisory_unlock({SERVE_LOCK})")
            await self._serve_conn.close()
        if self._writer is not None:
            await self._writer.conn.close()
        self._writer = self._serve_conn = None


def _serving_name(address: str | None) -> str:
    """The serving connection's application_name (63 bytes at most): who serves."""
    where = f" at {address}" if address else ""
    return f"streamq serve{where} pid {os.getpid()} on {socket.gethostname()}"[:63]
