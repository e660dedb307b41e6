"""A consumer name new to a producer's stream, on a database where another name applied
that stream, is refused until the application says where it starts: a misspelt name
would otherwise apply the whole stream a second time. Consumer databases of both
engines."""

from __future__ import annotations

import pytest

import streamq
from streamq import Consumer, GroupConsumer, Producer


async def publish(producer: Producer, *values: bytes) -> None:
    async with producer.transaction() as tx:
        await tx.publish_many("orders", list(values))


async def apply_all(consumer: Consumer | GroupConsumer, last: int) -> list[int]:
    """Apply batches (no effects but the position) up to seq ``last``; their seqs."""
    seen: list[int] = []
    async for batch in consumer:
        async with consumer.transaction(batch):
            seen += [record.seq for record in batch]
        if batch.last_seq >= last:
            return sorted(seen)
    raise AssertionError("the consumer ended")


async def test_a_misspelt_name_is_refused_and_a_new_one_starts_where_told(
    producer_db: str, either_consumer_db: str
) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, b"a", b"b", b"c")
        async with Consumer(
            producer.address, "orders", db=either_consumer_db, name="billing"
        ) as billing:
            assert await apply_all(billing, 3) == [1, 2, 3]
        typo = Consumer(producer.address, "orders", db=either_consumer_db, name="biling")
        with pytest.raises(streamq.NewConsumerNameError) as refused:
            await typo.start()
        await typo.close()
        assert refused.value.stored == {"billing": 3}
        message = str(refused.value)
        assert "consumer 'biling' has no position for stream 'orders'" in message
        assert "this database holds 'billing' (up to seq 3)" in message
        assert "start_seq=1 for the whole stream, start_seq=4 from where 'billing' is" in message
        # The refused name stored nothing: it is refused again, and 'billing' resumes.
        with pytest.raises(streamq.NewConsumerNameError):
            await Consumer(producer.address, "orders", db=either_consumer_db, name="biling").start()

        await publish(producer, b"d", b"e")
        options = {"db": either_consumer_db, "name": "audit"}
        async with Consumer(producer.address, "orders", start_seq=4, **options) as audit:
            assert await apply_all(audit, 5) == [4, 5]  # from where it was told
        await producer.publish("orders", b"f")
        async with Consumer(producer.address, "orders", start_seq=1, **options) as audit:
            assert await apply_all(audit, 6) == [6]  # resumes: start_seq is for a new name
        await producer.publish("orders", b"g")
        async with Consumer(
            producer.address, "orders", db=either_consumer_db, name="audit"
        ) as audit:
            assert await apply_all(audit, 7) == [7]  # its own position now: no refusal
        async with Consumer(
            producer.address, "orders", db=either_consumer_db, name="billing"
        ) as billing:
            assert await apply_all(billing, 7) == [4, 5, 6, 7]


async def test_a_groups_own_shares_are_not_another_name(
    producer_db: str, either_consumer_db: str
) -> None:
    """A group's members store positions as name[i/n]: the group started again is not a
    new name. Another group on the same database's stream (or the group's name misspelt)
    is, until told where to start, and the error names the group that applied it."""
    async with Producer(producer_db) as producer:
        await publish(producer, b"a", b"b")  # keyless: share 0
        options = {"db": either_consumer_db, "name": "billing", "shares": 2}
        async with GroupConsumer(producer.address, "orders", **options) as group:
            assert await apply_all(group, 2) == [1, 2]
        await producer.publish("orders", b"c")
        async with GroupConsumer(producer.address, "orders", **options) as group:
            assert await apply_all(group, 3) == [3]
        other = GroupConsumer(
            producer.address, "orders", db=either_consumer_db, name="audit", shares=2
        )
        try:
            with pytest.raises(streamq.NewConsumerNameError) as refused:
                await other.start()
                await anext(other)
        finally:
            await other.close()
        # Named as the application gives it, not by its shares' positions (billing[0/2]).
        message = str(refused.value)
        assert "this database holds 'billing' (2 shares, up to seq 3)" in message
        assert "Give the name it applied under ('billing')" in message
        assert "[" not in message
        told = GroupConsumer(
            producer.address, "orders", db=either_consumer_db, name="audit", shares=2, start_seq=3
        )
        async with told:
            assert await apply_all(told, 3) == [3]
