"""A bug the PostgreSQL crash run (tests/crash/test_crash.py) found, reduced to its steps: the
serving producer pushes another writer's records under the wrong epoch, and a consumer
that applied them is later refused with ``SeqsReusedError`` though nothing was lost.

A producer start takes a new epoch (E2). The first record after it may be another
writer's (``streamq.publish``): it starts the new segment, so its transaction inserts the
``streamq_epochs`` row (s, E2). If the producer's own next transaction commits before the
producer has caught up with that writer's commit, it finds the stream's last segment
already at E2 under the lock (``AppendState.last_epoch == epoch``), adds no segment, and
``_after_commit`` moves the in-memory head past s without the row. The catch-up that
follows finds the head not grown and loads no epoch row either, so the producer pushes
seqs s.. stamped with the previous segment's epoch (E1) until some later commit makes it
load (s, E2). A consumer that stored E1 with its position is then told, at its next
subscribe, that seqs s.. were written again by a higher epoch: ``SeqsReusedError``, and it
refuses to go on. In the crash run: a producer killed, other writers publishing while
none serves, the next producer's first transaction committing right after theirs.

Since PostgreSQL records are numbered by the serving producer once committed
(``engines/postgres/numbering.py``), there is no lock and no catch-up to race: the
numbering round that gives another writer's record the first seq after a producer start
writes the segment's epoch row itself and hands the segment to the log. The tests keep
the scenario (a producer start, another writer's commit inside the producer's own
transaction, then the producer's record) and check what matters to a consumer: the
records are served under the epoch the database holds for them, and nothing is taken
for reused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest

import streamq
from streamq.errors import SeqsReusedError

STREAM = "orders"


def publish_elsewhere(url: str, value: bytes) -> streamq.Receipt:
    """``streamq.publish`` from another connection, committed; its receipt (the serving
    producer numbers the record)."""
    with psycopg.connect(url) as conn:
        receipt = streamq.publish(conn, STREAM, value)
        conn.commit()
    assert isinstance(receipt, streamq.Receipt), receipt
    return receipt


def epoch_rows(url: str) -> list[tuple[int, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT e.first_seq, e.epoch FROM streamq_epochs e "
            "JOIN streamq_streams s ON s.id = e.stream_id WHERE s.name = %s ORDER BY 1",
            (STREAM,),
        ).fetchall()
    return [(int(first), int(epoch)) for first, epoch in rows]


async def test_another_writers_new_segment_is_served_under_its_epoch(
    pg_url: str, tmp_path: Path
) -> None:
    async with streamq.Producer(pg_url) as first:  # epoch E1 numbers seq 1
        assert await first.publish(STREAM, b"one") == 1
    async with streamq.Producer(pg_url) as producer:  # takes E2
        async with producer.transaction() as tx:
            # Inside the producer's transaction, another process publishes and commits:
            # its record is the first of E2's segment, seq 2...
            two = await asyncio.to_thread(publish_elsewhere, pg_url, b"two")
            # ...then the producer's own transaction publishes, after that commit.
            three = await tx.publish(STREAM, b"three")
        assert isinstance(three, streamq.Receipt)
        assert await producer.wait_served(two, timeout=10) == range(2, 3)
        assert await producer.wait_served(three, timeout=10) == range(3, 4)  # served already
        (first_seq, e1), (second, e2) = epoch_rows(pg_url)
        assert (first_seq, second) == (1, 2) and e2 > e1  # the database: seq 2 starts E2's
        assert producer.epoch == e2

        stream = producer.log.streams[STREAM]
        # What the producer serves seqs 1..3 under (RECORDS frames, SUBSCRIBED.after_epoch).
        served = [stream.epochs.epoch_of(seq) for seq in (1, 2, 3)]
        assert served == [e1, e2, e2], (
            f"the producer serves seqs 1..3 under epochs {served}, the database says {[e1, e2, e2]}"
        )


async def test_a_consumer_is_not_told_seqs_were_reused_when_none_were(
    pg_url: str, tmp_path: Path
) -> None:
    """The bug's consequence: a consumer applies seqs 1..3, as served; after another
    writer's later record is served, the consumer's next start must not be refused (it
    was, once the producer learnt seq 2's segment), and it gets just that record."""
    consumer_db = str(tmp_path / "consumer.db")
    async with streamq.Producer(pg_url) as first:
        assert await first.publish(STREAM, b"one") == 1
    async with streamq.Producer(pg_url) as producer:
        async with producer.transaction() as tx:
            two = await asyncio.to_thread(publish_elsewhere, pg_url, b"two")
            await tx.publish(STREAM, b"three")
        assert await producer.wait_served(two, timeout=10) == range(2, 3)
        async with streamq.Consumer(
            producer.address, STREAM, db=consumer_db, name="billing"
        ) as consumer:
            while consumer.applied < 3:  # seq 1 (E1), then 2..3 (E2): frames keep to a segment
                batch = await asyncio.wait_for(anext(consumer), 10)
                async with consumer.transaction(batch):
                    pass  # applies them and stores the epoch they were served under
            assert consumer.applied == 3
        # Any later commit by another writer, numbered and served.
        four = await asyncio.to_thread(publish_elsewhere, pg_url, b"four")
        assert await producer.wait_served(four, timeout=10) == range(4, 5)
        assert producer.head(STREAM) == 4
        # Nothing was lost or written again: seqs 1..4 are what they always were.
        consumer = streamq.Consumer(producer.address, STREAM, db=consumer_db, name="billing")
        try:
            await consumer.start()
        except SeqsReusedError as exc:
            pytest.fail(f"refused though no seq was reused: {exc}")
        try:
            batch = await asyncio.wait_for(anext(consumer), 10)
            assert [record.value for record in batch] == [b"four"]
        finally:
            await consumer.close()
