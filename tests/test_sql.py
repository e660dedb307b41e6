"""Transactions run as one function on the database's own thread: producer and consumer."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading

import pytest

import streamq
from streamq import BlockingSQL, BlockingTransaction, Consumer, Producer, SyncProducer
from streamq.engines.sqlite.storage import SEQ_BITS
from streamq.errors import OutOfOrderBatchError, TransactionClosedError
from streamq.records import DEFAULT_MAX_RECORD_SIZE

from .producer.test_producer import log_seqs

SEQ_MASK = (1 << SEQ_BITS) - 1


def debit_and_publish(tx: BlockingTransaction, sku: str, count: int) -> range:
    tx.execute("CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, n INTEGER)")
    tx.execute("INSERT OR IGNORE INTO stock VALUES (?, 100)", (sku,))
    tx.execute("UPDATE stock SET n = n - ? WHERE sku = ?", (count, sku))
    first = tx.publish("orders", sku.encode(), key=sku.encode(), headers={"n": b"%d" % count})
    rest = tx.publish_many("orders", [b"%s-%d" % (sku.encode(), i) for i in range(count - 1)])
    return range(first, rest.stop)


def read_all(address: str) -> list[streamq.Record]:
    with streamq.Client(address) as client:
        return [record for batch in client.read_range("orders", 1, 7) for record in batch]


def stock(path: str) -> list[tuple[str, int]]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT sku, n FROM stock ORDER BY sku").fetchall()


async def test_run_in_transaction_commits_sql_and_records_together(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        assert await producer.run_in_transaction(debit_and_publish, "a1", 3) == range(1, 4)
        async with producer.transaction() as tx:  # both kinds share one dense seq line
            assert await tx.publish("orders", b"async") == 4
        assert await producer.run_in_transaction(debit_and_publish, "b2", 2) == range(5, 7)
        assert producer.head("orders") == 6
        records = await asyncio.to_thread(read_all, producer.address)
    assert [r.seq for r in records] == [1, 2, 3, 4, 5, 6]
    assert (records[0].key, records[0].headers) == (b"a1", {"n": b"3"})
    assert [r.value for r in records[3:]] == [b"async", b"b2", b"b2-0"]
    assert stock(producer_db) == [("a1", 97), ("b2", 98)]
    assert log_seqs(producer_db) == [1, 2, 3, 4, 5, 6]


async def test_run_in_transaction_that_raises_commits_nothing(producer_db: str) -> None:
    def fails(tx: BlockingTransaction) -> None:
        debit_and_publish(tx, "a1", 2)
        tx.publish("new-stream", b"x")
        raise ValueError("boom")

    async with Producer(producer_db) as producer:
        await producer.run_in_transaction(debit_and_publish, "a1", 1)
        with pytest.raises(ValueError, match="boom"):
            await producer.run_in_transaction(fails)
        assert producer.head("orders") == 1
        assert "new-stream" not in producer.log.streams
        assert await producer.run_in_transaction(debit_and_publish, "a1", 1) == range(2, 3)
    assert stock(producer_db) == [("a1", 98)]
    assert log_seqs(producer_db) == [1, 2]


async def test_transaction_cannot_be_used_after_it_ends(producer_db: str) -> None:
    kept: list[BlockingTransaction] = []
    async with Producer(producer_db) as producer:
        await producer.run_in_transaction(lambda tx: kept.append(tx))
        with pytest.raises(TransactionClosedError):
            kept[0].publish("orders", b"late")
        with pytest.raises(TransactionClosedError):
            kept[0].execute("SELECT 1")
        assert "orders" not in producer.log.streams


class Held:
    """Holds a transaction function on the database thread until released."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.entered.set()
        self.release.wait(10)


@pytest.mark.parametrize("cancels", [1, 2])
async def test_cancelled_caller_still_sees_the_commit_through(
    producer_db: str, cancels: int
) -> None:
    """Cancelling the awaiting task (once, or again while it waits for the thread) cannot
    stop the thread: its records reach the log, and the next transaction follows them."""
    held = Held()

    def slow(tx: BlockingTransaction) -> None:
        tx.publish("orders", b"slow")
        held.hold()

    # durability="full": the transaction runs on the writer's thread (never on the loop's).
    async with Producer(producer_db, durability="full") as producer:
        await producer.publish("orders", b"first")
        task = asyncio.create_task(producer.run_in_transaction(slow))
        assert await asyncio.to_thread(held.entered.wait, 10)
        for _ in range(cancels):
            task.cancel()
            await asyncio.sleep(0)  # the task takes the cancel and waits for the thread again
        held.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert producer.head("orders") == 2
        assert await producer.publish("orders", b"next") == 3
    assert log_seqs(producer_db) == [1, 2, 3]


def test_sync_producer_runs_a_transaction_function(producer_db: str) -> None:
    with SyncProducer(producer_db) as producer:
        assert producer.run_in_transaction(debit_and_publish, "c3", 2) == range(1, 3)
        assert producer.head("orders") == 2
    assert stock(producer_db) == [("c3", 98)]


def test_sync_producer_threads_keep_dense_seqs_beside_other_writers_and_rollbacks(
    producer_db: str,
) -> None:
    """A thread's connection keeps what its own commits left between transactions: a
    commit by another connection, the producer's own, a rolled-back publish and a new
    stream each still give the next seq, with nothing skipped or given twice."""
    with SyncProducer(producer_db, serve=False) as producer:
        seqs: list[int] = []

        def publish(value: bytes) -> None:
            with producer.transaction() as tx:
                seqs.append(tx.publish("orders", value))

        publish(b"a")
        publish(b"b")  # from what the first left
        with contextlib.closing(sqlite3.connect(producer_db, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            seqs.append(streamq.publish(other, "orders", b"other"))
            other.execute("COMMIT")
        publish(b"c")  # after another connection's commit
        with pytest.raises(RuntimeError), producer.transaction() as tx:
            assert tx.publish("orders", b"rolled back") == 5
            raise RuntimeError("the application's error")
        publish(b"d")  # the rolled-back seq again
        thread = threading.Thread(target=publish, args=(b"thread",))
        thread.start()
        thread.join()
        publish(b"e")  # after another thread's connection committed
        with producer.transaction() as tx:
            with pytest.raises(streamq.RecordTooLargeError):  # the stream made, then refused
                tx.publish("new", b"x" * (DEFAULT_MAX_RECORD_SIZE + 1))
            assert tx.publish("new", b"first") == 1  # a stream made by this transaction
            seqs.append(tx.publish("orders", b"f"))
        assert producer.head("new") == 1
    assert seqs == list(range(1, 9))
    assert log_seqs(producer_db) == list(range(1, 9))


def test_sync_transactions_index_each_rising_timestamp_and_run_once(producer_db: str) -> None:
    """Several records in one transaction: each whose timestamp is above all earlier ones
    gets its time-index row (a seek by time finds it); a transaction object runs once."""
    with SyncProducer(producer_db, serve=False) as producer:
        with producer.transaction() as tx:
            for ts in (1_000, 2_000, 1_500, 3_000):
                tx.publish("orders", b"v", timestamp=ts)
        again = producer.transaction()
        with pytest.raises(TransactionClosedError, match="with block"):
            again.publish("orders", b"outside")
        with again:
            again.publish("orders", b"v", timestamp=4_000)
        with pytest.raises(RuntimeError, match="runs once"), again:
            pass
        seeks = [producer.seek_time("orders", ts) for ts in (0, 1_001, 2_001, 3_001)]
    assert seeks == [1, 2, 4, 5]
    with contextlib.closing(sqlite3.connect(producer_db)) as db:
        rows = db.execute("SELECT ts, pos & ? FROM streamq_time ORDER BY ts", (SEQ_MASK,))
        assert rows.fetchall() == [(1_000, 1), (2_000, 2), (3_000, 4), (4_000, 5)]


def credit(tx: BlockingSQL, batch: streamq.Batch, table: str) -> int:
    tx.execute(f"CREATE TABLE IF NOT EXISTS {table} (seq INTEGER, value BLOB)")
    tx.executemany(f"INSERT INTO {table} VALUES (?, ?)", [(r.seq, r.value) for r in batch])
    return len(batch)


def applied(path: str) -> tuple[list[int], int]:
    """Seqs in the credits table, and the consumer's stored position."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        seqs = [seq for (seq,) in db.execute("SELECT seq FROM credits ORDER BY rowid")]
        (position,) = db.execute("SELECT seq FROM streamq_positions").fetchone()
    return seqs, position


async def test_consumer_apply_stores_effects_and_position_together(
    producer_db: str, consumer_db: str
) -> None:
    def fails(tx: BlockingSQL, batch: streamq.Batch) -> None:
        credit(tx, batch, "credits")
        raise ValueError("boom")

    async with Producer(producer_db) as producer:
        await producer.run_in_transaction(debit_and_publish, "a1", 5)
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            batch = await anext(aiter(consumer))
            with pytest.raises(ValueError, match="boom"):
                await consumer.apply(batch, fails)
            assert consumer.applied == 0
            assert await consumer.apply(batch, credit, "credits") == 5
            with pytest.raises(OutOfOrderBatchError):
                await consumer.apply(batch, credit, "credits")
            assert consumer.applied == 5
    assert applied(consumer_db) == ([1, 2, 3, 4, 5], 5)


async def test_consumer_apply_cancelled_still_counts_the_commit(
    producer_db: str, consumer_db: str
) -> None:
    """The thread commits the batch and its position even if the caller is cancelled: the
    consumer must know, or the same batch would be applied twice."""
    held = Held()

    def slow(tx: BlockingSQL, batch: streamq.Batch) -> None:
        credit(tx, batch, "credits")
        held.hold()

    async with Producer(producer_db) as producer:
        await producer.run_in_transaction(debit_and_publish, "a1", 3)
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            batch = await anext(aiter(consumer))
            # As after a long transaction: this one runs on the connection's thread (on
            # the loop's, the hold would stop the loop).
            consumer._store._budget.note(1.0)  # type: ignore[union-attr]
            task = asyncio.create_task(consumer.apply(batch, slow))
            assert await asyncio.to_thread(held.entered.wait, 10)
            task.cancel()
            held.release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert consumer.applied == 3
            with pytest.raises(OutOfOrderBatchError):
                await consumer.apply(batch, credit, "credits")
    assert applied(consumer_db) == ([1, 2, 3], 3)


async def test_the_same_batch_applied_concurrently_is_applied_once(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db) as producer:
        await producer.run_in_transaction(debit_and_publish, "a1", 3)
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            batch = await anext(aiter(consumer))
            results = await asyncio.gather(
                consumer.apply(batch, credit, "credits"),
                consumer.apply(batch, credit, "credits"),
                return_exceptions=True,
            )
    assert sorted(type(r).__name__ for r in results) == ["OutOfOrderBatchError", "int"]
    assert applied(consumer_db) == ([1, 2, 3], 3)


async def test_consumer_apply_waits_on_its_thread_while_another_connection_writes(
    producer_db: str, consumer_db: str
) -> None:
    """Applied on the event loop's thread, BEGIN would wait for the application's other
    connection: the batch goes to the connection's thread, and commits once it is free."""
    async with Producer(producer_db) as producer:
        await producer.run_in_transaction(debit_and_publish, "a1", 3)
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            batch = await anext(aiter(consumer))
            other = sqlite3.connect(consumer_db, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")
                task = asyncio.create_task(consumer.apply(batch, credit, "credits"))
                for _ in range(20):  # the loop is free while the batch waits
                    await asyncio.sleep(0.01)
                assert not task.done()
                other.execute("COMMIT")
                assert await task == 3
            finally:
                other.close()
            assert consumer.applied == 3
    assert applied(consumer_db) == ([1, 2, 3], 3)
