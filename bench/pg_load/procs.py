"""The processes of the PostgreSQL load workload (the package's docstring), each speaking
``bench.common.Child``'s line protocol:

- ``writer SYSTEM URL INDEX SECONDS RATE OUT``: one application process. Each transaction
  inserts a business row and emits the matching event: ``streamq.publish`` (streamq), an
  outbox row (outbox, kafka, debezium); for ``SECONDS`` after GO, at ``RATE``
  transactions/s (0: as fast as it can). Writes each transaction's (n, start, COMMIT
  sent, COMMIT returned), wall-clock nanoseconds, to ``OUT``; says ``DONE count``.
- ``consumer ADDRESS OUT [STREAM]``: a ``streamq.Consumer`` of the stream; writes (writer,
  n, received) per record to ``OUT`` and checks seqs dense from 1; told ``EXPECT count``,
  says ``DONE count anomalies`` once it has them all. With ``STREAM`` ``public.outbox``
  (the capture system: ``streamq serve --capture outbox``), each record is a captured
  change of the outbox, its event the new row's payload.
- ``relay URL BOOTSTRAP TOPIC``: the outbox relay (``bench.transfer_pg.kafka``'s, on this
  workload's outbox); ``kafka-consumer BOOTSTRAP TOPIC OUT``: what the streamq consumer
  does, from Kafka (a record Kafka delivers twice counts as an anomaly).
- ``debezium-relay URL BOOTSTRAP TOPIC SLOT OFFSETS``: Debezium's PostgreSQL connector in
  the relay's place (``bench.transfer_pg.kafka``'s, on this workload's outbox; optional,
  ``BENCH_DEBEZIUM=1``).
"""

from __future__ import annotations

import array
import asyncio
import struct
import sys
import threading
import time
from typing import Any

import psycopg

import streamq
from streamq import _loop

from ..common import say, wait_line
from ..transfer_pg.common import OUTBOX_SCHEMA

STREAM = "orders"
CAPTURED = "public.outbox"  # the outbox's changes, captured by streamq (the capture system)
# An event: the writer, its transaction number, padding to 100 bytes.
EVENT = struct.Struct(">iq88x")
BUSINESS = "INSERT INTO orders (writer, n, note) VALUES (%s, %s, 'an order')"
OUTBOX = "INSERT INTO outbox (payload) VALUES (%s)"
SCHEMA = (
    "CREATE TABLE orders (id bigserial PRIMARY KEY, writer integer NOT NULL, "
    "n bigint NOT NULL, note text NOT NULL)",
    *OUTBOX_SCHEMA,  # the transfer workload's: its relay reads it
)


def writer(system: str, url: str, index: int, seconds: float, rate: float, out: str) -> None:
    times = array.array("q")
    with psycopg.connect(url) as conn:  # not autocommit: the first statement begins
        conn.execute("SET synchronous_commit = on")
        conn.commit()
        say("READY")
        wait_line("GO")
        start = time.time()
        deadline = start + seconds
        n = 0
        while True:
            began = time.time()
            if began >= deadline:
                break
            if rate > 0:
                due = start + n / rate
                if due > began:
                    time.sleep(due - began)
                    began = time.time()
            event = EVENT.pack(index, n)
            conn.execute(BUSINESS, (index, n))
            if system == "streamq":
                streamq.publish(conn, STREAM, event)
            else:
                conn.execute(OUTBOX, (event,))
            sent = time.time_ns()
            conn.commit()
            times.extend((n, int(began * 1e9), sent, time.time_ns()))
            n += 1
    with open(out, "wb") as f:
        times.tofile(f)
    say("DONE", n)


class Received:
    """What a consumer got: (writer, n, received ns) per record, and the anomalies."""

    def __init__(self) -> None:
        self.rows = array.array("q")
        self.seen: dict[int, int] = {}  # writer -> next n expected
        self.count = 0
        self.anomalies = 0  # a record twice, or a writer's records out of order
        self.expected: int | None = None
        self.lock = threading.Lock()

    def add(self, value: bytes, now: int) -> None:
        index, n = EVENT.unpack(value)
        if self.seen.get(index, 0) != n:
            self.anomalies += 1
        self.seen[index] = max(self.seen.get(index, 0), n + 1)
        self.rows.extend((index, n, now))
        self.count += 1

    def done(self) -> bool:
        with self.lock:
            return self.expected is not None and self.count >= self.expected

    def save(self, out: str) -> None:
        with open(out, "wb") as f:
            self.rows.tofile(f)


def _expectations(received: Received) -> None:
    """A thread: the parent's ``EXPECT count``."""
    for line in sys.stdin:
        word, *fields = line.split()
        if word == "EXPECT":
            with received.lock:
                received.expected = int(fields[0])
            return


async def streamq_consumer(address: str, out: str, stream: str = STREAM) -> None:
    received = Received()
    threading.Thread(target=_expectations, args=(received,), daemon=True).start()
    next_seq = 1
    captured = stream == CAPTURED
    async with streamq.Consumer(address, stream) as consumer:
        say("READY")
        while not received.done():
            try:
                async with asyncio.timeout(0.2):
                    batch = await anext(consumer)
            except TimeoutError:
                continue
            now = time.time_ns()
            for record in batch:
                if record.seq != next_seq:  # dense from 1, each once
                    received.anomalies += 1
                next_seq = record.seq + 1
                if captured:
                    received.add(streamq.decode_change(record.value)["new"]["payload"], now)
                else:
                    received.add(record.value, now)
    received.save(out)
    say("DONE", received.count, received.anomalies)


def kafka_consumer(bootstrap: str, topic: str, out: str) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    received = Received()
    threading.Thread(target=_expectations, args=(received,), daemon=True).start()
    consumer: Any = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"pg-load-{topic}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 10,
            "fetch.min.bytes": 1,
        }
    )
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    say("READY")
    while not received.done():
        # What has arrived, after 5 ms at most (consume waits for all it asks for).
        messages = consumer.consume(10_000, 0.005)
        now = time.time_ns()
        for message in messages:
            if message.error() is None:
                received.add(message.value(), now)
    consumer.close()
    received.save(out)
    say("DONE", received.count, received.anomalies)


def relay(url: str, bootstrap: str, topic: str) -> None:
    from ..transfer.common import Control
    from ..transfer.kafka import relay_outbox
    from ..transfer_pg.kafka import PostgresOutbox

    relay_outbox(PostgresOutbox(url), bootstrap, topic, Control())


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "writer":
        system, url, index, seconds, rate, out = args
        writer(system, url, int(index), float(seconds), float(rate), out)
    elif role == "consumer":
        _loop.run(streamq_consumer(*args))
    elif role == "kafka-consumer":
        kafka_consumer(*args)
    elif role == "relay":
        relay(*args)
    elif role == "debezium-relay":
        from ..transfer_pg.kafka import debezium_relay

        debezium_relay(*args)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
