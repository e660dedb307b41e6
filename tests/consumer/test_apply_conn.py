"""A consumer applying batches through the application's own connection or ORM session:
``streamq.save_position`` stores the position in the application's transaction."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from sqlalchemy import Integer, LargeBinary, create_engine, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import streamq
from streamq import Consumer, Producer


class Base(DeclarativeBase):
    pass


class Entry(Base):
    """What the consumer's application writes for each record, through its ORM."""

    __tablename__ = "entries"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[bytes] = mapped_column(LargeBinary)


async def publish(producer: Producer, count: int) -> None:
    async with producer.transaction() as tx:
        for n in range(count):
            await tx.publish("orders", b"order %d" % n)


async def test_an_orm_consumer_applies_exactly_once_and_resumes(
    producer_db: str, consumer_db: str
) -> None:
    engine = create_engine(f"sqlite:///{consumer_db}", connect_args={"timeout": 30})
    Base.metadata.create_all(engine)

    def apply(batch: streamq.Batch, fail: bool = False) -> None:
        with Session(engine) as session, session.begin():
            session.add_all(Entry(seq=r.seq, value=r.value) for r in batch)
            streamq.save_position(session, batch)
            if fail:
                raise RuntimeError("the application failed mid-batch")

    async with Producer(producer_db) as producer:
        await publish(producer, 10)
        consumer = Consumer(producer.address, "orders", db=consumer_db, name="ledger")
        async with consumer:
            batch = await anext(consumer)
            with pytest.raises(RuntimeError):
                await asyncio.to_thread(apply, batch, True)  # rolled back: effects and position
            await asyncio.to_thread(apply, batch)  # so the same batch applies again
            applied = f"applied up to seq {batch.last_seq}"
            with pytest.raises(streamq.OutOfOrderBatchError, match=applied):
                await asyncio.to_thread(apply, batch)  # but never twice
            await publish(producer, 20)
            batch = await anext(consumer)
            assert consumer.applied == batch.after == 10  # learnt when the next was asked for
            await asyncio.to_thread(apply, batch)
        # A restart resumes from the stored position: what the ORM committed with it.
        await publish(producer, 5)
        async with Consumer(producer.address, "orders", db=consumer_db, name="ledger") as again:
            batch = await anext(again)
            assert (batch.after, batch.last_seq) == (30, 35)
            await asyncio.to_thread(apply, batch)
            await publish(producer, 1)
            await anext(again)  # asking for more acknowledges what was applied
            async with asyncio.timeout(10):
                assert await producer.wait_applied("ledger", "orders", 35) == 35
    with Session(engine) as session:
        seqs = session.scalars(select(Entry.seq).order_by(Entry.seq)).all()
    engine.dispose()
    assert seqs == list(range(1, 36))


async def test_a_skipped_batch_is_refused(producer_db: str, consumer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, 10)
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            first = await anext(consumer)
            await publish(producer, 10)
            second = await anext(consumer)
            with sqlite3.connect(consumer_db) as conn:  # commits unless it raises
                with pytest.raises(streamq.OutOfOrderBatchError, match="applied nothing"):
                    streamq.save_position(conn, second)
                streamq.save_position(conn, first)
            with sqlite3.connect(consumer_db) as conn:
                streamq.save_position(conn, second)
            rows = conn.execute("SELECT seq FROM streamq_positions").fetchall()
            conn.close()
    assert rows == [(first.last_seq + len(second),)]


async def test_an_asyncio_orm_consumer(producer_db: str, consumer_db: str) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{consumer_db}")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    async with Producer(producer_db) as producer:
        await publish(producer, 12)
        async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
            async for batch in consumer:
                async with AsyncSession(engine) as session, session.begin():
                    session.add_all(Entry(seq=r.seq, value=r.value) for r in batch)
                    await streamq.save_position_async(session, batch)
                if batch.last_seq == 12:
                    break
    async with AsyncSession(engine) as session:
        seqs = (await session.scalars(select(Entry.seq))).all()
    await engine.dispose()
    assert sorted(seqs) == list(range(1, 13))


@pytest.mark.parametrize("asked", ["after the commit", "before the commit"])
async def test_a_position_saved_on_the_applications_connection_reaches_the_producer(
    producer_db: str, consumer_db: str, asked: str
) -> None:
    """The consumer ran no transaction to learn the position from: it reads it when asked
    for the next batch, and while it waits for one (the stream idle, or the next batch
    asked for before the commit, as a fan-in asks), within ``SAVED_POLL``. The producer's
    lag and ``wait_applied`` see it without another record."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{consumer_db}")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    try:
        async with Producer(producer_db) as producer:
            await publish(producer, 5)
            async with Consumer(producer.address, "orders", db=consumer_db, name="c") as consumer:
                batch = await anext(consumer)
                while batch.last_seq < 5:  # the records may come in more than one batch
                    async with consumer.transaction(batch):
                        pass
                    batch = await anext(consumer)
                waiting = None
                if asked == "before the commit":
                    waiting = asyncio.create_task(anext(consumer))
                async with AsyncSession(engine) as session, session.begin():
                    session.add_all(Entry(seq=r.seq, value=r.value) for r in batch)
                    await streamq.save_position_async(session, batch)
                if waiting is None:  # the stream is idle: this waits for a record
                    waiting = asyncio.create_task(anext(consumer))
                assert await producer.wait_applied("c", "orders", 5, timeout=10) == 5
                (lag,) = [lag for lag in producer.consumer_lags() if lag.consumer == "c"]
                assert (lag.applied, lag.lag) == (5, 0)
                await producer.publish("orders", b"next")
                assert [r.seq for r in await asyncio.wait_for(waiting, 10)] == [6]
    finally:
        await engine.dispose()
