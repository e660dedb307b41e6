"""Kafka's side of the slow-consumer workload: ``producer BOOTSTRAP TOPIC RATE SECONDS``
and ``consumer BOOTSTRAP TOPIC DB RATE``."""

from __future__ import annotations

import sqlite3
import sys
import time

from confluent_kafka import Consumer, Producer, TopicPartition

from ..common import say, wait_line
from ..kafka.clients import PRODUCER_THROUGHPUT, receive
from ..measure import Pacer
from . import VALUE, report


def producer(bootstrap: str, topic: str, rate: float, seconds: float) -> None:
    kafka = Producer({"bootstrap.servers": bootstrap, **PRODUCER_THROUGHPUT})
    kafka.list_topics(topic, timeout=30)
    say("READY")
    wait_line("GO")
    pacer, total = Pacer(rate, clock=time.monotonic), int(rate * seconds)
    while pacer.taken < total:
        due = min(pacer.owed(), total - pacer.taken)
        for _ in range(max(0, due)):
            kafka.produce(topic, VALUE)
        if due > 0:
            pacer.record(due)
        kafka.poll(max(0.001, pacer.wait()))
    kafka.flush(60)
    report(pacer, seconds)
    wait_line("STOP")


def consumer(bootstrap: str, topic: str, db: str, rate: float) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS applied (off INTEGER, value BLOB)")
    conn.execute("CREATE TABLE IF NOT EXISTS offsets (part INTEGER PRIMARY KEY, next INTEGER)")
    kafka = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "slow", "enable.auto.commit": False}
    )
    kafka.assign([TopicPartition(topic, 0, -2)])
    say("READY")
    pacer = Pacer(rate, clock=time.monotonic)
    while True:
        messages = [m for m in receive(kafka, 1000) if m.error() is None]
        if not messages:
            continue
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO applied VALUES (?, ?)", [(m.offset(), m.value()) for m in messages]
        )
        conn.execute(
            "INSERT OR REPLACE INTO offsets VALUES (0, ?)", ((messages[-1].offset() or 0) + 1,)
        )
        conn.execute("COMMIT")
        pacer.record(len(messages))
        time.sleep(pacer.wait())


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        producer(args[0], args[1], float(args[2]), float(args[3]))
    else:
        consumer(args[0], args[1], args[2], float(args[3]))
