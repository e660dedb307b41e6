"""Consumers over real loopback sockets: exactly-once application, resume, identity checks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sqlite3
from collections.abc import Callable

import pytest

import streamq
from streamq import Consumer, Producer
from streamq.errors import (
    ConsumerPositionError,
    OffsetOutOfRangeError,
    OutOfOrderBatchError,
    ProducerChangedError,
    UnknownStreamError,
)

from ..conftest import wait_for
from ..producer.test_producer import commit_holder


async def apply(consumer: Consumer, until: int) -> list[int]:
    """Apply batches into table ``credits`` until seq ``until``; returns seqs applied."""
    seen: list[int] = []
    async for batch in consumer:
        async with consumer.transaction(batch) as tx:
            await tx.execute("CREATE TABLE IF NOT EXISTS credits (seq INTEGER, value BLOB)")
            await tx.executemany(
                "INSERT INTO credits VALUES (?, ?)", [(r.seq, r.value) for r in batch]
            )
        seen += [r.seq for r in batch]
        if batch.last_seq >= until:
            break
    return seen


def credits(path: str) -> list[tuple[int, bytes]]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT seq, value FROM credits ORDER BY rowid").fetchall()


async def test_applies_every_record_once_and_resumes(producer_db: str, consumer_db: str) -> None:
    async def publish(start: int, end: int) -> None:
        for i in range(start, end, 30):
            async with producer.transaction() as tx:
                await tx.publish_many("orders", [b"v%d" % n for n in range(i, i + 30)])

    async with Producer(producer_db) as producer:
        await publish(0, 120)
        async with Consumer(producer.address, "orders", db=consumer_db, name="billing") as consumer:
            seen = await apply(consumer, 120)
        assert seen == list(range(1, 121))
        await publish(120, 300)
        last = 120
        # A batch whose transaction fails is not applied and comes again after a restart.
        async with Consumer(producer.address, "orders", db=consumer_db, name="billing") as consumer:
            batch = await anext(consumer)
            assert batch.first_seq == last + 1
            with pytest.raises(RuntimeError):
                async with consumer.transaction(batch) as tx:
                    await tx.execute("INSERT INTO credits VALUES (?, ?)", (-1, b"partial"))
                    raise RuntimeError("crash in the middle of applying")
            assert consumer.applied == last
        async with Consumer(producer.address, "orders", db=consumer_db, name="billing") as consumer:
            assert (await apply(consumer, 300))[0] == last + 1
    applied = credits(consumer_db)
    assert applied == [(n + 1, b"v%d" % n) for n in range(300)]
    with contextlib.closing(sqlite3.connect(consumer_db)) as db:
        rows = db.execute("SELECT consumer, stream, seq FROM streamq_positions").fetchall()
    assert rows == [("billing", "orders", 300)]


async def test_live_tail_is_pushed_after_catch_up(producer_db: str, consumer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            for n in range(1, 6):
                await producer.publish("orders", b"%d" % n)
                batch = await asyncio.wait_for(anext(consumer), 10)
                assert [r.seq for r in batch] == [n]
                async with consumer.transaction(batch):
                    pass
            await wait_for(
                lambda: any(s.acked == 5 for s in producer.server.subscriptions),  # type: ignore[union-attr]
                what="the producer to see the consumer's ack",
            )


async def test_batch_applied_twice_or_out_of_turn_is_refused(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"a")
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            batch = await anext(consumer)
            async with consumer.transaction(batch):
                pass
            with pytest.raises(OutOfOrderBatchError, match="applied up to 1"):
                async with consumer.transaction(batch):
                    pass
            await producer.publish("orders", b"b")
            await producer.publish("orders", b"c")
            later = await anext(consumer)
            assert later.first_seq == 2
    assert consumer.applied == 1


async def test_replaced_producer_database_is_detected(
    producer_db: str, consumer_db: str, reserve_port: Callable[[], int]
) -> None:
    port = reserve_port()
    async with Producer(producer_db, port=port) as producer:
        await producer.publish("orders", b"a")
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            await apply(consumer, 1)
    # Another database (a new producer id) now serves the same address.
    async with Producer(producer_db + ".new", port=port) as replacement:
        await replacement.publish("orders", b"other a")
        await replacement.publish("orders", b"other b")
        with pytest.raises(ProducerChangedError, match="database was replaced") as info:
            await Consumer(replacement.address, "orders", db=consumer_db, name="c").start()
        assert "allow_new_producer=True" in str(info.value)
        # A different consumer name has no history with the old producer: fine.
        async with Consumer(replacement.address, "orders", db=consumer_db, name="d") as other:
            assert (await anext(other)).first_seq == 1


async def test_producer_restored_from_older_copy_is_detected(
    producer_db: str, consumer_db: str
) -> None:
    backup = producer_db + ".backup"
    async with Producer(producer_db) as producer:
        for n in range(3):
            await producer.publish("orders", b"%d" % n)
    with contextlib.closing(sqlite3.connect(producer_db)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    shutil.copy(producer_db, backup)  # a backup with head 3
    async with Producer(producer_db) as producer:
        for n in range(3, 8):
            await producer.publish("orders", b"%d" % n)
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            await apply(consumer, 8)
    for leftover in (producer_db + "-wal", producer_db + "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(leftover)
    shutil.copy(backup, producer_db)  # the restore: same producer id, head 3
    async with Producer(producer_db) as restored:
        assert restored.head("orders") == 3
        with pytest.raises(ConsumerPositionError, match="applied up to seq 8"):
            await Consumer(restored.address, "orders", db=consumer_db, name="c").start()
    assert [seq for seq, _ in credits(consumer_db)] == list(range(1, 9))


async def test_consumer_reconnects_when_the_producer_restarts(
    producer_db: str, consumer_db: str, reserve_port: Callable[[], int]
) -> None:
    port = reserve_port()
    producer = Producer(producer_db, port=port)
    await producer.start()
    async with producer.transaction() as tx:
        await tx.publish_many("orders", [b"%d" % n for n in range(100)])
    consumer = Consumer(producer.address, "orders", db=consumer_db, name="c", reconnect_timeout=20)
    await consumer.start()
    try:
        assert (await apply(consumer, 100))[-1] == 100
        await producer.close()
        producer = Producer(producer_db, port=port)
        await producer.start()
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"%d" % n for n in range(100, 200)])
        assert (await apply(consumer, 200))[-1] == 200
        assert consumer.reconnects >= 1
    finally:
        await consumer.close()
        await producer.close()
    assert [seq for seq, _ in credits(consumer_db)] == list(range(1, 201))


async def test_subscribe_errors_reach_the_consumer(
    producer_db: str, reserve_port: Callable[[], int]
) -> None:
    async with Producer(producer_db) as producer:
        for n in range(10):
            await producer.publish("orders", b"%d" % n)
        with pytest.raises(UnknownStreamError, match="unknown stream 'nope'"):
            await Consumer(producer.address, "nope").start()
        with pytest.raises(OffsetOutOfRangeError, match="beyond the head"):
            await Consumer(producer.address, "orders", start_seq=12).start()
        await producer.truncate("orders", 5)
        with pytest.raises(OffsetOutOfRangeError, match=r"seqs 2\.\.4 no longer held"):
            await Consumer(producer.address, "orders", start_seq=2).start()
        async with Consumer(producer.address, "orders", start_seq=11) as at_head:
            await producer.publish("orders", b"10")
            assert [r.seq for r in await anext(at_head)] == [11]
        with pytest.raises(streamq.ConnectionLostError, match="cannot connect"):
            await Consumer(f"127.0.0.1:{reserve_port()}", "orders", connect_timeout=5).start()


def test_blocking_client_head_range_streams_status(producer_db: str) -> None:
    with streamq.SyncProducer(producer_db) as producer:
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"%d" % n for n in range(50)])
            tx.publish("audit", b"x")
        with streamq.Client(producer.address) as client:
            assert client.producer_id == producer.producer_id
            assert client.head("orders") == streamq.StreamInfo("orders", 50, 1)
            assert sorted(s.stream for s in client.streams()) == ["audit", "orders"]
            records = [r for b in client.read_range("orders", 10, 20) for r in b]
            assert [r.seq for r in records] == list(range(10, 20))
            assert [r.value for r in records] == [b"%d" % n for n in range(9, 19)]
            assert list(client.read_range("orders", 51, 51)) == []
            with pytest.raises(OffsetOutOfRangeError, match=r"range \[40, 52\) is not within"):
                list(client.read_range("orders", 40, 52))
        with streamq.Client(producer.address) as client:  # errors close the connection
            status = client.status()
            assert status["producer_id"] == producer.producer_id
            assert {s["stream"]: s["head"] for s in status["streams"]} == {"orders": 50, "audit": 1}
            with pytest.raises(UnknownStreamError):
                client.head("missing")


async def test_start_waits_for_a_producer_that_is_down(
    producer_db: str, reserve_port: Callable[[], int]
) -> None:
    port = reserve_port()
    with pytest.raises(streamq.ConnectionLostError, match=r"within 0\.3 s"):
        await Consumer(f"127.0.0.1:{port}", "orders", reconnect_timeout=0.3).start()
    consumer = Consumer(f"127.0.0.1:{port}", "orders", reconnect_timeout=20)
    starting = asyncio.create_task(consumer.start())
    async with Producer(producer_db, port=port) as producer:
        await producer.publish("orders", b"late producer")
        await asyncio.wait_for(starting, 20)
        try:
            assert [r.value for r in await anext(consumer)] == [b"late producer"]
        finally:
            await consumer.close()


async def test_transaction_cancelled_during_commit_counts_the_commit(
    producer_db: str, consumer_db: str
) -> None:
    """A COMMIT already on the database's thread happens: a cancel arriving meanwhile must
    still move ``applied``, or the same batch could be applied a second time."""
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"a")
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            batch = await anext(consumer)
            assert consumer._db is not None
            hold_commit, entered, release = commit_holder()
            await consumer._db.set_trace_callback(hold_commit)

            async def apply() -> None:
                async with consumer.transaction(batch) as tx:
                    await tx.execute("CREATE TABLE effects (seq INTEGER)")
                    await tx.execute("INSERT INTO effects VALUES (?)", (batch.last_seq,))

            task = asyncio.create_task(apply())
            assert await asyncio.to_thread(entered.wait, 10)
            task.cancel()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert consumer.applied == 1
            with pytest.raises(OutOfOrderBatchError):
                await apply()
    with contextlib.closing(sqlite3.connect(consumer_db)) as db:
        assert db.execute("SELECT seq FROM effects").fetchall() == [(1,)]
