"""Group commit: concurrent ``run_in_transaction`` calls share one COMMIT, each in its own
savepoint, with the outcome serial execution in arrival order would give."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading

import pytest

import streamq
from streamq import BlockingTransaction, Producer

from .test_producer import log_seqs


class Gate:
    """Holds the writer's thread inside a transaction until the test opens it, so that the
    transactions started meanwhile queue up and commit as one group. (The producers here
    have ``durability="full"``: their groups run on the writer's thread, never inline on
    the event loop's, which the gate would hold.)"""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def hold(self, tx: BlockingTransaction) -> int:
        seq = tx.publish("orders", b"first")
        self.entered.set()
        assert self.opened.wait(10)
        return seq


def read(address: str, stream: str, head: int) -> list[streamq.Record]:
    """What a consumer gets of seqs 1..head (a blocking client: on a thread of its own)."""
    with streamq.Client(address) as client:
        return [r for batch in client.read_range(stream, 1, head + 1) for r in batch]


def count_and_publish(tx: BlockingTransaction, i: int, fail: bool) -> tuple[int, int]:
    """Increment a counter, publish what it was: the serial order shows in both."""
    tx.execute("CREATE TABLE IF NOT EXISTS counter (n INTEGER NOT NULL)")
    tx.execute("INSERT INTO counter SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM counter)")
    (seen,) = tx.execute("SELECT n FROM counter").fetchone()
    tx.execute("UPDATE counter SET n = n + 1")
    seq = tx.publish("orders", b"%d:%d" % (i, seen))
    if fail:
        raise ValueError(f"member {i} gives up")
    return seq, seen


async def queued_behind(
    producer: Producer, gate: Gate, calls: list[asyncio.Future[object]]
) -> tuple[int, list[object]]:
    """Run ``gate.hold`` first, queue ``calls`` behind it, then open the gate."""
    first = asyncio.ensure_future(producer.run_in_transaction(gate.hold))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    tasks = [asyncio.ensure_future(call) for call in calls]
    await asyncio.sleep(0)  # every call is queued
    gate.opened.set()
    return await first, await asyncio.gather(*tasks, return_exceptions=True)


async def test_queued_transactions_commit_as_one_group_in_serial_order(
    producer_db: str,
) -> None:
    failing = {3, 17, 31}
    gate = Gate()
    async with Producer(producer_db, durability="full") as producer:
        calls = [producer.run_in_transaction(count_and_publish, i, i in failing) for i in range(32)]
        first, outcomes = await queued_behind(producer, gate, calls)  # type: ignore[arg-type]
        assert first == 1
        assert (producer.groups.groups, producer.groups.members) == (2, 30)
        assert producer.head("orders") == 30
        records = await asyncio.to_thread(read, producer.address, "orders", 30)
    kept = [i for i in range(32) if i not in failing]
    for i, outcome in enumerate(outcomes):
        if i in failing:
            assert isinstance(outcome, ValueError) and f"member {i}" in str(outcome)
    # Seqs dense after the first, counter values as one after another: the serial order.
    assert [o for o in outcomes if not isinstance(o, BaseException)] == [
        (2 + n, n) for n in range(len(kept))
    ]
    assert [r.value for r in records[1:]] == [b"%d:%d" % (i, n) for n, i in enumerate(kept)]
    assert log_seqs(producer_db) == list(range(1, 31))
    with contextlib.closing(sqlite3.connect(producer_db)) as db:
        assert db.execute("SELECT n FROM counter").fetchone() == (29,)


def create_and_publish(tx: BlockingTransaction, stream: str, fail: bool) -> int:
    seq = tx.publish(stream, b"x")
    if fail:
        raise ValueError("rolled back with its new stream")
    return seq


async def test_a_stream_created_in_a_group_continues_from_the_member_before(
    producer_db: str,
) -> None:
    """The first member to create a stream rolls back; the next creates it, and the ones
    after continue its seqs: heads, segments and the log follow the members that stayed."""
    gate = Gate()
    async with Producer(producer_db, durability="full") as producer:
        calls = [producer.run_in_transaction(create_and_publish, "new", i == 0) for i in range(4)]
        _, outcomes = await queued_behind(producer, gate, calls)  # type: ignore[arg-type]
        assert isinstance(outcomes[0], ValueError)
        assert outcomes[1:] == [1, 2, 3]
        assert producer.head("new") == 3
        assert await producer.publish("new", b"after") == 4
        records = await asyncio.to_thread(read, producer.address, "new", 4)
    assert [r.seq for r in records] == [1, 2, 3, 4]
    assert log_seqs(producer_db, "new") == [1, 2, 3, 4]


def violates_at_commit(tx: BlockingTransaction, i: int) -> int:
    """A row whose deferred foreign key fails only at COMMIT: the whole group's."""
    tx.execute("CREATE TABLE IF NOT EXISTS parent (id INTEGER PRIMARY KEY)")
    tx.execute(
        "CREATE TABLE IF NOT EXISTS child (parent INTEGER REFERENCES parent (id) "
        "DEFERRABLE INITIALLY DEFERRED)"
    )
    if i == 2:
        tx.execute("INSERT INTO child VALUES (42)")
    return tx.publish("orders", b"%d" % i)


async def test_a_failed_group_commit_fails_every_member(producer_db: str) -> None:
    gate = Gate()
    async with Producer(producer_db, durability="full") as producer:
        await producer.storage.writer.execute("PRAGMA foreign_keys = ON")  # type: ignore[attr-defined]
        calls = [producer.run_in_transaction(violates_at_commit, i) for i in range(5)]
        first, outcomes = await queued_behind(producer, gate, calls)  # type: ignore[arg-type]
        assert first == 1
        assert all(isinstance(o, sqlite3.IntegrityError) for o in outcomes), outcomes
        assert producer.head("orders") == 1  # none acknowledged, none served
        assert await producer.run_in_transaction(violates_at_commit, 0) == 2
    assert log_seqs(producer_db) == [1, 2]


def publish_one(tx: BlockingTransaction, value: bytes) -> int:
    return tx.publish("orders", value)


async def test_a_transaction_cancelled_while_queued_never_runs(producer_db: str) -> None:
    gate = Gate()
    async with Producer(producer_db, durability="full") as producer:
        first = asyncio.ensure_future(producer.run_in_transaction(gate.hold))
        assert await asyncio.to_thread(gate.entered.wait, 10)
        withdrawn = asyncio.ensure_future(producer.run_in_transaction(publish_one, b"withdrawn"))
        kept = asyncio.ensure_future(producer.run_in_transaction(publish_one, b"kept"))
        await asyncio.sleep(0)
        withdrawn.cancel()
        gate.opened.set()
        assert (await first, await kept) == (1, 2)
        with pytest.raises(asyncio.CancelledError):
            await withdrawn
        records = await asyncio.to_thread(read, producer.address, "orders", 2)
    assert [r.value for r in records] == [b"first", b"kept"]


async def test_a_transaction_cancelled_once_running_commits_then_raises(
    producer_db: str,
) -> None:
    """Cancelled while its group runs, a transaction runs to the end: its caller gets the
    cancel only once the COMMIT returned (cancelled again meanwhile, too), and what it
    published is in the log; the producer goes on."""
    gate = Gate()
    async with Producer(producer_db, durability="full") as producer:
        running = asyncio.ensure_future(producer.run_in_transaction(gate.hold))
        assert await asyncio.to_thread(gate.entered.wait, 10)
        running.cancel()
        await asyncio.sleep(0)
        running.cancel()  # twice: still waits for the COMMIT
        await asyncio.sleep(0)
        assert not running.done()
        gate.opened.set()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert await producer.run_in_transaction(publish_one, b"after") == 2
        records = await asyncio.to_thread(read, producer.address, "orders", 2)
    assert [r.value for r in records] == [b"first", b"after"]


async def test_full_durability_groups_concurrent_handlers(producer_db: str) -> None:
    """32 handlers at once with ``durability="full"``: fewer COMMITs (fsyncs) than
    transactions, every one acknowledged once committed, in one dense seq line."""
    async with Producer(producer_db, durability="full") as producer:
        seqs = await asyncio.gather(
            *(producer.run_in_transaction(publish_one, b"%d" % i) for i in range(32))
        )
        assert sorted(seqs) == list(range(1, 33))
        assert producer.groups.members == 32
        assert producer.groups.groups < 32
    assert log_seqs(producer_db) == list(range(1, 33))


async def test_short_transactions_run_on_the_loop_long_ones_on_the_writer_thread(
    producer_db: str,
) -> None:
    """With ``durability="normal"`` a short transaction costs no thread hop; one that
    runs long moves the next ones to the writer's thread until they are short again."""
    on_threads: list[str] = []

    def where(tx: BlockingTransaction, pause: float) -> int:
        on_threads.append(threading.current_thread().name)
        if pause:
            threading.Event().wait(pause)  # a slow statement, say
        return tx.publish("orders", b"x")

    async with Producer(producer_db) as producer:
        loop_thread = threading.current_thread().name
        for _ in range(3):
            await producer.run_in_transaction(where, 0)
        assert on_threads == [loop_thread] * 3
        await producer.run_in_transaction(where, 0.05)
        assert await producer.run_in_transaction(where, 0) == 5
        assert on_threads[4] != loop_thread  # after a long one: the writer's thread
        while on_threads[-1] != loop_thread:  # short ones bring it back: bounded by the average
            assert len(on_threads) < 100
            await producer.run_in_transaction(where, 0)
    assert log_seqs(producer_db) == list(range(1, len(on_threads) + 1))


async def test_back_to_back_transactions_let_the_server_serve(producer_db: str) -> None:
    """A loop of transactions committed on the event loop's thread still yields to it
    between them: other tasks (the server's) run meanwhile."""
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    async with Producer(producer_db) as producer:
        other = asyncio.create_task(other_task())
        for _ in range(200):
            await producer.run_in_transaction(publish_one, b"x")
        other.cancel()
        assert producer.groups.inline >= 100  # most of them on the loop's thread
    assert turns >= 200


async def test_while_another_connection_writes_the_transaction_waits_on_the_thread(
    producer_db: str,
) -> None:
    """BEGIN on the event loop's thread would wait for the other connection's write lock:
    the transaction goes to the writer's thread instead, waits there, and commits once
    the lock is free; the loop runs on meanwhile."""
    async with Producer(producer_db) as producer:
        await producer.run_in_transaction(publish_one, b"first")
        inline = producer.groups.inline
        other = sqlite3.connect(producer_db, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            task = asyncio.create_task(producer.run_in_transaction(publish_one, b"second"))
            for _ in range(20):  # the loop is free while the transaction waits
                await asyncio.sleep(0.01)
            assert not task.done()
            other.execute("COMMIT")
            assert await task == 2
        finally:
            other.close()
        assert producer.groups.inline == inline  # not on the loop's thread
        # Back on it once short transactions bring the average cost under the budget (a
        # loaded machine may have made the one on the thread slow).
        seq = 2
        while producer.groups.inline == inline and seq < 50:
            seq += 1
            assert await producer.run_in_transaction(publish_one, b"later") == seq
        assert producer.groups.inline == inline + 1
    assert log_seqs(producer_db) == list(range(1, seq + 1))


async def test_another_connections_commit_is_caught_up_before_begin(producer_db: str) -> None:
    """A commit by another connection, found before BEGIN, is caught up then, not holding
    the write lock: the transaction still runs on the loop's thread, with no hop
    (``bench.tools.lock_hold``), and its seq follows the other connection's. (Not serving:
    a serving producer's watch may catch up first.)"""
    async with Producer(producer_db, serve=False) as producer:
        await producer.run_in_transaction(publish_one, b"first")
        other = sqlite3.connect(producer_db, isolation_level=None)
        inline_after_other = 0
        seq = 1
        try:
            while inline_after_other < 3 and seq < 100:  # a loaded machine may go over budget
                other.execute("BEGIN IMMEDIATE")
                assert streamq.publish(other, "orders", b"other") == seq + 1
                other.execute("COMMIT")
                inline = producer.groups.inline
                seq += 2
                assert await producer.run_in_transaction(publish_one, b"mine") == seq
                inline_after_other += producer.groups.inline - inline
        finally:
            other.close()
        assert inline_after_other == 3
    assert log_seqs(producer_db) == list(range(1, seq + 1))


async def test_a_short_transaction_runs_its_statements_on_the_loop(producer_db: str) -> None:
    """``Producer.transaction()`` too: BEGIN, the application's statements and COMMIT run
    on the event loop's thread while they run short and nobody else holds the write lock
    (each hop to the writer's thread would be paid holding it); where BEGIN would wait,
    on the writer's thread."""
    async with Producer(producer_db) as producer:
        producer.storage.writer.raw.create_function(  # type: ignore[attr-defined]
            "thread_name", 0, lambda: threading.current_thread().name
        )

        async def where_it_ran(value: bytes) -> str:
            async with producer.transaction() as tx:
                cursor = await tx.execute("SELECT thread_name()")
                (name,) = await cursor.fetchone()
                await tx.publish("orders", value)
            return str(name)

        loop_thread = threading.current_thread().name
        assert await where_it_ran(b"a") == loop_thread
        other = sqlite3.connect(producer_db, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            task = asyncio.create_task(where_it_ran(b"b"))
            for _ in range(20):  # the loop is free while the transaction waits
                await asyncio.sleep(0.01)
            assert not task.done()
            other.execute("COMMIT")
            assert await task != loop_thread
        finally:
            other.close()
    assert log_seqs(producer_db) == [1, 2]


async def test_a_long_transaction_on_the_loop_lets_it_serve(producer_db: str) -> None:
    """A ``Producer.transaction()`` of many short statements, run on the event loop's
    thread, still lets the loop's other tasks run between them (about every millisecond
    of statements): the server is not held up for the whole transaction."""
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"first")  # the budget: short so far
        turns = 0
        done = asyncio.Event()

        async def other_task() -> None:
            nonlocal turns
            while not done.is_set():
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_task())
        await asyncio.sleep(0)
        async with producer.transaction() as tx:
            started = turns
            for n in range(3000):
                await tx.execute("SELECT ?", (n,))
            during = turns - started
            await tx.publish("orders", b"last")
        done.set()
        await task
    assert during > 0


async def test_transactions_started_together_commit_together_on_the_loop(
    producer_db: str,
) -> None:
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"first")
        groups, inline = producer.groups.groups, producer.groups.inline
        seqs = await asyncio.gather(
            *(producer.run_in_transaction(publish_one, b"%d" % i) for i in range(8))
        )
        assert seqs == list(range(2, 10))
        assert (producer.groups.groups, producer.groups.inline) == (groups + 1, inline + 1)
