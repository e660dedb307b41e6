"""The producer: atomic publishing, dense seqs, identity across restarts, API misuse."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import streamq
from streamq import Producer, ServerSettings, SyncProducer
from streamq.engines.sqlite.storage import unpack_rows
from streamq.errors import RecordTooLargeError, TransactionClosedError

from ..conftest import wait_for


def log_seqs(path: str, stream: str = "orders") -> list[int]:
    """Seqs stored for ``stream``, read straight from the producer's database file."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        (stream_id,) = db.execute(
            "SELECT id FROM streamq_streams WHERE name = ?", (stream,)
        ).fetchone()
        rows = db.execute(
            "SELECT pos, count, record FROM streamq_log WHERE pos >> 40 = ? ORDER BY pos",
            (stream_id,),
        ).fetchall()
    return [pos & ((1 << 40) - 1) for pos, _ in unpack_rows(rows)]


async def test_publish_commits_with_business_writes(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            await tx.execute("CREATE TABLE stock (sku TEXT PRIMARY KEY, n INTEGER)")
            await tx.execute("INSERT INTO stock VALUES ('a1', 10)")
        async with producer.transaction() as tx:
            await tx.execute("UPDATE stock SET n = n - 1 WHERE sku = ?", ("a1",))
            seq = await tx.publish("orders", b"payload", key=b"a1", headers={"type": b"reserved"})
        assert seq == 1
        assert await producer.publish("orders", b"x") == 2
        assert producer.head("orders") == 2
        cursor = await producer.storage.writer.conn.execute("SELECT n FROM stock")
        assert await cursor.fetchall() == [(9,)]
    assert log_seqs(producer_db) == [1, 2]


async def test_rolled_back_transaction_publishes_nothing(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            await tx.execute("CREATE TABLE stock (sku TEXT, n INTEGER)")
        await producer.publish("orders", b"first")
        with pytest.raises(RuntimeError, match="boom"):
            async with producer.transaction() as tx:
                await tx.execute("INSERT INTO stock VALUES ('a1', 1)")
                assert await tx.publish("orders", b"rolled back") == 2
                assert await tx.publish("other-new-stream", b"also rolled back") == 1
                raise RuntimeError("boom")
        assert producer.head("orders") == 1
        assert "other-new-stream" not in producer.log.streams
        cursor = await producer.storage.writer.conn.execute("SELECT count(*) FROM stock")
        assert await cursor.fetchall() == [(0,)]
        # The seq given out inside the rolled-back transaction is given again.
        assert await producer.publish("orders", b"second") == 2
        async with streamq.Consumer(producer.address, "orders") as consumer:
            batch = await anext(consumer)
        assert [(r.seq, r.value) for r in batch] == [(1, b"first"), (2, b"second")]


async def test_concurrent_transactions_get_dense_ordered_seqs(producer_db: str) -> None:
    async with Producer(producer_db) as producer:

        async def writer(n: int) -> list[int]:
            async with producer.transaction() as tx:
                seqs = [await tx.publish("orders", b"%d" % n) for _ in range(n % 7 + 1)]
                await asyncio.sleep(0)  # let other transactions try to interleave
                seqs += list(await tx.publish_many("orders", [b"m"] * (n % 3)))
                seqs.append(await tx.publish("audit", b"%d" % n))
                return seqs

        results = await asyncio.gather(*(writer(n) for n in range(60)))
        orders = sorted(s for seqs in results for s in seqs[:-1])
        assert orders == list(range(1, len(orders) + 1))
        assert sorted(seqs[-1] for seqs in results) == list(range(1, 61))
        for seqs in results:  # each transaction's seqs are one contiguous run
            assert seqs[:-1] == list(range(seqs[0], seqs[0] + len(seqs) - 1))
        assert producer.head("orders") == len(orders)
    assert log_seqs(producer_db) == orders


async def test_restart_keeps_identity_and_seqs(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        first_id, first_epoch = producer.producer_id, producer.epoch
        await producer.publish("orders", b"a")
        await producer.publish("orders", b"b")
    async with Producer(producer_db) as producer:
        assert producer.producer_id == first_id
        assert producer.epoch > first_epoch
        assert producer.head("orders") == 2
        assert await producer.publish("orders", b"c") == 3
    async with Producer(producer_db + ".other") as other:
        assert other.producer_id != first_id


async def test_large_transaction_is_flushed_in_chunks(producer_db: str) -> None:
    async with Producer(producer_db, flush_records=1000, tail_bytes=10_000) as producer:
        async with producer.transaction() as tx:
            seqs = await tx.publish_many("orders", (b"%06d" % i for i in range(5500)))
        assert seqs == range(1, 5501)
        # Too big to keep in memory: readers are served from SQLite instead.
        assert producer.log.streams["orders"].tail.get(1, 5501, 10_000, 10**9) is None
        async with streamq.Consumer(producer.address, "orders") as consumer:
            values = []
            async for batch in consumer:
                values += [r.value for r in batch]
                if batch.last_seq == 5500:
                    break
        assert values == [b"%06d" % i for i in range(5500)]


async def test_api_misuse_raises_precise_errors(producer_db: str) -> None:
    async with Producer(
        producer_db, settings=ServerSettings(max_frame_size=4096, max_batch_bytes=2048)
    ) as producer:
        async with producer.transaction() as tx:
            with pytest.raises(TypeError, match="value must be bytes, not str"):
                await tx.publish("orders", "text")  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="key must be bytes, not int"):
                await tx.publish("orders", b"v", key=5)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="header 'h' must be bytes"):
                await tx.publish("orders", b"v", headers={"h": 1})  # type: ignore[dict-item]
            with pytest.raises(ValueError, match="stream name"):
                await tx.publish("", b"v")
            with pytest.raises(RecordTooLargeError, match="exceeds the limit"):
                await tx.publish("orders", b"x" * 5000)
            seq = await tx.publish("orders", bytearray(b"bytes-like is fine"))
        assert seq == 1
        with pytest.raises(TransactionClosedError):
            await tx.publish("orders", b"late")
        with pytest.raises(TransactionClosedError):
            await tx.execute("SELECT 1")
        assert producer.head("orders") == 1
    with pytest.raises(RuntimeError, match="not running"):
        async with producer.transaction():
            pass
    with pytest.raises(ValueError, match="durability"):
        Producer(producer_db, durability="sometimes")  # type: ignore[arg-type]


def test_unsupported_database_urls_name_the_supported_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL of another scheme is refused before SQLite takes it for a file's path, by
    every entry point that opens a database, without echoing its password."""
    monkeypatch.chdir(tmp_path)  # where a file named after the URL would have appeared
    url = "mysql://shop:secret@db.example/shop"
    threads = set(threading.enumerate())
    entry_points: list[Callable[[], object]] = [
        lambda: Producer(url),
        lambda: SyncProducer(url),
        lambda: streamq.Consumer("127.0.0.1:1", "orders", db=url, name="billing"),
        lambda: streamq.list_dead_letters(url),
    ]
    for open_it in entry_points:
        with pytest.raises(streamq.DatabaseOpenError) as refused:
            open_it()
        message = str(refused.value)
        assert message.startswith("cannot open a mysql:// database")
        assert "SQLite file's path" in message and "postgresql://" in message
        assert "secret" not in message
    # SyncProducer stopped its loop's thread (an earlier test's may have ended meanwhile).
    assert set(threading.enumerate()) <= threads
    assert list(tmp_path.iterdir()) == []


def test_sqlalchemy_style_urls_say_to_drop_the_driver() -> None:
    """The URL an application gives SQLAlchemy (``postgresql+asyncpg://``) is refused
    with how to write it for streamq, not as an unknown database."""
    for driver in ("asyncpg", "psycopg"):
        url = f"postgresql+{driver}://shop:secret@db.example/shop"
        with pytest.raises(streamq.DatabaseOpenError) as refused:
            streamq.Consumer("127.0.0.1:1", "orders", db=url, name="billing")
        message = str(refused.value)
        assert f"without '+{driver}' (postgresql://...)" in message
        assert "secret" not in message


async def test_create_stream_and_truncate(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        assert producer.head("orders") == 0
        for i in range(10):
            await producer.publish("orders", b"%d" % i)
        await producer.truncate("orders", 6)
        stream = producer.log.streams["orders"]
        assert (stream.low, stream.head) == (6, 10)
    assert log_seqs(producer_db) == [6, 7, 8, 9, 10]
    async with Producer(producer_db) as producer:
        assert producer.log.streams["orders"].low == 6
        assert await producer.publish("orders", b"next") == 11


async def test_commits_from_another_process_reach_subscribers(producer_db: str) -> None:
    """``streamq publish`` writes into a database another process serves."""
    async with Producer(producer_db, watch_interval=0.02) as served:
        await served.publish("orders", b"served-1")
        async with streamq.Consumer(served.address, "orders") as consumer:
            assert [r.value for r in await anext(consumer)] == [b"served-1"]
            async with Producer(producer_db, serve=False) as other:
                assert await other.publish("orders", b"other-2") == 2
                assert await other.publish("new-stream", b"n") == 1
            batch = await asyncio.wait_for(anext(consumer), 10)
            assert [(r.seq, r.value) for r in batch] == [(2, b"other-2")]
            await wait_for(lambda: "new-stream" in served.log.streams, what="new stream seen")
            assert await served.publish("orders", b"served-3") == 3
            batch = await asyncio.wait_for(anext(consumer), 10)
            assert [(r.seq, r.value) for r in batch] == [(3, b"served-3")]


def test_sync_producer_for_blocking_code(producer_db: str) -> None:
    with SyncProducer(producer_db) as producer:
        with producer.transaction() as tx:
            tx.execute("CREATE TABLE stock (sku TEXT, n INTEGER)")
            tx.execute("INSERT INTO stock VALUES (?, ?)", ("a1", 5))
            assert tx.publish("orders", b"reserved", key=b"a1") == 1
        with pytest.raises(ZeroDivisionError), producer.transaction() as tx:
            tx.execute("UPDATE stock SET n = 0")
            tx.publish("orders", b"lost")
            _ = 1 / 0
        with producer.transaction() as tx:
            assert tx.execute("SELECT n FROM stock").fetchall() == [(5,)]
        # Several threads of a web server publishing at once.
        threads = [
            threading.Thread(target=lambda: [producer.publish("orders", b"t") for _ in range(20)])
            for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert producer.head("orders") == 81
        with streamq.Client(producer.address) as client:
            records = [r for batch in client.read_range("orders", 1, 82) for r in batch]
        assert [r.seq for r in records] == list(range(1, 82))
        assert records[0].value == b"reserved"


def commit_holder() -> tuple[Callable[[str], None], threading.Event, threading.Event]:
    """A trace callback that holds the next COMMIT on the writer's thread until released."""
    entered, release = threading.Event(), threading.Event()

    def hold_commit(statement: str) -> None:
        if statement == "COMMIT" and not release.is_set():
            entered.set()
            release.wait(10)

    return hold_commit, entered, release


async def cancel_during_commit(producer: Producer, work: Awaitable[object]) -> None:
    """Run ``work``, cancel it while its COMMIT runs, and expect the cancellation."""
    hold_commit, entered, release = commit_holder()
    await producer.storage.writer.conn.set_trace_callback(hold_commit)
    task = asyncio.ensure_future(work)
    assert await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await producer.storage.writer.conn.set_trace_callback(None)


async def test_caller_cancelled_during_commit_still_sees_the_commit_through(
    producer_db: str,
) -> None:
    """A COMMIT already sent to the writer's thread happens whatever the caller does: a
    cancel arriving meanwhile must leave the in-memory log matching the database."""
    async with Producer(producer_db, durability="full") as producer:  # commits on the thread
        await producer.publish("orders", b"first")
        await cancel_during_commit(producer, producer.publish("orders", b"second"))
        assert log_seqs(producer_db) == [1, 2]
        assert producer.head("orders") == 2
        assert await producer.publish("orders", b"third") == 3
        # Retention raises low before COMMIT; a cancelled truncate that committed keeps it.
        await cancel_during_commit(producer, producer.truncate("orders", 3))
        assert log_seqs(producer_db) == [3]
        assert producer.log.streams["orders"].low == 3
    assert log_seqs(producer_db) == [3]
