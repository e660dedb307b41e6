"""The WAL path: numbering what writers published as logical messages (``append.py``),
read from a replication slot of the serving producer's own. Each record is stored once
(in the WAL as the writer's message, then in ``streamq_log``), and the writers'
transactions write nothing else for it.

The slot (``streamq_<producer id>_publish``, built-in ``pgoutput`` with ``messages``)
streams every committed transaction that emitted a ``streamq`` message or inserted into
``streamq_pending`` (its publication), whole and in commit order, after its commit is
flushed; a rolled-back one never comes. A *round* takes the transactions that have come,
gives their records the seqs after each stream's head in that order, and in one
transaction of its own inserts them into the log, deletes the pending rows among them
and stores the position past them in ``streamq_capture``. It commits without waiting for
its flush (it rides on the writers' flushes instead of adding one between them); only
once the WAL is flushed past it are its records served and the slot confirmed past them.
The server decodes only flushed WAL, so each transaction that arrives says the WAL is
flushed past its commit; when none arrives for ``FLUSH_PATIENCE_MS``, the numberer
flushes itself. So:

- seqs are dense and follow the commit order: if T1 committed before T2 began, T1's
  commit record is first in the WAL, and decoding sends it first;
- a crash before a round's commit loses nothing: the slot, not confirmed, sends those
  transactions again; after it, they are sent again only if the slot was not yet
  confirmed, and those ending at or before the stored position are skipped;
- a transaction open for minutes delays nobody: decoding sends each at its commit.

Setting up (``_prepare``): once the slot is made, at LSN C, with a snapshot exported at
C, the pending rows that snapshot sees (committed before C) are numbered first, in the
same transaction that stores C and names the slot in ``streamq_meta`` (``publish_slot``),
from when on writers publish through the WAL. Pending rows committed after C come
through the slot. Without ``wal_level = logical`` or the REPLICATION attribute, the table
path (``numbering.Numberer``) runs instead, said once in the log and in ``status``.

A slot PostgreSQL invalidated (``max_slot_wal_keep_size``) has lost WAL that may hold
records: that is said in an error naming the position from which records may be lost,
writers go back to the table path meanwhile (``append.PATH_QUERY``), and the slot is made
again (docs/guides/postgresql.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ...errors import DatabaseOpenError
from ...producer.storage import Numbered, OpenTransactions
from .append import (
    MESSAGE_VERSION,
    PATH_CHECK_EVERY,
    PREFIX,
    SET_META,
    Statement,
    Steps,
    run_async,
)
from .driver import connect_async, psycopg_module
from .numbering import FLUSH, LIMIT, Numberer, StreamState, number_rows, number_steps, states_after
from .pgoutput import Begin, Commit, Insert, LogicalMessage, Relation, decode, format_lsn
from .replication import ExportedSnapshot, SlotReader

logger = logging.getLogger("streamq.postgres")

IDLE_WAIT = 1.0  # s: with nothing coming, a look anyway (status, the slot confirmed)
FLUSH_PATIENCE_MS = 3  # a round's flush left to the writers that long at most
CONFIRM_EVERY = 0.2  # s between confirmations of the slot (each one a message)
OPEN_LOOK_S = 1.0  # how often open writing transactions are looked up
_RECONNECT_FIRST, _RECONNECT_MOST = 0.5, 30.0
SETUP_TRIES = 3  # failures setting the WAL path up, connected, before the table path runs

# What a round needs to know first: the epoch, whether this server life took one, and
# the current transaction id (to widen the 32-bit ids decoding gives to xid8).
ROUND_START = """
SELECT (SELECT value FROM streamq_meta WHERE key = 'epoch'),
    EXISTS (SELECT FROM streamq_boot), pg_current_xact_id()::text::bigint"""
DELETE_PENDING = """
DELETE FROM streamq_pending WHERE (xid, id) IN (
    SELECT x::text::xid8, i FROM unnest(%(xids)b::bigint[], %(ids)b::bigint[]) AS t (x, i))"""
STORE = """
INSERT INTO streamq_capture (slot, lsn, tables) VALUES (%(slot)s, %(lsn)s, '{}')
ON CONFLICT (slot) DO UPDATE SET lsn = EXCLUDED.lsn"""
SLOT_QUERY = """
SELECT (SELECT value FROM streamq_meta WHERE key = 'publish_slot'),
    (SELECT wal_status FROM pg_replication_slots WHERE slot_name = %(slot)s),
    (SELECT lsn FROM streamq_capture WHERE slot = %(slot)s)"""
# Room for the WAL path's slot and its reader: slots and WAL senders, allowed and in use.
ROOM = """
SELECT current_setting('max_replication_slots')::int, current_setting('max_wal_senders')::int,
    (SELECT count(*) FROM pg_replication_slots),
    (SELECT count(*) FROM pg_stat_replication)"""
# Just after a round's commit: the WAL written so far (its commit record ends before
# there) and flushed so far, as byte positions.
WAL_POSITIONS = (
    "SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint, "
    "(pg_current_wal_flush_lsn() - '0/0')::bigint"
)
FLUSHED = "SELECT (pg_current_wal_flush_lsn() - '0/0')::bigint"
# Transactions of this database that have written something and not ended: any of them
# may have published (the WAL path takes no lock that would tell).
OPEN_WRITERS = """
SELECT count(*), extract(epoch FROM min(xact_start))::float8 FROM pg_stat_activity
WHERE datname = current_database() AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()"""


def publish_slot(producer_id: str) -> str:
    """The WAL path's slot and publication (capture's are ``streamq_<producer id>``)."""
    return f"streamq_{producer_id}_publish"


class BadMessage(ValueError):
    """A ``streamq`` logical message that is not one a streamq writer emits."""


def read_message(content: bytes) -> tuple[str, list[int], list[bytes], list[bytes | None]]:
    """``append.wal_message``'s stream, timestamps, unnumbered records and keys."""
    try:
        version, stream, ts, records, keys = msgpack.unpackb(content)
    except Exception as exc:
        raise BadMessage(f"not a streamq message ({exc})") from exc
    if version != MESSAGE_VERSION:
        raise BadMessage(f"message version {version!r}, this streamq reads {MESSAGE_VERSION}")
    if not (isinstance(stream, str) and len(ts) == len(records) == len(keys)):
        raise BadMessage("a message whose stream or record lists do not match")
    return stream, ts, records, keys


@dataclass(slots=True)
class Transaction:
    """One committed transaction's records, in publish order: ``(xid, id, stream, ts,
    record, key)``, the xid of messages' records 32-bit until the round widens it; and
    the pending rows among them, ``(xid8, id)``."""

    xid: int
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    pending: list[tuple[int, int]] = field(default_factory=list)
    end_lsn: int = 0


class WalDecoder:
    """pgoutput messages in, committed transactions with records out (sans-IO)."""

    def __init__(self) -> None:
        self._open: Transaction | None = None
        self._columns: dict[int, dict[str, int]] = {}  # relation id -> column positions
        self.bad = 0  # messages with our prefix that could not be read

    @property
    def between_transactions(self) -> bool:
        return self._open is None

    def feed(self, data: bytes) -> Transaction | None:
        """One message; the transaction it completes, if it holds records."""
        message = decode(data)
        if isinstance(message, Begin):
            self._open = Transaction(message.xid)
        elif isinstance(message, Commit):
            done, self._open = self._open, None
            if done is not None and done.rows:
                done.end_lsn = message.end_lsn
                return done
        elif isinstance(message, LogicalMessage):
            if message.prefix == PREFIX and message.transactional and self._open is not None:
                self._message(self._open, message)
        elif isinstance(message, Relation):
            self._columns[message.relation_id] = {c.name: i for i, c in enumerate(message.columns)}
        elif isinstance(message, Insert) and self._open is not None:
            self._pending(self._open, message)
        return None

    def _message(self, tx: Transaction, message: LogicalMessage) -> None:
        try:
            stream, ts, records, keys = read_message(message.content)
        except BadMessage as exc:
            self.bad += 1
            logger.error("a message at %s is left out: %s", format_lsn(message.lsn), exc)
            return
        lsn = message.lsn  # the receipt's id (append.PUBLISH_WAL): lsn, lsn + 1, ...
        tx.rows.extend(
            (tx.xid, lsn + i, stream, t, r, k)
            for i, (t, r, k) in enumerate(zip(ts, records, keys, strict=True))
        )

    def _pending(self, tx: Transaction, insert: Insert) -> None:
        """A row of ``streamq_pending`` (the publication's one table), as its text forms."""
        at, values = self._columns[insert.relation_id], insert.new

        def text(name: str) -> str:
            value = values[at[name]]
            assert isinstance(value, bytes)
            return value.decode()

        key = values[at["key"]]
        xid, row_id = int(text("xid")), int(text("id"))
        tx.pending.append((xid, row_id))
        tx.rows.append(
            (
                xid,
                row_id,
                text("stream"),
                int(text("ts")),
                bytes.fromhex(text("record")[2:]),
                None if not isinstance(key, bytes) else bytes.fromhex(key.decode()[2:]),
            )
        )


def widen(xid: int, reference: int) -> int:
    """A 32-bit transaction id as the xid8 it is: the one with those low 32 bits nearest
    ``reference``, a recent xid8 (within 2^31 of every transaction still decoded). An
    xid8 already is one."""
    value = (reference & ~0xFFFFFFFF) | (xid & 0xFFFFFFFF)
    if value - reference > 1 << 31:
        value -= 1 << 32
    elif reference - value > 1 << 31:
        value += 1 << 32
    return value


@dataclass(slots=True)
class Round:
    """What a round needs besides its transactions: the epoch (None: read it, in a
    transaction the caller began) and a recent xid8 to widen the 32-bit ids by."""

    epoch: int | None
    reference: int


def started(at: Round) -> Steps:
    """Read the epoch and a recent xid8 if ``at`` does not know them, in the caller's
    transaction; returns whether this server life took an epoch (else the numbering
    takes a new one)."""
    if at.epoch is not None:
        return True
    epoch, booted, at.reference = yield Statement(ROUND_START, fetch=True)
    at.epoch = int(epoch)
    return bool(booted)


def numbered_steps(
    rows: list[tuple[Any, ...]],
    at: Round,
    known: dict[str, StreamState],
    before_commit: Callable[[Numbered], None] | None = None,
    also: Statement | None = None,
) -> Steps:
    """``numbering.number_rows`` under ``at``'s epoch (read first if unknown)."""
    booted = yield from started(at)
    assert at.epoch is not None
    done: Numbered = yield from number_rows(rows, at.epoch, booted, known, before_commit, also)
    at.epoch = done.epoch
    known |= states_after(done)
    return done


def round_steps(
    transactions: list[Transaction],
    slot: str,
    known: dict[str, StreamState],
    before_commit: Callable[[Numbered], None] | None,
    at: Round,
) -> Steps:
    """One round: the records numbered into the log, the pending rows among them deleted,
    the position past them stored; a ``Numbered``. One statement (autocommit) when the
    epoch is known and no pending row came; else in the caller's transaction, which
    ``ROUND_START`` reads first (a new epoch taken if this server life took none)."""
    yield from started(at)  # the reference to widen ids by, first
    rows: list[tuple[Any, ...]] = []
    pending: list[tuple[int, int]] = []
    for tx in transactions:
        pending += tx.pending
        # A message's rows carry the 32-bit id, a pending row's its xid8: both widen alike.
        rows += [(widen(row[0], at.reference), *row[1:]) for row in tx.rows]
    if rows:  # (captured transactions may hold none: their position is stored alone)
        at.reference = max(at.reference, rows[-1][0])
    if pending:
        xids, ids = zip(*pending, strict=True)
        yield Statement(DELETE_PENDING, {"xids": list(xids), "ids": list(ids)})
    store = Statement(STORE, {"slot": slot, "lsn": transactions[-1].end_lsn})
    done: Numbered = yield from numbered_steps(rows, at, known, before_commit, also=store)
    return done


async def commit_round(
    conn: Any,
    transactions: list[Transaction],
    slot: str,
    known: dict[str, StreamState],
    at: Round,
    before_commit: Callable[[Numbered], None] | None = None,
) -> tuple[Numbered, int, int]:
    """One round (``round_steps``) committed on ``conn`` (autocommit, asynchronous
    commits) without waiting for its flush: the round, the WAL written up to just after
    its commit (flushed past there, it may be served), and the WAL flushed so far. On
    failure ``known`` and ``at`` are forgotten: read again from the database."""
    alone = at.epoch is not None and not any(tx.pending for tx in transactions)
    steps = round_steps(transactions, slot, known, before_commit, at)
    try:
        if alone:  # two statements: a pipeline would cost more than the round trip
            done: Numbered = await run_async(conn, steps)
        else:
            async with conn.pipeline():
                await conn.execute("BEGIN")
                done = await run_async(conn, steps)
                await conn.execute("COMMIT")
        cursor = await conn.execute(WAL_POSITIONS)
        bound, flushed = await cursor.fetchone()
    except BaseException:
        known.clear()
        at.epoch = None
        with contextlib.suppress(Exception):
            await conn.execute("ROLLBACK")
        raise
    return done, int(bound), int(flushed)


async def readable_within(readable: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for the slot's socket; whether it became readable."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await readable.wait()
    return readable.is_set()


class Rounds:
    """Rounds committed without waiting for their flush (``commit_round``), served in
    order once the WAL is flushed past their commit; the slot may then be confirmed past
    them. The WAL path's numbering and capture each keep one."""

    def __init__(self, serve: Callable[[Numbered], None]) -> None:
        self._serve = serve
        # (round, the WAL written up to just after its commit, the position past it)
        self._waiting: deque[tuple[Numbered, int, int]] = deque()
        self.flushed = 0  # the WAL is flushed up to here, as last seen
        self.served = 0  # the position past the last round served
        self.unserved: Counter[str] = Counter()  # streams of rounds committed, not served

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def start(self, position: int) -> None:
        """Reading the slot (again) from ``position``: rounds that waited are forgotten
        (after a failure, the producer reads the heads from the database)."""
        self._waiting.clear()
        self.unserved.clear()
        self.flushed = self.served = position

    async def commit(
        self,
        conn: Any,
        transactions: list[Transaction],
        slot: str,
        known: dict[str, StreamState],
        at: Round,
    ) -> None:
        """One round of ``transactions`` (``commit_round``), served once flushed."""
        done, bound, flushed = await commit_round(conn, transactions, slot, known, at, self._taken)
        self._waiting.append((done, bound, transactions[-1].end_lsn))
        self.flushed_to(flushed)

    def flushed_to(self, lsn: int) -> None:
        """The WAL is flushed up to ``lsn``: serve the rounds it is past, in order."""
        self.flushed = max(self.flushed, lsn)
        while self._waiting and self._waiting[0][1] <= self.flushed:
            done, _, self.served = self._waiting.popleft()
            try:
                self._serve(done)
            finally:
                for stream in done.streams:
                    self.unserved[stream.name] -= 1
                    if not self.unserved[stream.name]:
                        del self.unserved[stream.name]

    def confirmable(self, wal_end: int, idle: bool) -> int:
        """How far the slot may be confirmed: past the rounds served; and, ``idle``
        (nothing of ours read and not numbered) with none waiting, as far as the server
        has decoded (``wal_end``), so that the WAL other writes leave is not kept."""
        return max(self.served, wal_end) if idle and not self._waiting else self.served

    async def flush(self, conn: Any) -> None:
        """Flush the WAL (nobody else did), then serve every round waiting."""
        await conn.execute(FLUSH)
        cursor = await conn.execute(FLUSHED)
        (flushed,) = await cursor.fetchone()
        self.flushed_to(int(flushed))

    def _taken(self, done: Numbered) -> None:
        for stream in done.streams:
            self.unserved[stream.name] += 1


class WalNumberer:
    """The serving producer's numbering (``storage.Numbering``) through the WAL path, or
    through the table path (``numbering.Numberer``) where the WAL path cannot run."""

    def __init__(
        self,
        url: str,
        where: str,
        producer_id: str,
        serve: Callable[[Numbered], None],
        resync: Callable[[], Awaitable[Any]],
    ) -> None:
        self._url, self._where = url, where
        self.slot = publish_slot(producer_id)
        self._serve, self._resync = serve, resync
        self._table: Numberer | None = None  # the table path, if that is the one
        self._conn: Any = None
        self._known: dict[str, StreamState] = {}
        self._round_at = Round(None, 0)
        self._lost = False  # a round may have committed unserved: resync first
        self.position = 0  # every transaction ending at or before it is numbered
        self._waiting = Rounds(serve)  # rounds committed, served once flushed
        self.path: dict[str, Any] = {"path": "starting"}  # for status: which, and why
        self._rounds = 0  # through the WAL path
        self.bad_messages = 0
        self.idle_check = 5.0
        self._open = OpenTransactions()
        self._looked_at = -OPEN_LOOK_S

    # --- storage.Numbering, for either path ---------------------------------------------
    @property
    def unserved(self) -> Counter[str]:
        return self._table.unserved if self._table is not None else self._waiting.unserved

    @property
    def armed(self) -> bool:
        return self._table.armed if self._table is not None else False

    @property
    def rounds(self) -> int:
        return self._table.rounds if self._table is not None else self._rounds

    @property
    def open_transactions(self) -> OpenTransactions:
        return self._table.open_transactions if self._table is not None else self._open

    async def run(self) -> None:
        """For ever: a lost connection is made again and reading starts again from the
        stored position; where the WAL path cannot run, the table path runs instead."""
        delay = _RECONNECT_FIRST
        failed = 0  # setting up in a row, connected
        while True:
            try:
                await self._connect()
                try:
                    start = await self._prepare()
                except Exception as exc:
                    failed += 1
                    if failed < SETUP_TRIES:
                        raise
                    # Not a passing failure (a missing privilege, say): the table path
                    # numbers meanwhile, rather than nothing at all.
                    self._table_path(f"the WAL path could not be set up: {exc}")
                    start = None
                if start is None:
                    return await self._run_table_path()
                if self._lost:  # rounds may have committed unserved: flushed, then heads
                    await self._conn.execute(FLUSH)
                    await self._resync()
                    self._lost = False
                delay = _RECONNECT_FIRST
                await self._stream(start)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, DatabaseOpenError | psycopg_module().OperationalError):
                    logger.warning("numbering on %s: %s; connecting again", self._where, exc)
                else:
                    logger.exception("numbering records on %s failed", self._where)
                self._lost = True
                await self._reset()
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RECONNECT_MOST)

    async def _run_table_path(self) -> None:
        await self._reset()
        table = self._table = Numberer(self._url, self._where, self._serve, self._resync)
        table.idle_check = self.idle_check
        await table.run()

    async def _connect(self) -> None:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = await connect_async(
                self._url, self._where, application_name="streamq numbering"
            )
            # Rounds commit without waiting for their flush: served once flushed. (A
            # synchronous round would add a flush between the writers' own.)
            await self._conn.execute("SET synchronous_commit = off")

    async def _reset(self) -> None:
        self._known.clear()
        self._round_at.epoch = None  # read again on the next connection (a new epoch?)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = None

    async def _one(self, query: str, params: Any = None) -> Any:
        cursor = await self._conn.execute(query, params)
        return await cursor.fetchone()

    async def _prepare(self) -> int | None:
        """The stored position to read the slot from, the slot made first if needed; None
        where the WAL path cannot run (``path`` says why)."""
        (wal_level,) = await self._one("SHOW wal_level")
        if wal_level != "logical":
            self._table_path(
                f"wal_level is {wal_level!r}, the WAL path needs 'logical' "
                "(ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)"
            )
            return None
        (allowed, role) = await self._one(
            "SELECT rolreplication OR rolsuper, rolname FROM pg_roles WHERE rolname = current_user"
        )
        if not allowed:
            self._table_path(
                f"role {role!r} lacks the REPLICATION attribute the WAL path's slot needs "
                f"(ALTER ROLE {role} REPLICATION)"
            )
            return None
        named, status, stored = await self._one(SLOT_QUERY, {"slot": self.slot})
        if status is None and (reason := await self._no_room()) is not None:
            self._table_path(reason)
            return None
        await self._publication()
        if named == self.slot and status not in (None, "lost") and stored is not None:
            start = int(stored)
        else:
            start = await self._make_slot(named, status, stored)
        self.position = start
        self.path = {"path": "wal", "slot": self.slot}
        logger.info(
            "publishing on %s through the WAL (slot %s, from %s)",
            self._where,
            self.slot,
            format_lsn(start),
        )
        return start

    async def _no_room(self) -> str | None:
        """Why a slot cannot be made and read now, if it cannot: none free, or no WAL
        sender for it (the table path runs instead, until the next start)."""
        slots, senders, used, sending = await self._one(ROOM)
        if used >= slots:
            return (
                f"all {slots} replication slots are in use (max_replication_slots): "
                "raise it, or drop a slot nobody reads, and restart the serving process"
            )
        if sending >= senders:
            return (
                f"all {senders} WAL senders are in use (max_wal_senders): raise it and "
                "restart the serving process"
            )
        return None

    def _table_path(self, reason: str) -> None:
        self.path = {"path": "table", "reason": reason}
        logger.info("publishing on %s through table streamq_pending: %s", self._where, reason)

    async def _publication(self) -> None:
        (exists,) = await self._one(
            "SELECT count(*) FROM pg_publication WHERE pubname = %s", (self.slot,)
        )
        if not exists:
            await self._conn.execute(
                f'CREATE PUBLICATION "{self.slot}" FOR TABLE streamq_pending '
                "WITH (publish = 'insert')"
            )

    async def _make_slot(self, named: str | None, status: str | None, stored: int | None) -> int:
        """Make the slot (again), number the pending rows committed before it, and name it
        to writers; the position it starts from."""
        told = named == self.slot  # writers were publishing through it
        if told and (status in (None, "lost")):
            logger.error(
                "the WAL path's slot %s on %s was %s: records published through the WAL "
                "after %s may be lost; making it again",
                self.slot,
                self._where,
                "invalidated (max_slot_wal_keep_size)" if status == "lost" else "dropped",
                format_lsn(int(stored or 0)),
            )
        elif status is not None:  # made, but the setup did not finish: nobody used it
            logger.info("the WAL path's slot %s on %s: made again", self.slot, self._where)
        if named:  # writers go back to the table path before the slot goes
            await self._conn.execute(SET_META, ("publish_slot", ""))
            await asyncio.sleep(PATH_CHECK_EVERY * 1.5)
        if status is not None:
            await self._conn.execute("SELECT pg_drop_replication_slot(%s)", (self.slot,))
        exported = await asyncio.to_thread(
            ExportedSnapshot, self._url, self._where, self.slot, temporary=False
        )
        drained: list[Numbered] = []
        conn = self._conn
        try:
            await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            await conn.execute(f"SET TRANSACTION SNAPSHOT '{exported.name}'")
            await conn.execute("SET LOCAL synchronous_commit = on")  # served at once
            while (done := await run_async(conn, number_steps())) is not None:
                drained.append(done)
            await conn.execute(STORE, {"slot": self.slot, "lsn": exported.lsn})
            await conn.execute(SET_META, ("publish_slot", self.slot))
            await conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.execute("ROLLBACK")
            raise
        finally:
            exported.close()
        for done in drained:
            self._serve(done)
        logger.info(
            "the WAL path's slot %s made on %s at %s (%d pending records numbered first)",
            self.slot,
            self._where,
            format_lsn(exported.lsn),
            sum(len(s.records) for d in drained for s in d.streams),
        )
        return exported.lsn

    async def _stream(self, start: int) -> None:
        """Read the slot from ``start``: the transactions that have come, whole, numbered
        in rounds of about ``LIMIT`` records at most, each served once flushed."""
        reader = await asyncio.to_thread(
            SlotReader,
            self._url,
            self._where,
            self.slot,
            self.slot,
            start,
            messages=True,
            name="streamq publish",
        )
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fd = reader.fileno()
        loop.add_reader(fd, readable.set)
        decoder = WalDecoder()
        waiting = self._waiting
        waiting.start(start)
        confirmed, confirmed_at = start, 0.0
        batch: list[Transaction] = []
        count = 0
        try:
            while True:
                readable.clear()
                messages, drained = reader.read(LIMIT)
                for data in messages:
                    tx = decoder.feed(data)
                    if tx is not None and tx.end_lsn > self.position:
                        batch.append(tx)
                        count += len(tx.rows)
                self.bad_messages = decoder.bad
                if batch and (drained or count >= LIMIT):
                    await waiting.commit(self._conn, batch, self.slot, self._known, self._round_at)
                    self.position = batch[-1].end_lsn
                    self._rounds += 1
                    batch, count = [], 0
                # The server decodes only flushed WAL: what it has sent is flushed.
                waiting.flushed_to(reader.wal_end)
                idle = drained and not batch and decoder.between_transactions
                target, now = waiting.confirmable(reader.wal_end, idle), time.monotonic()
                if target > confirmed and now - confirmed_at >= CONFIRM_EVERY:
                    reader.confirm(confirmed := target)
                    confirmed_at = now
                if time.monotonic() - self._looked_at >= OPEN_LOOK_S:
                    await self._look()
                if drained and not batch:
                    wait = FLUSH_PATIENCE_MS / 1000 if waiting else IDLE_WAIT
                    if not await readable_within(readable, wait) and waiting:
                        await waiting.flush(self._conn)  # nobody flushed meanwhile
        finally:
            loop.remove_reader(fd)
            reader.close()

    async def _look(self) -> None:
        count, oldest = await self._one(OPEN_WRITERS)
        self._open = OpenTransactions(int(count), oldest)
        self._looked_at = time.monotonic()

    def status(self) -> dict[str, Any]:
        """For ``streamq status``: the path, why, and how far the WAL path has read."""
        status = dict(self.path)
        if status["path"] == "wal":
            status |= {"position": format_lsn(self.position), "rounds": self._rounds}
            if self.bad_messages:
                status["bad_messages"] = self.bad_messages
        return status

    async def close(self) -> None:
        if self._table is not None:
            await self._table.close()
        await self._reset()
