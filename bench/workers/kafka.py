"""Kafka's processes of the workers workload (the package's docstring): ``worker DB INDEX
WORKERS RATE COUNT SECONDS`` writing an outbox row, and ``consumer BOOTSTRAP TOPIC OUT
SECONDS DRAIN``."""

from __future__ import annotations

import sys
import time

from confluent_kafka import Consumer, TopicPartition

from ..kafka.clients import CONSUMER_LATENCY, receive
from .common import Expected, Receipts, main


def consumer(bootstrap: str, topic: str, out: str, seconds: float, drain: float) -> None:
    expected, receipts = Expected(), Receipts()
    deadline = time.monotonic() + seconds
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "workers", **CONSUMER_LATENCY})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        consumer.consume(1, timeout=0.5)  # connected and fetching before READY
        receipts.ready()
        while not expected.reached(len(receipts.received)) and time.monotonic() < deadline:
            if expected.arrived.is_set():
                deadline = min(deadline, expected.arrived_at + drain)
            events = []
            for message in receive(consumer):
                error, value, offset = message.error(), message.value(), message.offset()
                if error is not None:
                    raise RuntimeError(f"kafka consumer: {error}")
                assert value is not None and offset is not None
                events.append((offset, value))
            if events:
                receipts.record(events)
    finally:
        consumer.close()
    receipts.report(out)


if __name__ == "__main__":
    main(
        "outbox",
        sys.argv[1:],
        lambda args: consumer(args[0], args[1], args[2], float(args[3]), float(args[4])),
    )
