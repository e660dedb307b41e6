"""WAL checkpoints run beside the writer (checkpoints.py), never inside its COMMITs, with
``durability="normal"``; with ``"full"`` the commits keep SQLite's own."""

from __future__ import annotations

import contextlib
import os
import sqlite3

from streamq import Consumer, Producer
from streamq.engines.sqlite.checkpoints import WRITER_AUTOCHECKPOINT, Checkpointer
from streamq.engines.sqlite.positions import SQLitePositionStore
from streamq.engines.sqlite.storage import SQLiteStorage
from streamq.records import values_only

from ..conftest import wait_for

PAGE = 4096  # SQLite's default page size, the tests' databases'


async def publish(producer: Producer, transactions: int) -> None:
    for _ in range(transactions):
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"v" * 1000] * 20)


async def test_the_checkpointer_copies_the_wal_back(producer_db: str) -> None:
    async with Producer(producer_db, serve=False) as producer:
        storage = producer.storage
        assert isinstance(storage, SQLiteStorage) and storage.checkpointer is not None
        (pages,) = storage.writer.raw.execute("PRAGMA wal_autocheckpoint").fetchone()
        assert pages == WRITER_AUTOCHECKPOINT  # the writer's own: a fallback only
        await publish(producer, 300)  # several thousand WAL pages: a burst
        checkpointer = storage.checkpointer

        def all_copied() -> bool:
            return checkpointer.last is not None and checkpointer.last[1] == checkpointer.last[2]

        await wait_for(all_copied, what="a checkpoint that copied the whole WAL")
        assert checkpointer.last is not None and checkpointer.last[1] > 1000
        assert producer.head("orders") == 6000


async def test_an_idle_checkpointer_sleeps_until_the_wal_is_written(producer_db: str) -> None:
    """Idle, it waits for the WAL's watch, not for its next look: a look every minute
    still checkpoints a write within the test's wait."""
    async with Producer(producer_db, serve=False):
        pass  # the database
    with contextlib.closing(sqlite3.connect(producer_db, isolation_level=None)) as db:
        db.execute("PRAGMA wal_autocheckpoint=0")  # this connection's own: none
        db.execute("SELECT count(*) FROM streamq_streams")  # the WAL, as a writer has it
        checkpointer = Checkpointer(producer_db, "normal", tick=60.0, interval=0.0)
        await checkpointer.start()
        try:
            db.execute("CREATE TABLE written (x)")
            await wait_for(lambda: checkpointer.checkpoints == 1, what="a checkpoint after a write")
            assert checkpointer.last is not None and checkpointer.last[1] == checkpointer.last[2]
        finally:
            await checkpointer.close()


async def test_commits_leave_the_wal_to_the_checkpointer(producer_db: str) -> None:
    """Had a commit checkpointed at SQLite's usual 1,000 pages, the WAL would have started
    over from its beginning and stayed near that size."""
    async with Producer(producer_db, serve=False) as producer:
        storage = producer.storage
        assert isinstance(storage, SQLiteStorage) and storage.checkpointer is not None
        await storage.checkpointer.close()  # stopped: nothing copies the WAL back now
        await publish(producer, 300)
        assert os.path.getsize(producer_db + "-wal") > 1.5 * 1000 * PAGE


async def test_sessions_leave_the_wal_to_the_checkpointer(producer_db: str) -> None:
    """A ``SyncProducer``'s threads commit on sessions of their own: their COMMITs leave
    the WAL to the producer's checkpointer too."""
    async with Producer(producer_db, serve=False) as producer:
        storage = producer.storage
        assert isinstance(storage, SQLiteStorage) and storage.checkpointer is not None
        await storage.checkpointer.close()  # stopped: nothing copies the WAL back now
        session = storage.session("normal")
        try:
            for _ in range(300):
                session.begin()
                session.append("orders", values_only([b"v" * 1000] * 20), 1 << 20)
                session.commit()
        finally:
            session.close()
        assert os.path.getsize(producer_db + "-wal") > 1.5 * 1000 * PAGE


async def test_consumers_databases_are_checkpointed_beside_their_commits(
    producer_db: str, consumer_db: str
) -> None:
    with contextlib.closing(sqlite3.connect(consumer_db)) as db:
        db.execute("CREATE TABLE seen (v BLOB)")
    async with Producer(producer_db) as producer:
        await publish(producer, 100)
        consumer = Consumer(producer.address, "orders", db=consumer_db, name="billing")
        async with consumer:
            store = consumer._store
            assert isinstance(store, SQLitePositionStore) and store._checkpointer is not None
            checkpointer = store._checkpointer
            async for batch in consumer:
                async with consumer.transaction(batch) as tx:
                    await tx.executemany(
                        "INSERT INTO seen (v) VALUES (?)", [(r.value,) for r in batch]
                    )
                if batch.last_seq == 2000:
                    break
            await checkpointer.checkpoint()
            assert checkpointer.last is not None and checkpointer.last[1] > 0


async def test_full_durability_keeps_sqlite_s_own_checkpoints(producer_db: str) -> None:
    async with Producer(producer_db, serve=False, durability="full") as producer:
        storage = producer.storage
        assert isinstance(storage, SQLiteStorage) and storage.checkpointer is None
        (pages,) = storage.writer.raw.execute("PRAGMA wal_autocheckpoint").fetchone()
        assert pages == 1000
        await publish(producer, 300)
        assert os.path.getsize(producer_db + "-wal") < 1.5 * 1000 * PAGE  # restarted
