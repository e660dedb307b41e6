"""The PostgreSQL engine: the log's tables and the publish path, through psycopg 3.

The tables are the SQLite engine's (``sqlite/storage.py``), in PostgreSQL's types: ``streamq_meta``,
``streamq_streams``, ``streamq_log`` keyed by (stream_id, seq), ``streamq_time``,
``streamq_epochs``, ``streamq_consumers``; plus ``streamq_pending`` and ``streamq_boot``, below.

Publishing: no lock across the commit
-------------------------------------
A sequence or identity column cannot number a log: values are taken at insert and
committed in any order, and rolled-back ones leave gaps, so a reader that has seen 8
may later see 7 commit, or wait forever for a 7 that never will. Numbering at publish
time needs a lock held until the commit (and its WAL flush), which makes one stream's
writers commit one at a time. So writers do not number: ``publish`` inserts the record,
unnumbered, into ``streamq_pending`` with its transaction's id (``pg_current_xact_id()``)
and an identity id, in one statement and with no lock, and its transaction commits in
PostgreSQL's group commit with everyone else's. The serving producer numbers what has
committed (``numbering.py``): in transactions of its own, it moves the pending rows its
snapshot sees into ``streamq_log``, giving each stream's records the next seqs in
(xid, id) order, and serves them once that numbering is flushed. Hence:

- a record gets its seq only once its transaction has committed, and that seq never
  changes: seqs are dense, and a rollback (or a writer killed before its COMMIT) leaves
  nothing to number;
- if T1 committed before T2 began, T1's records come first: every snapshot that sees T2
  sees T1, and T1's xid is the smaller (it was taken before T1 committed);
- one transaction's records to a stream get consecutive seqs, in publish order.

``publish`` returns a ``Receipt`` (the transaction's id, the first row's id, how many)
instead of a seq; the serving producer says the seqs (``Producer.wait_served``).
Any isolation level works: the writer reads nothing.

Waking the serving producer: a doorbell, not NOTIFY per commit
--------------------------------------------------------------
A ``NOTIFY`` in every publishing transaction would make them queue again: PostgreSQL
takes a lock over the whole database at the commit of a notifying transaction and
holds it through the WAL flush. While records keep coming, the numberer looks for
them itself, waiting inside the server (``streamq_wait``: a few milliseconds' naps,
no round trip). Once idle it *arms the doorbell*: it takes ``DOORBELL`` exclusively,
only if no publishing transaction holds it shared (every publish takes it shared until
its transaction ends, with ``pg_try_``: it never waits). A publish that finds it armed
sends ``NOTIFY streamq``: only the first few transactions after an idle spell do. No
commit is missed: a transaction that published before the doorbell was armed had ended
by then, so the numberer's last look, just after arming, sees its records.

Publishing through the WAL: the record stored once
-------------------------------------------------
Where the server has ``wal_level = logical`` and the serving producer reads a
replication slot of its own (``walpath.py``), a publish writes nothing to a table:
``pg_logical_emit_message(true, 'streamq', ...)`` puts the records in the WAL, inside the
writer's transaction, and logical decoding hands them to the serving producer in commit
order once the transaction has committed (and never if it rolled back). The serving
producer numbers them and writes them to the log once, in batches, off the writers' path.
A writer looks once a second (``PublishPath``) whether that slot exists and is usable
(its name in ``streamq_meta``'s ``publish_slot``, set once the slot is read): while it
does not, records go to ``streamq_pending`` as above. Records of both paths reach the
serving producer through the slot (its publication holds ``streamq_pending``), so one
numbering orders them.

Epochs (docs/protocol.md): records are stamped with the database's epoch. PostgreSQL
loses commits only by a crash (with ``synchronous_commit=off``) or a failover to a replica
that had not received them; ``streamq_boot``, an UNLOGGED table, is emptied by both (crash
recovery resets unlogged tables; replicas never receive them). The first numbering that
finds it empty takes a new epoch, in its own transaction, and records it there; so seqs
written again after a loss carry a higher epoch than the ones lost. (SQLite's boot id
would not do: it is the client machine's, and clients on two machines would take a new
epoch at every turn.)

The logic is written once, as generators of statements (``Steps``): ``append`` and
``append_async`` only run them on a psycopg ``Connection`` or ``AsyncConnection``, or on
the application's asyncpg connection (``run_asyncpg``), where each statement a writer
runs has its asyncpg form (``in_both``: ``$n`` placeholders, asyncpg's own codecs).
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ...errors import SchemaMissingError
from ...producer.storage import EpochRow, LogRow, TimeRow
from ...records import CheckedRecord, Receipt, Unnumbered
from .driver import connect, database, in_transaction

# Of the PostgreSQL tables (SQLite's have their own, store.SCHEMA_VERSION). 2: unnumbered
# records in streamq_pending, numbered by the serving producer.
SCHEMA_VERSION = 2
UNDEFINED_TABLE = "42P01"  # SQLSTATE


def in_both(template: str, *binary: int) -> tuple[str, str]:
    """A statement in psycopg's placeholders (``%s``; ``%b``, binary, for the parameters
    numbered in ``binary``, from 1) and in asyncpg's (``$1``, ``$2``, ...), from one
    template with ``{}`` for each positional parameter."""
    count = template.count("{}")
    psycopg = ["%b" if n in binary else "%s" for n in range(1, count + 1)]
    return template.format(*psycopg), template.format(*(f"${n}" for n in range(1, count + 1)))


# Of the numberer's window (``numbering.Window``) below its frontier, the transactions
# that have committed (format with the xid8[] of ``open``): those whose rows can be seen.
COMMITTED = "ARRAY(SELECT x FROM unnest({open}) AS x WHERE pg_xact_status(x) = 'committed')"

CAPTURE_TABLE = """CREATE TABLE IF NOT EXISTS streamq_capture (
    slot text PRIMARY KEY,
    lsn bigint NOT NULL,   -- every transaction ending at or before it is published
    tables text[] NOT NULL
)"""
# Two create_schema at once would race on the catalog: the second waits for the first.
_SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtext('streamq_schema'))"
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS streamq_meta (key text PRIMARY KEY, value text NOT NULL)",
    """CREATE TABLE IF NOT EXISTS streamq_streams (
        id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        name text NOT NULL UNIQUE,
        low bigint NOT NULL DEFAULT 1,                  -- first seq still held
        key_index boolean NOT NULL DEFAULT false,       -- records' keys are indexed (history)
        compact boolean NOT NULL DEFAULT false,         -- compacted periodically
        notify_compacted boolean NOT NULL DEFAULT false,
        compacted bigint NOT NULL DEFAULT 0             -- compaction ran up to this seq
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_log (
        stream_id bigint NOT NULL,
        seq bigint NOT NULL,
        ts bigint NOT NULL,      -- milliseconds since the Unix epoch
        record bytea NOT NULL,   -- protocol.encode_record(...)
        key bytea,               -- the record's key if its stream has key_index, else NULL
        PRIMARY KEY (stream_id, seq)
    )""",
    # One key's records in seq order, read without a sort (history, compaction). Replaces
    # the (stream_id, key) index of the first PostgreSQL release, which sorted each key.
    "DROP INDEX IF EXISTS streamq_log_key",
    """CREATE INDEX IF NOT EXISTS streamq_log_key_seq ON streamq_log (stream_id, key, seq)
        WHERE key IS NOT NULL""",
    """CREATE TABLE IF NOT EXISTS streamq_time (
        stream_id bigint NOT NULL,
        ts bigint NOT NULL,      -- a timestamp above every earlier one of the stream
        seq bigint NOT NULL,     -- the first record that reached it
        PRIMARY KEY (stream_id, ts)
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_epochs (
        stream_id bigint NOT NULL,
        first_seq bigint NOT NULL,  -- this epoch appended from here to the next row
        epoch bigint NOT NULL,
        PRIMARY KEY (stream_id, first_seq)
    )""",
    """CREATE TABLE IF NOT EXISTS streamq_consumers (
        consumer text NOT NULL,
        stream text NOT NULL,
        applied bigint NOT NULL DEFAULT 0,  -- last seq the consumer reported applied
        registered_at bigint NOT NULL,      -- milliseconds since the Unix epoch
        updated_at bigint NOT NULL,         -- when it last reported (or registered)
        max_idle_ms bigint,                 -- dropped after this long away (NULL: never)
        max_bytes bigint,                   -- dropped when held back records exceed this
        registered boolean NOT NULL DEFAULT true,  -- false: a position reported, no registration
        PRIMARY KEY (consumer, stream)
    )""",
    # Tables made before these columns existed (rows already there are registrations).
    """ALTER TABLE streamq_consumers ADD COLUMN IF NOT EXISTS max_idle_ms bigint,
        ADD COLUMN IF NOT EXISTS max_bytes bigint,
        ADD COLUMN IF NOT EXISTS registered boolean NOT NULL DEFAULT true""",
    # Emptied by crash recovery and absent on a promoted replica: the module docstring.
    "CREATE UNLOGGED TABLE IF NOT EXISTS streamq_boot (epoch bigint NOT NULL)",
    # Committed records not numbered yet: the module docstring. (xid, id) is the order
    # they are numbered in; the serving producer deletes them as it numbers them.
    """CREATE TABLE IF NOT EXISTS streamq_pending (
        xid xid8 NOT NULL DEFAULT pg_current_xact_id(),  -- the publishing transaction
        id bigint GENERATED ALWAYS AS IDENTITY,          -- publish order within it
        stream text NOT NULL,
        ts bigint NOT NULL,      -- milliseconds since the Unix epoch
        record bytea NOT NULL,   -- protocol.encode_record(...) with seq 0
        key bytea,
        PRIMARY KEY (xid, id)
    )""",
    # How far a slot's reader has got: capture's (capture.py) and the WAL path's
    # (walpath.py), each in the transaction that publishes what it read.
    CAPTURE_TABLE,
    # The numberer's wait, inside the server (numbering.py): returns at once when records
    # are pending (in the numberer's window: ``numbering.Window``), when the WAL is
    # flushed up to what was written before the call (if ``flush``), or after
    # ``timeout_ms``; meanwhile naps ``nap_ms`` between looks.
    "DROP FUNCTION IF EXISTS streamq_wait(boolean, integer, double precision)",
    f"""CREATE OR REPLACE FUNCTION streamq_wait(flush boolean, timeout_ms integer,
        nap_ms double precision, frontier xid8, open xid8[],
        OUT pending boolean, OUT target pg_lsn, OUT flushed pg_lsn)
    LANGUAGE plpgsql VOLATILE AS $$
    DECLARE
        deadline timestamptz := clock_timestamp() + timeout_ms * interval '1 millisecond';
    BEGIN
        target := CASE WHEN flush THEN pg_current_wal_insert_lsn() END;
        LOOP
            pending := EXISTS (SELECT FROM streamq_pending WHERE xid > frontier)
                OR EXISTS (SELECT FROM streamq_pending
                           WHERE xid = ANY({COMMITTED.format(open="open")}));
            flushed := pg_current_wal_flush_lsn();
            IF pending OR flushed >= target OR clock_timestamp() >= deadline THEN
                RETURN;
            END IF;
            PERFORM pg_sleep(nap_ms / 1000.0);
        END LOOP;
    END $$""",
)
META_QUERY = "SELECT key, value FROM streamq_meta"
SET_META, SET_META_DOLLAR = in_both(
    "INSERT INTO streamq_meta (key, value) VALUES ({}, {}) "
    "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
)

# --- publishing (the module docstring) -------------------------------------------------
# NOTIFY's channel: the serving producer LISTENs on it.
CHANNEL = "streamq"
# The doorbell: an advisory lock (per database) with two int4 keys, "strq" and 2.
DOORBELL = "1937011313, 2"
# A publish, in one statement: the records, unnumbered, with their transaction's id; the
# first row's id and how many; and whether the doorbell is unarmed (taken shared until
# the transaction ends: the numberer cannot arm it meanwhile). Each statement a writer
# runs is in psycopg's placeholders and in asyncpg's (``_DOLLAR``: ``in_both``).
PUBLISH, PUBLISH_DOLLAR = in_both(
    f"""
WITH added AS (
    INSERT INTO streamq_pending (stream, ts, record, key)
    SELECT {{}}::text, * FROM unnest({{}}::bigint[], {{}}::bytea[], {{}}::bytea[])
    RETURNING id)
SELECT pg_current_xact_id()::text::bigint, min(id), count(*),
    pg_try_advisory_xact_lock_shared({DOORBELL})
FROM added""",
    2,
    3,
    4,
)
# ``PUBLISH`` of one record: no arrays to build and send.
PUBLISH_ONE, PUBLISH_ONE_DOLLAR = in_both(
    f"""
INSERT INTO streamq_pending (stream, ts, record, key) VALUES ({{}}, {{}}, {{}}, {{}})
RETURNING xid::text::bigint, id, 1, pg_try_advisory_xact_lock_shared({DOORBELL})"""
)
RING = f"SELECT pg_notify('{CHANNEL}', '')"  # delivered at the commit
# The WAL path: the records in a transactional logical message (``wal_message``), and
# the transaction's id and the message's LSN for the receipt. Nothing to wake: logical
# decoding pushes the transaction to the serving producer once committed.
PREFIX = "streamq"
PUBLISH_WAL, PUBLISH_WAL_DOLLAR = in_both(
    "SELECT pg_current_xact_id()::text::bigint, "
    f"(pg_logical_emit_message(true, '{PREFIX}', {{}}::bytea) - '0/0')::bigint",
    1,
)
# Whether to publish through the WAL: the slot the serving producer reads is there and
# has not lost WAL it needed (``walpath.py``).
PATH_QUERY = """
SELECT EXISTS (SELECT FROM pg_replication_slots
    WHERE slot_name = (SELECT value FROM streamq_meta WHERE key = 'publish_slot')
    AND database = current_database() AND wal_status IS DISTINCT FROM 'lost')"""
PATH_CHECK_EVERY = 1.0  # seconds a connection trusts what it last found
# Taking a new epoch: one numberer at a time, each rereading after the lock.
LOCK_EPOCH = "SELECT value FROM streamq_meta WHERE key = 'epoch' FOR UPDATE"
# The epoch, whether this server life took one, and the next epoch: one more, and at
# least (the server's WAL timeline << 42) + the server's time in milliseconds. A promoted
# replica is on a new timeline, higher than its old primary's, so its epochs exceed every
# epoch the old primary took, even those it never received (the old primary may have
# crashed and taken one, for seqs lost in the failover); the time makes each instance's
# epoch its own on one timeline, even after a restore from an older copy brought an
# older stored epoch back. The timeline is the first 8 hex digits of the current WAL
# file's name; the time fits in 42 bits until the year 2109.
EPOCH_QUERY = """
SELECT value, EXISTS (SELECT FROM streamq_boot), greatest(value::bigint + 1,
    (('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint << 42)
    + (extract(epoch FROM clock_timestamp()) * 1000)::bigint)
FROM streamq_meta WHERE key = 'epoch'"""
# The new epoch is committed synchronously whatever synchronous_commit says: a reader may
# see records stamped with it, and if a crash lost it, the next one would be taken again,
# with the same number, for other records.
NEW_EPOCH = """
WITH meta AS (UPDATE streamq_meta SET value = %(epoch)s::text WHERE key = 'epoch'),
    boot AS (DELETE FROM streamq_boot)
INSERT INTO streamq_boot (epoch) VALUES (%(epoch)s)"""
SYNC_COMMIT = "SET LOCAL synchronous_commit = on"


@dataclass(frozen=True, slots=True)
class Statement:
    sql: str
    params: Sequence[Any] | dict[str, Any] | None = None
    fetch: bool = False  # the step wants the statement's first row back (None: no row)
    fetch_all: bool = False  # the step wants every row back
    # The same statement with asyncpg's placeholders ($1, $2, ...: positional ``params``),
    # for the steps an application's asyncpg connection runs (``run_asyncpg``). A statement
    # without parameters is the same in both.
    dollar: str | None = None


# A generator of the statements one operation runs: each yield is sent its row(s).
Steps = Generator[Statement, Any, Any]


def new_epoch_steps(*, if_not_booted: bool) -> Steps:
    """Take a new epoch (only if this server life took none, with ``if_not_booted``), one
    at a time, committed synchronously; returns the epoch to stamp records with."""
    yield Statement(LOCK_EPOCH, fetch=True)
    epoch, booted, new = yield Statement(EPOCH_QUERY, fetch=True)
    if if_not_booted and booted:
        return int(epoch)  # another took it while this one waited for the lock
    yield Statement(SYNC_COMMIT)
    yield Statement(NEW_EPOCH, {"epoch": new})
    return int(new)


class PublishPath:
    """Whether one connection publishes through the WAL, as it last looked (at most
    ``PATH_CHECK_EVERY`` seconds ago): the module docstring."""

    __slots__ = ("checked_at", "wal")

    def __init__(self) -> None:
        self.wal = False
        self.checked_at = -PATH_CHECK_EVERY

    def stale(self) -> bool:
        return time.monotonic() - self.checked_at >= PATH_CHECK_EVERY

    def found(self, wal: bool) -> None:
        self.wal, self.checked_at = bool(wal), time.monotonic()


_paths: weakref.WeakKeyDictionary[Any, PublishPath] = weakref.WeakKeyDictionary()


def path_of(conn: Any) -> PublishPath:
    """The application connection's ``PublishPath``, kept as long as the connection (the
    driver's, under SQLAlchemy's adapter of an asyncpg one)."""
    conn = getattr(conn, "driver_connection", conn)
    path = _paths.get(conn)
    if path is None:
        path = _paths[conn] = PublishPath()
    return path


MESSAGE_VERSION = 1  # of ``wal_message``'s format


def wal_message(stream: str, records: Unnumbered) -> bytes:
    """The WAL path's message: the stream and its records (``walpath.read_message``)."""
    message = (MESSAGE_VERSION, stream, records.timestamps, records.encoded, records.keys)
    payload: bytes = msgpack.packb(message)
    return payload


def append_steps(
    stream: str, records: Unnumbered, *, where: Callable[[], str], path: PublishPath
) -> Steps:
    """Publish ``records``, encoded already, to ``stream`` in the caller's transaction: a
    ``Receipt``. ``where()`` names the database in errors. Takes no lock that others wait
    for."""
    try:
        if path.stale():
            (wal,) = yield Statement(PATH_QUERY, fetch=True)
            path.found(wal)
        if path.wal:
            payload = wal_message(stream, records)
            xid, lsn = yield Statement(PUBLISH_WAL, (payload,), True, dollar=PUBLISH_WAL_DOLLAR)
            return Receipt(stream, int(xid), int(lsn), len(records))
    except Exception as exc:
        if getattr(exc, "sqlstate", None) == UNDEFINED_TABLE:
            raise SchemaMissingError(_no_tables(where())) from exc
        raise
    statement: Statement
    if len(records) == 1:
        (record,), (ts,), (key,) = records.encoded, records.timestamps, records.keys
        params: tuple[Any, ...] = (stream, ts, record, key)
        statement = Statement(PUBLISH_ONE, params, True, dollar=PUBLISH_ONE_DOLLAR)
    else:
        params = (stream, records.timestamps, records.encoded, records.keys)
        statement = Statement(PUBLISH, params, True, dollar=PUBLISH_DOLLAR)
    try:
        xid, first_id, count, unarmed = yield statement
    except Exception as exc:
        if getattr(exc, "sqlstate", None) == UNDEFINED_TABLE:
            raise SchemaMissingError(_no_tables(where())) from exc
        raise
    if not unarmed:
        yield Statement(RING)
    return Receipt(stream, int(xid), int(first_id or 0), int(count))


def insert_statement(
    rows: Sequence[LogRow],
    times: Sequence[TimeRow],
    epochs: Sequence[EpochRow],
    also: Statement | None = None,
) -> Statement:
    """One statement for records, their time index rows and epoch rows, of any streams:
    one round trip however many records. ``also``: a further statement run with it, as a
    CTE (named parameters, none of those used here)."""
    params: dict[str, Any] = {}
    ctes = []
    if also is not None:
        ctes.append(f"also AS ({also.sql})")
        assert isinstance(also.params, dict)
        params |= also.params
    if epochs:
        ctes.append(
            "epochs AS (INSERT INTO streamq_epochs (stream_id, first_seq, epoch) SELECT * "
            "FROM unnest(%(e_ids)b::bigint[], %(e_firsts)b::bigint[], %(e_epochs)b::bigint[]))"
        )
        params |= _columns(("e_ids", "e_firsts", "e_epochs"), epochs)
    if times:
        ctes.append(
            "times AS (INSERT INTO streamq_time (stream_id, ts, seq) SELECT * "
            "FROM unnest(%(t_ids)b::bigint[], %(t_ts)b::bigint[], %(t_seqs)b::bigint[]))"
        )
        params |= _columns(("t_ids", "t_ts", "t_seqs"), times)
    params |= _columns(("ids", "seqs", "ts", "records", "keys"), rows)
    insert = (
        "INSERT INTO streamq_log (stream_id, seq, ts, record, key) SELECT * "
        "FROM unnest(%(ids)b::bigint[], %(seqs)b::bigint[], %(ts)b::bigint[], "
        "%(records)b::bytea[], %(keys)b::bytea[])"
    )
    return Statement(("WITH " + ", ".join(ctes) + " " if ctes else "") + insert, params)


def _columns(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, list[Any]]:
    """Rows as one array per column, for ``unnest``."""
    return {name: [row[i] for row in rows] for i, name in enumerate(names)}


def create_schema_steps() -> Steps:
    """Create the tables if needed, and the meta rows of a new database; returns the meta
    rows and whether the database is new (a producer id was made)."""
    yield Statement(_SCHEMA_LOCK)
    for statement in _SCHEMA:
        yield Statement(statement)
    rows = yield Statement(META_QUERY, fetch_all=True)
    meta: dict[str, Any] = {key: value for key, value in rows}
    created = "producer_id" not in meta
    if created:
        meta = {
            "producer_id": uuid.uuid4().hex,
            "schema_version": str(SCHEMA_VERSION),
            "created_at": str(int(time.time() * 1000)),
            "epoch": "0",
        }
        for item in meta.items():
            yield Statement(SET_META, item, dollar=SET_META_DOLLAR)
    elif meta.get("schema_version") == "1":  # the pending table is all it lacked
        meta["schema_version"] = str(SCHEMA_VERSION)
        version = ("schema_version", meta["schema_version"])
        yield Statement(SET_META, version, dollar=SET_META_DOLLAR)
    elif int(meta.get("schema_version", -1)) != SCHEMA_VERSION:
        raise SchemaMissingError(
            f"database has streamq schema version {meta.get('schema_version')!r}, "
            f"this streamq needs {SCHEMA_VERSION}"
        )
    return meta, created


# --- running the steps on a connection -------------------------------------------------


def run(conn: Any, steps: Steps) -> Any:
    """Run ``steps`` on a psycopg ``Connection``, in its transaction; their result. Also
    on SQLAlchemy's blocking face of an asyncpg connection (``AsyncConnection.run_sync``,
    Alembic's async template), which takes asyncpg's placeholders."""
    dollar = is_asyncpg(conn)
    with contextlib.closing(conn.cursor()) as cursor:  # SQLAlchemy's is no context manager
        try:
            step = next(steps)
            while True:
                try:
                    cursor.execute(*_in_style(step, dollar))
                    if step.fetch_all:
                        row = cursor.fetchall()
                    else:
                        row = cursor.fetchone() if step.fetch else None
                except Exception as exc:  # the steps turn it into streamq's error, or not
                    step = steps.throw(exc)
                    continue
                step = steps.send(row)
        except StopIteration as done:
            return done.value


async def run_async(conn: Any, steps: Steps) -> Any:
    """``run`` on a psycopg ``AsyncConnection`` or an asyncpg connection: the same
    statements, awaited."""
    if is_asyncpg(conn):
        return await run_asyncpg(conn, steps)
    async with conn.cursor() as cursor:

        async def execute(step: Statement) -> Any:
            await cursor.execute(step.sql, step.params)
            if step.fetch_all:
                return await cursor.fetchall()
            return await cursor.fetchone() if step.fetch else None

        return await _drive(steps, execute)


async def run_asyncpg(conn: Any, steps: Steps) -> Any:
    """``run`` on an asyncpg ``Connection`` (or a pool's): each statement in asyncpg's
    placeholders, with asyncpg's own binary codecs (arrays as lists, bytea as bytes)."""

    async def execute(step: Statement) -> Any:
        sql, params = _in_style(step, dollar=True)
        if step.fetch_all:
            return await conn.fetch(sql, *params)
        if step.fetch:
            return await conn.fetchrow(sql, *params)
        await conn.execute(sql, *params)
        return None

    return await _drive(steps, execute)


async def _drive(steps: Steps, execute: Callable[[Statement], Awaitable[Any]]) -> Any:
    """Run ``steps``, each statement by ``execute``: its row(s) sent back to the steps,
    its failure thrown into them (they turn it into streamq's error, or not)."""
    try:
        step = next(steps)
        while True:
            try:
                row = await execute(step)
            except Exception as exc:
                step = steps.throw(exc)
                continue
            step = steps.send(row)
    except StopIteration as done:
        return done.value


def _in_style(step: Statement, dollar: bool) -> tuple[str, Any]:
    """The statement's SQL and parameters for a driver: asyncpg's ($n) or psycopg's."""
    if not dollar:
        return step.sql, step.params
    if step.dollar is None and step.params:
        raise AssertionError(f"no asyncpg form of {step.sql!r}")  # a statement to write
    return step.dollar or step.sql, tuple(step.params or ())


def is_asyncpg(conn: Any) -> bool:
    """``conn`` speaks asyncpg's placeholders: an asyncpg connection, a pool's, or
    SQLAlchemy's DB-API adapter of one."""
    return type(conn).__module__.startswith(_ASYNCPG_MODULES)


_ASYNCPG_MODULES = ("asyncpg.", "sqlalchemy.dialects.postgresql.asyncpg")


def append(
    conn: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
) -> Receipt:
    """Publish ``records`` to ``stream`` in ``conn``'s (a psycopg ``Connection``) open
    transaction."""
    return append_unnumbered(conn, stream, Unnumbered.of(records, max_record_size))


def append_unnumbered(conn: Any, stream: str, records: Unnumbered) -> Receipt:
    """``append`` of records encoded already (``records.Unnumbered``)."""
    where = functools.partial(describe, conn)  # only for an error: it costs 25 µs
    receipt: Receipt = run(conn, append_steps(stream, records, where=where, path=path_of(conn)))
    return receipt


async def append_async(
    conn: Any, stream: str, records: Sequence[CheckedRecord], *, max_record_size: int
) -> Receipt:
    """``append`` on a psycopg ``AsyncConnection`` or an asyncpg connection."""
    where = functools.partial(describe, conn)
    unnumbered = Unnumbered.of(records, max_record_size)
    steps = append_steps(stream, unnumbered, where=where, path=path_of(conn))
    receipt: Receipt = await run_async(conn, steps)
    return receipt


HEAD_QUERY = """
SELECT greatest(s.low - 1, coalesce((SELECT max(seq) FROM streamq_log WHERE stream_id = s.id), 0))
FROM streamq_streams AS s WHERE s.name = %s"""


class PostgresSession:
    """One thread's own connection to a producer database (``storage.Session``):
    autocommit, transactions begun and ended by hand."""

    def __init__(self, url: str, durability: str) -> None:
        self.conn = connect(url, database(url), application_name="streamq sync producer")
        if durability == "full":
            self.conn.execute("SET synchronous_commit = on")

    @property
    def in_transaction(self) -> bool:
        return in_transaction(self.conn)

    def begin(self) -> None:
        self.conn.execute("BEGIN")

    def commit(self) -> None:
        self.conn.execute("COMMIT")

    def rollback(self) -> None:
        if self.in_transaction:
            self.conn.execute("ROLLBACK")

    def execute(self, sql: str, parameters: Any = ()) -> Any:
        return self.conn.execute(sql, parameters or None)

    def executemany(self, sql: str, parameters: Any) -> Any:
        cursor = self.conn.cursor()
        cursor.executemany(sql, parameters)
        return cursor

    def append(
        self, stream: str, records: Sequence[CheckedRecord], max_record_size: int
    ) -> Receipt:
        return append(self.conn, stream, records, max_record_size=max_record_size)

    def head(self, stream: str) -> int | None:
        row = self.conn.execute(HEAD_QUERY, (stream,)).fetchone()
        return None if row is None else int(row[0])

    def close(self) -> None:
        self.conn.close()


def create_schema(conn: Any) -> tuple[dict[str, Any], bool]:
    """Create the log tables in ``conn``'s (a psycopg ``Connection``) open transaction;
    the meta rows, and whether the database is new."""
    result: tuple[dict[str, Any], bool] = run(conn, create_schema_steps())
    return result


async def create_schema_async(conn: Any) -> tuple[dict[str, Any], bool]:
    """``create_schema`` on a psycopg ``AsyncConnection`` or an asyncpg connection."""
    result: tuple[dict[str, Any], bool] = await run_async(conn, create_schema_steps())
    return result


def describe(conn: Any) -> str:
    """The database ``conn`` (psycopg's, asyncpg's) is connected to, for error messages."""
    if is_asyncpg(conn):
        # asyncpg says where it connected only in private fields: the message names what
        # it finds. (Under SQLAlchemy's adapter: its ``driver_connection``.)
        conn = getattr(conn, "driver_connection", conn)
        dbname = getattr(getattr(conn, "_params", None), "database", "?")
        addr = getattr(conn, "_addr", "?")  # (host, port), or a Unix socket's path
        host = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else addr
        return f"PostgreSQL database {dbname!r} on {host}"
    info = conn.info
    host = info.host if info.host.startswith("/") else f"{info.host}:{info.port}"
    return f"PostgreSQL database {info.dbname!r} on {host}"


def _no_tables(where: str) -> str:
    return (
        f"{where} has no streamq log tables (or tables older than schema version "
        f"{SCHEMA_VERSION}, which has streamq_pending): create or upgrade them once with "
        "streamq.create_tables(conn) in a transaction (or a migration that calls it)"
    )
