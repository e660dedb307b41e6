"""SQLite's one-statement append (``engines/sqlite/append.py``): ``streamq.publish`` and
``SyncProducer`` hold the write lock for one INSERT that numbers its records from the
committed head, stored unnumbered and numbered by every reader; the time index written
by a trigger; the full path wherever an epoch, a stream or the schema needs more."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator

import streamq
from streamq import Consumer, Producer
from streamq.engines.sqlite.storage import SCHEMA_VERSION, SEQ_BITS, unpack_rows
from streamq.protocol import UNNUMBERED_PREFIX, decode_record, encode_record, numbered_run


@contextlib.contextmanager
def connection(path: str) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def meta(path: str, key: str) -> object:
    with connection(path) as conn:
        return conn.execute("SELECT value FROM streamq_meta WHERE key = ?", (key,)).fetchone()[0]


def statements_of_a_publish(conn: sqlite3.Connection, stream: str, value: bytes) -> list[str]:
    """The statements ``streamq.publish`` runs in a transaction of its own, each once
    (what a trigger runs inside one is traced with that statement's text)."""
    ran: list[str] = []
    conn.execute("BEGIN IMMEDIATE")
    conn.set_trace_callback(lambda sql: None if ran and ran[-1] == sql else ran.append(sql))
    try:
        streamq.publish(conn, stream, value)
    finally:
        conn.set_trace_callback(None)
        conn.execute("COMMIT")
    return ran


async def test_a_publish_holds_the_lock_for_one_statement(producer_db: str) -> None:
    async with Producer(producer_db, serve=False):
        pass
    with connection(producer_db) as conn:
        first = statements_of_a_publish(conn, "orders", b"a")  # the stream and its segment
        then = [statements_of_a_publish(conn, "orders", b"b%d" % n) for n in range(3)]
    assert len(first) > 1
    for ran in then:
        assert len(ran) == 1 and ran[0].startswith("INSERT OR IGNORE INTO streamq_log"), ran


def stored(path: str) -> list[tuple[int, int, bytes]]:
    """(last seq, count, record) of every row, as stored."""
    with connection(path) as conn:
        rows = conn.execute("SELECT pos, count, record FROM streamq_log ORDER BY pos")
        return [(p & ((1 << SEQ_BITS) - 1), count, record) for p, count, record in rows]


async def test_unnumbered_rows_read_numbered_everywhere(producer_db: str) -> None:
    """Rows the statement wrote (a record, a run, a keyed record) are stored unnumbered,
    and served, read back by history and by ``unpack_rows`` numbered, as the others."""
    async with Producer(producer_db, serve=False) as producer:
        await producer.create_stream("orders", key_index=True)
        await producer.publish("orders", b"by the producer")
    with connection(producer_db) as conn:
        conn.execute("BEGIN IMMEDIATE")
        assert streamq.publish(conn, "orders", b"alone") == 2
        assert streamq.publish_many(conn, "orders", [b"x", b"y", b"z"]) == range(3, 6)
        assert streamq.publish(conn, "orders", b"keyed", key=b"k1") == 6
        conn.execute("COMMIT")
    rows = stored(producer_db)
    assert [(last, count) for last, count, _ in rows] == [(1, 1), (2, 1), (5, 3), (6, 1)]
    assert [record.startswith(UNNUMBERED_PREFIX) for *_, record in rows] == [0, 1, 1, 1]
    with connection(producer_db) as conn:
        raw = conn.execute("SELECT pos, count, record FROM streamq_log ORDER BY pos").fetchall()
    assert [(p & ((1 << SEQ_BITS) - 1), decode_record(r).seq) for p, r in unpack_rows(raw)] == [
        (seq, seq) for seq in range(1, 7)
    ]
    async with Producer(producer_db, tail_bytes=0) as producer:
        async with Consumer(producer.address, "orders") as consumer:
            got: list[streamq.Record] = []
            async for batch in consumer:
                got += batch
                if batch.last_seq == 6:
                    break
        assert [(r.seq, r.value) for r in got][1:] == [
            (2, b"alone"),
            (3, b"x"),
            (4, b"y"),
            (5, b"z"),
            (6, b"keyed"),
        ]
        [keyed] = await producer.history("orders", b"k1")
        assert (keyed.seq, keyed.value, keyed.key) == (6, b"keyed", b"k1")
    with connection(producer_db) as conn:
        conn.execute("BEGIN IMMEDIATE")
        assert streamq.publish(conn, "orders", b"keyed again", key=b"k1") == 7
        conn.execute("COMMIT")
    async with Producer(producer_db, serve=False) as producer:
        [removed] = await producer.compact("orders")
        assert (removed.old_seq, removed.old_value) == (6, b"keyed")
        assert (removed.new_seq, removed.new_value) == (7, b"keyed again")


def test_numbered_run_numbers_only_unnumbered_records() -> None:
    unnumbered = [encode_record(0, 7, None, v, {}) for v in (b"a", b"bb")]
    numbered = [encode_record(s, 7, None, v, {}) for s, v in ((41, b"a"), (42, b"bb"))]
    assert numbered_run(41, 2, b"".join(unnumbered)) == b"".join(numbered)
    assert numbered_run(41, 1, unnumbered[0]) == numbered[0]
    assert numbered_run(41, 2, b"".join(numbered)) == b"".join(numbered)


async def test_the_trigger_indexes_time_as_the_full_path_does(tmp_path: object) -> None:
    """Timestamps that rise, repeat and fall: the same time rows either way."""
    stamps = [10, 20, 20, 15, 30, 30, 40]
    indexes = []
    for via in ("producer", "publish"):
        path = os.path.join(str(tmp_path), f"{via}.db")
        async with Producer(path, serve=False) as producer:
            await producer.create_stream("s")
            if via == "producer":
                for ts in stamps:
                    async with producer.transaction() as tx:
                        await tx.publish("s", b"v", timestamp=ts)
        if via == "publish":
            with connection(path) as conn:
                for ts in stamps:
                    conn.execute("BEGIN IMMEDIATE")
                    streamq.publish(conn, "s", b"v", timestamp=ts)
                    conn.execute("COMMIT")
        with connection(path) as conn:
            indexes.append(conn.execute("SELECT ts, pos FROM streamq_time ORDER BY ts").fetchall())
    assert indexes[0] == indexes[1]
    assert [ts for ts, _ in indexes[1]] == [10, 20, 30, 40]


async def test_a_version_3_database_is_migrated_with_a_new_epoch(producer_db: str) -> None:
    """Version 3 had no unnumbered rows and no trigger: publish refuses it until a
    producer migrates it, which takes a new epoch (so no writer appends as before)."""
    async with Producer(producer_db, serve=False) as producer:
        await producer.publish("orders", b"a")
    with connection(producer_db) as conn:
        conn.executescript(
            """
            DROP TRIGGER streamq_time_of_unnumbered;
            UPDATE streamq_meta SET value = 3 WHERE key = 'schema_version';
            """
        )
    epoch = int(str(meta(producer_db, "epoch")))
    with connection(producer_db) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            streamq.publish(conn, "orders", b"b")
        except streamq.SchemaMissingError as error:
            assert "version 3" in str(error) and "start a Producer on it once" in str(error)
        else:
            raise AssertionError("a version 3 database took a record")
        finally:
            conn.execute("ROLLBACK")
    with connection(producer_db) as conn:
        conn.execute("BEGIN IMMEDIATE")
        streamq.create_tables(conn)
        conn.execute("COMMIT")
    assert meta(producer_db, "schema_version") == SCHEMA_VERSION
    assert int(str(meta(producer_db, "epoch"))) > epoch
    with connection(producer_db) as conn:
        triggers = conn.execute("SELECT name FROM sqlite_schema WHERE type = 'trigger'")
        assert [name for (name,) in triggers] == ["streamq_time_of_unnumbered"]
        for value in (b"b", b"c"):
            conn.execute("BEGIN IMMEDIATE")
            streamq.publish(conn, "orders", value)
            conn.execute("COMMIT")
    values: list[bytes] = []
    async with (
        Producer(producer_db, tail_bytes=0) as producer,
        Consumer(producer.address, "orders") as consumer,
    ):
        async for batch in consumer:
            values += [record.value for record in batch]
            if batch.last_seq == 3:
                break
    assert values == [b"a", b"b", b"c"]


def test_a_sync_producer_appends_in_one_statement_after_another_connection(
    producer_db: str,
) -> None:
    """A ``SyncProducer`` keeps what its own commits left while nobody else commits (one
    INSERT of rows numbered in memory); after another connection's commit, the one
    statement, never a read of the state holding the lock."""
    with streamq.SyncProducer(producer_db, serve=False) as producer:
        for value in (b"a", b"b"):
            producer.publish("orders", value)
        with connection(producer_db) as other:
            other.execute("BEGIN IMMEDIATE")
            assert streamq.publish(other, "orders", b"other") == 3
            other.execute("COMMIT")
        session = producer._session()
        ran: list[str] = []
        session.conn.set_trace_callback(  # type: ignore[attr-defined]
            lambda sql: None if ran and ran[-1] == sql else ran.append(sql)
        )
        assert producer.publish("orders", b"mine") == 4
        session.conn.set_trace_callback(None)  # type: ignore[attr-defined]
    statements = [sql.split()[0] for sql in ran]
    assert statements == ["BEGIN", "PRAGMA", "INSERT", "COMMIT"], ran
    assert ran[2].startswith("INSERT OR IGNORE INTO streamq_log")


def test_publish_many_of_no_values_appends_nothing(producer_db: str) -> None:
    """An empty ``publish_many`` is an empty range, on the application's connection and a
    ``SyncProducer``'s alike, before and after another connection's commit."""
    with streamq.SyncProducer(producer_db, serve=False) as producer:
        producer.publish("orders", b"a")
        with producer.transaction() as tx:
            assert tx.publish_many("orders", []) == range(0)
        with connection(producer_db) as other:
            other.execute("BEGIN IMMEDIATE")
            assert streamq.publish_many(other, "orders", []) == range(0)
            assert streamq.publish(other, "orders", b"b") == 2
            other.execute("COMMIT")
        with producer.transaction() as tx:
            assert tx.publish_many("orders", iter(())) == range(0)
            assert tx.publish("orders", b"c") == 3
    assert [(last, count) for last, count, _ in stored(producer_db)] == [(1, 1), (2, 1), (3, 1)]
