"""The benchmarks' real Kafka broker (bench/kafka/broker.py): it starts, serves, and stops.

The first run on a machine downloads the broker's jars from Maven Central with Maven.
"""

from __future__ import annotations

import os
import time

import pytest
from confluent_kafka import (  # type: ignore[import-untyped,unused-ignore]
    Consumer,
    KafkaException,
    Producer,
)

from bench.kafka.broker import KafkaBroker

COUNT = 1000


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still listed: a zombie not yet reaped is gone too.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(240)
def test_broker_round_trip_over_two_partitions() -> None:
    with KafkaBroker() as broker:
        pid = broker.pid
        log_dir = broker.log_dir
        assert broker.bootstrap.startswith("127.0.0.1:")
        assert broker.config["process.roles"] == "broker,controller"
        assert broker.running
        broker.create_topic("smoke", 2)

        delivered: list[int] = []
        failed: list[str] = []

        def on_delivery(error: object, message: object) -> None:
            if error is not None:
                failed.append(str(error))
            else:
                delivered.append(1)

        producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
        sent = {f"value {i}".encode() for i in range(COUNT)}
        for i, value in enumerate(sorted(sent)):
            producer.produce("smoke", value, key=str(i).encode(), on_delivery=on_delivery)
            producer.poll(0)
        assert producer.flush(60) == 0
        del producer
        assert not failed
        assert len(delivered) == COUNT

        consumer = Consumer(
            {
                "bootstrap.servers": broker.bootstrap,
                "group.id": "smoke-test",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        received: list[bytes] = []
        partitions: set[int] = set()
        try:
            consumer.subscribe(["smoke"])
            deadline = time.monotonic() + 90
            while len(received) < COUNT and time.monotonic() < deadline:
                for message in consumer.consume(500, timeout=0.5):
                    if message.error():
                        raise KafkaException(message.error())
                    payload, partition = message.value(), message.partition()
                    assert payload is not None and partition is not None
                    received.append(payload)
                    partitions.add(partition)
        finally:
            consumer.close()

        assert len(received) == COUNT
        assert set(received) == sent
        assert partitions == {0, 1}  # keyed messages landed in both partitions

    assert not broker.running
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"broker JVM {pid} still running"
    assert not log_dir.exists()  # its temporary folder was removed
