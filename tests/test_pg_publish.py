"""``streamq.publish`` into PostgreSQL through the application's own psycopg connection,
SQLAlchemy session or asyncio connection, against a real server (``tests/pgserver.py``):
the record commits or rolls back with the business row, and concurrent writers from
many processes get dense seqs in commit order (``streamq/engines/postgres/``)."""

from __future__ import annotations

import itertools
import os
import select
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import streamq
from streamq.protocol import decode_record

from .waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
ORDERS = "CREATE TABLE orders (worker text NOT NULL, n integer NOT NULL)"


@pytest.fixture
def db(pg_url: str) -> str:
    """A database with the log tables and an orders table."""
    with psycopg.connect(pg_url) as conn:
        streamq.create_tables(conn)
        conn.execute(ORDERS)
    return pg_url


def log(url: str, stream: str = "orders") -> list[streamq.Record]:
    """The stream's committed records, in seq order, as a new connection sees them."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT l.record FROM streamq_log l JOIN streamq_streams s ON s.id = l.stream_id "
            "WHERE s.name = %s ORDER BY l.seq",
            (stream,),
        ).fetchall()
    return [decode_record(record) for (record,) in rows]


def sqlalchemy_url(url: str, driver: str = "psycopg") -> str:
    return url.replace("postgresql://", f"postgresql+{driver}://")


def test_publish_commits_with_the_business_row_and_a_rollback_publishes_nothing(
    db: str,
) -> None:
    with psycopg.connect(db) as conn:  # not autocommit: the first statement begins
        conn.execute("INSERT INTO orders VALUES ('a', 1)")
        seq = streamq.publish(conn, "orders", b"a1", key=b"a", headers={"type": b"new"})
        assert seq == 1
        conn.commit()
        conn.execute("INSERT INTO orders VALUES ('b', 2)")
        assert streamq.publish(conn, "orders", b"rolled back") == 2
        conn.rollback()
        assert streamq.publish_many(conn, "orders", [b"c3", b"c4"]) == range(2, 4)  # reused
        conn.execute("INSERT INTO orders VALUES ('c', 3)")
        conn.commit()
        assert conn.execute("SELECT worker FROM orders ORDER BY n").fetchall() == [("a",), ("c",)]
        epochs = conn.execute("SELECT first_seq, epoch FROM streamq_epochs").fetchall()
    assert [(r.seq, r.value, r.key, r.headers) for r in log(db)] == [
        (1, b"a1", b"a", {"type": b"new"}),
        (2, b"c3", None, {}),
        (3, b"c4", None, {}),
    ]
    # One segment, under the epoch the first writer took: on WAL timeline 1, the server's
    # time in milliseconds above 1 << 42.
    ((first, epoch),) = epochs
    assert first == 1 and 1 << 42 < epoch < 2 << 42


def test_autocommit_connection_needs_a_transaction(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        with pytest.raises(streamq.NotInTransactionError, match="autocommit"):
            streamq.publish(conn, "orders", b"alone")
        with conn.transaction():
            assert streamq.publish(conn, "orders", b"in a transaction") == 1
    assert [r.value for r in log(db)] == [b"in a transaction"]


def test_missing_tables_name_the_database(pg_url: str) -> None:
    missing = pytest.raises(streamq.SchemaMissingError, match=r"'test_\d+'.*create_tables")
    with psycopg.connect(pg_url) as conn, missing:
        streamq.publish(conn, "orders", b"x")


def test_repeatable_read_is_refused(db: str) -> None:
    """Its snapshot would not see the previous publisher's commit."""
    with psycopg.connect(db) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with pytest.raises(streamq.UnsupportedConnectionError, match="READ COMMITTED"):
            streamq.publish(conn, "orders", b"x")


def test_sqlalchemy_session_and_connection(db: str) -> None:
    engine = create_engine(sqlalchemy_url(db))
    try:
        with Session(engine) as session, session.begin():
            session.execute(text("INSERT INTO orders VALUES ('s', 1)"))
            assert streamq.publish(session, "orders", b"from a session") == 1
        with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
            assert streamq.publish(session, "orders", b"rolled back") == 2
            raise RuntimeError("the request failed")
        with engine.begin() as connection:
            assert streamq.publish(connection, "orders", b"from a connection") == 2
    finally:
        engine.dispose()
    assert [r.value for r in log(db)] == [b"from a session", b"from a connection"]


async def test_publish_async_on_psycopg_and_sqlalchemy(db: str) -> None:
    async with await psycopg.AsyncConnection.connect(db) as conn:
        await conn.execute("INSERT INTO orders VALUES ('a', 1)")
        assert await streamq.publish_async(conn, "orders", b"async psycopg") == 1
        await conn.commit()
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        with pytest.raises(streamq.NotInTransactionError):
            await streamq.publish_async(conn, "orders", b"alone")
    engine = create_async_engine(sqlalchemy_url(db))
    try:
        async with AsyncSession(engine) as session, session.begin():
            assert await streamq.publish_async(session, "orders", b"async session") == 2
    finally:
        await engine.dispose()
    assert [r.value for r in log(db)] == [b"async psycopg", b"async session"]


def test_first_writer_after_a_crash_takes_a_new_epoch(db: str) -> None:
    """Crash recovery empties the unlogged streamq_boot (so does a promotion): the first
    writer after it takes a new epoch, and its records start a new segment."""
    with psycopg.connect(db) as conn:
        streamq.publish(conn, "orders", b"before")
        conn.commit()
        conn.execute("TRUNCATE streamq_boot")  # what crash recovery does to it
        conn.commit()
        assert streamq.publish(conn, "orders", b"after") == 2
        conn.commit()
        assert streamq.publish(conn, "orders", b"same life") == 3
        conn.commit()
        epochs = conn.execute("SELECT first_seq, epoch FROM streamq_epochs ORDER BY 1").fetchall()
        meta: dict[str, str] = dict(conn.execute("SELECT key, value FROM streamq_meta").fetchall())
    ((first, before), (second, after)) = epochs
    assert (first, second) == (1, 2) and 1 << 42 < before < after < 2 << 42
    assert meta["epoch"] == str(after)


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_publisher_waits_for_the_previous_ones_commit(db: str, outcome: str) -> None:
    """A holds the stream's lock from its publish to its end; B's publish waits for it,
    then numbers after A's commit (or reuses A's seq after its rollback): a reader can
    never see a seq commit before a lower one."""
    with (
        psycopg.connect(db) as a,
        psycopg.connect(db) as b,
        psycopg.connect(db, autocommit=True) as observer,
    ):
        streamq.publish(a, "orders", b"first")  # creates the stream
        a.commit()
        a.execute("INSERT INTO orders VALUES ('a', 2)")
        assert streamq.publish(a, "orders", b"a") == 2  # A holds the lock, uncommitted
        result: dict[str, Any] = {}
        done = threading.Event()

        def publish_b() -> None:
            try:
                b.execute("INSERT INTO orders VALUES ('b', 3)")
                result["seq"] = streamq.publish(b, "orders", b"b")
                b.commit()
            except BaseException as exc:
                result["error"] = exc
            finally:
                done.set()

        thread = threading.Thread(target=publish_b)
        thread.start()
        try:

            def b_waits_for_a() -> bool:
                row = observer.execute(
                    "SELECT %s = ANY(pg_blocking_pids(%s))",
                    (a.info.backend_pid, b.info.backend_pid),
                ).fetchone()
                return bool(row and row[0])

            wait_until(b_waits_for_a, "B to wait for A's lock")
            assert not done.is_set()
            assert [r.seq for r in log(db)] == [1]  # A's record is not visible yet
        finally:
            a.commit() if outcome == "commit" else a.rollback()
            assert done.wait(30), "B's publish did not finish after A ended"
            thread.join(30)
    assert "error" not in result, result.get("error")
    expected = [(1, b"first"), (2, b"a"), (3, b"b")]
    if outcome == "rollback":
        assert result["seq"] == 2  # A's seq, reused: no gap
        expected = [(1, b"first"), (2, b"b")]
    else:
        assert result["seq"] == 3
    assert [(r.seq, r.value) for r in log(db)] == expected


# --- many processes at once ------------------------------------------------------------

VIAS = ("psycopg", "autocommit", "sqlalchemy") * 2 + ("psycopg", "psycopg")


def read_line(process: subprocess.Popen[bytes], timeout: float) -> bytes:
    """The process's next line of output, or a failure after ``timeout`` seconds."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output from {process.args!r} in {timeout} s"
    return process.stdout.readline()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes the test starts: killed at the end if still running."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


def test_eight_writer_processes_get_dense_seqs_in_commit_order(
    db: str, processes: list[subprocess.Popen[bytes]]
) -> None:
    per_writer = 300
    names = [f"w{i}" for i in range(len(VIAS))]
    for name, via in zip(names, VIAS, strict=True):
        processes.append(
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.writers.pg_worker", db, name),
                    *("--via", via, "--transactions", str(per_writer)),
                ],
                cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    for process in processes:
        line = read_line(process, 60)
        assert line == b"READY\n", line
    for process in processes:  # all at once: their transactions overlap
        assert process.stdin is not None
        process.stdin.write(b"go\n")
        process.stdin.flush()
    outputs = [process.communicate(timeout=240)[0].decode() for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output
        assert f"DONE committed={per_writer} refused=0" in output, output
    records = log(db)
    total = per_writer * len(VIAS)
    assert [r.seq for r in records] == list(range(1, total + 1))  # dense, none twice
    with psycopg.connect(db) as conn:
        orders = [f"{w}:{n}".encode() for w, n in conn.execute("SELECT worker, n FROM orders")]
    assert len(orders) == total
    assert Counter(r.value for r in records) == Counter(orders)  # each committed order once
    runs = sum(1 for a, b in itertools.pairwise(records) if a.key != b.key)
    assert runs > 10, "the writers did not overlap: nothing was tested"
    for name in names:  # each writer's records in its own order
        mine = [int(r.value.split(b":")[1]) for r in records if r.key == name.encode()]
        assert mine == list(range(per_writer))
