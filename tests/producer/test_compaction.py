"""Compaction: only each key's latest record stays; removals are reported; gaps are not loss."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import msgpack
import pytest

import streamq
import streamq.producer.compaction
from streamq import Client, Compacted, Consumer, Producer
from streamq.engines.sqlite import storage as sqlite_storage
from streamq.errors import OffsetOutOfRangeError

from ..conftest import wait_for
from ..logsql import stored_seqs

# seq:    1     2     3     4     5     6     7     8
KEYS = [b"a", b"b", None, b"a", b"c", b"a", b"b", None]
SURVIVORS = [3, 5, 6, 7, 8]


async def fill(producer: Producer, stream: str = "accounts") -> None:
    async with producer.transaction() as tx:
        for seq, key in enumerate(KEYS, start=1):
            await tx.publish(stream, b"v%d" % seq, key=key)


@pytest.fixture
def producer_db(either_producer_db: str) -> str:
    """Every test on both engines (those reading SQLite's file take their own path)."""
    return either_producer_db


async def test_compaction_keeps_each_keys_latest_and_reports_the_rest(producer_db: str) -> None:
    told: list[tuple[str, list[Compacted]]] = []
    async with Producer(producer_db, on_compacted=lambda s, r: told.append((s, r))) as producer:
        await producer.create_stream("accounts", key_index=True, notify_compacted=True)
        await fill(producer)
        removed = await producer.compact("accounts")
        # Each removed record with the one that superseded it: the next of its key.
        assert [(c.key, c.old_seq, c.old_value, c.new_seq, c.new_value) for c in removed] == [
            (b"a", 1, b"v1", 4, b"v4"),
            (b"b", 2, b"v2", 7, b"v7"),
            (b"a", 4, b"v4", 6, b"v6"),
        ]
        assert told == [("accounts", removed)]
        assert [r.seq for r in await producer.history("accounts", b"a")] == [6]
        # The same removals, as records another team can decode with plain msgpack.
        notes = await producer.history("accounts.compacted", b"a")  # keyed by the key
        assert [Compacted.from_record(r).old_seq for r in notes] == [1, 4]
        async with Consumer(producer.address, "accounts.compacted") as notifications:
            batch = await anext(notifications)
        assert [Compacted.from_record(r) for r in batch] == removed
        assert msgpack.unpackb(batch[0].value) == {
            "stream": "accounts",
            "key": b"a",
            "old_seq": 1,
            "old_value": b"v1",
            "new_seq": 4,
            "new_value": b"v4",
        }
        assert [r.key for r in batch] == [b"a", b"b", b"a"]
        assert await producer.compact("accounts") == []  # nothing new since
        assert len(told) == 1
        # New records of old keys: only those are looked at, the old survivor goes.
        await producer.publish("accounts", b"v9", key=b"c")
        assert [(c.old_seq, c.new_seq) for c in await producer.compact("accounts")] == [(5, 9)]
    seqs = stored_seqs(producer_db)
    assert seqs == [3, 6, 7, 8, 9]


async def test_notifications_commit_with_the_deletion(producer_db: str) -> None:
    """A failing notification write rolls the deletion back: both or neither."""
    async with Producer(producer_db) as producer:
        await producer.create_stream("accounts", key_index=True, notify_compacted=True)
        await fill(producer)
        # A stream name one character too long for the notification stream to be created.
        long_name = "x" * (255 - len(".compacted") + 1)
        await producer.create_stream(long_name, key_index=True, notify_compacted=True)
        await fill(producer, long_name)
        with pytest.raises(ValueError, match="stream name"):
            await producer.compact(long_name)
        assert [r.seq for r in await producer.history(long_name, b"a")] == [1, 4, 6]
        assert producer.log.streams[long_name].compacted == 0
        assert len(await producer.compact("accounts")) == 3


async def test_consumers_skip_compaction_gaps_without_reporting_loss(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db, settings=streamq.ServerSettings(max_batch_records=2)) as p:
        await p.create_stream("accounts", key_index=True)
        await fill(p)
        async with Consumer(p.address, "accounts", db=consumer_db, name="c") as consumer:
            first = await anext(consumer)  # from the tail buffer, before compaction
            async with consumer.transaction(first):
                pass
            await p.compact("accounts")
            seen = [r.seq for r in first]
            while seen[-1] < 8:
                batch = await anext(consumer)
                async with consumer.transaction(batch):
                    pass
                seen += [r.seq for r in batch]
        assert seen[: len(first)] == [r.seq for r in first]
        assert [s for s in seen if s > first.last_seq] == [
            s for s in SURVIVORS if s > first.last_seq
        ]
        # From the start, and after a restart of the producer, the gaps are skipped too.
    async with Producer(producer_db) as p:
        async with Consumer(p.address, "accounts") as tail:
            got: list[int] = []
            while not got or got[-1] < 8:
                got += [r.seq for r in await anext(tail)]
        assert got == SURVIVORS
        async with Consumer(p.address, "accounts", start_seq=4) as tail:  # 4 is a gap
            assert (await anext(tail)).first_seq == 5

        def read_range() -> list[int]:
            with Client(p.address) as client:
                return [r.seq for batch in client.read_range("accounts", 1, 9) for r in batch]

        assert await asyncio.to_thread(read_range) == SURVIVORS
        # A truncated range still reports loss, compacted or not.
        await p.truncate("accounts", 4)
        with pytest.raises(OffsetOutOfRangeError, match=r"seqs 2\.\.3 no longer held"):
            async with Consumer(p.address, "accounts", start_seq=2) as gone:
                await anext(gone)
        async with Consumer(p.address, "accounts", start_seq=4) as held:
            assert [r.seq for r in await anext(held)] == [5, 6, 7, 8]


async def test_periodic_compaction_and_its_async_hook(producer_db: str) -> None:
    told: list[int] = []

    async def hook(stream: str, removed: list[Compacted]) -> None:
        told.extend(c.old_seq for c in removed)

    async with Producer(producer_db, compact_interval=0.05, on_compacted=hook) as producer:
        await producer.create_stream("accounts", key_index=True, compact=True)
        await producer.create_stream("kept", key_index=True)  # not compacted by itself
        await fill(producer)
        await fill(producer, "kept")
        # The hook runs once the deletion committed, after ``compacted`` moved: wait for it.
        await wait_for(lambda: len(told) >= 3, what="the hook told of the compaction")
        assert sorted(told) == [1, 2, 4]
        assert producer.log.streams["accounts"].compacted == 8
        assert len(await producer.history("kept", b"a")) == 3
        assert producer.server is not None
        streams = {s["stream"]: s for s in producer.server.status()["streams"]}
        assert (streams["accounts"]["compact"], streams["accounts"]["compacted"]) == (True, 8)
        assert (streams["kept"]["compact"], streams["kept"]["compacted"]) == (False, 0)
        assert streams["kept"]["key_index"] is True


async def test_compaction_needs_the_key_index(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        with pytest.raises(ValueError, match="key_index=True"):
            await producer.create_stream("accounts", compact=True)
        await producer.publish("plain", b"v", key=b"a")
        with pytest.raises(ValueError, match="no key index"):
            await producer.compact("plain")


def test_compaction_query_seeks_the_key_index(tmp_path: Path) -> None:
    path = str(tmp_path / "p.db")
    with streamq.SyncProducer(path, serve=False) as producer:
        producer.create_stream("accounts", key_index=True)
        producer.publish("accounts", b"x", key=b"k")
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute(
            f"EXPLAIN QUERY PLAN {sqlite_storage.COMPACTION_QUERY}", (1 << 40, 2 << 40, 1 << 40)
        ).fetchall()
    plan = " | ".join(str(row[-1]) for row in rows)
    assert "SEARCH l USING INDEX streamq_log_key" in plan, plan


async def test_compaction_in_windows_removes_the_same(
    producer_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long streams are compacted a window of seqs per transaction: same result."""
    monkeypatch.setattr(streamq.producer.compaction, "WINDOW", 3)
    told: list[list[int]] = []
    async with Producer(
        producer_db, on_compacted=lambda s, r: told.append([c.old_seq for c in r])
    ) as p:
        await p.create_stream("accounts", key_index=True)
        await fill(p)
        removed = await p.compact("accounts")
        # Seqs 1..3 (a, b: nothing yet), then 4..6 (a twice), then 7..8 (b again).
        assert told == [[1, 4], [2]]
        assert sorted((c.old_seq, c.new_seq) for c in removed) == [(1, 4), (2, 7), (4, 6)]
        assert p.log.streams["accounts"].compacted == 8
        async with Consumer(p.address, "accounts") as tail:
            got: list[int] = []
            while not got or got[-1] < 8:
                got += [r.seq for r in await anext(tail)]
        assert got == SURVIVORS


async def test_compaction_by_another_process_is_not_served_from_memory(producer_db: str) -> None:
    """Records another process compacted away leave the serving producer's tail too."""
    async with Producer(producer_db, watch_interval=0.02) as served:
        await served.create_stream("accounts", key_index=True)
        await fill(served)
        async with Producer(producer_db, serve=False) as other:
            await other.compact("accounts")
        stream = served.log.streams["accounts"]
        await wait_for(lambda: stream.compacted == len(KEYS), what="compaction seen")

        def read() -> list[int]:
            with Client(served.address) as client:
                return [r.seq for batch in client.read_range("accounts", 1, 9) for r in batch]

        assert await asyncio.to_thread(read) == SURVIVORS


async def test_gaps_compacted_by_another_process_are_skipped_before_the_watch_sees_them(
    producer_db: str,
) -> None:
    """A reader meeting a gap its producer has not heard of yet asks the database whether
    compaction made it, rather than failing the consumer as if retention had."""
    async with Producer(producer_db, tail_bytes=0, watch_interval=3600) as served:
        await served.create_stream("accounts", key_index=True)
        await fill(served)
        async with Producer(producer_db, serve=False) as other:
            await other.compact("accounts")

        def read() -> list[int]:
            with Client(served.address) as client:
                return [r.seq for batch in client.read_range("accounts", 1, 9) for r in batch]

        assert await asyncio.to_thread(read) == SURVIVORS
