"""``streamq.publish`` through the application's own connection, inside its transaction:
plain sqlite3, SQLAlchemy (sync and asyncio), aiosqlite, served by a real producer."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import aiosqlite
import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import streamq
from streamq import Consumer, Producer

from ..conftest import wait_for

SCHEMA = "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL)"


async def received(address: str, stream: str, until: int) -> list[streamq.Record]:
    """Every record of ``stream`` up to seq ``until``, as a consumer receives them."""
    records: list[streamq.Record] = []
    async with Consumer(address, stream) as consumer:
        async for batch in consumer:
            records += batch
            if batch.last_seq >= until:
                return records
    raise AssertionError("consumer stopped")


def head(producer: Producer, stream: str) -> int:
    """The head the producer serves (0 before it knows the stream)."""
    known = producer.log.streams.get(stream)
    return 0 if known is None else known.head


@contextlib.contextmanager
def app_connection(path: str, **options: object) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(path, **options)  # type: ignore[call-overload]
    try:
        conn.execute(SCHEMA)
        conn.commit()
        yield conn
    finally:
        conn.close()


async def test_publish_commits_with_the_application_and_a_rollback_publishes_nothing(
    producer_db: str,
) -> None:
    async with Producer(producer_db) as producer:
        with app_connection(producer_db) as conn:
            with conn:  # sqlite3's own transaction: it begins at the first write
                conn.execute("INSERT INTO orders (sku) VALUES ('a1')")
                seq = streamq.publish(
                    conn, "orders", b"reserved a1", key=b"a1", headers={"type": b"reserved"}
                )
            assert seq == 1
            with pytest.raises(RuntimeError), conn:
                conn.execute("INSERT INTO orders (sku) VALUES ('b2')")
                assert streamq.publish(conn, "orders", b"rolled back") == 2
                raise RuntimeError("the request failed")
            with conn:  # a publish first: sqlite3 begins the transaction for it
                assert streamq.publish(conn, "orders", b"c3") == 2  # the rolled-back seq, reused
                conn.execute("INSERT INTO orders (sku) VALUES ('c3')")
            assert conn.execute("SELECT sku FROM orders").fetchall() == [("a1",), ("c3",)]
        records = await received(producer.address, "orders", 2)
    assert [(r.seq, r.value, r.key, r.headers) for r in records] == [
        (1, b"reserved a1", b"a1", {"type": b"reserved"}),
        (2, b"c3", None, {}),
    ]


async def test_autocommit_connection_needs_a_transaction(producer_db: str) -> None:
    async with Producer(producer_db, serve=False):
        with app_connection(producer_db, isolation_level=None) as conn:
            with pytest.raises(streamq.NotInTransactionError, match="autocommit mode"):
                streamq.publish(conn, "orders", b"alone")
            conn.execute("BEGIN IMMEDIATE")
            assert streamq.publish(conn, "orders", b"in a transaction") == 1
            conn.execute("COMMIT")
            assert conn.execute("SELECT count(*) FROM streamq_log").fetchone() == (1,)


def test_a_database_without_the_log_tables_is_named(tmp_path: Path) -> None:
    path = str(tmp_path / "plain.db")
    with app_connection(path) as conn, conn:
        with pytest.raises(streamq.SchemaMissingError, match=r"plain\.db.*streamq init"):
            streamq.publish(conn, "orders", b"x")
        conn.execute("INSERT INTO orders (sku) VALUES ('kept')")  # the transaction goes on
    with app_connection(path) as conn:
        assert conn.execute("SELECT sku FROM orders").fetchall() == [("kept",)]


async def test_unsupported_connections_are_refused_with_what_is_supported(
    producer_db: str,
) -> None:
    with pytest.raises(streamq.UnsupportedConnectionError, match=r"sqlite3\.Connection"):
        streamq.publish(object(), "orders", b"x")
    with pytest.raises(TypeError):  # UnsupportedConnectionError is a TypeError too
        streamq.publish("orders.db", "orders", b"x")
    async with aiosqlite.connect(producer_db) as conn:
        with pytest.raises(streamq.UnsupportedConnectionError, match="publish_async"):
            streamq.publish(conn, "orders", b"x")
    with (
        app_connection(producer_db) as plain,
        pytest.raises(streamq.UnsupportedConnectionError, match=r"streamq\.publish\("),
    ):
        await streamq.publish_async(plain, "orders", b"x")


async def test_connection_errors_name_the_call_that_was_made(tmp_path: Path) -> None:
    """``create_tables`` and ``save_position`` share publish's checks: their errors say
    what that call needs, not what publishing does."""
    path = str(tmp_path / "app.db")
    batch = streamq.Batch("orders", "p1", 0, (), consumer="c", endpoint="127.0.0.1:1")
    with app_connection(path, isolation_level=None) as conn:
        calls = (
            ("create_tables", lambda: streamq.create_tables(conn), "the log tables commit"),
            ("save_position", lambda: streamq.save_position(conn, batch), "position commits"),
            ("publish", lambda: streamq.publish(conn, "orders", b"x"), "the record commits"),
        )
        for name, call, commits in calls:
            with pytest.raises(streamq.NotInTransactionError) as refused:
                call()
            assert f"before streamq.{name}, so " in str(refused.value)
            assert commits in str(refused.value)
            assert "publishing" not in str(refused.value)
        conn.execute("BEGIN")
        streamq.create_tables(conn)  # in a transaction, as a migration runs it
        conn.execute("COMMIT")
        assert conn.execute("SELECT count(*) FROM streamq_streams").fetchone() == (0,)
    async with aiosqlite.connect(path) as conn:
        with pytest.raises(streamq.UnsupportedConnectionError, match="save_position_async"):
            streamq.save_position(conn, batch)
        with pytest.raises(streamq.UnsupportedConnectionError, match="create_tables_async"):
            streamq.create_tables(conn)
    fresh = str(tmp_path / "fresh.db")
    async with aiosqlite.connect(fresh) as conn:
        await streamq.create_tables_async(conn)  # in the transaction the module opens
        await conn.commit()
    with app_connection(fresh) as conn:
        assert conn.execute("SELECT count(*) FROM streamq_streams").fetchone() == (0,)
    with (
        contextlib.closing(sqlite3.connect(fresh)) as blocking,
        pytest.raises(streamq.UnsupportedConnectionError, match=r"streamq\.create_tables\("),
    ):
        await streamq.create_tables_async(blocking)
    with (
        app_connection(path) as plain,
        pytest.raises(streamq.UnsupportedConnectionError, match=r"streamq\.save_position\("),
    ):
        await streamq.save_position_async(plain, batch)
    with pytest.raises(streamq.UnsupportedConnectionError, match=r"streamq\.create_tables "):
        streamq.create_tables(object())


async def test_publish_async_on_aiosqlite(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        async with aiosqlite.connect(producer_db) as conn:
            await conn.execute(SCHEMA)
            await conn.execute("INSERT INTO orders (sku) VALUES ('a1')")  # begins (legacy mode)
            assert await streamq.publish_async(conn, "orders", b"a1", key=b"a1") == 1
            await conn.commit()
        records = await received(producer.address, "orders", 1)
    assert [(r.seq, r.value) for r in records] == [(1, b"a1")]


def immediate_transactions(engine: object) -> None:
    """SQLAlchemy on SQLite, as the README recommends with several writers: the driver's
    own transaction handling off, and BEGIN IMMEDIATE at each transaction's start."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: sqlite3.Connection, record: object) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: object) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # type: ignore[attr-defined]


@pytest.mark.parametrize("immediate", [False, True], ids=["driver-default", "begin-immediate"])
async def test_sqlalchemy_session_and_connection(producer_db: str, immediate: bool) -> None:
    async with Producer(producer_db) as producer:
        engine = create_engine(f"sqlite:///{producer_db}")
        if immediate:
            immediate_transactions(engine)
        with engine.begin() as conn:
            conn.execute(text(SCHEMA))
        with Session(engine) as session, session.begin():
            session.execute(text("INSERT INTO orders (sku) VALUES ('a1')"))
            assert streamq.publish(session, "orders", b"from a session") == 1
        with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
            streamq.publish(session, "orders", b"rolled back")
            raise RuntimeError
        with engine.connect() as conn:  # autobegin: publish begins, commit() commits
            streamq.publish(conn, "orders", b"from a connection")
            conn.commit()
        with Session(engine) as session:
            count = session.execute(text("SELECT count(*) FROM orders")).scalar_one()
        engine.dispose()
        records = await received(producer.address, "orders", 2)
    assert count == 1
    expected = [(1, b"from a session"), (2, b"from a connection")]
    assert [(r.seq, r.value) for r in records] == expected


async def test_sqlalchemy_asyncio_session(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        engine = create_async_engine(f"sqlite+aiosqlite:///{producer_db}")
        async with engine.begin() as conn:
            await conn.execute(text(SCHEMA))
        async with AsyncSession(engine) as session, session.begin():
            await session.execute(text("INSERT INTO orders (sku) VALUES ('a1')"))
            assert await streamq.publish_async(session, "orders", b"async session") == 1
        async with engine.connect() as conn:
            assert await streamq.publish_async(conn, "orders", b"async connection") == 2
            await conn.rollback()
        async with engine.begin() as conn:
            assert await streamq.publish_async(conn, "orders", b"async connection") == 2
        await engine.dispose()
        records = await received(producer.address, "orders", 2)
    assert [(r.seq, r.value) for r in records] == [(1, b"async session"), (2, b"async connection")]


async def test_a_served_producer_notices_commits_without_polling(producer_db: str) -> None:
    """With the periodic check an hour apart, only the WAL watch can tell the producer."""
    async with Producer(producer_db, watch_interval=3600) as producer:
        with app_connection(producer_db) as conn:
            for n in range(1, 4):
                with conn:
                    streamq.publish(conn, "orders", b"%d" % n)
                await wait_for(lambda n=n: head(producer, "orders") == n, 10)


async def test_the_producer_continues_after_other_connections_seqs(producer_db: str) -> None:
    """The producer's own transactions and the application's, interleaved: one dense log,
    no ConcurrentWriterError (the producer's head is checked under the write lock)."""
    async with Producer(producer_db, watch_interval=3600) as producer:
        with app_connection(producer_db) as conn:
            for n in range(5):
                await producer.publish("orders", b"producer %d" % n)
                with conn:
                    streamq.publish(conn, "orders", b"app %d" % n)
        assert await producer.run_in_transaction(lambda tx: tx.publish("orders", b"fn")) == 11
        records = await received(producer.address, "orders", 11)
    assert [r.seq for r in records] == list(range(1, 12))
    assert [r.value for r in records][:4] == [b"producer 0", b"app 0", b"producer 1", b"app 1"]
