"""Kafka's client settings and receive loop, the same in every workload's Kafka processes."""

from __future__ import annotations

from confluent_kafka import Consumer, Message

# confluent-kafka's documented throughput settings: batch, linger, big queues.
PRODUCER_THROUGHPUT = {
    "acks": "all",
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 1_048_576,
    "compression.type": "none",
}
CONSUMER_THROUGHPUT = {
    "enable.auto.commit": False,
    "auto.offset.reset": "earliest",
    "fetch.max.bytes": 52_428_800,
    "max.partition.fetch.bytes": 10_485_760,
    "queued.max.messages.kbytes": 262_144,
}

# confluent-kafka's documented low-latency settings: send at once, no batching delay.
PRODUCER_LATENCY = {"acks": "all", "linger.ms": 0, "socket.nagle.disable": True}
# Its consumer: hand over fetched data at once; offsets are not committed.
CONSUMER_LATENCY = {"enable.auto.commit": False, "fetch.wait.max.ms": 1, "fetch.min.bytes": 1}


def receive(c: Consumer, limit: int = 10_000) -> list[Message]:
    """Wait for one message, then take whatever else is already fetched (up to ``limit``).

    ``Consumer.consume(n, timeout)`` alone waits until ``n`` messages or the timeout,
    which would add up to the timeout to every batch's latency.
    """
    first = c.poll(1.0)
    if first is None:
        return []
    return [first, *c.consume(limit - 1, timeout=0)]
