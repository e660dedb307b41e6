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


def ingest(spark: Any, broker: Any, folder: Path, partitions: int, total: int) -> float:
    topic = f"ingest-{uuid.uuid4().hex[:8]}"
    _fill_topic(broker, topic, partitions, total)
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
    )
    return time_query(spark, reader, folder / "ck")


def latency(spark: Any, broker: Any, folder: Path, rate: float, seconds: float) -> Latency:
    """The latency workload's Kafka producer (configured for latency) in its own process."""
    topic = f"latency-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", topic)
    )
    args = ("producer", broker.bootstrap, topic, rate, seconds)
    with Child("bench.latency.kafka", *args) as publisher:
        publisher.expect("READY")
        return measure(spark, reader, folder / "ck", publisher, rate, seconds)
