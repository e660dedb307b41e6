"""A bug the PostgreSQL crash run (tests/test_crash.py) found, reduced to its steps: the
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
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest

import streamq
from streamq.errors import SeqsReusedError

STREAM = "orders"


def publish_elsewhere(url: str, value: bytes) -> int:
    """``streamq.publish`` from another connection, committed; its seq."""
    with psycopg.connect(url) as conn:
        seq = streamq.publish(conn, STREAM, value)
        conn.commit()
    return seq


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
    async with streamq.Producer(pg_url) as first:  # epoch E1 writes seq 1
        await first.publish(STREAM, b"one")
    async with streamq.Producer(pg_url) as producer:  # takes E2
        async with producer.transaction() as tx:
            # Holding the producer's writer (so its catch-up waits): another process
            # publishes seq 2, the first record of E2's segment, and commits...
            assert await asyncio.to_thread(publish_elsewhere, pg_url, b"two") == 2
            # ...then the producer's own transaction appends seq 3 after it.
            assert await tx.publish(STREAM, b"three") == 3
        (_, e1), (second, e2) = epoch_rows(pg_url)
        assert second == 2 and e2 > e1  # the database: seq 2 is E2's

        stream = producer.log.streams[STREAM]
        # What the producer serves seq 2 under (RECORDS frames, SUBSCRIBED.after_epoch).
        assert stream.epochs.epoch_of(2) == e2, (
            f"the producer serves seq 2 under epoch {stream.epochs.epoch_of(2)}, "
            f"the database says {e2}"
        )


async def test_a_consumer_is_not_told_seqs_were_reused_when_none_were(
    pg_url: str, tmp_path: Path
) -> None:
    """The consequence: a consumer applies seqs 1..3, as served; later the producer learns
    seq 2's segment, and the consumer's next start is refused."""
    consumer_db = str(tmp_path / "consumer.db")
    async with streamq.Producer(pg_url) as first:
        await first.publish(STREAM, b"one")
    async with streamq.Producer(pg_url) as producer:
        async with producer.transaction() as tx:
            await asyncio.to_thread(publish_elsewhere, pg_url, b"two")
            await tx.publish(STREAM, b"three")
        async with streamq.Consumer(
            producer.address, STREAM, db=consumer_db, name="billing"
        ) as consumer:
            while consumer.applied < 3:  # seq 1 (E1), then 2..3 (E2): frames keep to a segment
                batch = await asyncio.wait_for(anext(consumer), 10)
                async with consumer.transaction(batch):
                    pass  # applies them and stores the epoch they were served under
            assert consumer.applied == 3
        # Any later commit by another writer: the producer catches up, seq 2's row too.
        await asyncio.to_thread(publish_elsewhere, pg_url, b"four")
        deadline = asyncio.get_running_loop().time() + 10
        while producer.head(STREAM) < 4:
            assert asyncio.get_running_loop().time() < deadline, "the producer never saw seq 4"
            await asyncio.sleep(0.01)
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
