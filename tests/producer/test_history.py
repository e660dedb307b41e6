"""Per-key history and seeking by time: local, over real loopback sockets, and the CLI.

Both are index lookups in the producer's SQLite file; the query plans are checked
with EXPLAIN QUERY PLAN so that a change turning them into scans fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import streamq
from streamq import Client, Consumer, Producer, ServerSettings
from streamq.engines.sqlite import storage as sqlite_storage
from streamq.errors import OffsetOutOfRangeError, UnknownStreamError
from streamq.protocol import Record, encode_record

from ..conftest import wait_for
from ..logsql import stored_keys

STREAMQ = [sys.executable, "-m", "streamq"]
T0 = 1_700_000_000_000  # ms since the epoch


def plan(path: str, sql: str, parameters: tuple[object, ...]) -> str:
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute(f"EXPLAIN QUERY PLAN {sql}", parameters).fetchall()
    return " | ".join(str(row[-1]) for row in rows)


# --- history ---------------------------------------------------------------------


@pytest.fixture
def producer_db(either_producer_db: str) -> str:
    """Every test on both engines (those reading SQLite's file take their own path)."""
    return either_producer_db


@pytest.mark.parametrize("key_index", [True, False], ids=["indexed", "scanned"])
async def test_history_returns_one_keys_records_in_seq_order(
    producer_db: str, key_index: bool
) -> None:
    settings = ServerSettings(max_batch_records=3)  # several frames per answer
    async with Producer(producer_db, settings=settings) as producer:
        await producer.create_stream("orders", key_index=key_index)
        await producer.create_stream("other")
        keys = [b"a", b"b", None, b"a", b"c", b"a", b"b"] * 5
        async with producer.transaction() as tx:
            for i, key in enumerate(keys):
                await tx.publish("orders", b"v%d" % i, key=key)
                await tx.publish("other", b"o%d" % i, key=b"a")  # same key, other stream
        expected = [i + 1 for i, key in enumerate(keys) if key == b"a"]

        local = await producer.history("orders", b"a")
        assert [r.seq for r in local] == expected
        assert [r.value for r in local] == [b"v%d" % (s - 1) for s in expected]
        assert all(r.key == b"a" for r in local)
        assert [r.seq for r in await producer.history("orders", b"a", from_seq=10)] == [
            s for s in expected if s >= 10
        ]
        assert await producer.history("orders", b"zzz") == []

        def remote() -> tuple[list[Record], list[Record], int]:
            with Client(producer.address) as client:
                history_a = client.history("orders", b"a")
                history_b = client.history("orders", b"b", 30)
                window = client.history("orders", b"a", 5, 20)
                return history_a, history_b + window, client.head("orders").head

        history_a, history_b, head = await asyncio.to_thread(remote)
        window = [r for r in local if 5 <= r.seq < 20]
        assert window and history_b[-len(window) :] == window
        history_b = history_b[: -len(window)]
        assert history_a == local
        assert history_b == [r for r in await producer.history("orders", b"b") if r.seq >= 30]
        assert head == len(keys)
        assert await streamq.history(producer.address, "orders", b"a") == local

    assert stored_keys(producer_db) == (
        30 if key_index else 0
    )  # a stream without the index stores no keys


def test_history_query_is_an_index_seek(tmp_path: Path) -> None:
    path = str(tmp_path / "p.db")
    with streamq.SyncProducer(path, serve=False) as producer:
        producer.publish("orders", b"x", key=b"k")
    query_plan = plan(path, sqlite_storage.KEY_RECORDS_QUERY, (b"k", 1 << 40, 2 << 40, 10))
    assert "USING INDEX streamq_log_key" in query_plan, query_plan
    assert "SCAN" not in query_plan, query_plan


async def test_history_skips_what_retention_deleted(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        for _ in range(6):
            await producer.publish("orders", b"v", key=b"k")
        await producer.truncate("orders", 4)
        assert [r.seq for r in await producer.history("orders", b"k")] == [4, 5, 6]
        remote = await streamq.history(producer.address, "orders", b"k", from_seq=2)
        assert [r.seq for r in remote] == [4, 5, 6]


async def test_history_errors_name_the_problem(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"v", key=b"k")
        with pytest.raises(UnknownStreamError):
            await producer.history("nope", b"k")
        with pytest.raises(ValueError, match="seqs start at 1"):
            await producer.history("orders", b"k", from_seq=0)
        with pytest.raises(UnknownStreamError):
            await streamq.history(producer.address, "nope", b"k")
        with pytest.raises(OffsetOutOfRangeError, match="seqs start at 1"):
            await streamq.history(producer.address, "orders", b"k", from_seq=0)
        # The producer and its other clients go on.
        assert [r.seq for r in await streamq.history(producer.address, "orders", b"k")] == [1]


async def test_version_1_database_is_migrated_with_its_keys_and_times(tmp_path: Path) -> None:
    """A database written by streamq before the indexes existed gets them at first start."""
    producer_db = str(tmp_path / "v1.db")  # a SQLite file from an older streamq
    with contextlib.closing(sqlite3.connect(producer_db)) as db:
        db.executescript(
            """
            CREATE TABLE streamq_meta (key TEXT PRIMARY KEY, value NOT NULL);
            CREATE TABLE streamq_streams (
                id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, low INTEGER NOT NULL DEFAULT 1);
            CREATE TABLE streamq_log (pos INTEGER PRIMARY KEY, ts INTEGER NOT NULL,
                record BLOB NOT NULL);
            INSERT INTO streamq_meta VALUES ('producer_id', 'abc'), ('schema_version', 1),
                ('created_at', 0), ('epoch', 3);
            INSERT INTO streamq_streams (id, name) VALUES (1, 'orders');
            """
        )
        times = [T0, T0 + 10, T0 + 5, T0 + 20]
        keys = [b"a", None, b"a", b"b"]
        db.executemany(
            "INSERT INTO streamq_log VALUES (?, ?, ?)",
            [
                (sqlite_storage.pos(1, seq), ts, encode_record(seq, ts, key, b"v", {}))
                for seq, (ts, key) in enumerate(zip(times, keys, strict=True), start=1)
            ],
        )
        db.commit()
    async with Producer(producer_db) as producer:
        assert producer.producer_id == "abc"
        assert [r.seq for r in await producer.history("orders", b"a")] == [1, 3]
        assert await producer.seek_time("orders", T0 + 6) == 2
        assert await producer.seek_time("orders", T0 + 11) == 4
        await producer.publish("orders", b"new", key=b"a")
        assert [r.seq for r in await producer.history("orders", b"a")] == [1, 3, 5]


# --- seeking by time ---------------------------------------------------------------


async def test_seek_time_finds_the_first_seq_at_or_after_a_timestamp(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        assert await producer.seek_time("orders", T0) == 1  # empty stream: head + 1
        # Timestamps need not increase: the 40 after 50 never moves an answer back.
        times = [10, 20, 20, 50, 40, 60, 60, 90]
        async with producer.transaction() as tx:
            for ts in times:
                await tx.publish("orders", b"v", timestamp=T0 + ts)
        answers = {0: 1, 10: 1, 11: 2, 20: 2, 21: 4, 40: 4, 50: 4, 51: 6, 60: 6, 61: 8, 90: 8}
        for at, seq in answers.items():
            assert await producer.seek_time("orders", T0 + at) == seq, at
        assert await producer.seek_time("orders", T0 + 91) == 9  # nothing that late

        def seek_remotely() -> dict[int, streamq.TimePosition]:
            with Client(producer.address) as client:
                return {at: client.seek_time("orders", T0 + at) for at in answers}

        remote = await asyncio.to_thread(seek_remotely)
        assert remote == {
            at: streamq.TimePosition("orders", seq, 8, 1) for at, seq in answers.items()
        }
        await producer.truncate("orders", 5)
        assert await producer.seek_time("orders", T0) == 5  # clamped to the first held
        assert await producer.seek_time("orders", T0 + 51) == 6
        async with producer.transaction() as tx:
            await tx.publish("orders", b"late", timestamp=T0 + 100)
        assert await producer.seek_time("orders", T0 + 95) == 9


def test_seek_time_query_is_an_index_seek(tmp_path: Path) -> None:
    path = str(tmp_path / "p.db")
    with streamq.SyncProducer(path, serve=False) as producer:
        producer.publish("orders", b"x")
    query_plan = plan(path, sqlite_storage.SEEK_TIME_QUERY, (1, T0))
    assert "SEARCH streamq_time USING PRIMARY KEY" in query_plan, query_plan
    assert "SCAN" not in query_plan, query_plan


async def test_time_index_follows_another_writer(producer_db: str) -> None:
    """Records committed by another process (here: another connection) keep the index right."""
    async with Producer(producer_db, watch_interval=0.01) as producer:
        async with producer.transaction() as tx:
            await tx.publish("orders", b"a", timestamp=T0 + 10)
        async with Producer(producer_db, serve=False) as other, other.transaction() as tx:
            await tx.publish("orders", b"b", timestamp=T0 + 30)
        await wait_for(lambda: producer.head("orders") == 2, what="the other writer's commit")
        async with producer.transaction() as tx:
            await tx.publish("orders", b"c", timestamp=T0 + 20)  # below the other's 30
            await tx.publish("orders", b"d", timestamp=T0 + 40)
        assert await producer.seek_time("orders", T0 + 15) == 2
        assert await producer.seek_time("orders", T0 + 31) == 4


async def test_consumer_starts_at_a_time(producer_db: str, consumer_db: str) -> None:
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            for i in range(10):
                await tx.publish("orders", b"v%d" % i, timestamp=T0 + 100 * i)
        async with Consumer(producer.address, "orders", start_time=T0 + 650) as consumer:
            batch = await anext(consumer)
            assert batch.after == 7
            assert [r.seq for r in batch] == [8, 9, 10]
        # With a database, the time applies until a position is stored.
        options = {"db": consumer_db, "name": "billing", "start_time": T0 + 850}
        async with Consumer(producer.address, "orders", **options) as consumer:
            batch = await anext(consumer)
            assert [r.seq for r in batch] == [10]
            async with consumer.transaction(batch):
                pass
        await producer.publish("orders", b"new")
        async with Consumer(producer.address, "orders", **options) as consumer:
            assert [r.seq for r in await anext(consumer)] == [11]
        # A time beyond every record: only records committed from now on.
        async with Consumer(producer.address, "orders", start_time=T0 * 2) as consumer:
            await producer.publish("orders", b"newer")
            assert [r.seq for r in await anext(consumer)] == [12]


# --- command line ------------------------------------------------------------------


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STREAMQ, *args], capture_output=True, text=True, timeout=60, check=False
    )


async def run_async(*args: str) -> subprocess.CompletedProcess[str]:
    """``run`` off the event loop, which serves the producer meanwhile."""
    return await asyncio.to_thread(run, *args)


async def test_cli_history_from_a_file_and_a_server(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            for i, key in enumerate([b"a", b"b", b"a"]):
                await tx.publish("orders", b"v%d" % i, key=key, timestamp=T0 + i)
        for source in (producer_db, producer.address):
            done = await run_async("history", source, "orders", "a", "--json")
            assert done.returncode == 0, done.stderr
            rows = [json.loads(line) for line in done.stdout.splitlines()]
            assert [(r["seq"], r["value"], r["key"]) for r in rows] == [
                (1, "v0", "a"),
                (3, "v2", "a"),
            ]
        done = await run_async("history", producer.address, "orders", "a", "--from", "2")
        assert done.stdout.splitlines() == [f"3\t{T0 + 2} key=a\tv2"]
        done = await run_async("history", "no-such-file.db", "orders", "a")
        assert done.returncode != 0
        assert "neither a database file nor HOST:PORT" in done.stderr
        done = await run_async("history", producer_db, "missing", "a")
        assert done.returncode == 1
        assert "unknown stream 'missing'" in done.stderr


async def test_cli_tail_from_time(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            for i in range(5):
                await tx.publish("orders", b"v%d" % i, timestamp=T0 + 1000 * i)
        iso = "2023-11-14T22:13:22"  # T0 is 2023-11-14T22:13:20Z
        for when in (str(T0 + 2000), iso, iso + "+00:00"):
            done = await run_async(
                "tail", producer.address, "orders", "--from-time", when, "--count", "3"
            )
            assert done.returncode == 0, done.stderr
            assert [line.split("\t")[0] for line in done.stdout.splitlines()] == ["3", "4", "5"]
        done = await run_async("tail", producer.address, "orders", "--from-time", "yesterday")
        assert done.returncode == 2
        assert "ISO 8601" in done.stderr


def test_help_lists_history() -> None:
    done = run("--help")
    assert "history" in done.stdout
    done = run("tail", "--help")
    assert "--from-time" in done.stdout


async def test_key_index_is_opt_in_and_survives_restarts(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await producer.create_stream("indexed", key_index=True)
        await producer.publish("indexed", b"v", key=b"k")
        await producer.publish("implicit", b"v", key=b"k")  # created by its first publish
    async with Producer(producer_db) as producer:
        assert producer.log.streams["indexed"].settings.key_index
        assert not producer.log.streams["implicit"].settings.key_index
        await producer.publish("indexed", b"w", key=b"k")
        assert [r.value for r in await producer.history("indexed", b"k")] == [b"v", b"w"]
        assert [r.value for r in await producer.history("implicit", b"k")] == [b"v"]
