"""Kafka's side of the latency workload: ``producer BOOTSTRAP TOPIC RATE SECONDS`` and
``consumer BOOTSTRAP TOPIC TOTAL``, on confluent-kafka's documented low-latency settings.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from ..common import say, wait_line
from ..kafka.clients import CONSUMER_LATENCY, PRODUCER_LATENCY, receive
from ..measure import Latencies, Pacer
from . import record_receipt, record_value, schedule_start

# Called with the time (``time.perf_counter``) a record was produced, then librdkafka's
# delivery report: its error (None: acknowledged) and the message.
OnDelivery = Callable[[float, KafkaError | None, Message], None]


def produce_paced(
    kafka: Producer, topic: str, pacer: Pacer, total: int, on_delivery: OnDelivery | None = None
) -> None:
    """``total`` records on ``pacer``'s schedule, each produced once it is due, then every
    delivery awaited (``flush``)."""
    while pacer.taken < total:
        first = pacer.taken
        for number, due in enumerate(pacer.take(max(0, min(total - first, pacer.owed()))), first):
            value = record_value(due, number)
            report = None if on_delivery is None else partial(on_delivery, time.perf_counter())
            while True:
                try:
                    kafka.produce(topic, value, on_delivery=report)
                    break
                except BufferError:  # its queue is full: it is behind, and the latency shows it
                    kafka.poll(0.001)
        kafka.poll(min(0.001, pacer.wait()))
    kafka.flush(60)


def producer(bootstrap: str, topic: str, rate: float, seconds: float) -> None:
    kafka = Producer({"bootstrap.servers": bootstrap, **PRODUCER_LATENCY})
    kafka.list_topics(topic, timeout=30)
    say("READY")
    wait_line("GO")
    pacer, total = Pacer(rate, schedule_start()), int(rate * seconds)
    say("START", total)
    produce_paced(kafka, topic, pacer, total)
    wait_line("STOP")


def consumer(bootstrap: str, topic: str, total: int) -> None:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "latency", **CONSUMER_LATENCY})
    c.assign([TopicPartition(topic, 0, -2)])
    c.consume(1, timeout=0.5)
    say("READY")
    latencies = Latencies()
    while latencies.count < total:
        messages = receive(c)
        received = time.time()
        values = [m.value() for m in messages if m.error() is None]
        record_receipt(latencies, [v for v in values if v is not None], received)
    c.close()
    say("DONE", *latencies.figures())


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        producer(args[0], args[1], float(args[2]), float(args[3]))
    else:
        consumer(args[0], args[1], int(args[2]))
