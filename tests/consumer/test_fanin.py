"""Fan-in: one consumer, the same stream from several producers, exactly once per producer."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from streamq import (
    Batch,
    BlockingSQL,
    Consumer,
    FanInConsumer,
    OutOfOrderBatchError,
    Producer,
    ProducerChangedError,
)
from streamq.engines.sqlite.storage import HEAD_QUERY

from ..conftest import wait_for
from ..crashrun import Proc

STREAM = "orders"


async def apply(fanin: FanInConsumer, last: dict[str, int]) -> int:
    """Apply one batch into ``applied``, checking each producer's seqs follow on; its size."""
    batch = await anext(fanin)
    assert batch.first_seq == last.get(batch.producer_id, 0) + 1, "a producer's order broke"
    async with fanin.transaction(batch) as tx:
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS applied "
            "(producer TEXT, seq INTEGER, value BLOB, PRIMARY KEY (producer, seq))"
        )
        await tx.executemany(
            "INSERT INTO applied VALUES (?, ?, ?)",
            [(batch.producer_id, r.seq, r.value) for r in batch],
        )
    last[batch.producer_id] = batch.last_seq
    return len(batch)


def insert_rows(tx: BlockingSQL, batch: Batch) -> None:
    tx.executemany(
        "INSERT INTO applied VALUES (?, ?, ?)", [(batch.producer_id, r.seq, r.value) for r in batch]
    )


def applied_rows(path: str) -> dict[str, list[int]]:
    seqs: dict[str, list[int]] = {}
    with contextlib.closing(sqlite3.connect(path)) as db:
        for producer, seq in db.execute("SELECT producer, seq FROM applied ORDER BY rowid"):
            seqs.setdefault(producer, []).append(seq)
    return seqs


async def test_three_producers_into_one_database(tmp_path: Path, consumer_db: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        producers = [
            await stack.enter_async_context(Producer(str(tmp_path / f"p{i}.db"))) for i in range(3)
        ]
        for i, producer in enumerate(producers):
            async with producer.transaction() as tx:
                await tx.publish_many(STREAM, [b"p%d-%d" % (i, n) for n in range(50 * (i + 1))])
        addresses = [p.address for p in producers]
        last: dict[str, int] = {}
        async with FanInConsumer(addresses, STREAM, db=consumer_db, name="billing") as fanin:
            applied = 0
            while applied < 300:
                applied += await apply(fanin, last)
            assert fanin.lag == 0
            await producers[0].publish(STREAM, b"unread")
            assert await fanin.fetch_lag() == 1
            assert fanin.applied == {p.address: 50 * (i + 1) for i, p in enumerate(producers)}
            for i, producer in enumerate(producers):
                await producer.wait_applied("billing", STREAM, 50 * (i + 1), timeout=10)
        for producer in producers[1:]:
            await producer.publish(STREAM, b"after")
        # Restarted: each producer resumes from its own stored position (applied in one hop).
        async with FanInConsumer(addresses, STREAM, db=consumer_db, name="billing") as fanin:
            for _ in range(3):
                batch = await anext(fanin)
                assert batch.first_seq == last[batch.producer_id] + 1
                await fanin.apply(batch, insert_rows)
                with pytest.raises(OutOfOrderBatchError):
                    await fanin.apply(batch, insert_rows)
        rows = applied_rows(consumer_db)
        for i, producer in enumerate(producers):
            assert rows[producer.producer_id] == list(range(1, 50 * (i + 1) + 2))
        with contextlib.closing(sqlite3.connect(consumer_db)) as db:
            positions = dict(db.execute("SELECT producer_id, seq FROM streamq_positions"))
        assert positions == {p.producer_id: p.head(STREAM) for p in producers}


async def test_batches_stay_with_their_producer(tmp_path: Path, consumer_db: str) -> None:
    async with Producer(str(tmp_path / "a.db")) as a, Producer(str(tmp_path / "b.db")) as b:
        await a.publish(STREAM, b"a1")
        await b.publish(STREAM, b"b1")
        with pytest.raises(ValueError, match="serve the same producer"):
            async with FanInConsumer(
                [a.address, a.address.replace("127.0.0.1", "localhost")], STREAM
            ):
                pass
        async with FanInConsumer([a.address, b.address], STREAM, db=consumer_db, name="x") as f:
            first = await anext(f)
            second = await anext(f)
            assert {first.producer_id, second.producer_id} == {a.producer_id, b.producer_id}
            async with f.transaction(second):
                pass
            with pytest.raises(OutOfOrderBatchError):  # the same batch twice
                async with f.transaction(second):
                    pass
            # A batch from a single consumer of another producer is not this fan-in's.
            async with Producer(str(tmp_path / "c.db")) as c:
                await c.publish(STREAM, b"c1")
                async with Consumer(c.address, STREAM) as other:
                    stray = await anext(other)
                with pytest.raises(ValueError, match="not read here"):
                    async with f.transaction(stray):
                        pass


async def test_the_name_is_bound_to_the_producers_the_fan_in_lists(
    tmp_path: Path, consumer_db: str
) -> None:
    """A producer at a listed address starts next to the others' positions under the
    shared name; one at an address the name never read, while it holds positions from a
    producer no longer listed, is refused unless ``allow_new_producer=True``."""
    async with contextlib.AsyncExitStack() as stack:
        a, b, c = [
            await stack.enter_async_context(Producer(str(tmp_path / f"{n}.db"))) for n in "abc"
        ]
        await a.publish(STREAM, b"a1")
        await b.create_stream(STREAM)  # nothing in it yet: no position from b
        last: dict[str, int] = {}
        async with FanInConsumer([a.address, b.address], STREAM, db=consumer_db, name="x") as f:
            assert await apply(f, last) == 1 and last == {a.producer_id: 1}
        await b.publish(STREAM, b"b1")
        async with FanInConsumer([a.address, b.address], STREAM, db=consumer_db, name="x") as f:
            assert await apply(f, last) == 1 and last[b.producer_id] == 1

        await c.publish(STREAM, b"c1")
        with pytest.raises(ProducerChangedError) as info:
            async with FanInConsumer([a.address, c.address], STREAM, db=consumer_db, name="x"):
                pass
        message = str(info.value)
        assert f"{c.address} serves producer {c.producer_id}, but consumer 'x'" in message
        assert f"from producer {b.producer_id} (at {b.address}, up to seq 1)" in message
        assert a.producer_id not in message  # listed: expected under the name
        assert "allow_new_producer=True" in message
        async with FanInConsumer(
            [a.address, c.address], STREAM, db=consumer_db, name="x", allow_new_producer=True
        ) as f:
            assert await apply(f, last) == 1 and last[c.producer_id] == 1
    assert applied_rows(consumer_db) == {p.producer_id: [1] for p in (a, b, c)}


TOTAL = 2_000  # records per producer process
PACE = 2_000  # records per second each publishes, at most


async def test_kill_9_one_producer_while_the_others_go_on(
    tmp_path: Path, consumer_db: str, reserve_port: Callable[[], int]
) -> None:
    ports = [reserve_port() for _ in range(3)]
    dbs = [str(tmp_path / f"producer{i}.db") for i in range(3)]
    allow = [tmp_path / f"allow{i}" for i in range(3)]  # how far each producer may publish

    def release(i: int, upto: int) -> None:
        allow[i].write_text(str(upto))

    def start(i: int, life: int) -> Proc:
        args = [dbs[i], str(ports[i]), str(TOTAL), "--pace", str(PACE), "--seed", str(i)]
        args += ["--allow", str(allow[i])]
        proc = Proc("producer_proc.py", args, tmp_path / f"producer{i}-{life}.log")
        proc.wait_line("READY", 20, proc.tail)
        return proc

    release(0, 400)
    release(1, TOTAL)  # the victim publishes all along, so it dies mid-publishing
    release(2, 400)
    procs = [start(i, 0) for i in range(3)]
    try:
        addresses = [f"127.0.0.1:{port}" for port in ports]
        last: dict[str, int] = {}
        async with FanInConsumer(addresses, STREAM, db=consumer_db, name="billing") as fanin:
            ids = [c.producer_id for c in fanin.consumers]
            victim = ids[1]
            assert victim is not None and None not in ids

            async def apply_until(done: Callable[[], bool]) -> None:
                async with asyncio.timeout(60):
                    while not done():
                        await apply(fanin, last)

            await apply_until(lambda: last.get(victim, 0) >= 300)
            assert procs[1].kill()  # kill -9
            with contextlib.closing(sqlite3.connect(dbs[1])) as db:
                (head_at_kill,) = db.execute(HEAD_QUERY, (STREAM,)).fetchone()
            # The others go on while it is down.
            release(0, 1_000)
            release(2, 1_000)
            await apply_until(lambda: last.get(ids[0], 0) >= 1_000 and last.get(ids[2], 0) >= 1_000)
            assert last.get(victim, 0) <= head_at_kill  # only what it had committed
            procs[1] = start(1, 1)  # same files, same port
            release(0, TOTAL)
            release(2, TOTAL)
            await apply_until(lambda: all(last.get(p, 0) >= TOTAL for p in ids if p))
            assert fanin.consumers[1].reconnects >= 1
            assert fanin.consumers[0].reconnects == fanin.consumers[2].reconnects == 0
            await wait_for(lambda: fanin.lag == 0, what="no lag")
        rows = applied_rows(consumer_db)
        for producer_id in ids:
            assert producer_id is not None
            assert rows[producer_id] == list(range(1, TOTAL + 1))  # once each, in order
    finally:
        for proc in procs:
            proc.kill()
