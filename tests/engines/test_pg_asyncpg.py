"""asyncpg as the application's connection, against a real server: ``publish_async``,
``publish_many_async`` and ``create_tables_async`` on a raw asyncpg connection and a
pool's, SQLAlchemy's ``postgresql+asyncpg`` sessions and connections, ``run_sync`` and an
Alembic migration of Alembic's async template. The record commits or rolls back with the
business row, on both publish paths (``either_path_db``: the pending table, the WAL)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import asyncpg
import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import streamq

from .test_pg_publish import (
    ORDERS,
    db,
    either_path_db,
    log,
    number,
    sqlalchemy_url,
)

__all__ = ["db", "either_path_db"]  # fixtures, used by name


def tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class WHERE relkind = 'r' "
            "AND relnamespace = 'public'::regnamespace"
        ).fetchall()
    return {name for (name,) in rows}


async def numbered(url: str) -> list[bytes]:
    """Number what committed, as the serving producer does; the stream's values."""
    await asyncio.to_thread(number, url)
    return [record.value for record in log(url)]


async def test_raw_connection_publishes_in_its_transaction(either_path_db: str) -> None:
    conn = await asyncpg.connect(either_path_db)
    try:
        async with conn.transaction():
            await conn.execute("INSERT INTO orders VALUES ('a', 1)")
            first = await streamq.publish_async(conn, "orders", b"a1", key=b"a")
            xid = await conn.fetchval("SELECT pg_current_xact_id()::text::bigint")
        assert isinstance(first, streamq.Receipt)
        assert (first.stream, first.xid, first.count) == ("orders", xid, 1)
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await conn.execute("INSERT INTO orders VALUES ('b', 2)")
                await streamq.publish_async(conn, "orders", b"rolled back")
                raise RuntimeError("the request failed")
        async with conn.transaction():
            many = await streamq.publish_many_async(conn, "orders", [b"c3", b"c4", b"c5"])
            assert isinstance(many, streamq.Receipt) and many.count == 3
        assert await conn.fetch("SELECT worker FROM orders") == [("a",)]
    finally:
        await conn.close()
    assert await numbered(either_path_db) == [b"a1", b"c3", b"c4", b"c5"]
    assert log(either_path_db)[0].key == b"a"


async def test_a_pool_connection_publishes(db: str) -> None:
    async with asyncpg.create_pool(db, min_size=1, max_size=2) as pool:
        for n in range(3):  # the same connection again: what it cached still holds
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("INSERT INTO orders VALUES ('p', $1)", n)
                receipt = await streamq.publish_async(conn, "orders", b"p%d" % n)
                assert isinstance(receipt, streamq.Receipt)
    assert await numbered(db) == [b"p0", b"p1", b"p2"]


async def test_outside_a_transaction_is_refused_and_writes_nothing(db: str) -> None:
    conn = await asyncpg.connect(db)
    try:
        with pytest.raises(streamq.NotInTransactionError, match=r"async with conn\.transaction"):
            await streamq.publish_async(conn, "orders", b"alone")
        with pytest.raises(streamq.UnsupportedConnectionError, match="publish_async"):
            streamq.publish(conn, "orders", b"blocking call")
        with pytest.raises(streamq.UnsupportedConnectionError, match="create_tables_async"):
            streamq.create_tables(conn)
    finally:
        await conn.close()
    assert await numbered(db) == []


async def test_create_tables_async_then_publish(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        with pytest.raises(streamq.SchemaMissingError, match=r"'test_\d+' on 127\.0\.0\.1:\d+"):
            async with conn.transaction():
                await streamq.publish_async(conn, "orders", b"no tables yet")
        async with conn.transaction():
            await streamq.create_tables_async(conn)
            await conn.execute(ORDERS)
        async with conn.transaction():  # again: nothing to do, nothing lost
            await streamq.create_tables_async(conn)
            await streamq.publish_async(conn, "orders", b"after")
    finally:
        await conn.close()
    assert {"streamq_log", "streamq_pending", "streamq_meta"} <= tables(pg_url)
    assert await numbered(pg_url) == [b"after"]


async def test_sqlalchemy_asyncpg_session_and_connection(either_path_db: str) -> None:
    """Publishing first in a session's transaction: SQLAlchemy's asyncpg adapter begins
    the database transaction lazily, and the record must still be inside it (the
    rollback takes it too)."""
    engine = create_async_engine(sqlalchemy_url(either_path_db, "asyncpg"))
    try:
        async with AsyncSession(engine) as session, session.begin():
            receipt = await streamq.publish_async(session, "orders", b"session")
            await session.execute(text("INSERT INTO orders VALUES ('s', 1)"))
            assert isinstance(receipt, streamq.Receipt)
        with pytest.raises(RuntimeError):
            async with AsyncSession(engine) as session, session.begin():
                await streamq.publish_async(session, "orders", b"rolled back")
                raise RuntimeError("the request failed")
        async with engine.begin() as connection:
            await streamq.publish_many_async(connection, "orders", [b"c1", b"c2"])
        async with engine.connect() as connection:  # no begin(): autobegin, as SQLAlchemy's
            await streamq.publish_async(connection, "orders", b"autobegun")
            await connection.commit()
        auto = engine.execution_options(isolation_level="AUTOCOMMIT")
        async with auto.connect() as connection:
            with pytest.raises(streamq.NotInTransactionError):
                await streamq.publish_async(connection, "orders", b"autocommit")
    finally:
        await engine.dispose()
    assert await numbered(either_path_db) == [b"session", b"c1", b"c2", b"autobegun"]


async def test_run_sync_creates_tables_and_publishes(pg_url: str) -> None:
    """SQLAlchemy's blocking face of an asyncpg connection (``run_sync``, which Alembic's
    async template runs migrations in) takes the blocking calls."""
    engine = create_async_engine(sqlalchemy_url(pg_url, "asyncpg"))
    try:
        async with engine.begin() as connection:
            await connection.run_sync(streamq.create_tables)
            await connection.exec_driver_sql(ORDERS)
        async with engine.begin() as connection:
            receipt = await connection.run_sync(streamq.publish, "orders", b"via run_sync")
            assert isinstance(receipt, streamq.Receipt) and receipt.count == 1
    finally:
        await engine.dispose()
    assert await numbered(pg_url) == [b"via run_sync"]


def test_alembic_async_template_migration_creates_the_tables(pg_url: str, tmp_path: Path) -> None:
    """``alembic init -t async``, one migration calling ``streamq.create_tables`` with
    ``op.get_bind()``, ``alembic upgrade head`` on ``postgresql+asyncpg://``: the
    business table and the log tables commit in the migration's transaction."""
    alembic = [sys.executable, "-m", "alembic"]
    subprocess.run([*alembic, "init", "-t", "async", "migrations"], cwd=tmp_path, check=True)
    versions = tmp_path / "migrations" / "versions"
    (versions / "0001_streamq.py").write_text(
        textwrap.dedent(
            '''
            """The log tables, in the same migration as the business tables."""
            from alembic import op

            import streamq

            revision = "0001"
            down_revision = None


            def upgrade() -> None:
                op.execute("CREATE TABLE orders (id integer PRIMARY KEY)")
                streamq.create_tables(op.get_bind())


            def downgrade() -> None:
                op.execute("DROP TABLE orders")
            '''
        )
    )
    ini = tmp_path / "alembic.ini"
    url = sqlalchemy_url(pg_url, "asyncpg")
    ini.write_text(
        ini.read_text().replace(
            "sqlalchemy.url = driver://user:pass@localhost/dbname", f"sqlalchemy.url = {url}"
        )
    )
    env = {**os.environ, "PYTHONPATH": str(Path(streamq.__file__).parents[1])}
    done = subprocess.run(
        [*alembic, "upgrade", "head"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert {"orders", "streamq_log", "streamq_pending", "alembic_version"} <= tables(pg_url)
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == ("0001",)
