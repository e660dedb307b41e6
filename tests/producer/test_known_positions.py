"""What a producer says of its consumers stays true across reshares and restarts.

Positions of a split a reshare replaced disappear as the new split subscribes (their
registration moves to it); every reported position is stored, at most about once a second,
and shown again after a restart with its lag and when it was reported, until it is removed
or expires; stored positions of unregistered consumers are bounded as in memory. Real
producers and consumers over loopback, SQLite files and the fixtures' PostgreSQL server,
status through the real CLI or ``Client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamq import Client, Consumer, Producer, ServerSettings
from streamq.engines import is_postgres_url
from streamq.producer.consumer_positions import MAX_UNREGISTERED, Positions

from ..conftest import wait_for

FAST = ServerSettings(progress_interval=0.05)
STREAMQ = [sys.executable, "-m", "streamq"]


async def publish(producer: Producer, count: int) -> None:
    async with producer.transaction() as tx:
        for n in range(count):
            await tx.publish("orders", b"v", key=b"k%d" % n)


async def run_share(
    producer: Producer, db: str, share: tuple[int, int] | None, until: int, name: str = "billing"
) -> None:
    """A worker that applies up to ``until`` and stops once the producer has its report."""
    async with Consumer(producer.address, "orders", db=db, name=name, share=share) as worker:
        while worker.applied < until:
            async with worker.transaction(await anext(worker)):
                pass
        await producer.wait_applied(worker.name, "orders", until, timeout=10)


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [*STREAMQ, *args], capture_output=True, text=True, timeout=60, check=False
    )


async def status(address: str) -> dict[str, Any]:
    def ask() -> dict[str, Any]:
        with Client(address) as client:
            return client.status()

    return await asyncio.to_thread(ask)


async def names(producer: Producer) -> list[str]:
    """The consumers ``streamq status`` lists positions of."""
    return sorted(p["consumer"] for p in (await status(producer.address))["positions"])


def stored(db: str) -> dict[str, tuple[int, bool]]:
    """``streamq_consumers`` as the producer's database holds it: consumer -> (applied,
    registered)."""
    query = "SELECT consumer, applied, registered FROM streamq_consumers"
    if is_postgres_url(db):
        with psycopg.connect(db) as conn:
            rows = conn.execute(query).fetchall()
    else:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            rows = conn.execute(query).fetchall()
    return {consumer: (applied, bool(registered)) for consumer, applied, registered in rows}


def execute(db: str, sql: str) -> None:
    if is_postgres_url(db):
        with psycopg.connect(db) as conn:
            conn.execute(sql)
    else:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.execute(sql)
            conn.commit()


def scrape(address: str) -> dict[tuple[str, str], float]:
    """The producer's /metrics: (metric, consumer label) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, sample.labels.get("consumer", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# --- 1. shares a reshare replaced disappear ---------------------------------------------


async def test_status_after_a_reshare_shows_only_the_new_split(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db, settings=FAST) as producer:
        await publish(producer, 60)
        for i in range(3):
            await run_share(producer, consumer_db, (i, 3), 60)
        assert await names(producer) == ["billing[0/3]", "billing[1/3]", "billing[2/3]"]
        moved = await cli("reshare", consumer_db, "billing", "--shares", "2")
        assert moved.returncode == 0, moved.stderr
        # The first share of the new split to subscribe ends the whole old one.
        await run_share(producer, consumer_db, (0, 2), 60)
        assert await names(producer) == ["billing[0/2]"]
        await run_share(producer, consumer_db, (1, 2), 60)
    # Forgotten in the database too: a restarted producer does not bring them back.
    async with Producer(producer_db, settings=FAST) as producer:
        assert await names(producer) == ["billing[0/2]", "billing[1/2]"]
        back = await cli("reshare", consumer_db, "billing", "--shares", "1")
        assert back.returncode == 0, back.stderr
        await run_share(producer, consumer_db, None, 60)  # unshared again: the shares go
        assert await names(producer) == ["billing"]
    async with Producer(producer_db) as producer:
        assert await names(producer) == ["billing"]
        assert stored(producer_db) == {"billing": (60, False)}


async def test_a_worker_of_the_old_split_still_running_goes_as_it_leaves(
    producer_db: str, tmp_path: Path
) -> None:
    """A worker of the old split acknowledging after the new split subscribed (an online
    change, or one still finishing a batch) shows while it runs, and goes with it."""

    async def apply_until(worker: Consumer, seq: int) -> None:
        while worker.applied < seq:
            async with worker.transaction(await anext(worker)):
                pass
        await producer.wait_applied(worker.name, "orders", seq, timeout=10)

    old_db, new_db = str(tmp_path / "old.db"), str(tmp_path / "new.db")
    async with Producer(producer_db, settings=FAST) as producer:
        await publish(producer, 30)
        old = Consumer(producer.address, "orders", db=old_db, name="billing", share=(0, 3))
        async with old:
            await apply_until(old, 30)
            async with Consumer(
                producer.address, "orders", db=new_db, name="billing", share=(0, 2)
            ) as new:
                await apply_until(new, 30)
                assert await names(producer) == ["billing[0/2]"]
                await publish(producer, 30)
                await apply_until(old, 60)  # still running: it shows
                assert await names(producer) == ["billing[0/2]", "billing[0/3]"]
                await old.close()
                await wait_for(
                    lambda: [p.consumer for p in producer.consumer_lags()] == ["billing[0/2]"],
                    what="the old worker's position to go with it",
                )


async def test_a_registration_moves_to_the_new_split(
    producer_db: str, consumer_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Registered shares replaced by a reshare: their registration neither stays behind
    (holding records for no one) nor is dropped (retention would then delete what the new
    shares have not applied, once ``audit`` has): the new names are registered, at the old
    position, with the loosest of the old limits, and one line says so."""
    async with Producer(producer_db, settings=FAST) as producer:
        await publish(producer, 60)
        await producer.register_consumer("audit", "orders")
        await producer.register_consumer("billing[0/3]", "orders", max_idle_ms=60_000)
        for i in (1, 2):
            await producer.register_consumer(
                f"billing[{i}/3]", "orders", max_idle_ms=120_000, max_bytes=10**9
            )
        for i in range(3):
            await run_share(producer, consumer_db, (i, 3), 60)
        await asyncio.to_thread(report, producer.address, "audit", 60)
        assert (await cli("reshare", consumer_db, "billing", "--shares", "2")).returncode == 0
        with caplog.at_level(logging.INFO, logger="streamq.producer"):
            await run_share(producer, consumer_db, (0, 2), 60)
        (line,) = [r.getMessage() for r in caplog.records if "another split" in r.getMessage()]
        assert line == (
            "consumer 'billing' now reads 'orders' as 2 share(s): forgot billing[0/3], "
            "billing[1/3], billing[2/3] (another split) and moved their registration to "
            "billing[0/2], billing[1/2], from seq 60"
        )
        expected = [
            ("audit", 60, True, None, None),
            ("billing[0/2]", 60, True, 120_000, None),
            ("billing[1/2]", 60, True, 120_000, None),
        ]
        assert (
            sorted(
                (p.consumer, p.applied, p.registered, p.max_idle_ms, p.max_bytes)
                for p in producer.consumer_lags()
            )
            == expected
        )
        # audit applies what comes next; billing[1/2] has not: retention keeps it.
        await publish(producer, 20)
        await asyncio.to_thread(report, producer.address, "audit", 80)
        await producer.apply_retention()
        assert producer.log.stream("orders").low == 61
    async with Producer(producer_db) as producer:
        assert sorted(
            (p.consumer, p.applied, p.registered, p.max_idle_ms, p.max_bytes)
            for p in producer.consumer_lags()
        ) == [("audit", 80, True, None, None), *expected[1:]]


def report(address: str, consumer: str, seq: int) -> None:
    """REPORT_POSITION, as a Spark query sends it."""
    with Client(address) as client:
        client.report_position("orders", consumer, seq)


# --- 2. known positions survive restarts --------------------------------------------------


async def test_a_consumer_that_is_down_keeps_its_position_and_lag_across_a_restart(
    either_producer_db: str, consumer_db: str
) -> None:
    db = either_producer_db
    async with Producer(db) as producer:
        await publish(producer, 30)
        await run_share(producer, consumer_db, None, 30)
        (reported,) = producer.consumer_lags()
        # Saved within about a second while serving, not only at close (a crash, say).
        await wait_for(lambda: stored(db) == {"billing": (30, False)}, what="the periodic save")
    async with Producer(db, metrics_port=0) as producer:  # billing is down, not registered
        await publish(producer, 12)
        shown = await cli("status", producer.address, "--json")
        assert shown.returncode == 0, shown.stderr
        (position,) = json.loads(shown.stdout)["positions"]
        assert (position["consumer"], position["applied"], position["head"]) == ("billing", 30, 42)
        assert (position["lag"], position["registered"]) == (12, False)
        assert abs(position["updated_at"] - reported.updated_at * 1000) <= 1  # when it reported
        table = await cli("status", producer.address)
        assert "billing" in table.stdout and " ago" in table.stdout, table.stdout
        metrics = await asyncio.to_thread(scrape, producer.metrics_address)
        assert metrics["streamq_consumer_lag", "billing"] == 12
        assert metrics["streamq_consumer_applied", "billing"] == 30
        last_report = metrics["streamq_consumer_last_report_seconds", "billing"]
        assert abs(last_report - reported.updated_at) < 0.002
        # It comes back: the same position moves on, as before the restart.
        await run_share(producer, consumer_db, None, 42)
        assert [(p.consumer, p.lag) for p in producer.consumer_lags()] == [("billing", 0)]


async def test_positions_expire_unless_connected(either_producer_db: str, tmp_path: Path) -> None:
    producer_db = either_producer_db
    settings = ServerSettings(position_expiry=0.5)
    async with Producer(producer_db, settings=settings) as producer:
        await publish(producer, 10)
        idle_db, gone_db = str(tmp_path / "idle.db"), str(tmp_path / "gone.db")
        async with Consumer(producer.address, "orders", db=idle_db, name="idle") as idle:
            while idle.applied < 10:
                async with idle.transaction(await anext(idle)):
                    pass
            await producer.wait_applied("idle", "orders", 10, timeout=10)
            await run_share(producer, gone_db, None, 10, name="gone")
            # Both silent past the expiry, idle longer: only the one not connected goes.
            await wait_for(lambda: stored(producer_db) == {"idle": (10, False)}, what="expiry")
            assert await names(producer) == ["idle"]
        await wait_for(lambda: stored(producer_db) == {}, what="idle's expiry once gone")
        assert await names(producer) == []
    async with Producer(producer_db) as producer:
        assert producer.consumer_lags() == []


async def test_streamq_consumers_lists_and_removes_known_positions(
    producer_db: str, consumer_db: str
) -> None:
    async with Producer(producer_db, watch_interval=0.02) as producer:
        await publish(producer, 5)
        await run_share(producer, consumer_db, None, 5)
        await wait_for(lambda: "billing" in stored(producer_db), what="the periodic save")
        listed = await cli("consumers", "list", producer_db, "--json")
        assert listed.returncode == 0, listed.stderr
        (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (row["consumer"], row["applied"], row["lag"], row["registered"]) == (
            "billing",
            5,
            0,
            False,
        )
        removed = await cli("consumers", "remove", producer_db, "billing", "orders")
        assert removed.returncode == 0, removed.stderr
        # The serving producer notices: status stops showing it, now.
        await wait_for(lambda: producer.consumer_lags() == [], what="the serving producer")
        again = await cli("consumers", "remove", producer_db, "billing", "orders")
        assert again.returncode == 1
        assert again.stderr == (
            "streamq consumers: 'billing' on 'orders' is not registered and has no known position\n"
        )
    async with Producer(producer_db) as producer:
        assert producer.consumer_lags() == []


async def test_stored_positions_are_bounded_as_in_memory(producer_db: str) -> None:
    """Names come from peers: the oldest unregistered positions go from the database too."""
    async with Producer(producer_db) as producer:
        await publish(producer, 1)
        first = [f"first-{n}" for n in range(10)]
        await asyncio.to_thread(report_all, producer.address, first)
        await wait_for(lambda: len(stored(producer_db)) == 10, what="the periodic save")
        later = [f"later-{n}" for n in range(MAX_UNREGISTERED)]
        await asyncio.to_thread(report_all, producer.address, later)
    assert sorted(stored(producer_db)) == sorted(later)
    async with Producer(producer_db) as producer:
        assert len(producer.consumer_lags()) == MAX_UNREGISTERED


def report_all(address: str, consumers: list[str]) -> None:
    with Client(address) as client:
        for consumer in consumers:
            client.report_position("orders", consumer, 1)


async def test_a_database_from_before_known_positions_is_migrated(
    either_producer_db: str,
) -> None:
    """Rows of a ``streamq_consumers`` without the ``registered`` column are registrations."""
    db = either_producer_db
    async with Producer(db) as producer:
        await publish(producer, 3)
        await producer.register_consumer("billing", "orders")
    execute(db, "ALTER TABLE streamq_consumers DROP COLUMN registered")
    async with Producer(db) as producer:
        await asyncio.to_thread(report, producer.address, "audit", 2)
    assert stored(db) == {"billing": (0, True), "audit": (2, False)}
    async with Producer(db) as producer:
        assert sorted((p.consumer, p.applied, p.registered) for p in producer.consumer_lags()) == [
            ("audit", 2, False),
            ("billing", 0, True),
        ]


def test_other_splits_are_the_same_consumer_under_another_number_of_shares() -> None:
    positions = Positions()
    for name in ("billing", "billing[0/3]", "billing[2/3]", "billing[1/2]", "billings", "bill"):
        positions.report(name, "orders", 5)
    positions.report("billing[x]", "orders", 5)  # not a share's name
    positions.report("billing[0/3]", "refunds", 5)  # another stream

    def other(shares: int) -> list[str]:
        return sorted(p.consumer for p in positions.other_splits("billing", "orders", shares))

    assert other(2) == ["billing", "billing[0/3]", "billing[2/3]"]
    assert other(3) == ["billing", "billing[1/2]"]
    assert other(1) == ["billing[0/3]", "billing[1/2]", "billing[2/3]"]
