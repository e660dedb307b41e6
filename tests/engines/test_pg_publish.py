"""``streamq.publish`` into PostgreSQL through the application's own psycopg connection,
SQLAlchemy session or asyncio connection, against a real server (``tests/pgserver.py``):
the record commits or rolls back with the business row, unnumbered (a ``Receipt``); once
numbered (``number_all`` here, as the serving producer does), committed records get dense
seqs, each once, and many processes' records keep real-time order
(``streamq/engines/postgres/``)."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import os
import select
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import streamq
from streamq.engines.postgres.append import run
from streamq.engines.postgres.numbering import SNAPSHOT, TAKE, Window, number_all, number_steps
from streamq.protocol import decode_record

from ..conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
ORDERS = "CREATE TABLE orders (worker text NOT NULL, n integer NOT NULL)"


@pytest.fixture
def db(pg_url: str) -> str:
    """A database with the log tables and an orders table."""
    with psycopg.connect(pg_url) as conn:
        streamq.create_tables(conn)
        conn.execute(ORDERS)
    return pg_url


@pytest.fixture(params=["table", "wal"])
def either_path_db(request: pytest.FixtureRequest) -> str:
    """``db`` on a server whose serving producer publishes through the pending table
    (``wal_level = replica``), or through the WAL (``logical``: walpath.py)."""
    url: str = request.getfixturevalue("pg_url" if request.param == "table" else "capture_url")
    with psycopg.connect(url) as conn:
        streamq.create_tables(conn)
        conn.execute(ORDERS)
    return url


def log(url: str, stream: str = "orders") -> list[streamq.Record]:
    """The stream's numbered records, in seq order, as a new connection sees them."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT l.record FROM streamq_log l JOIN streamq_streams s ON s.id = l.stream_id "
            "WHERE s.name = %s ORDER BY l.seq",
            (stream,),
        ).fetchall()
    return [decode_record(record) for (record,) in rows]


def pending(url: str) -> list[bytes]:
    """The values of the committed records not numbered yet, in numbering order."""
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT record FROM streamq_pending ORDER BY xid, id").fetchall()
    return [decode_record(record).value for (record,) in rows]


def number(url: str) -> int:
    """What the serving producer does, at once: number every committed pending record.
    How many it numbered."""
    with psycopg.connect(url, autocommit=True) as conn:
        return number_all(conn)


def epochs(url: str) -> list[tuple[int, int]]:
    """The segments: (first seq, epoch), in seq order."""
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT first_seq, epoch FROM streamq_epochs ORDER BY 1").fetchall()
    return [(int(first), int(epoch)) for first, epoch in rows]


def epoch_state(url: str) -> tuple[int, list[int]]:
    """The database's epoch (streamq_meta) and what this server life took (streamq_boot)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT value FROM streamq_meta WHERE key = 'epoch'").fetchone()
        boot = conn.execute("SELECT epoch FROM streamq_boot").fetchall()
    assert row is not None
    return int(row[0]), [int(epoch) for (epoch,) in boot]


def current_xid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
    assert row is not None
    return int(str(row[0]))


def publish_committed(url: str, value: bytes) -> streamq.Receipt:
    """``streamq.publish`` on a connection of its own, committed."""
    with psycopg.connect(url) as conn:
        receipt = streamq.publish(conn, "orders", value)
        conn.commit()
    assert isinstance(receipt, streamq.Receipt)
    return receipt


def sqlalchemy_url(url: str, driver: str = "psycopg") -> str:
    return url.replace("postgresql://", f"postgresql+{driver}://")


def test_publish_commits_with_the_business_row_and_a_rollback_publishes_nothing(
    db: str,
) -> None:
    """The writer numbers nothing and takes no epoch: its committed records wait in
    ``streamq_pending``, a rolled-back transaction's are gone; numbering gives the
    committed ones dense seqs from 1, each once, under the epoch the first numbering took."""
    with psycopg.connect(db) as conn:  # not autocommit: the first statement begins
        conn.execute("INSERT INTO orders VALUES ('a', 1)")
        first = streamq.publish(conn, "orders", b"a1", key=b"a", headers={"type": b"new"})
        assert isinstance(first, streamq.Receipt)
        assert first == streamq.Receipt("orders", current_xid(conn), first.id, 1)
        conn.commit()
        conn.execute("INSERT INTO orders VALUES ('b', 2)")
        rolled_back = streamq.publish(conn, "orders", b"rolled back")
        assert isinstance(rolled_back, streamq.Receipt) and rolled_back.xid > first.xid
        conn.rollback()
        many = streamq.publish_many(conn, "orders", [b"c3", b"c4"])
        assert isinstance(many, streamq.Receipt)
        assert (many.stream, many.count) == ("orders", 2) and many.xid > rolled_back.xid
        conn.execute("INSERT INTO orders VALUES ('c', 3)")
        conn.commit()
        assert conn.execute("SELECT worker FROM orders ORDER BY n").fetchall() == [("a",), ("c",)]
    # Committed, not numbered: nothing in the log, no epoch taken, the rollback left nothing.
    assert log(db) == [] and epochs(db) == [] and epoch_state(db) == (0, [])
    assert pending(db) == [b"a1", b"c3", b"c4"]
    assert number(db) == 3
    assert number(db) == 0  # each record numbered once
    assert pending(db) == []
    assert [(r.seq, r.value, r.key, r.headers) for r in log(db)] == [
        (1, b"a1", b"a", {"type": b"new"}),
        (2, b"c3", None, {}),
        (3, b"c4", None, {}),
    ]
    # One segment, under the epoch the first numbering took: on WAL timeline 1, the
    # server's time in milliseconds above 1 << 42.
    ((first_seq, epoch),) = epochs(db)
    assert first_seq == 1 and 1 << 42 < epoch < 2 << 42
    assert epoch_state(db) == (epoch, [epoch])


def test_autocommit_connection_needs_a_transaction(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        with pytest.raises(streamq.NotInTransactionError, match="autocommit"):
            streamq.publish(conn, "orders", b"alone")
        with conn.transaction():
            receipt = streamq.publish(conn, "orders", b"in a transaction")
            assert isinstance(receipt, streamq.Receipt) and receipt.xid == current_xid(conn)
    assert number(db) == 1  # the refused publish wrote nothing
    assert [(r.seq, r.value) for r in log(db)] == [(1, b"in a transaction")]


def test_missing_tables_name_the_database(pg_url: str) -> None:
    missing = pytest.raises(streamq.SchemaMissingError, match=r"'test_\d+'.*create_tables")
    with psycopg.connect(pg_url) as conn, missing:
        streamq.publish(conn, "orders", b"x")


@pytest.mark.parametrize(
    "level",
    [psycopg.IsolationLevel.REPEATABLE_READ, psycopg.IsolationLevel.SERIALIZABLE],
    ids=["repeatable_read", "serializable"],
)
def test_any_isolation_level_publishes(db: str, level: psycopg.IsolationLevel) -> None:
    """REPEATABLE READ used to be refused: publishing read the stream's head, and an older
    snapshot would not have seen the previous publisher's commit. Now the writer reads
    nothing: A, whose snapshot predates B's commit, publishes after it, and numbering
    gives A's record the seq after B's, none twice."""
    with psycopg.connect(db) as a, psycopg.connect(db) as b:
        a.isolation_level = level
        assert a.execute("SELECT count(*) FROM orders").fetchone() == (0,)  # A's snapshot
        b.execute("INSERT INTO orders VALUES ('b', 1)")
        streamq.publish(b, "orders", b"b")
        b.commit()
        assert a.execute("SELECT count(*) FROM orders").fetchone() == (0,)  # B is not seen
        a.execute("INSERT INTO orders VALUES ('a', 2)")
        receipt = streamq.publish(a, "orders", b"a")
        assert isinstance(receipt, streamq.Receipt) and receipt.count == 1
        a.commit()
    assert number(db) == 2
    assert [(r.seq, r.value) for r in log(db)] == [(1, b"b"), (2, b"a")]


def test_sqlalchemy_session_and_connection(db: str) -> None:
    engine = create_engine(sqlalchemy_url(db))
    receipts = []
    try:
        with Session(engine) as session, session.begin():
            session.execute(text("INSERT INTO orders VALUES ('s', 1)"))
            receipts.append(streamq.publish(session, "orders", b"from a session"))
        with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
            receipts.append(streamq.publish(session, "orders", b"rolled back"))
            raise RuntimeError("the request failed")
        with engine.begin() as connection:
            receipts.append(streamq.publish(connection, "orders", b"from a connection"))
    finally:
        engine.dispose()
    assert all(isinstance(r, streamq.Receipt) and r.count == 1 for r in receipts), receipts
    assert pending(db) == [b"from a session", b"from a connection"]
    assert number(db) == 2
    assert [(r.seq, r.value) for r in log(db)] == [
        (1, b"from a session"),
        (2, b"from a connection"),
    ]


async def test_publish_async_on_psycopg_and_sqlalchemy(db: str) -> None:
    async with await psycopg.AsyncConnection.connect(db) as conn:
        await conn.execute("INSERT INTO orders VALUES ('a', 1)")
        receipt = await streamq.publish_async(conn, "orders", b"async psycopg")
        cursor = await conn.execute("SELECT pg_current_xact_id()::text::bigint")
        row = await cursor.fetchone()
        assert isinstance(receipt, streamq.Receipt) and row is not None
        assert receipt == streamq.Receipt("orders", int(row[0]), receipt.id, 1)
        await conn.commit()
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        with pytest.raises(streamq.NotInTransactionError):
            await streamq.publish_async(conn, "orders", b"alone")
    engine = create_async_engine(sqlalchemy_url(db))
    try:
        async with AsyncSession(engine) as session, session.begin():
            receipt = await streamq.publish_async(session, "orders", b"async session")
            assert isinstance(receipt, streamq.Receipt) and receipt.count == 1
    finally:
        await engine.dispose()
    assert await asyncio.to_thread(number, db) == 2
    assert [(r.seq, r.value) for r in log(db)] == [(1, b"async psycopg"), (2, b"async session")]


def test_first_numbering_after_a_crash_takes_a_new_epoch(db: str) -> None:
    """Crash recovery empties the unlogged streamq_boot (so does a promotion): the first
    numbering round after it takes a new epoch (not the first writer, which reads
    nothing), and the records it numbers start a new segment; later rounds of the same
    server life keep it."""
    publish_committed(db, b"before")
    assert number(db) == 1
    ((_, before),) = epochs(db)
    with psycopg.connect(db) as conn:
        conn.execute("TRUNCATE streamq_boot")  # what crash recovery does to it
        conn.commit()
        streamq.publish(conn, "orders", b"after")
        conn.commit()
    assert epoch_state(db) == (before, [])  # the writer took none
    assert number(db) == 1
    publish_committed(db, b"same life")
    assert number(db) == 1
    ((first, seen_before), (second, after)) = epochs(db)
    assert (first, second) == (1, 2) and seen_before == before
    assert 1 << 42 < before < after < 2 << 42
    assert epoch_state(db) == (after, [after])
    assert [(r.seq, r.value) for r in log(db)] == [(1, b"before"), (2, b"after"), (3, b"same life")]


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_publisher_does_not_wait_for_an_uncommitted_one(db: str, outcome: str) -> None:
    """It used to: A held the stream's lock from its publish to its end, and B's publish
    waited for it. Now publishing takes no lock: B publishes and commits while A is open
    (its session would give up within seconds if it waited), and B's record is numbered
    then, though A's transaction is the older one; A's is numbered once A commits, after
    B's (a rollback leaves nothing). So a reader still never sees a seq commit before a
    lower one, and no seq is ever reused: seqs go only to committed records, after the
    head."""
    with (
        psycopg.connect(db) as a,
        psycopg.connect(db) as b,
        psycopg.connect(db, autocommit=True) as numbering,
    ):
        streamq.publish(a, "orders", b"first")  # creates the stream
        a.commit()
        assert number_all(numbering) == 1
        b.execute("SET statement_timeout = '10s'")  # a publish or commit that waited fails
        b.commit()
        a.execute("INSERT INTO orders VALUES ('a', 2)")
        receipt_a = streamq.publish(a, "orders", b"a")  # A is open, uncommitted
        b.execute("INSERT INTO orders VALUES ('b', 3)")
        receipt_b = streamq.publish(b, "orders", b"b")
        b.commit()
        assert isinstance(receipt_a, streamq.Receipt) and isinstance(receipt_b, streamq.Receipt)
        assert receipt_a.xid < receipt_b.xid
        assert number_all(numbering) == 1  # B's, while A is open
        assert [(r.seq, r.value) for r in log(db)] == [(1, b"first"), (2, b"b")]
        a.commit() if outcome == "commit" else a.rollback()
        assert number_all(numbering) == (1 if outcome == "commit" else 0)
    expected = [(1, b"first"), (2, b"b")]
    if outcome == "commit":
        expected.append((3, b"a"))
    assert [(r.seq, r.value) for r in log(db)] == expected
    assert pending(db) == []


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


def read_times(path: Path) -> dict[int, tuple[int, int]]:
    """A writer's ``--times`` file: order number -> (started, ended), in nanoseconds."""
    times = {}
    for line in path.read_text().splitlines():
        n, started, ended = map(int, line.split())
        times[n] = (started, ended)
    return times


async def test_eight_writer_processes_get_dense_seqs_in_real_time_order(
    either_path_db: str, processes: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """Eight processes commit 300 orders each with their records, all at once, while a
    serving producer numbers what commits, round after round. (The seqs used to be taken
    under the stream's lock, so they were in commit order; now they are given after the
    commit.) Once numbered: seqs dense, each committed order's record once, each writer's
    records in its own order, and real-time order: a transaction that committed before
    another began has the lower seq, for every such pair (from the times each writer
    noted, on the machine's one monotonic clock)."""
    db = either_path_db
    per_writer = 300
    total = per_writer * len(VIAS)
    names = [f"w{i}" for i in range(len(VIAS))]
    with psycopg.connect(db) as conn:
        (wal_level,) = conn.execute("SHOW wal_level").fetchone() or ("",)
    async with streamq.Producer(db) as producer:
        numberer = producer.numberer
        assert numberer is not None
        await wait_for(lambda: numberer.status()["path"] != "starting", what="a path chosen")
        assert numberer.status()["path"] == ("wal" if wal_level == "logical" else "table")
        for name, via in zip(names, VIAS, strict=True):
            processes.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "tests.writers.pg_worker", db, name),
                        *("--via", via, "--transactions", str(per_writer)),
                        *("--times", str(tmp_path / f"{name}.times")),
                    ],
                    cwd=ROOT,
                    env=dict(os.environ, PYTHONPATH=str(ROOT)),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        for process in processes:
            line = await asyncio.to_thread(read_line, process, 60)
            assert line == b"READY\n", line
        rounds_before = numberer.rounds
        for process in processes:  # all at once: their transactions overlap
            assert process.stdin is not None
            process.stdin.write(b"go\n")
            process.stdin.flush()
        finished = await asyncio.gather(
            *(asyncio.to_thread(process.communicate, timeout=240) for process in processes)
        )
        rounds_while_writing = numberer.rounds - rounds_before
        for process, (output, _) in zip(processes, finished, strict=True):
            assert process.returncode == 0, output.decode()
            assert f"DONE committed={per_writer} refused=0" in output.decode(), output.decode()
        await wait_for(
            lambda: "orders" in producer.log.streams and producer.head("orders") >= total,
            timeout=60,
            what="every record served",
        )
        assert producer.head("orders") == total
        epoch = producer.epoch
    # Numbered as they committed, not all at the end: each round took what had committed.
    assert rounds_while_writing > 10, f"{rounds_while_writing} rounds: nothing was tested"
    assert pending(db) == []
    assert epochs(db) == [(1, epoch)]  # one segment, the serving producer's
    records = log(db)
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

    # Real-time order. Each transaction as (ended, started, seq, order), sorted by end; for
    # each one, the highest seq of those that ended before it started must be lower.
    seqs = {r.value: r.seq for r in records}
    transactions = sorted(
        (ended, started, seqs[b"%s:%d" % (name.encode(), n)], f"{name}:{n}")
        for name in names
        for n, (started, ended) in read_times(tmp_path / f"{name}.times").items()
    )
    assert len(transactions) == total
    ends = [ended for ended, _, _, _ in transactions]
    highest = list(accumulate((seq for _, _, seq, _ in transactions), max))
    before_it = 0  # (earlier, later) pairs checked, of two writers
    violations = []
    for _, started, seq, order in transactions:
        ended_before = bisect.bisect_left(ends, started)  # those with ended < started
        if ended_before and highest[ended_before - 1] > seq:
            earlier = next(t for t in transactions[:ended_before] if t[2] > seq)
            violations.append(
                f"{earlier[3]} (seq {earlier[2]}) committed before {order} (seq {seq}) began"
            )
        before_it += ended_before
    assert not violations, f"{len(violations)} out of real-time order, e.g. {violations[:5]}"
    same_writer = len(names) * per_writer * (per_writer - 1) // 2  # sequential in each
    assert before_it - same_writer > total, "no two writers' transactions were ordered in time"


def test_a_round_takes_whole_transactions(db: str) -> None:
    """A round limited to fewer rows than a transaction holds takes that transaction
    whole: an older transaction committing before the next round cannot land between
    its records, which keep consecutive seqs."""
    with (
        psycopg.connect(db) as old,
        psycopg.connect(db) as big,
        psycopg.connect(db, autocommit=True) as numbering,
    ):
        streamq.publish(old, "orders", b"old")  # the older transaction, still open
        streamq.publish_many(big, "orders", [b"big %d" % n for n in range(5)])
        big.commit()
        with numbering.transaction():
            first = run(numbering, number_steps(limit=3))
        assert [len(s.records) for s in first.streams] == [5]
        old.commit()
        assert number_all(numbering) == 1
    assert [(r.seq, r.value) for r in log(db)] == [
        *((n + 1, b"big %d" % n) for n in range(5)),
        (6, b"old"),
    ]


def _round(conn: Any, window: Window, limit: int) -> tuple[Any, Window]:
    """One round as the numberer runs it: the snapshot read before TAKE gives the next
    window."""
    with conn.transaction():
        snapshot = conn.execute(SNAPSHOT).fetchone()
        done = run(conn, number_steps(limit=limit, window=window))
    return done, Window.after(snapshot, done, limit)


def test_rounds_in_their_window_miss_nothing(db: str) -> None:
    """Rounds that look only where pending rows can still be (``Window``): transactions
    open across rounds, older and younger than those taken, and rounds cut by their
    limit, are all numbered, each once, in commit order."""
    with (
        psycopg.connect(db) as older,
        psycopg.connect(db) as younger,
        psycopg.connect(db) as writer,
        psycopg.connect(db, autocommit=True) as numbering,
    ):
        streamq.publish(older, "orders", b"older")  # open across the rounds below
        for n in range(4):
            streamq.publish(writer, "orders", b"w%d" % n)
            writer.commit()
        window = Window()
        done, window = _round(numbering, window, limit=2)  # cut: w0, w1
        assert [len(s.records) for s in done.streams] == [2]
        streamq.publish(younger, "orders", b"younger")  # begun after that snapshot
        done, window = _round(numbering, window, limit=2)  # w2, w3
        assert older.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        older.commit()
        done, window = _round(numbering, window, limit=10)  # older
        younger.commit()
        streamq.publish(writer, "orders", b"last")
        writer.commit()
        done, window = _round(numbering, window, limit=10)  # younger, last
        assert _round(numbering, window, limit=10)[0] is None
        assert pending(db) == []
    assert [r.value for r in log(db)] == [b"w0", b"w1", b"w2", b"w3", b"older", b"younger", b"last"]
    assert [r.seq for r in log(db)] == list(range(1, 8))


def test_rounds_skip_rows_taken_while_an_old_snapshot_is_held(db: str) -> None:
    """Rows taken stay in the table and its index while a snapshot older than them is
    held (vacuum may not remove them): a round in its window does not read them again,
    where a round over the whole index reads their pages (PostgreSQL's count of buffers
    the round's TAKE touched)."""
    with (
        psycopg.connect(db, autocommit=True) as held,
        psycopg.connect(db) as writer,
        psycopg.connect(db, autocommit=True) as numbering,
    ):
        held.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        held.execute("SELECT 1")  # its snapshot, older than every row below
        window = Window()
        for batch in range(20):
            streamq.publish_many(writer, "orders", [b"%d" % batch] * 1000)
            writer.commit()
            done, window = _round(numbering, window, limit=10_000)
            assert done is not None
        streamq.publish(writer, "orders", b"one more")
        writer.commit()
        numbering.execute("ANALYZE streamq_pending")  # as autovacuum would have

        def buffers_touched(round_window: Window) -> int:
            with numbering.transaction():
                (plan,) = numbering.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + TAKE, round_window.params(10)
                ).fetchone()
                raise psycopg.Rollback  # the same round again, over the whole index
            assert plan[0]["Plan"]["Actual Rows"] == 1  # "one more"
            return int(plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"]["Shared Read Blocks"])

        in_window, everywhere = buffers_touched(window), buffers_touched(Window())
        held.execute("ROLLBACK")
    assert in_window < 30
    assert everywhere > 5 * in_window, (in_window, everywhere)
