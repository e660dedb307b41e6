"""A consumer whose database is PostgreSQL: positions and effects in one PostgreSQL
transaction, against a real server (``tests/pgserver.py``) and a real SQLite producer
serving on loopback.

The scenarios that do not depend on the engine run on both, SQLite and PostgreSQL (the
``target`` fixture), and must behave alike: resume after a restart with no duplicates
and no gaps, two consumers racing for one batch (one wins, the other gets
``OutOfOrderBatchError``), producers that lost or rewrote what was applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import streamq
from streamq import Batch, Consumer, FanInConsumer, Producer
from streamq.errors import (
    ConsumerPositionError,
    DatabaseOpenError,
    NotInTransactionError,
    OutOfOrderBatchError,
    ProducerChangedError,
    SchemaMissingError,
    SeqsReusedError,
    TransactionClosedError,
)

from ..conftest import wait_for
from ..producer.test_epochs import image_at, restore

ROOT = Path(__file__).resolve().parents[2]
EFFECTS = "CREATE TABLE credits (seq BIGINT PRIMARY KEY, value BYTEA NOT NULL)"


@dataclass
class Target:
    """The consumer's database, on one engine: what ``Consumer(db=...)`` takes, and the
    application's SQL in that engine's placeholders."""

    engine: str
    db: str

    def sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.engine == "postgres" else statement

    def query(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows as a new connection sees them (what is committed)."""
        if self.engine == "postgres":
            with psycopg.connect(self.db) as conn:
                return conn.execute(self.sql(statement), params or None).fetchall()
        with contextlib.closing(sqlite3.connect(self.db)) as db:
            return db.execute(statement, params).fetchall()

    def execute(self, statement: str) -> None:
        if self.engine == "postgres":
            with psycopg.connect(self.db) as conn:
                conn.execute(statement)
        else:
            with contextlib.closing(sqlite3.connect(self.db)) as db, db:
                db.execute(statement)

    def credits(self) -> list[int]:
        return [seq for (seq,) in self.query("SELECT seq FROM credits ORDER BY seq")]

    def positions(self) -> list[tuple[Any, ...]]:
        return self.query("SELECT consumer, seq, epoch, endpoint FROM streamq_positions")


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, consumer_db: str) -> Target:
    """The consumer's database with an effects table: a SQLite file, or a fresh
    PostgreSQL database."""
    if request.param == "postgres":
        result = Target("postgres", request.getfixturevalue("pg_url"))
    else:
        result = Target("sqlite", consumer_db)
    result.execute(EFFECTS)
    return result


@contextlib.asynccontextmanager
async def serving(producer_db: str) -> AsyncIterator[Producer]:
    """A producer serving on loopback, with an empty stream "orders" to subscribe to."""
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        yield producer


async def publish(producer: Producer, count: int) -> None:
    """``count`` records in one transaction: consumers get them as one batch."""
    async with producer.transaction() as tx:
        await tx.publish_many("orders", [b"order %d" % n for n in range(count)])


async def apply_transactions(consumer: Consumer, target: Target, until: int) -> list[int]:
    """Apply batches with ``transaction`` until seq ``until``; the seqs applied."""
    seen: list[int] = []
    insert = target.sql("INSERT INTO credits VALUES (?, ?)")
    async for batch in consumer:
        async with consumer.transaction(batch) as tx:
            await tx.executemany(insert, [(r.seq, r.value) for r in batch])
        seen += [r.seq for r in batch]
        if batch.last_seq >= until:
            break
    return seen


def insert_rows(tx: Any, batch: Batch, insert: str) -> int:
    """``Consumer.apply``'s function: blocking statements."""
    tx.executemany(insert, [(r.seq, r.value) for r in batch])
    return len(batch)


async def apply_blocking(consumer: Consumer, target: Target, until: int) -> list[int]:
    """Apply batches with ``apply`` until seq ``until``; the seqs applied."""
    seen: list[int] = []
    insert = target.sql("INSERT INTO credits VALUES (?, ?)")
    async for batch in consumer:
        assert await consumer.apply(batch, insert_rows, insert) == len(batch)
        seen += [r.seq for r in batch]
        if batch.last_seq >= until:
            break
    return seen


# --- both engines ----------------------------------------------------------------------


async def test_applies_exactly_once_and_resumes_after_restart(
    producer_db: str, target: Target
) -> None:
    insert = target.sql("INSERT INTO credits VALUES (?, ?)")
    async with Producer(producer_db) as producer:
        await publish(producer, 20)
        async with Consumer(producer.address, "orders", db=target.db, name="ledger") as first:
            assert await apply_transactions(first, target, 20) == list(range(1, 21))
        # A restart resumes from the stored position, with the blocking twin this time.
        await publish(producer, 10)
        async with Consumer(producer.address, "orders", db=target.db, name="ledger") as again:
            batch = await anext(again)
            assert (batch.after, batch.last_seq) == (20, 30)
            assert await again.apply(batch, insert_rows, insert) == 10
            await publish(producer, 20)
            assert await apply_blocking(again, target, 50) == list(range(31, 51))
            await publish(producer, 5)
            assert await apply_transactions(again, target, 55) == list(range(51, 56))
            async with asyncio.timeout(10):  # each commit is acknowledged to the producer
                assert await producer.wait_applied("ledger", "orders", 55) == 55
    assert target.credits() == list(range(1, 56))  # no duplicate, no gap
    assert target.positions() == [("ledger", 55, producer.epoch, producer.address)]


async def test_a_failed_batch_commits_nothing_and_is_applied_again(
    producer_db: str, target: Target
) -> None:
    insert = target.sql("INSERT INTO credits VALUES (?, ?)")

    def fails(tx: Any, batch: Batch) -> None:
        insert_rows(tx, batch, insert)
        raise RuntimeError("the application failed mid-batch")

    async with Producer(producer_db) as producer:
        await publish(producer, 5)
        async with Consumer(producer.address, "orders", db=target.db, name="c") as consumer:
            batch = await anext(consumer)
            with pytest.raises(RuntimeError, match="mid-batch"):
                async with consumer.transaction(batch) as tx:
                    await tx.executemany(insert, [(r.seq, r.value) for r in batch])
                    raise RuntimeError("the application failed mid-batch")
            with pytest.raises(TransactionClosedError):
                await tx.execute(insert, (99, b"late"))
            with pytest.raises(RuntimeError, match="mid-batch"):
                await consumer.apply(batch, fails)
            assert target.credits() == [] and target.positions() == []
            assert consumer.applied == 0
            await consumer.apply(batch, insert_rows, insert)  # so the same batch applies again
            with pytest.raises(OutOfOrderBatchError, match="applied up to 5"):
                await consumer.apply(batch, insert_rows, insert)  # but never twice
    assert target.credits() == [1, 2, 3, 4, 5]


async def test_apply_runs_off_the_event_loop(producer_db: str, target: Target) -> None:
    """``fn`` blocks until the event loop has run once more: it would wait forever (10 s)
    if it ran on the loop's thread. (On SQLite, a transaction after a long one: short ones
    run on the loop's thread, see test_blocking.py.)"""
    entered, loop_ran = threading.Event(), threading.Event()

    def waits_for_the_loop(tx: Any, batch: Batch) -> str:
        insert_rows(tx, batch, target.sql("INSERT INTO credits VALUES (?, ?)"))
        entered.set()
        if not loop_ran.wait(10):
            raise AssertionError("the event loop did not run while fn did")
        return threading.current_thread().name

    async with Producer(producer_db) as producer:
        await publish(producer, 3)
        async with Consumer(producer.address, "orders", db=target.db, name="c") as consumer:
            batch = await anext(consumer)
            if target.engine == "sqlite":
                consumer._store._budget.note(1.0)  # type: ignore[union-attr]
            task = asyncio.create_task(consumer.apply(batch, waits_for_the_loop))
            assert await asyncio.to_thread(entered.wait, 10)
            loop_ran.set()  # from the loop: possible only because fn runs elsewhere
            assert await task != threading.current_thread().name
            assert consumer.applied == 3
    assert target.credits() == [1, 2, 3]


async def test_two_consumers_racing_for_one_batch(producer_db: str, target: Target) -> None:
    """Two consumer processes (here: two consumers, each with its own connection) apply
    the same batch at once. The first holds its transaction open until the second is
    waiting for the database's lock; then it rolls back (the second wins), or commits
    (the second gets ``OutOfOrderBatchError``). Once on the first batch (no position row
    yet), once on a later one."""
    if target.engine == "postgres":
        # The consumer asks for READ COMMITTED whatever the server's default.
        name = target.db.rpartition("/")[2]
        target.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = serializable")
    insert = target.sql("INSERT INTO credits VALUES (?, ?)")

    async def blocked_on_a_lock() -> bool:
        if target.engine == "sqlite":
            return True  # its busy handler cannot be seen from outside: the outcome is
        rows = target.query(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return bool(rows[0][0])

    async def race(commit: bool) -> tuple[Batch, Batch, asyncio.Task[int]]:
        batch_a, batch_b = await anext(a), await anext(b)
        assert batch_a.records == batch_b.records and batch_a.after == batch_b.after
        with contextlib.suppress(LookupError):
            async with a.transaction(batch_a) as tx:
                await tx.executemany(insert, [(r.seq, r.value) for r in batch_a])
                second = asyncio.create_task(b.apply(batch_b, insert_rows, insert))
                await wait_for(blocked_on_a_lock, what="the second consumer to wait")
                assert not second.done()
                if not commit:
                    raise LookupError("the first consumer fails: the second goes on")
        return batch_a, batch_b, second

    async with (
        serving(producer_db) as producer,
        Consumer(producer.address, "orders", db=target.db, name="ledger") as a,
        Consumer(producer.address, "orders", db=target.db, name="ledger") as b,
    ):
        await publish(producer, 4)
        first, _, second = await race(commit=False)
        assert await second == 4  # the second consumer applied seqs 1..4
        with pytest.raises(OutOfOrderBatchError, match="applied up to seq 4"):
            async with a.transaction(first):  # its position is stale: refused
                raise AssertionError("a batch out of turn must not start")
        await publish(producer, 3)
        _, _, second = await race(commit=True)  # a learns the position b committed
        with pytest.raises(OutOfOrderBatchError, match="applied up to seq 7"):
            await second
        assert (a.applied, b.applied) == (7, 4)
    assert target.credits() == list(range(1, 8))
    assert [row[:2] for row in target.positions()] == [("ledger", 7)]


async def test_a_producer_restored_from_an_older_copy_is_refused(
    producer_db: str, target: Target
) -> None:
    image = producer_db + ".image"
    async with Producer(producer_db) as producer:
        await publish(producer, 3)
        image_at(producer_db, image)  # a backup with head 3
        await publish(producer, 5)
        async with Consumer(producer.address, "orders", db=target.db, name="c") as consumer:
            await apply_transactions(consumer, target, 8)
    restore(image, producer_db)
    async with Producer(producer_db) as restored:
        assert restored.head("orders") == 3
        consumer = Consumer(restored.address, "orders", db=target.db, name="c")
        with pytest.raises(ConsumerPositionError, match="applied up to seq 8") as info:
            await consumer.start()
        assert info.value.lost == range(4, 9)
    assert target.credits() == list(range(1, 9))


async def test_lost_commits_with_reused_seqs_are_refused(producer_db: str, target: Target) -> None:
    """The epoch stored with the position is what tells reused seqs from the ones applied."""
    image = producer_db + ".image"
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"kept")
        image_at(producer_db, image)  # the power goes out here: seqs 2.. are not synced
        for n in range(2, 6):
            await producer.publish("orders", b"lost %d" % n)
        async with Consumer(producer.address, "orders", db=target.db, name="c") as consumer:
            await apply_transactions(consumer, target, 5)
        assert [row[2] for row in target.positions()] == [producer.epoch]
    restore(image, producer_db)
    async with Producer(producer_db) as restarted:
        for n in range(2, 9):
            await restarted.publish("orders", b"new %d" % n)  # seqs 2..5 re-used
        consumer = Consumer(restarted.address, "orders", db=target.db, name="c")
        with pytest.raises(SeqsReusedError, match=r"seqs 2\.\.5") as info:
            await consumer.start()
        assert info.value.lost == range(2, 6)
    assert target.credits() == [1, 2, 3, 4, 5]  # nothing more applied


async def test_a_consumer_name_is_bound_to_the_producers_it_applied_from(
    tmp_path: Path, target: Target
) -> None:
    """Positions from producer A, then producer B serving a stream of the same name at
    another address: applying B's records under that name would mix two logs."""
    async with Producer(str(tmp_path / "a.db")) as a, Producer(str(tmp_path / "b.db")) as b:
        await publish(a, 3)
        await publish(b, 2)
        async with Consumer(a.address, "orders", db=target.db, name="c") as consumer:
            await apply_transactions(consumer, target, 3)
        with pytest.raises(ProducerChangedError) as info:
            await Consumer(b.address, "orders", db=target.db, name="c").start()
        message = str(info.value)
        assert message.startswith(f"{b.address} serves producer {b.producer_id}, but consumer ")
        assert (
            f"consumer 'c' applied stream 'orders' from producer {a.producer_id} "
            f"(at {a.address}, up to seq 3): a consumer name is bound to the producers it "
            "applied from" in message
        )
        assert "allow_new_producer=True" in message and "\n" not in message
        assert [row[:2] for row in target.positions()] == [("c", 3)]  # nothing of B's
        # Opted in: B's records from its first, under a position of its own.
        async with Consumer(
            b.address, "orders", db=target.db, name="c", allow_new_producer=True
        ) as consumer:
            batch = await anext(consumer)
            assert (batch.producer_id, batch.first_seq, batch.last_seq) == (b.producer_id, 1, 2)
            async with consumer.transaction(batch):
                pass  # the position only: credits holds A's seqs
        # Bound to both now: each resumes from its own position, with no opt-in.
        await publish(a, 1)
        await publish(b, 1)
        for producer, applied in ((a, 3), (b, 2)):
            async with Consumer(producer.address, "orders", db=target.db, name="c") as consumer:
                batch = await anext(consumer)
                assert (batch.producer_id, batch.after) == (producer.producer_id, applied)
    stored = dict(target.query("SELECT producer_id, seq FROM streamq_positions"))
    assert stored == {a.producer_id: 3, b.producer_id: 2}
    assert target.credits() == [1, 2, 3]


# --- PostgreSQL ------------------------------------------------------------------------


async def test_positions_table_in_postgresql_types(producer_db: str, pg_url: str) -> None:
    """Created if missing (``postgres://`` URLs too); opening it again changes nothing."""
    async with Producer(producer_db) as producer:
        await publish(producer, 2)
        url = pg_url.replace("postgresql://", "postgres://")
        for _ in range(2):
            async with Consumer(producer.address, "orders", db=url, name="c", durability="full"):
                pass
    with psycopg.connect(pg_url) as conn:
        columns = conn.execute(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_name = 'streamq_positions' ORDER BY ordinal_position"
        ).fetchall()
        key = conn.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = ANY (i.indkey) WHERE i.indrelid = 'streamq_positions'::regclass "
            "AND i.indisprimary ORDER BY a.attnum"
        ).fetchall()
    assert columns == [
        ("consumer", "text", "NO"),
        ("producer_id", "text", "NO"),
        ("stream", "text", "NO"),
        ("seq", "bigint", "NO"),
        ("epoch", "bigint", "YES"),
        ("endpoint", "text", "NO"),
        ("updated_at", "bigint", "NO"),
    ]
    assert key == [("consumer",), ("producer_id",), ("stream",)]


async def test_a_connection_the_server_ended_is_opened_again(producer_db: str, pg_url: str) -> None:
    """Connections the server ended (``pg_terminate_backend``) are opened again by the next
    transaction, ``transaction``'s and ``apply``'s alike (``db_reconnect_timeout``): no
    error reaches the application, and each batch is applied once."""
    target = Target("postgres", pg_url)
    target.execute(EFFECTS)
    insert = target.sql("INSERT INTO credits VALUES (?, ?)")

    def terminate_others() -> None:
        rows = target.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert rows and all(ok for (ok,) in rows)

    async with Producer(producer_db) as producer:
        await publish(producer, 2)
        async with Consumer(producer.address, "orders", db=pg_url, name="c") as consumer:
            batch = await anext(consumer)
            await consumer.apply(batch, insert_rows, insert)  # opens apply's connection too
            await publish(producer, 2)
            batch = await anext(consumer)
            terminate_others()
            async with consumer.transaction(batch) as tx:
                await tx.executemany(insert, [(r.seq, r.value) for r in batch])
            assert consumer.applied == 4
            await publish(producer, 2)
            batch = await anext(consumer)
            terminate_others()
            assert await consumer.apply(batch, insert_rows, insert) == 2
            assert consumer.applied == 6
            await publish(producer, 2)
            assert await apply_transactions(consumer, target, 8) == [7, 8]
    assert target.credits() == [1, 2, 3, 4, 5, 6, 7, 8]


async def test_a_cancelled_transaction_commits_nothing(producer_db: str, pg_url: str) -> None:
    target = Target("postgres", pg_url)
    target.execute(EFFECTS)
    insert = target.sql("INSERT INTO credits VALUES (?, ?)")
    async with Producer(producer_db) as producer:
        await publish(producer, 3)
        async with Consumer(producer.address, "orders", db=pg_url, name="c") as consumer:
            batch = await anext(consumer)

            async def slow_apply() -> None:
                async with consumer.transaction(batch) as tx:
                    await tx.executemany(insert, [(r.seq, r.value) for r in batch])
                    await tx.execute("SELECT pg_sleep(30)")

            task = asyncio.create_task(slow_apply())
            sleeping = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'"
            await wait_for(lambda: target.query(sleeping)[0][0] == 1, what="the transaction")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert consumer.applied == 0 and target.credits() == []
            await consumer.apply(batch, insert_rows, insert)  # the same batch, once
    assert target.credits() == [1, 2, 3]


# Holds a COMMIT: a deferred trigger, run by COMMIT, waits for an advisory lock.
HOLD_COMMIT = (
    "CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$",
    "CREATE CONSTRAINT TRIGGER held AFTER INSERT ON credits DEFERRABLE INITIALLY DEFERRED "
    "FOR EACH ROW EXECUTE FUNCTION hold_commit()",
)


async def test_transaction_cancelled_during_commit_counts_the_commit(
    producer_db: str, pg_url: str
) -> None:
    """A COMMIT already sent happens: a cancel arriving meanwhile must still move
    ``applied``, or the same batch could be applied a second time."""
    target = Target("postgres", pg_url)
    target.execute(EFFECTS)
    for statement in HOLD_COMMIT:
        target.execute(statement)
    insert = target.sql("INSERT INTO credits VALUES (?, ?)")
    async with Producer(producer_db) as producer:
        await publish(producer, 2)
        async with Consumer(producer.address, "orders", db=pg_url, name="c") as consumer:
            batch = await anext(consumer)

            async def apply() -> None:
                async with consumer.transaction(batch) as tx:
                    await tx.executemany(insert, [(r.seq, r.value) for r in batch])

            with psycopg.connect(pg_url, autocommit=True) as holder:
                holder.execute("SELECT pg_advisory_lock(4242)")
                task = asyncio.create_task(apply())
                waiting = (
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' "
                    "AND query = 'COMMIT'"
                )
                await wait_for(lambda: target.query(waiting)[0][0] == 1, what="the COMMIT")
                task.cancel()  # while the COMMIT waits
                holder.execute("SELECT pg_advisory_unlock(4242)")
            with pytest.raises(asyncio.CancelledError):
                await task
            assert consumer.applied == 2
            with pytest.raises(OutOfOrderBatchError):
                await apply()
    assert target.credits() == [1, 2]


async def test_a_database_that_cannot_be_opened_is_named(
    producer_db: str, pg_url: str, reserve_port: Callable[[], int]
) -> None:
    async with Producer(producer_db) as producer:
        server = pg_url.rpartition("/")[0]
        bad = {
            f"postgresql://streamq:s3cret@127.0.0.1:{reserve_port()}/ledger": "refused",
            f"{server}/no_such_database": 'database "no_such_database" does not exist',
            "postgresql://streamq:s3cret@[::1/ledger": "IPv6",
        }
        for url, reason in bad.items():
            consumer = Consumer(producer.address, "orders", db=url, name="c")
            with pytest.raises(DatabaseOpenError) as info:
                await consumer.start()
            message = str(info.value)
            assert "consumer's PostgreSQL database" in message and reason in message
            assert "s3cret" not in message  # the password is not repeated, even by libpq
            named = url.replace("s3cret", "***") if "[" not in url else "***@[::1/ledger"
            assert named in message


async def test_fan_in_into_postgresql(tmp_path: Path, pg_url: str) -> None:
    """Two producers into one PostgreSQL database: each producer's records once, in
    order, and a restarted fan-in resumes each from its own stored position."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE applied (producer text NOT NULL, seq bigint NOT NULL)")

    async def drain(fanin: FanInConsumer, count: int) -> None:
        applied = 0
        async with asyncio.timeout(20):
            while applied < count:
                batch = await anext(fanin)
                async with fanin.transaction(batch) as tx:
                    await tx.execute(
                        "INSERT INTO applied SELECT %s, unnest(%s::bigint[])",
                        (batch.producer_id, [r.seq for r in batch]),
                    )
                applied += len(batch)
        assert applied == count

    async with (
        Producer(str(tmp_path / "a.db")) as a,
        Producer(str(tmp_path / "b.db")) as b,
    ):
        for producer in (a, b):
            async with producer.transaction() as tx:
                await tx.publish_many("orders", [b"x"] * 20)
        addresses = [a.address, b.address]
        async with FanInConsumer(addresses, "orders", db=pg_url, name="ledger") as fanin:
            await drain(fanin, 40)
        for producer in (a, b):
            async with producer.transaction() as tx:
                await tx.publish_many("orders", [b"y"] * 5)
        async with FanInConsumer(addresses, "orders", db=pg_url, name="ledger") as fanin:
            await drain(fanin, 10)
            assert fanin.applied == {a.address: 25, b.address: 25}
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT producer, seq FROM applied ORDER BY producer, seq").fetchall()
    assert sorted(rows) == sorted((p.producer_id, seq) for p in (a, b) for seq in range(1, 26))


def test_without_psycopg_the_error_says_what_to_install(tmp_path: Path) -> None:
    """In a fresh interpreter where psycopg cannot be imported (``sys.modules`` holds
    None: what Python does for a module that is absent)."""
    code = (
        "import sys; sys.modules['psycopg'] = None\n"
        "import streamq\n"
        "try:\n"
        "    streamq.Consumer('127.0.0.1:1', 'orders', db='postgresql://u@h/d', name='c')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=True,
    )
    assert "pip install 'streamq[postgres]'" in result.stdout, result.stderr


# --- save_position through the application's own connection, on PostgreSQL -------------


@pytest.fixture
def ledger(pg_url: str) -> Iterator[str]:
    """A PostgreSQL database with the application's table."""
    with psycopg.connect(pg_url) as conn:
        conn.execute(EFFECTS)
    yield pg_url


def alchemy(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://")


async def test_save_position_on_a_psycopg_connection(producer_db: str, ledger: str) -> None:
    def apply(batch: Batch, fail: bool = False) -> None:
        with psycopg.connect(ledger) as conn:  # commits unless the block raises
            # The position first: a batch already applied is refused before its effects.
            streamq.save_position(conn, batch)
            conn.cursor().executemany(
                "INSERT INTO credits VALUES (%s, %s)", [(r.seq, r.value) for r in batch]
            )
            if fail:
                raise RuntimeError("the application failed mid-batch")

    async with Producer(producer_db) as producer:
        await publish(producer, 10)
        async with Consumer(producer.address, "orders", db=ledger, name="ledger") as consumer:
            batch = await anext(consumer)
            with pytest.raises(RuntimeError):
                await asyncio.to_thread(apply, batch, True)  # rolled back: effects and position
            await asyncio.to_thread(apply, batch)  # so the same batch applies again
            with pytest.raises(OutOfOrderBatchError, match="applied up to seq 10"):
                await asyncio.to_thread(apply, batch)  # but never twice
            await publish(producer, 20)
            batch = await anext(consumer)
            assert consumer.applied == batch.after == 10  # learnt when the next was asked for
            await asyncio.to_thread(apply, batch)
        await publish(producer, 5)
        async with Consumer(producer.address, "orders", db=ledger, name="ledger") as again:
            batch = await anext(again)  # resumes from what the application committed
            assert (batch.after, batch.last_seq) == (30, 35)
            await asyncio.to_thread(apply, batch)
            await publish(producer, 1)
            await anext(again)  # asking for more acknowledges what was applied
            async with asyncio.timeout(10):
                assert await producer.wait_applied("ledger", "orders", 35) == 35
    assert Target("postgres", ledger).credits() == list(range(1, 36))


async def test_save_position_refuses_a_skipped_batch_and_autocommit(
    producer_db: str, ledger: str
) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, 3)
        async with Consumer(producer.address, "orders", db=ledger, name="c") as consumer:
            first = await anext(consumer)
            await publish(producer, 3)
            second = await anext(consumer)
            with psycopg.connect(ledger) as conn:
                with pytest.raises(OutOfOrderBatchError, match="applied nothing"):
                    streamq.save_position(conn, second)
                conn.rollback()  # an error aborts a PostgreSQL transaction
                streamq.save_position(conn, first)
            with psycopg.connect(ledger, autocommit=True) as conn:
                with pytest.raises(NotInTransactionError, match="autocommit"):
                    streamq.save_position(conn, second)
                with conn.transaction():
                    streamq.save_position(conn, second)
            with pytest.raises(TypeError, match=r"streamq\.Batch"):
                streamq.save_position(conn, (1, 2, 3))
    assert [row[:2] for row in Target("postgres", ledger).positions()] == [("c", 6)]


async def test_save_position_without_the_table_names_the_database(
    producer_db: str, pg_url: str
) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, 1)
        async with Consumer(producer.address, "orders", name="c") as consumer:  # no db=
            batch = await anext(consumer)
        name = pg_url.rpartition("/")[2]
        with psycopg.connect(pg_url) as conn:
            missing = rf"PostgreSQL database '{name}'.* no streamq_positions table"
            with pytest.raises(SchemaMissingError, match=missing):
                streamq.save_position(conn, batch)


async def test_save_position_through_sqlalchemy(producer_db: str, ledger: str) -> None:
    engine = create_engine(alchemy(ledger))
    insert = text("INSERT INTO credits VALUES (:seq, :value)")

    def with_session(batch: Batch) -> None:
        with Session(engine) as session, session.begin():
            session.execute(insert, [{"seq": r.seq, "value": r.value} for r in batch])
            streamq.save_position(session, batch)

    def with_connection(batch: Batch) -> None:
        with engine.begin() as connection:
            streamq.save_position(connection, batch)
            connection.execute(insert, [{"seq": r.seq, "value": r.value} for r in batch])

    try:
        async with (
            serving(producer_db) as producer,
            Consumer(producer.address, "orders", db=ledger, name="c") as consumer,
        ):
            for apply in (with_session, with_connection, with_session):
                await publish(producer, 4)
                batch = await anext(consumer)
                await asyncio.to_thread(apply, batch)
            with pytest.raises(OutOfOrderBatchError, match="applied up to seq 12"):
                await asyncio.to_thread(with_connection, batch)
    finally:
        engine.dispose()
    assert Target("postgres", ledger).credits() == list(range(1, 13))


async def test_save_position_async_through_psycopg_and_sqlalchemy(
    producer_db: str, ledger: str
) -> None:
    engine = create_async_engine(alchemy(ledger))
    try:
        async with (
            serving(producer_db) as producer,
            Consumer(producer.address, "orders", db=ledger, name="c") as consumer,
        ):
            await publish(producer, 4)
            batch = await anext(consumer)
            async with AsyncSession(engine) as session, session.begin():
                await session.execute(
                    text("INSERT INTO credits VALUES (:seq, :value)"),
                    [{"seq": r.seq, "value": r.value} for r in batch],
                )
                await streamq.save_position_async(session, batch)
            await publish(producer, 4)
            batch = await anext(consumer)
            async with await psycopg.AsyncConnection.connect(ledger) as conn:
                async with conn.cursor() as cursor:
                    await cursor.executemany(
                        "INSERT INTO credits VALUES (%s, %s)",
                        [(r.seq, r.value) for r in batch],
                    )
                await streamq.save_position_async(conn, batch)
                await conn.commit()
                with pytest.raises(OutOfOrderBatchError, match="applied up to seq 8"):
                    await streamq.save_position_async(conn, batch)
                await conn.rollback()  # the error aborted the transaction
            await publish(producer, 1)
            assert (await anext(consumer)).after == 8 and consumer.applied == 8
    finally:
        await engine.dispose()
    assert Target("postgres", ledger).credits() == list(range(1, 9))


async def test_save_position_async_through_asyncpg(producer_db: str, ledger: str) -> None:
    """A raw asyncpg connection and SQLAlchemy's postgresql+asyncpg: the position commits
    with the rows, a batch applied twice is refused, and outside a transaction nothing
    is written."""
    engine = create_async_engine(alchemy(ledger).replace("+psycopg", "+asyncpg"))
    conn = await asyncpg.connect(ledger)
    try:
        async with (
            serving(producer_db) as producer,
            Consumer(producer.address, "orders", db=ledger, name="c") as consumer,
        ):
            await publish(producer, 4)
            batch = await anext(consumer)
            with pytest.raises(streamq.NotInTransactionError):
                await streamq.save_position_async(conn, batch)
            async with conn.transaction():
                await conn.executemany(
                    "INSERT INTO credits VALUES ($1, $2)", [(r.seq, r.value) for r in batch]
                )
                await streamq.save_position_async(conn, batch)
            with pytest.raises(OutOfOrderBatchError, match="applied up to seq 4"):
                async with conn.transaction():
                    await streamq.save_position_async(conn, batch)
            await publish(producer, 4)
            batch = await anext(consumer)
            async with AsyncSession(engine) as session, session.begin():
                await streamq.save_position_async(session, batch)  # first: begun lazily
                await session.execute(
                    text("INSERT INTO credits VALUES (:seq, :value)"),
                    [{"seq": r.seq, "value": r.value} for r in batch],
                )
            await publish(producer, 1)
            assert (await anext(consumer)).after == 8 and consumer.applied == 8
    finally:
        await conn.close()
        await engine.dispose()
    assert Target("postgres", ledger).credits() == list(range(1, 9))


DJANGO_APPLIES = """
import asyncio, sys
from urllib.parse import urlsplit

import django
from django.conf import settings

url = urlsplit(sys.argv[1])
database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.path[1:]}
database |= {"USER": url.username, "HOST": url.hostname, "PORT": url.port}
settings.configure(DATABASES={"default": database})
django.setup()
from django.db import connection, transaction

import streamq
from streamq.consumer.batch import Batch
from streamq.consumer.database import open_position_store
from streamq.protocol import Record


async def create_table():
    store = open_position_store(sys.argv[1])
    await store.open()
    await store.close()


asyncio.run(create_table())
records = (Record(1, 0, None, b"one", {}), Record(2, 0, None, b"two", {}))
batch = Batch("orders", "p1", 0, records, consumer="c", endpoint="127.0.0.1:1")
with transaction.atomic():
    streamq.save_position(connection, batch)
    with connection.cursor() as cursor:
        cursor.executemany("INSERT INTO credits VALUES (%s, %s)", [(r.seq, r.value) for r in batch])
for outside in (False, True):
    try:
        if outside:
            streamq.save_position(connection, batch)
        else:
            with transaction.atomic():
                streamq.save_position(connection, batch)
    except (streamq.OutOfOrderBatchError, streamq.NotInTransactionError) as exc:
        print(type(exc).__name__, exc)
"""


def test_save_position_through_django(ledger: str) -> None:
    """Django's connection on PostgreSQL (psycopg 3), in a process of its own: Django is
    configured once per process."""
    result = subprocess.run(
        [sys.executable, "-c", DJANGO_APPLIES, ledger],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 0, result.stderr
    refused, outside = result.stdout.splitlines()
    assert refused.startswith("OutOfOrderBatchError") and "applied up to seq 2" in refused
    assert outside.startswith("NotInTransactionError") and "atomic()" in outside
    target = Target("postgres", ledger)
    assert target.credits() == [1, 2]
    assert target.positions() == [("c", 2, 0, "127.0.0.1:1")]


async def test_a_worker_starting_does_not_wait_for_the_others_batches(
    producer_db: str, pg_url: str
) -> None:
    """Opening a consumer on PostgreSQL takes no table lock once the tables exist: a share
    starting while another share's batch is open applies at once, instead of queueing its
    setup (and every later transaction) behind that batch."""
    release = threading.Event()

    def held(tx: Any, batch: Batch) -> None:
        if not release.wait(30):
            raise TimeoutError("never released")

    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            for n in range(20):
                await tx.publish("orders", b"%d" % n, key=b"k%d" % n)
        async with Consumer(producer.address, "orders", db=pg_url, name="w", share=(0, 2)) as first:
            holding = asyncio.create_task(first.apply(await anext(first), held))
            await wait_for(lambda: _open_transactions(pg_url) >= 1, what="share 0's batch open")
            try:
                async with Consumer(
                    producer.address, "orders", db=pg_url, name="w", share=(1, 2)
                ) as second:
                    batch = await anext(second)
                    await asyncio.wait_for(second.apply(batch, lambda tx, b: None), 10)
                    assert second.applied == 20 and not holding.done()
            finally:
                release.set()
            await holding
            assert first.applied == 20


def _open_transactions(url: str) -> int:
    """Sessions of other connections inside a transaction (not idle, not this one)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
            "AND pid <> pg_backend_pid() AND datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0
