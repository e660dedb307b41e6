"""Workload 5, second part: micro-batch latency, publish to visible in the sink.

A publisher thread writes records at a steady rate (stamped with their publish time in
ms); a streaming query with the default trigger hands each micro-batch to
``foreachBatch``, which takes ``now - timestamp`` for every row. The same for streamq (one
producer, read by the ``streamq`` source) and Kafka (a one-partition topic, read by
Spark's Kafka source, the producer on its low-latency settings).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

import streamq

from .latency_programs import PRODUCER_LATENCY

TICK = 0.01  # s between the publisher's batches
WARMUP = 3.0  # s of micro-batches not counted (query start-up)


def _paced(rate: float, seconds: float, send: Callable[[int], None]) -> int:
    """Call ``send(count)`` every TICK with the records due by then, for ``seconds``;
    returns the publish time (ms) of the last batch."""
    start, sent, last_ms = time.monotonic(), 0, 0
    total = int(rate * seconds)
    while sent < total:
        due = min(total, int((time.monotonic() - start) * rate))
        if due > sent:
            last_ms = int(time.time() * 1000)
            send(due - sent)
            sent = due
        time.sleep(TICK)  # pacing a load generator, not synchronising a test
    return last_ms


class _Sink:
    """foreachBatch: records each row's publish-to-visible latency, in microseconds."""

    def __init__(self, after: float) -> None:
        self.after = after  # epoch seconds; rows published earlier are start-up
        self.histogram = HdrHistogram(1, 600_000_000, 3)
        self.newest_ms = 0  # the newest publish time seen

    def __call__(self, df: Any, batch_id: int) -> None:
        published = [row[0] for row in df.selectExpr("unix_millis(timestamp)").collect()]
        now_ms = time.time() * 1000
        for ms in published:
            self.newest_ms = max(self.newest_ms, ms)
            if ms >= self.after * 1000:
                self.histogram.record_value(max(1, int((now_ms - ms) * 1000)))


def _measure(spark: Any, reader: Any, checkpoint: Path, publish: Callable[[], int]) -> _Sink:
    sink = _Sink(after=time.time() + WARMUP)
    query = (
        reader.load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        last_ms = publish()
        deadline = time.monotonic() + 60
        while sink.newest_ms < last_ms and query.isActive and time.monotonic() < deadline:
            time.sleep(0.1)  # until the last batch published is visible in the sink
    finally:
        query.stop()
    return sink


def run_streamq(spark: Any, folder: Path, rate: float, seconds: float) -> _Sink:
    with streamq.SyncProducer(str(folder / "p.db")) as producer:
        producer.create_stream("events")

        def send(count: int) -> None:
            with producer.transaction() as tx:
                tx.publish_many("events", [b"v" * 100] * count)

        reader = (
            spark.readStream.format("streamq")
            .option("endpoints", producer.address)
            .option("stream", "events")
            .option("startingOffsets", "latest")
        )
        return _measure(spark, reader, folder / "ck", lambda: _paced(rate, seconds, send))


def run_kafka(spark: Any, broker: Any, folder: Path, rate: float, seconds: float) -> _Sink:
    from confluent_kafka import Producer

    topic = f"latency-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    producer = Producer({"bootstrap.servers": broker.bootstrap, **PRODUCER_LATENCY})

    def send(count: int) -> None:
        for _ in range(count):
            producer.produce(topic, b"v" * 100)
        producer.poll(0)

    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "latest")
    )
    try:
        return _measure(spark, reader, folder / "ck", lambda: _paced(rate, seconds, send))
    finally:
        producer.flush(30)
