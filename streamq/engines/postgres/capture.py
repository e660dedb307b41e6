"""Tables as streams: every committed INSERT, UPDATE, DELETE and TRUNCATE on captured
tables, read from PostgreSQL's WAL and published as records (docs/guides/capture.md).

The serving producer reads a logical replication slot of its own (``streamq_<producer
id>``, PostgreSQL's built-in ``pgoutput`` plugin) over a publication of the captured
tables (named alike), through the streaming replication protocol (``replication.py``):
the server pushes each transaction, whole and in commit order, once it has committed.
What has come is turned into change records (``changes.py``) and numbered straight into
the captured streams' log (``walpath.commit_round``, as the WAL path numbers what writers
publish), in one statement that also stores how far the capture has got, in
``streamq_capture``: each change stored once. Only once the WAL is flushed past that
commit are the records served and the slot confirmed past it. So, exactly once:

- a crash before the commit loses nothing: the slot has not moved, the stream starts
  again before those transactions;
- a crash after it, before the slot was confirmed (or after: PostgreSQL persists a slot's
  position at its next checkpoint, and a server crash can take it back), sends again
  transactions already published: those that end at or before the stored position are
  skipped.

While no captured table changes, the slot is confirmed as far as the server has decoded,
so that the WAL other writes leave (other tables, streamq's own numbering) is not kept.

With ``snapshot``, a table's rows come first, once: read as of a snapshot a temporary
slot exports (``replication.ExportedSnapshot``: every transaction committed before its
LSN is in it, none after), numbered in one transaction that stores that LSN in
``streamq_capture_snapshot``; the table's changes committed before it are then left out
(``ChangeDecoder``'s ``snapshots``), whatever the slot sends again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import CaptureError, DatabaseOpenError
from ...producer.storage import Numbered
from ...records import CheckedRecord, encode_unnumbered
from .append import CAPTURE_TABLE, SYNC_COMMIT, run_async
from .changes import Captured, ChangeDecoder, snapshot_records, table_of
from .driver import connect_async, psycopg_module
from .numbering import FLUSH, StreamState
from .pgoutput import Column, Relation, decode, format_lsn, parse_lsn
from .replication import ExportedSnapshot, SlotReader
from .walpath import (
    FLUSH_PATIENCE_MS,
    Round,
    Rounds,
    Transaction,
    numbered_steps,
    readable_within,
)

logger = logging.getLogger("streamq.capture")

LIMIT = 10_000  # messages read before what they hold is published
RETAINED_EVERY = 1.0  # s between looks at the WAL the slot holds back
# Past this much WAL held back by the slot, a warning (once, until it is back under).
RETAINED_WARNING = 1 << 30
RETAINED = (
    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint "
    "FROM pg_replication_slots WHERE slot_name = %s"
)
_RECONNECT_FIRST, _RECONNECT_MOST = 0.5, 30.0

# The tables whose rows were published as of a snapshot (``--snapshot``), and its LSN:
# their changes committed before it are in those rows, and are left out.
SNAPSHOTS_TABLE = """CREATE TABLE IF NOT EXISTS streamq_capture_snapshot (
    slot text NOT NULL,
    tbl text NOT NULL,
    lsn bigint NOT NULL,
    rows bigint NOT NULL,
    PRIMARY KEY (slot, tbl)
)"""
SNAPSHOT_BATCH = 5_000  # rows read and published at a time
# The captured tables' columns: as pgoutput's RELATION message gives them (name, type,
# modifier, whether the replica identity holds it: for a snapshot's rows), and as a
# reader of their streams types them (the Spark source): the type's name (an array's:
# its elements'), whether an array, and a numeric's precision and scale where declared.
CATALOG_QUERY = """
SELECT n.nspname || '.' || c.relname, a.attname, a.atttypid, a.atttypmod,
    c.relreplident = 'f' OR a.attnum = ANY(COALESCE(
        (SELECT i.indkey::int2[] FROM pg_index i WHERE i.indrelid = c.oid
         AND CASE c.relreplident WHEN 'i' THEN i.indisreplident ELSE i.indisprimary END),
        '{}')),
    COALESCE(e.typname, t.typname), e.oid IS NOT NULL,
    CASE WHEN COALESCE(e.typname, t.typname) = 'numeric' AND a.atttypmod >= 4
        THEN ((a.atttypmod - 4) >> 16) & 65535 END,
    CASE WHEN COALESCE(e.typname, t.typname) = 'numeric' AND a.atttypmod >= 4
        THEN (((a.atttypmod - 4) & 2047) # 1024) - 1024 END
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A'
WHERE n.nspname || '.' || c.relname = ANY(%s)
ORDER BY 1, a.attnum"""

# The tables' primary keys, and whether each can be captured (a table without a primary
# key publishes UPDATE and DELETE only with REPLICA IDENTITY FULL or USING INDEX:
# PostgreSQL would refuse the application's own updates otherwise).
TABLES_QUERY = """
SELECT n.nspname || '.' || c.relname, c.relreplident,
    ARRAY(SELECT a.attname FROM pg_index i
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
          WHERE i.indrelid = c.oid AND i.indisprimary
          ORDER BY array_position(i.indkey::int2[], a.attnum))
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND n.nspname || '.' || c.relname = ANY(%s)"""


def slot_name(producer_id: str) -> str:
    """The producer's slot and publication: one each per producer database."""
    return f"streamq_{producer_id}"


@dataclass(frozen=True, slots=True)
class CaptureState:
    """What ``prepare`` found or made: the slot and publication, the stored position,
    each table's primary key columns, and the snapshots taken."""

    slot: str
    lsn: int
    keys: dict[str, list[str]]
    snapshots: dict[str, int]  # the tables published as of a snapshot: its LSN
    relations: dict[str, Relation]  # each table's, as ``CATALOG_QUERY`` reads them
    columns: dict[str, list[dict[str, Any]]]  # and each table's columns' types, for status


async def prepare(
    conn: Any, producer_id: str, streams: Mapping[str, str], where: str
) -> CaptureState:
    """Check the server and tables can be captured, and make (or bring up to date) the
    publication, the slot and the stored position; ``CaptureError`` says what is wrong.
    ``conn``: autocommit, not in a transaction (a slot is made outside of one)."""
    (wal_level,) = await _one(conn, "SHOW wal_level")
    if wal_level != "logical":
        raise CaptureError(
            f"capturing tables needs wal_level = logical, and {where} has {wal_level!r}: "
            "run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL"
        )
    (allowed, role) = await _one(
        conn,
        "SELECT rolreplication OR rolsuper, rolname FROM pg_roles WHERE rolname = current_user",
    )
    if not allowed:
        raise CaptureError(
            f"capturing tables reads a replication slot, which needs the REPLICATION "
            f"attribute: role {role!r} lacks it on {where} (ALTER ROLE {role} REPLICATION)"
        )
    keys = await _checked_tables(conn, list(streams), where)
    slot = slot_name(producer_id)
    await conn.execute(CAPTURE_TABLE)
    await _publication(conn, slot, list(streams))
    row = await _one(conn, "SELECT lsn FROM streamq_capture WHERE slot = %s", (slot,))
    stored = None if row is None else int(row[0])
    found = await _one(
        conn, "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    )
    if found is None:
        (made,) = await _one(
            conn, "SELECT lsn FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,)
        )
        lsn = parse_lsn(str(made))
        if stored is not None:  # the slot was dropped behind the capture's back
            logger.error(
                "capture on %s: slot %s was gone, made again at %s: changes committed "
                "after %s and before it were not captured",
                where,
                slot,
                format_lsn(lsn),
                format_lsn(stored),
            )
        logger.info("capture on %s: slot %s made at %s", where, slot, format_lsn(lsn))
    else:
        lsn = stored if stored is not None else parse_lsn(str(found[0]))
    await conn.execute(
        "INSERT INTO streamq_capture (slot, lsn, tables) VALUES (%s, %s, %s) "
        "ON CONFLICT (slot) DO UPDATE SET tables = EXCLUDED.tables",
        (slot, lsn, sorted(streams)),
    )
    # A table left out and captured again later gets a snapshot of its own again.
    await conn.execute(SNAPSHOTS_TABLE)
    await conn.execute(
        "DELETE FROM streamq_capture_snapshot WHERE slot = %s AND NOT tbl = ANY(%s)",
        (slot, list(streams)),
    )
    cursor = await conn.execute(
        "SELECT tbl, lsn FROM streamq_capture_snapshot WHERE slot = %s", (slot,)
    )
    snapshots = {table: int(at) for table, at in await cursor.fetchall()}
    relations, columns = await _catalog(conn, list(streams))
    return CaptureState(slot, lsn, keys, snapshots, relations, columns)


async def _catalog(
    conn: Any, tables: list[str]
) -> tuple[dict[str, Relation], dict[str, list[dict[str, Any]]]]:
    """Each table as a RELATION message would give it, and its columns' types:
    ``{"name", "type", "array"}``, and ``"precision"`` and ``"scale"`` for a numeric
    that declares them (docs/guides/capture.md)."""
    cursor = await conn.execute(CATALOG_QUERY, (tables,))
    found: dict[str, list[Column]] = {table: [] for table in tables}
    columns: dict[str, list[dict[str, Any]]] = {table: [] for table in tables}
    for row in await cursor.fetchall():
        table, name, type_oid, modifier, key, type_name, array, precision, scale = row
        found[table].append(Column(name, type_oid, modifier, key))
        column = {"name": name, "type": type_name, "array": array}
        if precision is not None:
            column.update(precision=precision, scale=scale)
        columns[table].append(column)
    relations = {}
    for table in tables:
        namespace, name = table.split(".", 1)
        relations[table] = Relation(0, namespace, name, "d", tuple(found[table]))
    return relations, columns


async def _checked_tables(conn: Any, tables: list[str], where: str) -> dict[str, list[str]]:
    cursor = await conn.execute(TABLES_QUERY, (tables,))
    found = {name: (identity, list(key)) for name, identity, key in await cursor.fetchall()}
    missing = [t for t in tables if t not in found]
    if missing:
        raise CaptureError(f"cannot capture {', '.join(missing)}: no such table in {where}")
    for table, (identity, key) in found.items():
        if not key and identity in ("d", "n"):
            raise CaptureError(
                f"cannot capture {table}: it has no primary key, and PostgreSQL would then "
                f"refuse its UPDATEs and DELETEs once published: add a primary key, or run "
                f"ALTER TABLE {table} REPLICA IDENTITY FULL"
            )
    return {table: key for table, (_, key) in found.items() if key}


async def _publication(conn: Any, name: str, tables: list[str]) -> None:
    """The publication of exactly ``tables``, made or changed."""
    sql = psycopg_module().sql
    listed = sql.SQL(", ").join(_name(t) for t in tables)
    (exists,) = await _one(conn, "SELECT count(*) FROM pg_publication WHERE pubname = %s", (name,))
    verb = "ALTER PUBLICATION {} SET TABLE {}" if exists else "CREATE PUBLICATION {} FOR TABLE {}"
    await conn.execute(sql.SQL(verb).format(sql.Identifier(name), listed))


async def _text_forms(conn: Any) -> None:
    """Every value's text as the change format reads it (``changes.py``)."""
    await conn.execute("SET TimeZone = 'UTC'")
    await conn.execute("SET DateStyle = 'ISO, YMD'")
    await conn.execute("SET extra_float_digits = 3")


def _name(table: str) -> Any:
    """``schema.name`` as an identifier."""
    return psycopg_module().sql.Identifier(*table.split(".", 1))


async def _one(conn: Any, query: Any, params: Any = None) -> Any:
    cursor = await conn.execute(query, params)
    return await cursor.fetchone()


class Capture:
    """The serving producer's capture loop, on a connection of its own (module docstring):
    what it publishes, the producer's numbering serves as it serves every writer's."""

    def __init__(
        self,
        url: str,
        where: str,
        producer_id: str,
        streams: Mapping[str, str],
        max_record_size: int,
        serve: Callable[[Numbered], None],
        resync: Callable[[], Awaitable[Any]],
        snapshot: bool = False,
    ) -> None:
        self._url, self._where = url, where
        # After a snapshot or a failure: the heads from the database (``Producer._resync``).
        self._resync = resync
        self.producer_id = producer_id
        self.streams = dict(streams)
        self.slot = slot_name(producer_id)
        self._max_record_size = max_record_size
        self.snapshot = snapshot  # each table's rows first, once (``_take_snapshot``)
        self.snapshotting: dict[str, Any] | None = None  # a snapshot's progress
        self._conn: Any = None
        self._state: CaptureState | None = None
        self.lsn = 0  # every transaction ending at or before it is published
        self.captured = 0  # changes published by this process
        self.retained_bytes = 0  # WAL the slot holds back, as last seen
        self._waiting = Rounds(serve)  # rounds committed, served once flushed
        self._known: dict[str, StreamState] = {}  # the captured streams, as numbered
        self._round_at = Round(None, 0)
        self._next_id = 0  # records' ids within their rounds' groups (no receipts wait)
        self._lost = False  # rounds may have committed unserved: flush and resync
        self._retained_at = -RETAINED_EVERY  # monotonic time of that look

    async def prepare(self) -> CaptureState:
        """Check and make what capture needs (``prepare``), before serving."""
        conn = await self._connect()
        self._state = await prepare(conn, self.producer_id, self.streams, self._where)
        self.lsn = self._state.lsn
        return self._state

    async def _connect(self) -> Any:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = await connect_async(
                self._url, self._where, application_name="streamq capture"
            )
            # Its commits wait for no flush of their own: their records are served, and
            # the slot confirmed past what they stored, once the WAL is flushed past them
            # (``_confirmable``).
            await self._conn.execute("SET synchronous_commit = off")
            await _text_forms(self._conn)
        return self._conn

    async def run(self) -> None:
        """For ever: the changes as the server sends them; a lost connection is made
        again, the stream started again from the stored position."""
        delay = _RECONNECT_FIRST
        while True:
            try:
                if self._state is None:
                    await self.prepare()
                assert self._state is not None
                if self._lost:  # rounds may have committed unserved: flushed, then heads
                    await (await self._connect()).execute(FLUSH)
                    await self._resync()
                    self._lost = False
                todo = [t for t in self.streams if t not in self._state.snapshots]
                if self.snapshot and todo:
                    await self._take_snapshot(todo)
                await self._stream()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                psycopg = psycopg_module()
                if isinstance(exc, DatabaseOpenError | psycopg.OperationalError):
                    logger.warning("capture on %s: %s; connecting again", self._where, exc)
                else:
                    logger.exception("capture on %s failed; trying again", self._where)
                await self._reset()
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RECONNECT_MOST)

    async def _reset(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = None
        self._state = None  # prepared again: the stored position is read anew
        self._known.clear()
        self._round_at.epoch = None
        self._lost = True  # a round may have committed, and not been served

    async def _stream(self) -> None:
        """Read the slot from the stored position on: what has come, whole transactions,
        is published in one transaction, then the slot confirmed past it."""
        assert self._state is not None
        conn = await self._connect()
        start = self.lsn
        reader = await asyncio.to_thread(
            SlotReader, self._url, self._where, self.slot, self.slot, start
        )
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fd = reader.fileno()
        loop.add_reader(fd, readable.set)
        decoder = ChangeDecoder(self.streams, self._state.keys, self._state.snapshots)
        confirmed = start
        waiting = self._waiting
        waiting.start(start)
        try:
            while True:
                readable.clear()
                messages, drained = reader.read(LIMIT)
                new = []
                for data in messages:
                    # A table's RELATION (before its first change, or after the table
                    # changed): its columns may be new.
                    if data[:1] == b"R" and isinstance(relation := decode(data), Relation):
                        await self._follow(conn, relation)
                    captured = decoder.feed(data)
                    if captured is not None and captured.end_lsn > self.lsn:
                        new.append(captured)
                if new:
                    await self._publish(conn, new)
                # The server decodes only flushed WAL: what it has sent is flushed.
                waiting.flushed_to(reader.wal_end)
                idle = drained and decoder.between_transactions
                if (target := waiting.confirmable(reader.wal_end, idle)) > confirmed:
                    reader.confirm(confirmed := target)
                if time.monotonic() - self._retained_at >= RETAINED_EVERY:
                    await self._look_at_retained(conn)
                if drained and not new:
                    wait = FLUSH_PATIENCE_MS / 1000 if waiting else RETAINED_EVERY
                    if not await readable_within(readable, wait) and waiting:
                        await waiting.flush(conn)  # nobody flushed meanwhile
        finally:
            loop.remove_reader(fd)
            reader.close()

    async def _follow(self, conn: Any, relation: Relation) -> None:
        """Keep a captured table's columns, as the status reports them (the Spark source
        types its changes by them), as the table has them now, if a RELATION message shows
        other columns than those known (a column added, dropped or renamed)."""
        assert self._state is not None
        known = self._state.columns.get(relation.table)
        if known is None or [c["name"] for c in known] == [c.name for c in relation.columns]:
            return
        _, columns = await _catalog(conn, [relation.table])
        self._state.columns[relation.table] = columns[relation.table]

    async def _take_snapshot(self, tables: list[str]) -> None:
        """The rows of ``tables`` as of a snapshot consistent with a point of the WAL, as
        records, in one transaction that also stores that point: from then on, those
        tables' changes committed before it (in the rows) are left out, the later ones
        captured. A crash before its commit leaves nothing: it is taken again."""
        assert self._state is not None
        exported = await asyncio.to_thread(
            ExportedSnapshot, self._url, self._where, f"{self.slot}_snapshot"
        )
        try:
            conn = await connect_async(self._url, self._where, application_name="streamq snapshot")
            try:
                await _text_forms(conn)
                async with conn.transaction():
                    rows = await self._snapshot_rows(conn, exported, tables)
                    # Its records are served from the database once it commits: flushed.
                    await conn.execute(SYNC_COMMIT)
                    await conn.execute(
                        "INSERT INTO streamq_capture_snapshot (slot, tbl, lsn, rows) "
                        "SELECT %s, * FROM unnest(%s::text[], %s::bigint[], %s::bigint[])",
                        (self.slot, tables, [exported.lsn] * len(tables), rows),
                    )
            finally:
                await conn.close()
        except BaseException:
            self._known.clear()  # numbered in a transaction that did not commit
            raise
        finally:
            exported.close()
            self.snapshotting = None
        await self._resync()  # the streams' new heads, from the database
        self._state.snapshots.update(dict.fromkeys(tables, exported.lsn))
        logger.info(
            "capture on %s: snapshot of %s at %s published: %s rows",
            self._where,
            ", ".join(tables),
            format_lsn(exported.lsn),
            ", ".join(str(n) for n in rows),
        )

    async def _snapshot_rows(
        self, conn: Any, exported: ExportedSnapshot, tables: list[str]
    ) -> list[int]:
        """In ``conn``'s transaction: the tables' rows as of ``exported``, published; how
        many each has."""
        assert self._state is not None
        sql = psycopg_module().sql
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        await conn.execute(
            sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(exported.name))
        )
        relations = [self._state.relations[name] for name in tables]
        counts = []
        for name in tables:
            (count,) = await _one(conn, sql.SQL("SELECT count(*) FROM {}").format(_name(name)))
            counts.append(int(count))
        total, done, now_ms = sum(counts), 0, int(time.time() * 1000)
        at = Round(None, 0)  # the epoch read in this transaction
        self.snapshotting = {
            "tables": tables,
            "lsn": format_lsn(exported.lsn),
            "rows": 0,
            "of": total,
        }
        for relation in relations:
            table = table_of(relation, self.streams, self._state.keys)
            texts = sql.SQL(", ").join(
                sql.SQL("t.{}::text").format(sql.Identifier(c.name)) for c in relation.columns
            )
            # Qualified: a bare name would sort by the output column, the key as text.
            order = sql.SQL(", ").join(
                sql.SQL("t.{}").format(sql.Identifier(relation.columns[i].name)) for i in table.key
            )
            query = sql.SQL("SELECT {} FROM {} AS t").format(texts, _name(relation.table))
            if table.key:
                query += sql.SQL(" ORDER BY {}").format(order)
            cursor = conn.cursor(name="streamq_snapshot")
            await cursor.execute(query)
            while batch := await cursor.fetchmany(SNAPSHOT_BATCH):
                values = [tuple(None if v is None else v.encode() for v in row) for row in batch]
                records = snapshot_records(table, values, exported.lsn, now_ms, done, total)
                await run_async(conn, numbered_steps(self._rows(records, 0), at, self._known))
                done += len(records)
                self.snapshotting["rows"] = done
            await cursor.close()
        return counts

    def _rows(self, records: list[tuple[str, CheckedRecord]], xid: int) -> list[tuple[Any, ...]]:
        """Records of their streams, in order, as ``numbering.number_rows`` takes them:
        of transaction ``xid`` (0: a snapshot's), each with an id of its own."""
        encoded = encode_unnumbered([r for _, r in records], self._max_record_size)
        first, self._next_id = self._next_id, self._next_id + len(records)
        return [
            (xid, first + i, stream, record[3], data, record[1])
            for i, ((stream, record), data) in enumerate(zip(records, encoded, strict=True))
        ]

    async def _publish(self, conn: Any, new: list[Captured]) -> None:
        """The records of ``new`` numbered into their streams, and the position past them
        stored, in one statement (its own transaction: ``walpath.commit_round``); served
        once flushed."""
        transactions = [
            Transaction(c.xid, self._rows(c.records, c.xid), [], c.end_lsn) for c in new
        ]
        await self._waiting.commit(conn, transactions, self.slot, self._known, self._round_at)
        self.lsn = new[-1].end_lsn
        self.captured += sum(len(c.records) for c in new)

    async def _look_at_retained(self, conn: Any) -> None:
        """How much WAL the slot keeps PostgreSQL from recycling (a metric, in status);
        past ``RETAINED_WARNING``, a warning."""
        row = await _one(conn, RETAINED, (self.slot,))
        retained = int(row[0] or 0) if row is not None else 0
        if retained > RETAINED_WARNING >= self.retained_bytes:
            logger.warning(
                "capture on %s: slot %s holds back %d MiB of WAL, more than %d MiB: the "
                "capture is behind; set max_slot_wal_keep_size to bound it",
                self._where,
                self.slot,
                retained >> 20,
                RETAINED_WARNING >> 20,
            )
        self.retained_bytes = retained
        self._retained_at = time.monotonic()

    def status(self) -> dict[str, Any]:
        """For ``streamq status``: what is captured, how far, the WAL held back, each
        captured stream's columns, and the snapshot being taken, if one is."""
        status = {
            "slot": self.slot,
            "tables": dict(self.streams),
            "lsn": format_lsn(self.lsn),
            "changes": self.captured,
            "retained_wal_bytes": self.retained_bytes,
        }
        if self._state is not None:
            columns = self._state.columns
            status["columns"] = {self.streams[t]: columns.get(t, []) for t in self.streams}
        if self.snapshotting is not None:
            status["snapshot"] = dict(self.snapshotting)
        return status

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None
