"""Epochs: which producer instance wrote which seqs, and consumers that catch re-used seqs.

Real producers and consumers on loopback and real SQLite files. A lost suffix of commits
is made with SQLite's backup API (a consistent copy taken at the moment the power "goes
out"); tests/crash/test_power_loss.py does it at the level of WAL frames.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable

import pytest

from streamq import Consumer, Producer, SeqsReusedError
from streamq.producer.committed_log import Epochs

from ..conftest import wait_for
from ..consumer.test_consumer import apply, credits


def epoch_rows(path: str) -> list[tuple[int, int]]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute(
            "SELECT first_seq, epoch FROM streamq_epochs ORDER BY first_seq"
        ).fetchall()


def image_at(path: str, target: str) -> None:
    """A consistent copy of the database as it is now: what a power loss after this keeps."""
    with (
        contextlib.closing(sqlite3.connect(path)) as src,
        contextlib.closing(sqlite3.connect(target)) as dst,
    ):
        src.backup(dst)


def restore(image: str, path: str) -> None:
    for leftover in (path + "-wal", path + "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(leftover)
    os.replace(image, path)


def test_epochs_lookup() -> None:
    epochs = Epochs()
    assert epochs.epoch_of(5) == 0 and epochs.vouch(5, 5, 1) == (0, 0)
    for first, epoch in ((1, 1), (11, 3), (21, 4), (31, 2), (41, 5)):
        epochs.add(first, epoch)
    epochs.add(41, 9)  # an older row loaded again is ignored
    assert [epochs.epoch_of(s) for s in (1, 10, 11, 30, 31, 45)] == [1, 1, 3, 4, 2, 5]
    assert epochs.segment_end(12) == 21 and epochs.segment_end(41) == 1 << 63
    # vouch(position, head, the highest epoch the client read) -> (after_epoch, rewritten_from)
    assert epochs.vouch(15, 50, 3) == (3, 0)  # same epoch: intact
    assert epochs.vouch(35, 50, 4) == (2, 0)  # a lower one: written before the client read it
    assert epochs.vouch(15, 50, 1) == (3, 11)  # seqs 11.. rewritten by epoch 3
    assert epochs.vouch(25, 50, 1) == (4, 11)  # by epochs 3 and 4
    assert epochs.vouch(45, 50, 4) == (5, 41)  # epoch 2's segment is older: it stops there
    assert epochs.vouch(45, 50, 0) == (5, 0)  # the client's epoch unknown: nothing to say
    assert epochs.vouch(0, 50, 0) == (0, 0)
    # The head went back below the position: seqs written by lower epochs are intact ...
    assert epochs.vouch(60, 15, 4) == (0, 0)
    # ... those by higher ones were written after the loss.
    assert epochs.vouch(60, 45, 4) == (0, 41)


async def test_each_writer_process_is_recorded_and_no_false_alarm(
    producer_db: str, consumer_db: str, reserve_port: Callable[[], int]
) -> None:
    """Every writer stamps its records with the database's current epoch, and a producer
    starting in another process makes a new one: the serving producer's next commit
    carries it too. Consumers store the epochs, and a restart raises nothing."""
    port = reserve_port()
    async with Producer(producer_db, port=port, watch_interval=0.02) as server:
        await server.publish("orders", b"a1")
        await server.publish("orders", b"a2")
        e = server.epoch
        async with Producer(producer_db, serve=False) as other:  # starts while served
            assert other.epoch > e
            other_epoch = other.epoch
            await other.publish("orders", b"b3")
        await wait_for(lambda: server.head("orders") == 3)
        await server.publish("orders", b"a4")
        async with Producer(producer_db, serve=False) as third:  # starts, writes nothing
            assert third.epoch > other.epoch
            third_epoch = third.epoch
        await server.publish("orders", b"a5")
        assert server.epoch == third.epoch  # learnt when its transaction began
        consumer = Consumer(server.address, "orders", db=consumer_db, name="c", max_batch_records=1)
        async with consumer:  # one batch per frame
            epochs = []
            async for batch in consumer:
                async with consumer.transaction(batch):
                    pass
                epochs += [batch.epoch] * len(batch)
                if batch.last_seq == 5:
                    break
        # Frames split at each epoch's segment; a batch carries the highest epoch so far.
        e2, e3 = other_epoch, third_epoch
        assert epochs == [e, e, e2, e2, e3]
    assert epoch_rows(producer_db) == [(1, e), (3, e2), (5, e3)]
    async with Producer(producer_db, port=port) as restarted:
        await restarted.publish("orders", b"a6")
        async with Consumer(restarted.address, "orders", db=consumer_db, name="c") as consumer:
            assert (await apply(consumer, 6)) == [6]
    assert epoch_rows(producer_db)[-1] == (6, restarted.epoch) and restarted.epoch > e3


async def test_lost_commits_with_reused_seqs_are_refused(
    producer_db: str, consumer_db: str
) -> None:
    image = str(producer_db) + ".image"
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"kept")
        image_at(producer_db, image)  # the power goes out here: seqs 2.. are not synced
        for n in range(2, 6):
            await producer.publish("orders", b"lost %d" % n)
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            await apply(consumer, 5)
    restore(image, producer_db)
    async with Producer(producer_db) as restarted:
        assert restarted.head("orders") == 1
        for n in range(2, 9):
            await restarted.publish("orders", b"new %d" % n)  # seqs 2..5 re-used
        consumer = Consumer(restarted.address, "orders", db=consumer_db, name="c")
        with pytest.raises(SeqsReusedError, match=r"seqs 2\.\.5") as info:
            await consumer.start()
        assert info.value.lost == range(2, 6)
    assert [seq for seq, _ in credits(consumer_db)] == [1, 2, 3, 4, 5]  # nothing more applied


async def test_a_database_restored_from_an_older_copy_is_refused_even_past_its_head(
    producer_db: str, consumer_db: str
) -> None:
    """The copy was taken before a restart: the lost records were written by the next
    producer instance, whose epoch the restored database's stored epoch would give again
    (it did, before epochs took the time too). The restored producer commits more than
    was lost, so its head is past the consumer's position: only epochs can tell."""
    image = str(producer_db) + ".image"
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"kept")
        image_at(producer_db, image)  # last night's backup
    async with Producer(producer_db) as later:
        for n in range(2, 5):
            await later.publish("orders", b"lost %d" % n)
        async with Consumer(later.address, "orders", db=consumer_db, name="c") as consumer:
            await apply(consumer, 4)
    restore(image, producer_db)  # the disk died; the backup comes back
    async with Producer(producer_db) as restored:
        assert restored.epoch > later.epoch
        for n in range(2, 9):
            await restored.publish("orders", b"new %d" % n)  # seqs 2..8: past the consumer
        consumer = Consumer(restored.address, "orders", db=consumer_db, name="c")
        with pytest.raises(SeqsReusedError, match=r"seqs 2\.\.4") as info:
            await consumer.start()
        assert info.value.lost == range(2, 5)
    assert [seq for seq, _ in credits(consumer_db)] == [1, 2, 3, 4]  # nothing more applied


async def test_a_consumer_without_database_catches_reuse_on_reconnect(
    producer_db: str, reserve_port: Callable[[], int]
) -> None:
    image = str(producer_db) + ".image"
    port = reserve_port()
    producer = Producer(producer_db, port=port)
    await producer.start()
    for n in range(1, 4):
        await producer.publish("orders", b"%d" % n)
    image_at(producer_db, image)
    for n in range(4, 8):
        await producer.publish("orders", b"%d" % n)
    consumer = Consumer(producer.address, "orders", reconnect_timeout=20)
    await consumer.start()
    try:
        seen = []
        async for batch in consumer:
            seen += [r.seq for r in batch]
            if seen[-1] == 7:
                break
        await producer.close()
        restore(image, producer_db)
        # Written before the port is served again: the consumer, reconnecting, finds
        # seqs 4..7 re-used (not a head below them, which it would if it came first).
        async with Producer(producer_db, serve=False) as writer, writer.transaction() as tx:
            await tx.publish_many("orders", [b"x"] * 10)  # seqs 4..13, 4..7 re-used
        producer = Producer(producer_db, port=port)
        await producer.start()
        with pytest.raises(SeqsReusedError) as info:
            async for _ in consumer:
                pass
        assert info.value.lost == range(4, 8)
    finally:
        await consumer.close()
        await producer.close()


async def test_positions_table_of_an_older_streamq_gets_the_epoch_column(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"1")
        await producer.publish("orders", b"2")
        with contextlib.closing(sqlite3.connect(consumer_db)) as db:
            db.execute(
                "CREATE TABLE streamq_positions (consumer TEXT NOT NULL, producer_id TEXT NOT NULL,"
                " stream TEXT NOT NULL, seq INTEGER NOT NULL, endpoint TEXT NOT NULL,"
                " updated_at INTEGER NOT NULL, PRIMARY KEY (consumer, producer_id, stream))"
            )
            db.execute(
                "INSERT INTO streamq_positions VALUES ('c', ?, 'orders', 1, ?, 0)",
                (producer.producer_id, producer.address),
            )
            db.commit()
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            assert await apply(consumer, 2) == [2]
        with contextlib.closing(sqlite3.connect(consumer_db)) as db:
            assert db.execute("SELECT seq, epoch FROM streamq_positions").fetchall() == [
                (2, producer.epoch)
            ]


async def test_a_stream_made_by_another_process_is_served_with_its_epoch(
    producer_db: str,
) -> None:
    async with Producer(producer_db, watch_interval=0.02) as server:
        async with Producer(producer_db, serve=False) as other:
            await other.publish("audit", b"1")
        await wait_for(lambda: "audit" in server.log.streams)
        async with Consumer(server.address, "audit") as consumer:
            batch = await anext(consumer)
        assert (batch.last_seq, batch.epoch) == (1, other.epoch)
