"""A consumer's receiving side: frames decoded as reads arrive, under TCP flow control."""

from __future__ import annotations

import asyncio

import pytest

from streamq import ConnectionLostError, Consumer, Producer
from streamq.consumer.settings import ConsumerSettings
from streamq.consumer.subscription import Received, Resume, Subscription
from streamq.protocol import Record

from ..conftest import wait_for

RECORD = b"r" * 1000
TRANSACTIONS = 40
PER_TRANSACTION = 1000  # 40 MB in all


async def test_a_consumer_whose_application_takes_nothing_holds_the_producer_back(
    producer_db: str,
) -> None:
    """Past ``queue_batches`` waiting, the consumer stops reading its socket: the producer's
    writes for it stop at the socket buffers, and its own memory holds a few batches, not
    the stream. Taken again, everything comes, in order."""
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        server = producer.server
        assert server is not None
        async with Consumer(producer.address, "orders", start_seq=1, queue_batches=2) as idle:
            await wait_for(lambda: len(server.subscriptions) == 1, what="the subscription")
            (subscription,) = server.subscriptions
            for _ in range(TRANSACTIONS):
                async with producer.transaction() as tx:
                    await tx.publish_many("orders", [RECORD] * PER_TRANSACTION)
            total = TRANSACTIONS * PER_TRANSACTION
            # Held back: the server has stopped writing for it (its buffer is past the mark).
            await wait_for(
                lambda: subscription.buffered > 0 and subscription.sent < total,
                what="the producer held back by the consumer's full socket",
            )
            inbox = idle.subscription._inbox
            held = sum(len(batch.records) for batch in inbox if not isinstance(batch, Exception))
            assert held * len(RECORD) < 8 * 1024 * 1024, f"{held} records waiting in the consumer"
            assert subscription.sent < total // 2, subscription.sent

            expected = 1
            async with asyncio.timeout(60):
                async for batch in idle:
                    assert [r.seq for r in batch] == list(range(expected, batch.last_seq + 1))
                    expected = batch.last_seq + 1
                    if batch.last_seq == total:
                        break
            assert expected == total + 1


def batch(after: int, last: int, epoch: int = 1) -> Received:
    records = tuple(Record(seq, 0, None, b"v", {}) for seq in range(after + 1, last + 1))
    return Received("p1", after, records, epoch, last)


async def test_batches_waiting_behind_each_other_are_taken_as_one_up_to_the_limit() -> None:
    """``next`` merges what waits in the inbox into one batch until ``max_records`` is
    reached (a batch is never split), and stops at a failure queued among them, which the
    call after raises, before the batches behind it."""

    async def no_resume(producer_id: str, seek: object) -> Resume:
        raise AssertionError("never connected")

    subscription = Subscription(
        "127.0.0.1:1", "orders", "c", ConsumerSettings(), no_resume, lambda: 0
    )
    for item in (batch(0, 2), batch(2, 3), batch(3, 6, epoch=2), batch(6, 7)):
        subscription._put(item)
    first = await subscription.next(max_records=4)
    assert [r.seq for r in first.records] == [1, 2, 3, 4, 5, 6]
    assert (first.after, first.last_seq, first.epoch) == (0, 6, 2)
    assert await subscription.next(max_records=1) == batch(6, 7)

    queued: list[Received | BaseException] = [batch(7, 8), ConnectionLostError("gone"), batch(8, 9)]
    for queued_item in queued:
        subscription._put(queued_item)
    assert await subscription.next(max_records=100) == batch(7, 8)
    with pytest.raises(ConnectionLostError):
        await subscription.next(max_records=100)
    assert await subscription.next(max_records=100) == batch(8, 9)
