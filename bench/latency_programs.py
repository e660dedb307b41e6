"""The latency workload's processes, for both systems.

``sq-producer DB RATE SECONDS DURABILITY``, ``sq-consumer ADDRESS``,
``kafka-producer BOOTSTRAP TOPIC RATE SECONDS``, ``kafka-consumer BOOTSTRAP TOPIC``.

Producers publish on a fixed schedule: record i is due at start + i / RATE, and carries
that due time. Consumers measure receipt minus due time, so a stall delays every record
due during it and shows in the percentiles (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import struct
import sys
import time
from typing import cast

from hdrh.histogram import HdrHistogram

import streamq
from streamq import _loop
from streamq.storage import Durability

from .common import say, wait_line

RECORD_SIZE = 100
_DUE = struct.Struct("<dq")  # due time (s since the epoch), record number


def _value(due: float, number: int) -> bytes:
    return _DUE.pack(due, number).ljust(RECORD_SIZE, b".")


def _schedule(rate: float, seconds: float) -> tuple[float, int]:
    """The wall-clock start and how many records are due in all."""
    return time.time() + 0.2, int(rate * seconds)


class Latencies:
    def __init__(self, total: int) -> None:
        self.histogram = HdrHistogram(1, 120_000_000, 3)  # microseconds, up to 2 min
        self.total = total
        self.seen = 0

    def record(self, values: list[bytes], received: float) -> None:
        for value in values:
            due, _ = _DUE.unpack_from(value)
            self.histogram.record_value(max(1, int((received - due) * 1e6)))
        self.seen += len(values)

    def report(self) -> None:
        h = self.histogram
        say(
            "DONE",
            *(h.get_value_at_percentile(p) for p in (50, 99, 99.9)),
            h.get_max_value(),
            self.seen,
        )


def _publish(tx: streamq.BlockingTransaction, values: list[bytes]) -> None:
    for value in values:  # one record each, as the Kafka producer sends them
        tx.publish("latency", value)


async def sq_producer(db: str, rate: float, seconds: float, durability: Durability) -> None:
    async with streamq.Producer(db, port=0, durability=durability) as producer:
        await producer.create_stream("latency")
        say("READY", producer.address)
        await asyncio.to_thread(wait_line, "GO")
        start, total = _schedule(rate, seconds)
        say("START", total)
        sent = 0
        while sent < total:
            due_now = min(total, int((time.time() - start) * rate) + 1)
            if due_now > sent:
                values = [_value(start + n / rate, n) for n in range(sent, due_now)]
                await producer.run_in_transaction(_publish, values)
                sent = due_now
            else:
                # Event-loop timers tick in milliseconds: sleep to just before the next
                # record is due, then yield until it is (as the Kafka loop's poll(0) does).
                delay = start + sent / rate - time.time()
                await asyncio.sleep(delay - 0.001 if delay > 0.002 else 0)
        await asyncio.to_thread(wait_line, "STOP")


async def sq_consumer(address: str, total: int) -> None:
    latencies = Latencies(total)
    async with streamq.Consumer(address, "latency", start_seq=1) as consumer:
        say("READY")
        async for batch in consumer:
            latencies.record([r.value for r in batch], time.time())
            if latencies.seen >= total:
                break
    latencies.report()


# confluent-kafka's documented low-latency settings: send at once, no batching delay.
PRODUCER_LATENCY = {"acks": "all", "linger.ms": 0, "socket.nagle.disable": True}
# Its consumer: hand over fetched data at once; offsets are not committed.
CONSUMER_LATENCY = {"enable.auto.commit": False, "fetch.wait.max.ms": 1, "fetch.min.bytes": 1}


def kafka_producer(bootstrap: str, topic: str, rate: float, seconds: float) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, **PRODUCER_LATENCY})
    producer.list_topics(topic, timeout=30)
    say("READY")
    wait_line("GO")
    start, total = _schedule(rate, seconds)
    say("START", total)
    sent = 0
    while sent < total:
        due_now = min(total, int((time.time() - start) * rate) + 1)
        for number in range(sent, due_now):
            value = _value(start + number / rate, number)
            while True:
                try:
                    producer.produce(topic, value)
                    break
                except BufferError:  # its queue is full: it is behind, and the latency shows it
                    producer.poll(0.001)
        sent = max(sent, due_now)
        producer.poll(max(0.0, min(0.001, start + sent / rate - time.time())))
    producer.flush(60)
    wait_line("STOP")


def kafka_consumer(bootstrap: str, topic: str, total: int) -> None:
    from confluent_kafka import Consumer, TopicPartition

    from .kafka_pipe import receive

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "latency", **CONSUMER_LATENCY})
    consumer.assign([TopicPartition(topic, 0, -2)])
    consumer.consume(1, timeout=0.5)
    say("READY")
    latencies = Latencies(total)
    while latencies.seen < total:
        messages = receive(consumer)
        received = time.time()
        values = [m.value() for m in messages if m.error() is None]
        latencies.record([v for v in values if v is not None], received)
    consumer.close()
    latencies.report()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "sq-producer":
        _loop.run(sq_producer(args[0], float(args[1]), float(args[2]), cast(Durability, args[3])))
    elif role == "sq-consumer":
        _loop.run(sq_consumer(args[0], int(args[1])))
    elif role == "kafka-producer":
        kafka_producer(args[0], args[1], float(args[2]), float(args[3]))
    else:
        kafka_consumer(args[0], args[1], int(args[2]))
