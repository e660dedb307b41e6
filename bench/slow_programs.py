"""The slow-consumer workload's processes, for both systems.

``sq-producer DB RATE SECONDS``, ``sq-consumer ADDRESS DB RATE``,
``kafka-producer BOOTSTRAP TOPIC RATE SECONDS``, ``kafka-consumer BOOTSTRAP TOPIC DB RATE``.

Producers commit on a fixed schedule and report the rate they achieved, overall and in
their worst second. Consumers apply exactly once into SQLite, held to RATE records/s.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time

import streamq
from streamq import _loop

from .common import say, wait_line
from .kafka_pipe import receive

VALUE = b"s" * 100


class Pacer:
    """Counts what was done per second against a schedule of RATE per second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.start = time.monotonic()
        self.done = 0
        self.per_second: dict[int, int] = {}

    def due(self) -> int:
        return int((time.monotonic() - self.start) * self.rate) + 1 - self.done

    def record(self, count: int) -> None:
        self.done += count
        second = int(time.monotonic() - self.start)
        self.per_second[second] = self.per_second.get(second, 0) + count

    def delay(self) -> float:
        return max(0.0, self.start + self.done / self.rate - time.monotonic())

    def report(self, seconds: float) -> None:
        full = [self.per_second.get(s, 0) for s in range(int(seconds))]
        say("DONE", self.done / seconds, min(full) if full else 0)


async def sq_producer(db: str, rate: float, seconds: float) -> None:
    async with streamq.Producer(db, port=0) as producer:
        await producer.create_stream("slow")
        say("READY", producer.address)
        await asyncio.to_thread(wait_line, "GO")
        pacer, total = Pacer(rate), int(rate * seconds)
        while pacer.done < total:
            due = min(pacer.due(), total - pacer.done)
            if due > 0:
                async with producer.transaction() as tx:
                    await tx.publish_many("slow", [VALUE] * due)
                pacer.record(due)
            await asyncio.sleep(max(0.001, pacer.delay()))
        pacer.report(seconds)
        await asyncio.to_thread(wait_line, "STOP")


async def sq_consumer(address: str, db: str, rate: float) -> None:
    async with streamq.Consumer(address, "slow", db=db, name="slow", queue_batches=4) as c:
        assert c._db is not None
        await c._db.execute("CREATE TABLE IF NOT EXISTS applied (seq INTEGER, value BLOB)")
        say("READY")
        pacer = Pacer(rate)
        async for batch in c:
            async with c.transaction(batch) as tx:
                await tx.executemany(
                    "INSERT INTO applied VALUES (?, ?)", [(r.seq, r.value) for r in batch]
                )
            pacer.record(len(batch))
            await asyncio.sleep(pacer.delay())


def kafka_producer(bootstrap: str, topic: str, rate: float, seconds: float) -> None:
    from confluent_kafka import Producer

    from .kafka_pipe import PRODUCER_THROUGHPUT

    producer = Producer({"bootstrap.servers": bootstrap, **PRODUCER_THROUGHPUT})
    producer.list_topics(topic, timeout=30)
    say("READY")
    wait_line("GO")
    pacer, total = Pacer(rate), int(rate * seconds)
    while pacer.done < total:
        due = min(pacer.due(), total - pacer.done)
        for _ in range(max(0, due)):
            producer.produce(topic, VALUE)
        if due > 0:
            pacer.record(due)
        producer.poll(max(0.001, pacer.delay()))
    producer.flush(60)
    pacer.report(seconds)
    wait_line("STOP")


def kafka_consumer(bootstrap: str, topic: str, db: str, rate: float) -> None:
    from confluent_kafka import Consumer, TopicPartition

    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS applied (off INTEGER, value BLOB)")
    conn.execute("CREATE TABLE IF NOT EXISTS offsets (part INTEGER PRIMARY KEY, next INTEGER)")
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "slow", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, 0, -2)])
    say("READY")
    pacer = Pacer(rate)
    while True:
        messages = [m for m in receive(consumer, 1000) if m.error() is None]
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
        time.sleep(pacer.delay())


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "sq-producer":
        _loop.run(sq_producer(args[0], float(args[1]), float(args[2])))
    elif role == "sq-consumer":
        _loop.run(sq_consumer(args[0], args[1], float(args[2])))
    elif role == "kafka-producer":
        kafka_producer(args[0], args[1], float(args[2]), float(args[3]))
    else:
        kafka_consumer(args[0], args[1], args[2], float(args[3]))
