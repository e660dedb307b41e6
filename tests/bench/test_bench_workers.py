"""The workers workload (bench/workers/run.py), tiny: two worker processes publish into one
database through their own sqlite3 connections while ``streamq serve`` pushes to a
consumer process; every committed order arrives once, seqs dense and in commit order.
The same through an outbox, the transfer workload's relay and a real Kafka broker; the
synchronous path's three variants; and the checker against bad receipts. Every run's
delivered/s is measured to the consumer's last receipt, on the workers' clock.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from bench.kafka.broker import KafkaBroker
from bench.workers import run as workers
from bench.workers.common import ORDERS_SCHEMA, RECEIVED_SCHEMA, SYNC_VARIANTS

from ..children import running_children

ORDERS = 400
DRAIN = 10.0  # s for the consumer to receive the last commit; then the check names what is missing


def our_children() -> list[str]:
    """Command lines of this process's children still running."""
    return list(running_children().values())


def assert_measured_to_delivery(run: workers.Run) -> None:
    """delivered/s is every timed order over the common start -> the consumer's last
    receipt, and commits/s over the start -> the last COMMIT returned.

    What cannot fail: a record arrives after its transaction began, so the last receipt
    comes after the last order began, and delivered/s is at most the rate the orders
    were begun at. Not asserted: delivered/s <= commits/s. The consumer can receive the
    last order between its COMMIT reaching the log and its worker reading the clock
    after it returned (a worker descheduled there, on a loaded machine), so the last
    receipt may come before the last COMMIT's measured return by that moment.
    """
    clock = run.clock
    assert 0 < clock["last_begun"] <= clock["last_commit"], clock
    assert clock["last_begun"] < clock["last_receipt"], clock
    assert run.commits_per_s == pytest.approx(run.committed / clock["last_commit"])
    assert run.delivered_per_s == pytest.approx(run.latency[4] / clock["last_receipt"])
    assert 0 < run.delivered_per_s < run.committed / clock["last_begun"], run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rate", [0, 2000], ids=["max-rate", "paced"])
def test_two_workers_every_order_received_once_in_commit_order(tmp_path: Path, rate: int) -> None:
    try:
        run = workers.run_once("streamq", tmp_path, 2, ORDERS, rate, drain_timeout=DRAIN)
    finally:
        assert our_children() == []
    assert run.refused == 0 and run.errors == [], run
    assert run.committed == ORDERS, run
    with contextlib.closing(sqlite3.connect(tmp_path / "received.db")) as conn:
        seqs = [row[0] for row in conn.execute("SELECT position FROM received ORDER BY rowid")]
    assert seqs == list(range(1, ORDERS + 2 + 1))  # and each worker's warm-up order
    assert run.check == {
        "committed": ORDERS + 2,
        "received": ORDERS + 2,
        "logged": ORDERS + 2,
        "lost": 0,
        "received_twice": 0,
        "phantom": 0,
        "dense": True,
        "commit_order": True,
        "anomalies": 0,
    }
    assert run.latency[4] == ORDERS  # every timed order was timed once (warm-ups are not)
    assert run.commit_latency[4] == ORDERS
    assert_measured_to_delivery(run)


@pytest.mark.timeout(120)
def test_kafka_outbox_two_workers_every_order_received_once(
    tmp_path: Path, kafka_broker: KafkaBroker
) -> None:
    try:
        run = workers.run_once("kafka", tmp_path, 2, ORDERS, 0, kafka_broker, drain_timeout=DRAIN)
    finally:
        assert our_children() == []
    assert run.refused == 0 and run.committed == ORDERS, run
    with contextlib.closing(sqlite3.connect(tmp_path / "received.db")) as conn:
        offsets = [row[0] for row in conn.execute("SELECT position FROM received ORDER BY rowid")]
    assert offsets == list(range(ORDERS + 2))
    assert run.check["anomalies"] == 0 and run.check["logged"] == ORDERS + 2, run.check
    assert run.latency[4] == ORDERS
    assert_measured_to_delivery(run)


@pytest.mark.timeout(60)
def test_sync_path_variants(tmp_path: Path) -> None:
    for variant in SYNC_VARIANTS:
        one = workers.sync_once(variant, tmp_path, 2, 200)
        assert one.rate > 0 and one.refused == 0 and one.cpu_us > 0, variant
        assert one.synchronous == workers.NORMAL, variant
        # streamq_log: a row per transaction and stream, holding ``count`` records.
        events = "COUNT(*) FROM outbox" if variant == "sqlite3" else "SUM(count) FROM streamq_log"
        with contextlib.closing(sqlite3.connect(tmp_path / f"sync-{variant}-2.db")) as conn:
            orders = conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0]
            events = conn.execute(f"SELECT {events}").fetchone()[0]
        assert orders == events == 200 + 2, variant  # and each thread's warm-up order
    assert our_children() == []


def test_checker_sees_lost_doubled_phantom_and_reordered(tmp_path: Path) -> None:
    service, received = tmp_path / "service.db", tmp_path / "received.db"
    with contextlib.closing(sqlite3.connect(service)) as conn, conn:
        conn.execute(ORDERS_SCHEMA)
        conn.execute("CREATE TABLE outbox (id INTEGER PRIMARY KEY, payload BLOB)")
        conn.executemany(
            "INSERT INTO orders (id, worker, number, amount, due_ns) VALUES (?, 0, ?, 1, 0)",
            [(i, i) for i in range(1, 6)],
        )
        conn.executemany("INSERT INTO outbox (payload) VALUES (?)", [(b"",)] * 5)

    def receipts(rows: list[tuple[int, int]]) -> dict[str, object]:
        received.unlink(missing_ok=True)
        with contextlib.closing(sqlite3.connect(received)) as conn, conn:
            conn.execute(RECEIVED_SCHEMA)
            conn.executemany("INSERT INTO received VALUES (?, ?)", rows)
        return workers.check(service, received, first_position=0)

    assert receipts([(i, i + 1) for i in range(5)])["anomalies"] == 0
    lost = receipts([(0, 1), (1, 2), (2, 3), (3, 4)])
    assert lost["lost"] == 1 and lost["anomalies"] > 0
    twice = receipts([(0, 1), (1, 2), (2, 2), (3, 3), (4, 4), (5, 5)])
    assert twice["received_twice"] == 1 and not twice["commit_order"]
    phantom = receipts([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 9)])
    assert phantom["phantom"] == 1 and phantom["anomalies"] > 0
    gap = receipts([(0, 1), (1, 2), (3, 3), (4, 4), (5, 5)])
    assert not gap["dense"] and gap["anomalies"] == 1
    reordered = receipts([(0, 2), (1, 1), (2, 3), (3, 4), (4, 5)])
    assert not reordered["commit_order"] and reordered["anomalies"] == 1
