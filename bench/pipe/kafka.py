"""Kafka's side of the pipe workload: ``producer BOOTSTRAP TOPIC N SIZE`` and
``consumer BOOTSTRAP TOPIC DB N DURABILITY``.

The consumer does what a careful Kafka user does for exactly-once into a
database: it stores each partition's offset in the same SQLite transaction as
the records it applies, and starts from those offsets.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time

from confluent_kafka import Consumer, Producer, TopicPartition

from ..common import say, wait_line
from ..kafka.clients import CONSUMER_THROUGHPUT, PRODUCER_THROUGHPUT, receive


def producer(bootstrap: str, topic: str, count: int, size: int) -> None:
    value = os.urandom(size)
    p = Producer({"bootstrap.servers": bootstrap, **PRODUCER_THROUGHPUT})
    p.list_topics(topic, timeout=30)
    say("READY")
    wait_line("GO")
    say("START", time.time())
    for _ in range(count):
        while True:
            try:
                p.produce(topic, value)
                break
            except BufferError:  # local queue full: let deliveries drain
                p.poll(0.01)
        p.poll(0)
    p.flush(120)
    say("PRODUCED", time.time())
    wait_line("STOP")


def consumer(bootstrap: str, topic: str, db: str, count: int, durability: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={durability.upper()}")
    conn.execute("CREATE TABLE IF NOT EXISTS applied (part INTEGER, off INTEGER, value BLOB)")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS offsets (topic TEXT, part INTEGER, next INTEGER, "
        "PRIMARY KEY (topic, part))"
    )
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", **CONSUMER_THROUGHPUT})
    partitions = c.list_topics(topic, timeout=30).topics[topic].partitions
    stored = dict(conn.execute("SELECT part, next FROM offsets WHERE topic = ?", (topic,)))
    c.assign([TopicPartition(topic, p, stored.get(p, -2)) for p in partitions])  # -2: beginning
    say("READY")
    applied = 0
    while applied < count:
        messages = receive(c)
        rows = [(m.partition(), m.offset(), m.value()) for m in messages if m.error() is None]
        if not rows:
            continue
        ends: dict[int, int] = {}
        for part, offset, _ in rows:
            assert part is not None and offset is not None
            ends[part] = offset + 1
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO applied VALUES (?, ?, ?)", rows)
        conn.executemany(
            "INSERT OR REPLACE INTO offsets VALUES (?, ?, ?)",
            [(topic, part, end) for part, end in ends.items()],
        )
        conn.execute("COMMIT")
        applied += len(rows)
    say("DONE", time.time())
    c.close()
    conn.close()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        producer(args[0], args[1], int(args[2]), int(args[3]))
    else:
        consumer(args[0], args[1], args[2], int(args[3]), args[4])
