"""The Spark sink workload's consumers, each a process of its own applying every row it
receives into its own SQLite database (WAL, synchronous=NORMAL), its position stored in
the same transaction: ``streamq ADDRESS STREAM DB`` (a ``streamq.Consumer``, which does
that itself) and ``kafka BOOTSTRAP TOPIC DB`` (confluent-kafka, its offsets in a table of
that database, as the pipe workload's Kafka consumer keeps them).

Each row applied is ``(id, created_us, written_ms, applied_us)``: the row's id and
creation time (from its value, ``VALUE_SQL``), when the sink's system took it (the
record's timestamp: streamq's commit, Kafka's producer send), and when it was applied.
The rows have no key: a row the consumer got twice is there twice. They say READY, then
apply until stopped (SIGTERM); the workload reads their databases.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from collections.abc import Iterable
from typing import Any

from ..common import say

# The rows both sinks write: 100 bytes, "ID,CREATED_US," padded with dots (Spark SQL over
# a source's ``value`` (a long) and ``timestamp`` columns).
ROW_BYTES = 100
VALUE_SQL = (
    "RPAD(CONCAT(CAST(value AS STRING), ',', CAST(unix_micros(timestamp) AS STRING), ','), "
    f"{ROW_BYTES}, '.') AS value"
)


def rows_from(spark: Any, source: str, rows: int, **options: object) -> Any:
    """The first ``rows`` rows of Spark's ``source`` (``rate`` or ``rate-micro-batch``,
    with ``options``) as a streaming DataFrame of ``value`` (``VALUE_SQL``); later
    micro-batches are empty."""
    reader = spark.readStream.format(source)
    for name, value in options.items():
        reader = reader.option(name, value)
    return reader.load().where(f"value < {rows}").selectExpr(VALUE_SQL)


APPLIED = (
    "CREATE TABLE IF NOT EXISTS applied "
    "(id INTEGER, created_us INTEGER, written_ms INTEGER, applied_us INTEGER)"
)
Row = tuple[int, int, int, int]


def prepare(db: str) -> sqlite3.Connection:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(APPLIED)
    return conn


def applied_rows(received: Iterable[tuple[bytes, int]]) -> list[Row]:
    """``(value, written_ms)`` pairs as the rows to insert, applied now."""
    now = int(time.time() * 1_000_000)
    rows = []
    for value, written in received:
        row_id, created, _ = value.split(b",", 2)
        rows.append((int(row_id), int(created), written, now))
    return rows


INSERT = "INSERT INTO applied VALUES (?, ?, ?, ?)"


async def streamq_consumer(address: str, stream: str, db: str) -> None:
    import streamq

    prepare(db).close()
    async with streamq.Consumer(address, stream, db=db, name="bench") as consumer:
        say("READY")
        async for batch in consumer:
            async with consumer.transaction(batch) as tx:
                await tx.executemany(INSERT, applied_rows((r.value, r.timestamp) for r in batch))


def kafka_consumer(bootstrap: str, topic: str, db: str) -> None:
    from confluent_kafka import Consumer, TopicPartition

    from ..kafka.clients import CONSUMER_LATENCY, CONSUMER_THROUGHPUT, receive

    conn = prepare(db)
    conn.execute("CREATE TABLE IF NOT EXISTS offsets (part INTEGER PRIMARY KEY, next INTEGER)")
    # Large fetches, handed over at once: Kafka's best for rows/s and latency alike.
    settings = {**CONSUMER_THROUGHPUT, **CONSUMER_LATENCY}
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", **settings})
    partitions = c.list_topics(topic, timeout=30).topics[topic].partitions
    stored = dict(conn.execute("SELECT part, next FROM offsets"))
    c.assign([TopicPartition(topic, p, stored.get(p, -2)) for p in partitions])  # -2: earliest
    say("READY")
    while True:
        messages = [m for m in receive(c) if m.error() is None]
        if not messages:
            continue
        ends = {m.partition(): m.offset() + 1 for m in messages}  # type: ignore[operator]
        rows = applied_rows((m.value(), m.timestamp()[1]) for m in messages)  # type: ignore[misc]
        conn.execute("BEGIN")
        conn.executemany(INSERT, rows)
        conn.executemany("INSERT OR REPLACE INTO offsets VALUES (?, ?)", ends.items())
        conn.execute("COMMIT")


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "streamq":
        from streamq import _loop

        _loop.run(streamq_consumer(args[0], args[1], args[2]))
    else:
        kafka_consumer(args[0], args[1], args[2])
