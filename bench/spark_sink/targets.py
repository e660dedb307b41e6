"""Where the Spark sink workload's queries write: a fresh producer database served by
``streamq serve`` or a Kafka topic, each with its consumer running (``consumers``), and
the query that writes there. Shared by the runs (``run``) and the fault's query
process (``faults``)."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common import Child

STREAM = "bench"
# Spark's Kafka sink as its users tune it for throughput (the Java producer's names, as
# kafka.* options): acks=all as streamq's commit, batches of up to 1 MB, 5 ms linger.
KAFKA_SINK = {
    "kafka.acks": "all",
    "kafka.linger.ms": "5",
    "kafka.batch.size": "1000000",
    "kafka.compression.type": "none",
}


@dataclass
class Target:
    """Where one sink's query writes, and the consumer database it ends in."""

    system: str
    options: dict[str, str]  # the sink's: format and its options
    consumer_db: Path

    def applied(self) -> tuple[int, int]:
        """Rows the consumer applied, and how many distinct ones (a scan of them all)."""
        with closing(sqlite3.connect(self.consumer_db, timeout=30)) as conn:
            row = conn.execute("SELECT count(*), count(DISTINCT id) FROM applied").fetchone()
        return int(row[0]), int(row[1])

    def rows(self) -> int:
        """Rows the consumer applied, from the last rowid (it only inserts): cheap enough to
        poll, where ``applied`` scans every row (60 ms at 500,000 rows)."""
        with closing(sqlite3.connect(self.consumer_db, timeout=30)) as conn:
            (last,) = conn.execute("SELECT max(rowid) FROM applied").fetchone()
        return int(last or 0)


def producer_db(folder: Path) -> str:
    """A fresh SQLite producer database with stream ``STREAM``, nobody serving it yet."""
    import streamq

    db = str(folder / f"producer-{uuid.uuid4().hex[:8]}.db")
    with streamq.SyncProducer(db, serve=False) as producer:
        producer.create_stream(STREAM)
    return db


@contextmanager
def target(system: str, broker: Any, folder: Path, partitions: int) -> Iterator[Target]:
    """A fresh place for ``system``'s sink to write (a producer database served by
    ``streamq serve``, or a topic of ``partitions`` partitions), its consumer running."""
    consumer_db = folder / f"consumer-{uuid.uuid4().hex[:8]}.db"
    if system == "streamq":
        db = producer_db(folder)
        with Child("streamq", "serve", db, "--host", "127.0.0.1", "--port", "0") as server:
            address = server.expect("serving", timeout=60)[-1]
            args = ("streamq", address, STREAM, consumer_db)
            with Child("bench.spark_sink.consumers", *args) as consumer:
                consumer.expect("READY", timeout=60)
                options = {"format": "streamq", "db": db, "stream": STREAM}
                yield Target(system, options, consumer_db)
        return
    topic = f"sink-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions)
    args = ("kafka", broker.bootstrap, topic, consumer_db)
    with Child("bench.spark_sink.consumers", *args) as consumer:
        consumer.expect("READY", timeout=60)
        options = {"format": "kafka", "kafka.bootstrap.servers": broker.bootstrap}
        yield Target(system, {**options, **KAFKA_SINK, "topic": topic}, consumer_db)


def start_query(rows: Any, sink: dict[str, str], checkpoint: Path) -> Any:
    """``rows`` (a streaming DataFrame of ``value``) written by a sink (``Target.options``)."""
    options = dict(sink)
    writer = rows.writeStream.format(options.pop("format"))
    for name, value in {**options, "checkpointLocation": str(checkpoint)}.items():
        writer = writer.option(name, value)
    return writer.start()
