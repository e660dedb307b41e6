"""Retention that knows its consumers: caps by age and size, registered consumers kept,
data loss reported; registrations persisted and managed from the command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamq
from streamq import Consumer, OffsetOutOfRangeError, Producer

from ..conftest import wait_for
from ..logsql import stored_bytes, stored_seqs
from .test_lag import apply_until, scrape

STREAMQ = [sys.executable, "-m", "streamq"]


async def publish(producer: Producer, count: int, value: bytes = b"x" * 90, **kw: int) -> None:
    async with producer.transaction() as tx:
        for _ in range(count):
            await tx.publish("orders", value, **kw)


@pytest.fixture
def producer_db(either_producer_db: str) -> str:
    """Every test on both engines (those reading SQLite's file take their own path)."""
    return either_producer_db


async def test_records_stay_until_every_registered_consumer_applied(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, 100)
        assert await producer.apply_retention() == []  # nobody registered: no cap, keep all
        await producer.register_consumer("billing", "orders")
        await producer.register_consumer("audit", "orders")
        assert await producer.apply_retention() == []  # neither has applied anything
        async with Consumer(
            producer.address, "orders", db=consumer_db, name="billing", max_batch_records=60
        ) as consumer:
            await apply_until(consumer, 60)
            await producer.wait_applied("billing", "orders", consumer.applied, timeout=10)
            assert await producer.apply_retention() == []  # audit still needs seq 1
            await asyncio.to_thread(report, producer.address, "audit", 30)  # as Spark does
            (truncation,) = await producer.apply_retention()
            assert truncation == streamq.Truncation("orders", 31, 30, {})
            # An unregistered reader holds nothing back.
            await asyncio.to_thread(report, producer.address, "adhoc", 10)
            await producer.unregister_consumer("audit", "orders")
            await publish(producer, 10)  # not applied by billing: kept
            (truncation,) = await producer.apply_retention()
            assert truncation.low == consumer.applied + 1
            assert stored_seqs(producer_db)[0] == consumer.applied + 1


def report(address: str, consumer: str, seq: int) -> None:
    with streamq.Client(address) as client:
        client.report_position("orders", consumer, seq)


async def test_age_cap_deletes_and_reports_the_loss(producer_db: str, consumer_db: str) -> None:
    old = int(time.time() * 1000) - 3_600_000
    async with Producer(producer_db, retention_ms=60_000) as producer:
        await publish(producer, 10, timestamp=old)  # an hour old
        await publish(producer, 5)
        await producer.register_consumer("billing", "orders")
        (truncation,) = await producer.apply_retention()
        assert truncation == streamq.Truncation("orders", 11, 10, {"billing": 10})
        assert producer.log.stream("orders").low == 11
        (lag,) = producer.consumer_lags()
        assert (lag.consumer, lag.applied, lag.lost, lag.lag) == ("billing", 0, 10, 15)
        # The consumer learns it when it asks for what is gone.
        with pytest.raises(OffsetOutOfRangeError, match=r"seqs 1\.\.10 no longer held"):
            async with Consumer(producer.address, "orders", db=consumer_db, name="billing"):
                pass


async def test_size_cap_keeps_the_newest_bytes(producer_db: str) -> None:
    async with Producer(producer_db, retention_bytes=5_000) as producer:
        for _ in range(4):  # passes in between: the size is counted incrementally
            for _ in range(30):  # a transaction each: the cap deletes transactions' records
                await publish(producer, 1)
            await producer.apply_retention()
            held = stored_bytes(producer_db)
            assert 5_000 - 100 < held <= 5_000 or producer.log.stream("orders").low == 1
        stream = producer.log.stream("orders")
        assert stream.head == 120 and 5_000 - 100 < stored_bytes(producer_db) <= 5_000
        assert stored_seqs(producer_db)[0] == stream.low
        # Per stream, over the producer's default: 0 bytes empties the stream, the head stays.
        producer.set_retention("orders", bytes=0)
        (truncation,) = await producer.apply_retention()
        assert truncation.low == 121 and stored_bytes(producer_db) == 0
        assert producer.head("orders") == 120
        assert await producer.publish("orders", b"next") == 121


async def test_registrations_and_positions_survive_restarts(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, 20)
        await producer.register_consumer("billing", "orders")
        async with Consumer(producer.address, "orders", db=consumer_db, name="billing") as c:
            await apply_until(c, 20)
            await producer.wait_applied("billing", "orders", 20, timeout=10)
    # Saved at close; a new producer knows the position before the consumer reconnects.
    async with Producer(producer_db) as producer:
        (lag,) = producer.consumer_lags()
        assert (lag.consumer, lag.stream, lag.applied, lag.registered) == (
            "billing",
            "orders",
            20,
            True,
        )
        assert await producer.unregister_consumer("billing", "orders")
        assert not await producer.unregister_consumer("billing", "orders")
    # Unregistered, its position is still known; forgotten, it is gone.
    async with Producer(producer_db) as producer:
        (lag,) = producer.consumer_lags()
        assert (lag.consumer, lag.applied, lag.registered) == ("billing", 20, False)
        assert await producer.forget_consumer("billing", "orders")
        assert not await producer.forget_consumer("billing", "orders")
    async with Producer(producer_db) as producer:
        assert producer.consumer_lags() == []


async def test_a_database_from_before_registrations_gets_the_table(tmp_path: Path) -> None:
    producer_db = str(tmp_path / "old.db")  # a SQLite file from an older streamq
    async with Producer(producer_db) as producer:
        await publish(producer, 3)
    with contextlib.closing(sqlite3.connect(producer_db)) as db:
        db.execute("DROP TABLE streamq_consumers")
        db.commit()
    async with Producer(producer_db) as producer:
        await producer.register_consumer("billing", "orders")
        assert [p.consumer for p in producer.consumer_lags()] == ["billing"]


async def test_retention_runs_periodically(producer_db: str) -> None:
    async with Producer(producer_db, retention_bytes=0, retention_interval=0.05) as producer:
        await publish(producer, 10)
        await wait_for(lambda: producer.log.stream("orders").low == 11, what="a retention pass")
        # low is raised just before the deletion commits: wait for the commit too.
        await wait_for(lambda: stored_bytes(producer_db) == 0, what="the deletion's commit")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STREAMQ, *args], capture_output=True, text=True, timeout=60, check=False
    )


async def test_consumers_command_line(tmp_path: Path) -> None:
    db = str(tmp_path / "orders.db")
    async with Producer(db, watch_interval=0.02) as producer:
        await publish(producer, 5)
        added = run("consumers", "add", db, "billing", "orders")
        assert added.returncode == 0, added.stderr
        # The serving producer notices a registration made by another process.
        await wait_for(lambda: bool(producer.positions.registered("orders")), what="the reload")
        listed = run("consumers", "list", db, "--json")
        assert listed.returncode == 0, listed.stderr
        (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (row["consumer"], row["stream"], row["applied"], row["lag"]) == (
            "billing",
            "orders",
            0,
            5,
        )
        assert "billing" in run("consumers", "list", db).stdout
        assert run("consumers", "remove", db, "billing", "orders").returncode == 0
        await wait_for(lambda: not producer.positions.registered("orders"), what="the removal")
        missing = run("consumers", "remove", db, "billing", "orders")
        assert missing.returncode != 0 and "is not registered" in missing.stderr
    assert "consumers" in run("--help").stdout
    absent = run("consumers", "list", str(tmp_path / "absent.db"))
    assert absent.returncode != 0 and "does not exist" in absent.stderr


async def test_manual_truncate_counts_what_registered_consumers_lose(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await publish(producer, 10)
        await producer.register_consumer("billing", "orders")
        await producer.truncate("orders", 4)
        (lag,) = producer.consumer_lags()
        assert lag.lost == 3


def expected_low(
    path: str, low: int, cap_bytes: int | None, since_ms: int | None, keep: int
) -> int:
    """The retention rules computed the slow way, from every row of the stream. A row (one
    insert's run of records) is what they delete: it goes whole, or stays whole."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute(  # (first seq, last seq, newest timestamp, bytes), oldest first
            "SELECT (pos & 1099511627775) - count + 1, pos & 1099511627775, ts, length(record) "
            "FROM streamq_log ORDER BY pos"
        ).fetchall()
    end = rows[-1][1] + 1 if rows else low
    target = low
    if since_ms is not None:
        target = max(target, next((first for first, _, ts, _ in rows if ts >= since_ms), end))
    if cap_bytes is not None:
        held = sum(size for *_, size in rows)
        start = low
        for _, last, _, size in rows:
            if held <= cap_bytes:
                break
            held -= size
            start = last + 1
        target = max(target, start)
    return max(target, min(keep, end))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(  # passes: (record sizes with ages in minutes, the consumer's applied seq)
        st.tuples(
            st.lists(st.tuples(st.integers(1, 300), st.integers(0, 120)), max_size=12),
            st.integers(0, 80),
        ),
        min_size=1,
        max_size=5,
    ),
    st.one_of(st.none(), st.integers(0, 2_000)),
    st.one_of(st.none(), st.integers(1, 100)),
    st.booleans(),
)
def test_each_pass_deletes_exactly_what_the_rules_say(
    passes: list[tuple[list[tuple[int, int]], int]],
    cap_bytes: int | None,
    cap_minutes: int | None,
    registered: bool,
) -> None:
    async def scenario(path: str) -> None:
        cap_ms = None if cap_minutes is None else cap_minutes * 60_000
        async with Producer(path, serve=False, retention_bytes=cap_bytes, retention_ms=cap_ms) as p:
            await p.create_stream("orders")
            if registered:
                await p.register_consumer("billing", "orders")
            reported = 0  # positions only move forward
            for records, applied in passes:
                now = int(time.time() * 1000)
                async with p.transaction() as tx:
                    for size, minutes in records:
                        # Half a minute off the cap's whole minutes: never on its boundary.
                        stamp = now - minutes * 60_000 - 30_000
                        await tx.publish("orders", b"v" * size, timestamp=stamp)
                if registered:
                    p.positions.report("billing", "orders", applied)
                    reported = max(reported, applied)
                stream = p.log.stream("orders")
                since = None if cap_ms is None else int(time.time() * 1000) - cap_ms
                keep = min(reported, stream.head) + 1 if registered else stream.low
                # Ages are half a minute from any cap: the moment between here and the pass
                # cannot move a record across it.
                expected = expected_low(path, stream.low, cap_bytes, since, keep)
                await p.apply_retention()
                assert stream.low == expected

    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(scenario(os.path.join(folder, "p.db")))


async def test_a_connected_consumer_behind_a_forced_cap_gets_the_gone_seqs(
    producer_db: str, consumer_db: str
) -> None:
    settings = streamq.ServerSettings(max_batch_records=50)
    async with Producer(producer_db, settings=settings) as producer:
        await producer.register_consumer("billing", "orders")
        async with producer.transaction() as tx:  # 40 MB: more than the sockets' buffers hold
            await tx.publish_many("orders", [b"v" * 1000] * 40_000)
        consumer = Consumer(
            producer.address, "orders", db=consumer_db, name="billing", queue_batches=1
        )
        async with consumer:
            await wait_for(lambda: consumer.received > 0, what="the first records")
            # The push is stuck on full socket buffers (a few MB) far below the cap's cut.
            producer.set_retention("orders", bytes=5_000_000)
            (truncation,) = await producer.apply_retention()
            assert truncation.lost == {"billing": truncation.low - 1}  # it had applied nothing
            with pytest.raises(OffsetOutOfRangeError, match="no longer held"):
                async for batch in consumer:  # what was in flight, then the loss
                    async with consumer.transaction(batch):
                        pass
            assert 0 < consumer.applied < truncation.low - 1  # nothing skipped silently


async def test_size_cap_counts_what_compaction_removed(producer_db: str) -> None:
    """Compaction shrinks a stream: the size retention remembers must shrink with it, or
    the cap deletes records the stream has room for. (Served: on PostgreSQL the serving
    producer numbers what is published, and compaction sees only numbered records.)"""
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders", key_index=True)
        async with producer.transaction() as tx:
            for _ in range(10):
                await tx.publish("orders", b"x" * 90, key=b"same")
        cap = stored_bytes(producer_db)
        producer.set_retention("orders", bytes=cap)
        assert await producer.apply_retention() == []  # at the cap: nothing to delete
        assert len(await producer.compact("orders")) == 9
        async with producer.transaction() as tx:  # back to ten records: still at the cap
            for i in range(9):
                await tx.publish("orders", b"x" * 90, key=b"k%d" % i)
        assert stored_bytes(producer_db) <= cap
        assert await producer.apply_retention() == []
        assert producer.log.streams["orders"].low == 1


# --- registrations with limits: a consumer that never comes back ------------------------


async def test_a_registration_past_its_byte_limit_is_dropped(
    producer_db: str, consumer_db: str
) -> None:
    """``stale`` never connects: it holds every record back until what it has not
    applied passes its max_bytes. Then it is dropped (logged, counted, shown), retention
    deletes what ``active`` applied, and ``stale`` coming back gets the gone-seqs error."""
    async with Producer(producer_db, metrics_port=0) as producer:
        await producer.register_consumer("active", "orders")
        await producer.register_consumer("stale", "orders", max_bytes=3_000)
        await publish(producer, 20)  # about 2,000 bytes: under the limit
        await asyncio.to_thread(report, producer.address, "active", 20)
        assert await producer.apply_retention() == []  # stale still holds them
        await publish(producer, 20)  # about 4,000: over
        await asyncio.to_thread(report, producer.address, "active", 40)
        (truncation,) = await producer.apply_retention()
        assert (truncation.low, truncation.deleted) == (41, 40)
        [stale] = [p for p in producer.consumer_lags() if p.consumer == "stale"]
        assert not stale.registered and "over its max_bytes=3000" in stale.dropped
        assert producer.registrations_dropped == 1
        metrics = await asyncio.to_thread(scrape, producer.metrics_address)
        assert metrics[("streamq_registrations_dropped_total", ())] == 1
        with pytest.raises(OffsetOutOfRangeError, match="no longer held"):
            async with Consumer(producer.address, "orders", db=consumer_db, name="stale") as c:
                await anext(c)
    async with Producer(producer_db) as producer:  # dropped in the database too
        assert [p.consumer for p in producer.consumer_lags() if p.registered] == ["active"]


async def test_a_registration_idle_past_its_limit_is_dropped_unless_connected(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db) as producer:
        await producer.register_consumer("away", "orders", max_idle_ms=100)
        await producer.register_consumer("here", "orders", max_idle_ms=100)
        await publish(producer, 5)
        async with Consumer(producer.address, "orders", db=consumer_db, name="here") as here:
            await apply_until(here, 5)
            await producer.wait_applied("here", "orders", 5, timeout=10)

            def lag_of(name: str) -> streamq.ConsumerLag:
                return next(p for p in producer.consumer_lags() if p.consumer == name)

            async def both_silent_for_long() -> bool:
                await producer.apply_retention()
                silent = time.time() - lag_of("here").updated_at
                return silent > 0.3 and bool(lag_of("away").dropped)

            await wait_for(both_silent_for_long, what="the idle registration's drop")
            # "here" is connected: however long since it last reported, it stays.
            assert lag_of("here").registered and not lag_of("here").dropped
        [away] = [p for p in producer.consumer_lags() if p.consumer == "away"]
        assert "not connected and silent" in away.dropped and "max_idle_ms=100" in away.dropped


async def test_limits_from_the_command_line(tmp_path: Path) -> None:
    db = str(tmp_path / "orders.db")
    assert run("init", db).returncode == 0
    added = run("consumers", "add", db, "ledger", "orders", "--max-bytes", "5000")
    assert added.returncode == 0, added.stderr
    listed = run("consumers", "list", db, "--json")
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["consumer"], row["max_bytes"], row["max_idle_ms"]) == ("ledger", 5000, None)
    refused = run("consumers", "add", db, "ledger", "orders", "--max-bytes", "0")
    assert refused.returncode == 2 and "--max-bytes: must be 1 or more" in refused.stderr


def test_sync_producer_registers_with_limits(tmp_path: Path) -> None:
    """``SyncProducer.register_consumer`` takes the limits ``Producer``'s does, and they
    drop a registration that is away too long, as on the asyncio producer."""
    with streamq.SyncProducer(str(tmp_path / "p.db")) as producer:
        producer.publish("orders", b"x")
        producer.register_consumer("billing", "orders", max_idle_ms=1, max_bytes=10_000)

        def billing() -> streamq.ConsumerLag:
            (lag,) = [p for p in producer.consumer_lags() if p.consumer == "billing"]
            return lag

        assert (billing().registered, billing().max_idle_ms, billing().max_bytes) == (
            True,
            1,
            10_000,
        )
        deadline = time.monotonic() + 10  # passes until one runs 1 ms after registering
        while billing().registered and time.monotonic() < deadline:
            producer.apply_retention()
        assert not billing().registered and "max_idle_ms=1" in billing().dropped
