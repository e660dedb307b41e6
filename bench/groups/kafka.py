"""Kafka's side of the groups workload, on confluent-kafka.

``producer BOOTSTRAP TOPIC RATE``: prints ``READY``, then produces RATE records a second
(the same keys, values and schedule as streamq's producer; each key to partition
``share_of(key, SHARES)``, so the partitions hold the keys streamq's shares do) until
``STOP`` (or ``MAX_SECONDS``), prints ``DONE COUNT`` once every record is acknowledged.

``member BOOTSTRAP TOPIC DB SESSION_MS HEARTBEAT_MS``: one consumer of the group named
after the topic, a new one each run (``cooperative-sticky``, no auto commit), applying
into the same kind of SQLite database as streamq's members, exactly once by the same
design: each batch's rows and its partitions' next offsets in one transaction, and every
partition assigned read from the offset stored there. Prints ``JOINED``, ``HELD
PARTITIONS`` whenever its assignment changes and ``LOST COUNT`` when partitions were taken
from it while it lived (its session expired); applies until ``STOP`` (or ``MAX_SECONDS``).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from streamq import share_of

from ..common import say, wait_line
from ..kafka.clients import CONSUMER_LATENCY, PRODUCER_LATENCY
from ..measure import Pacer
from .common import INSERT, SHARES, due_of, key_of, number_of, value_of

MAX_SECONDS = 1800.0  # no process of a run lives longer
TICK = 0.002  # s between the producer's rounds, as streamq's producer commits
# acks=all, no batching delay; idempotent, so that a retry cannot reorder a key's records.
PRODUCER = {**PRODUCER_LATENCY, "enable.idempotence": True}


def _stop_on_line() -> threading.Event:
    """Set once the driver sends STOP (or closes stdin)."""
    stop = threading.Event()

    def wait() -> None:
        try:
            wait_line("STOP")
        finally:
            stop.set()

    threading.Thread(target=wait, daemon=True).start()
    return stop


def producer(bootstrap: str, topic: str, rate: float) -> None:
    kafka = Producer({"bootstrap.servers": bootstrap, **PRODUCER})
    kafka.list_topics(topic, timeout=30)
    say("READY")
    stop = _stop_on_line()
    pacer = Pacer(rate)
    total = int(rate * MAX_SECONDS)
    deadline = time.monotonic() + MAX_SECONDS
    while pacer.taken < total and not stop.is_set():
        first = pacer.taken + 1
        for n, due in enumerate(pacer.take(max(0, min(total - pacer.taken, pacer.owed()))), first):
            key = key_of(n)
            while True:
                try:
                    kafka.produce(topic, value_of(n, due), key, share_of(key, SHARES))
                    break
                except BufferError:  # its queue is full: it is behind
                    if time.monotonic() > deadline:
                        raise SystemExit("kafka producer: its queue stayed full") from None
                    kafka.poll(0.001)
        kafka.poll(TICK)
    left = kafka.flush(60)
    if left:
        raise SystemExit(f"kafka producer: {left} records not acknowledged within 60 s")
    say("DONE", pacer.taken)
    stop.wait(MAX_SECONDS)


class Applier:
    """The consumer's database: offsets read on assignment, rows and offsets written in
    one transaction per batch."""

    def __init__(self, db: str) -> None:
        self.conn = sqlite3.connect(db, isolation_level=None, timeout=30)
        self.conn.execute("PRAGMA synchronous=NORMAL")  # as streamq's consumer ("normal")
        self.pid = os.getpid()

    def offsets(self) -> dict[int, int]:
        rows = self.conn.execute("SELECT part, next FROM offsets")
        return {int(part): int(end) for part, end in rows}

    def apply(self, messages: list[Any]) -> None:
        now = time.time()
        rows, ends = [], {}
        for m in messages:
            value, part, offset = m.value(), m.partition(), m.offset()
            rows.append((number_of(value), m.key(), part, self.pid, due_of(value), now))
            ends[part] = offset + 1
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(INSERT, rows)
            conn.executemany(
                "INSERT OR REPLACE INTO offsets (part, next) VALUES (?, ?)", list(ends.items())
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def member(bootstrap: str, topic: str, db: str, session_ms: int, heartbeat_ms: int) -> None:
    applier = Applier(db)
    held: set[int] = set()
    lost = 0

    def show() -> None:
        say("HELD", ",".join(map(str, sorted(held))))

    def on_assign(c: Consumer, partitions: list[TopicPartition]) -> None:
        stored = applier.offsets()  # read now: after the last holder's last commit
        for p in partitions:
            p.offset = stored.get(p.partition, OFFSET_BEGINNING)
        c.incremental_assign(partitions)
        held.update(p.partition for p in partitions)
        show()

    def on_revoke(c: Consumer, partitions: list[TopicPartition]) -> None:
        held.difference_update(p.partition for p in partitions)  # the library unassigns
        show()

    def on_lost(c: Consumer, partitions: list[TopicPartition]) -> None:
        nonlocal lost
        lost += len(partitions)
        say("LOST", lost)
        on_revoke(c, partitions)

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": topic,
            **CONSUMER_LATENCY,
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": session_ms,
            "heartbeat.interval.ms": heartbeat_ms,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        c.subscribe([topic], on_assign=on_assign, on_revoke=on_revoke, on_lost=on_lost)
        say("JOINED")
        stop = _stop_on_line()
        deadline = time.monotonic() + MAX_SECONDS
        while not stop.is_set() and time.monotonic() < deadline:
            first = c.poll(0.1)  # rebalance callbacks run in here, on this thread
            if first is None:
                continue
            messages = [first, *c.consume(9_999, timeout=0)]
            for m in messages:
                if m.error() is not None:
                    raise SystemExit(f"kafka consumer: {m.error()}")
            # A partition revoked during this call is its new holder's from the offset
            # stored: whatever of it was fetched here is not applied.
            mine = [m for m in messages if m.partition() in held]
            if mine:
                applier.apply(mine)
    finally:
        c.close()


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "producer":
        producer(args[0], args[1], float(args[2]))
    elif role == "member":
        member(args[0], args[1], args[2], int(args[3]), int(args[4]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
