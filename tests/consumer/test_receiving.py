"""A consumer's receiving side: frames decoded as reads arrive, under TCP flow control."""

from __future__ import annotations

import asyncio

from streamq import Consumer, Producer

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
