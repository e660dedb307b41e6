"""Kafka's side of the fan-out workload: ``producer BOOTSTRAP TOPIC RATE SECONDS`` and
``consumers BOOTSTRAP TOPIC COUNT TOTAL``.

The producer is the latency workload's (``linger.ms=0``, ``acks=all``), its publish
latency from ``produce`` to the delivery report. Each consumer is a group of its own
(``group.id`` its own), assigned the topic's one partition from its start, on a thread of
its own (librdkafka's ``poll`` blocks); offsets are not committed.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from ..common import say, wait_line
from ..kafka.clients import CONSUMER_LATENCY, PRODUCER_LATENCY, receive
from ..latency import schedule_start
from ..latency.kafka import produce_paced
from ..measure import Latencies, Pacer
from . import Tally, on_stop

# The latency workload's consumer settings, but for how long the broker holds a fetch
# that finds nothing new: Kafka's default (500 ms), not 1 ms. With fetch.min.bytes=1 the
# broker answers a waiting fetch as soon as a record is appended, so this bounds only the
# idle polling, which at 1 ms is a thousand requests a second per consumer to the broker.
CONSUMER_FANOUT = {**CONSUMER_LATENCY, "fetch.wait.max.ms": 500}
READY_TIMEOUT = 120.0  # s for every consumer to connect and be assigned its partition


def producer(bootstrap: str, topic: str, rate: float, seconds: float) -> None:
    kafka = Producer({"bootstrap.servers": bootstrap, **PRODUCER_LATENCY})
    kafka.list_topics(topic, timeout=30)
    publishes = Latencies()
    failed: list[KafkaError] = []

    def delivered(sent: float, error: KafkaError | None, message: Message) -> None:
        publishes.record_micros([int((time.perf_counter() - sent) * 1e6)])
        if error is not None:
            failed.append(error)

    say("READY")
    wait_line("GO")
    start = schedule_start()
    pacer, total = Pacer(rate, start), int(rate * seconds)
    say("START", total)
    produce_paced(kafka, topic, pacer, total, delivered)
    elapsed = time.time() - start
    if failed or publishes.count < total:
        raise RuntimeError(f"{total - publishes.count + len(failed)} of {total} not delivered")
    p50, p99, *_ = publishes.figures()
    say("PUBLISHED", total / elapsed, p50, p99)
    wait_line("STOP")


def consumers(bootstrap: str, topic: str, count: int, total: int) -> None:
    tally = Tally(count, total)
    stop = threading.Event()
    ready: queue.Queue[BaseException | None] = queue.Queue()

    def consume(index: int) -> None:
        try:
            settings = {"bootstrap.servers": bootstrap, "group.id": f"{topic}-{index}"}
            c = Consumer({**settings, **CONSUMER_FANOUT})
            c.assign([TopicPartition(topic, 0, -2)])  # -2: from the partition's start
            c.consume(1, timeout=0.5)  # connected and fetching before READY
        except BaseException as error:
            ready.put(error)
            raise
        ready.put(None)
        try:
            while not stop.is_set():
                messages = receive(c)
                received = time.time()
                values = [m.value() for m in messages if m.error() is None]
                if tally.receive(index, [v for v in values if v is not None], received):
                    break
        finally:
            c.close()

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for _ in threads:
        error = ready.get(timeout=READY_TIMEOUT)
        if error is not None:
            raise error
    say("READY")
    on_stop(stop.set)
    for thread in threads:
        thread.join()
    tally.say_done()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        producer(args[0], args[1], float(args[2]), float(args[3]))
    else:
        consumers(args[0], args[1], int(args[2]), int(args[3]))
