"""The Spark workload read from Kafka by Spark's own Kafka source: ingest from one topic of
N partitions, and micro-batch latency from a one-partition topic."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from ..common import Child
from .common import RECORD, Latency, measure, time_query


def _fill_topic(broker: Any, topic: str, partitions: int, total: int) -> None:
    broker.create_topic(topic, partitions)
    _produce(broker, topic, partitions, total)


def _produce(broker: Any, topic: str, partitions: int, total: int) -> None:
    """``total`` records, spread evenly over the topic's partitions."""
    producer = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 20})
    for i in range(total):
        while True:
            try:
                producer.produce(topic, RECORD, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(300)


# The Kafka source as its users tune it: a consumer's fetch waits up to fetch.max.wait.ms
# (500 ms by default) for fetch.min.bytes to arrive, and each of a micro-batch's partition
# tasks ends on such a fetch at the end of its offset range, so by default a partition
# costs its task about 0.5 s even when its records are all there (64 partitions of one
# record each: addBatch 17.4 s by default, 1.4 s with 5 ms). Spark passes kafka.* options
# to its consumers (docs: "Structured Streaming + Kafka Integration Guide", Kafka
# specific configurations).
TUNED = {"kafka.fetch.max.wait.ms": "5"}


def reader(spark: Any, broker: Any, topic: str, **options: str) -> Any:
    """``spark.readStream.format("kafka")`` on ``topic``, tuned (``TUNED``)."""
    read = spark.readStream.format("kafka")
    for name, value in {
        "kafka.bootstrap.servers": broker.bootstrap,
        "subscribe": topic,
        **TUNED,
        **options,
    }.items():
        read = read.option(name, value)
    return read


def ingest(spark: Any, broker: Any, folder: Path, partitions: int, total: int) -> float:
    topic = f"ingest-{uuid.uuid4().hex[:8]}"
    _fill_topic(broker, topic, partitions, total)
    return time_query(
        spark, reader(spark, broker, topic, startingOffsets="earliest"), folder / "ck"
    )


def latency(spark: Any, broker: Any, folder: Path, rate: float, seconds: float) -> Latency:
    """The latency workload's Kafka producer (configured for latency) in its own process."""
    topic = f"latency-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    args = ("producer", broker.bootstrap, topic, rate, seconds)
    with Child("bench.latency.kafka", *args) as publisher:
        publisher.expect("READY")
        read = reader(spark, broker, topic)
        return measure(spark, read, folder / "ck", publisher, rate, seconds)
