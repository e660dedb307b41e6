"""Kafka's processes of the transfer workload (the package's docstring): ``outbox-producer
DB TOTAL RATE SEED``, ``outbox-handlers DB TOTAL SEED HANDLERS DURABILITY``, ``relay DB
BOOTSTRAP TOPIC``, ``naive-producer DB BOOTSTRAP TOPIC TOTAL RATE SEED`` and ``consumer
BOOTSTRAP TOPIC DB TARGET DEDUPE``; and the broker's warm-up."""

from __future__ import annotations

import random
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from ..common import say
from ..kafka.clients import PRODUCER_THROUGHPUT, receive
from ..measure import Latencies
from .common import (
    CREDIT,
    DEBIT,
    DEPOSIT,
    JOURNAL,
    KAFKA_CONSUMER_SCHEMA,
    LEDGER,
    RECORD_CREDIT,
    RELAY_SCHEMA,
    Control,
    debits,
    make_transfers,
    open_db,
    paced_transfers,
    payloads,
    setup_consumer_db,
    setup_producer_db,
)

RELAY_BATCH = 5000  # outbox rows per relay round
RELAY_POLL = 0.001  # s between the relay's checks for new commits (PRAGMA data_version)

# Kafka clients. The relay and the naive producer: idempotent, acks=all, batching as in the
# pipe workload (they wait for delivery of what they produced, which sends at once).
KAFKA_PRODUCER = {**PRODUCER_THROUGHPUT, "enable.idempotence": True}
KAFKA_CONSUMER = {
    "group.id": LEDGER,
    "enable.auto.commit": False,  # offsets live in the consumer's own database
    "auto.offset.reset": "earliest",
    "fetch.wait.max.ms": 10,
    "fetch.min.bytes": 1,
}


class DeliveryFailed(RuntimeError):
    pass


class KafkaSender:
    """An idempotent producer that waits until what it produced is acknowledged.

    Before it is used, it delivers one message to ``TOPIC-warm-up``: a long-running
    service has long had its producer id and metadata (a fresh one waits ~0.3 s for them).
    """

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import KafkaError, Message, Producer

        self.topic = topic
        self.errors: list[KafkaError] = []
        self.producer = Producer({"bootstrap.servers": bootstrap, **KAFKA_PRODUCER})
        self.producer.list_topics(topic, timeout=30)

        def delivered(error: KafkaError | None, message: Message) -> None:
            if error is not None:
                self.errors.append(error)

        self._delivered = delivered
        self.topic = f"{topic}-warm-up"
        self.send([b"warm-up"])
        self.topic = topic

    def send(self, values: Sequence[bytes]) -> None:
        """Produce ``values`` and wait until every one is acknowledged (acks=all)."""
        for value in values:
            while True:
                try:
                    self.producer.produce(self.topic, value, on_delivery=self._delivered)
                    break
                except BufferError:  # local queue full: let deliveries drain
                    self.producer.poll(0.01)
        left = self.producer.flush(60)
        if left or self.errors:
            raise DeliveryFailed(f"{left} not delivered within 60 s; errors {self.errors[:3]}")


def outbox_producer(db: str, total: int, rate: float, seed: int) -> None:
    control = Control()
    rng = random.Random(seed)
    conn = open_db(db)
    last = setup_producer_db(conn, outbox=True)
    say("READY")
    control.wait_go()
    say("START", time.time())
    for transfers, dues in paced_transfers(control, rng, rate, last, total):
        conn.execute("BEGIN IMMEDIATE")  # debit, journal and outbox rows: one commit
        conn.executemany(DEBIT, debits(transfers))
        conn.executemany(JOURNAL, transfers)
        conn.executemany(
            "INSERT INTO outbox (payload) VALUES (?)", [(p,) for p in payloads(transfers, dues)]
        )
        conn.execute("COMMIT")
        control.worst_moment()  # committed; the relay has not seen it yet
    say("DONE", time.time())
    control.wait_stop()
    conn.close()


def outbox_handlers(db: str, total: int, seed: int, handlers: int, durability: str) -> None:
    """``handlers`` threads of a web service, each committing one transfer per
    transaction on its own connection. SQLite has one writer: they take turns on a lock
    (its busy handler, sleeping and retrying, does worse); each COMMIT is its own."""
    control = Control()
    rng = random.Random(seed)
    conns = [open_db(db, durability) for _ in range(handlers)]
    last = setup_producer_db(conns[0], outbox=True)
    requests = iter(make_transfers(rng, last + 1, total - last))
    taking, writing = threading.Lock(), threading.Lock()

    def handler(conn: sqlite3.Connection) -> None:
        while not control.stop.is_set():
            with taking:
                request = next(requests, None)
            if request is None:
                return
            with writing:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(DEBIT, (request.amount, request.account))
                conn.execute(JOURNAL, request)
                conn.execute("INSERT INTO outbox (payload) VALUES (?)", payloads([request], None))
                conn.execute("COMMIT")
            control.worst_moment()

    say("READY")
    control.wait_go()
    say("START", time.time())
    threads = [threading.Thread(target=handler, args=(conn,)) for conn in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    say("DONE", time.time())
    control.wait_stop()
    for conn in conns:
        conn.close()


class Outbox(Protocol):
    """An outbox as the relay reads it, in the producer's database (one per engine)."""

    def version(self) -> object:
        """Changes whenever another connection commits (cheap: polled)."""

    def fetch(self, limit: int) -> list[tuple[Any, bytes]]:
        """Up to ``limit`` rows after the recorded position, in relay order:
        (position, payload)."""

    def record(self, position: Any) -> None:
        """Store ``position`` (the last row relayed) in the producer's database."""

    def close(self) -> None: ...


class SQLiteOutbox:
    """Rows by id: SQLite's one writer gives ids in commit order, so none commits late."""

    def __init__(self, db: str) -> None:
        self.conn = open_db(db)
        self.conn.execute(RELAY_SCHEMA)
        self.conn.execute("INSERT OR IGNORE INTO relay_state (id, last) VALUES (0, 0)")
        row = self.conn.execute("SELECT last FROM relay_state WHERE id = 0").fetchone()
        self.last = int(row[0])

    def version(self) -> object:
        return self.conn.execute("PRAGMA data_version").fetchone()[0]

    def fetch(self, limit: int) -> list[tuple[Any, bytes]]:
        return self.conn.execute(
            "SELECT id, payload FROM outbox WHERE id > ? ORDER BY id LIMIT ?", (self.last, limit)
        ).fetchall()

    def record(self, position: Any) -> None:
        self.last = int(position)
        self.conn.execute("UPDATE relay_state SET last = ? WHERE id = 0", (self.last,))

    def close(self) -> None:
        self.conn.close()


def _wait_for_commit(outbox: Outbox, seen: object, control: Control) -> None:
    """Poll the outbox's version (SQLite: ``PRAGMA data_version``) every ``RELAY_POLL``."""
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline and not control.stop.is_set():
        if outbox.version() != seen:
            return
        time.sleep(RELAY_POLL)


def relay_outbox(outbox: Outbox, bootstrap: str, topic: str, control: Control) -> None:
    """The relay's loop, whatever the engine: read, produce and wait for delivery, record."""
    sender = KafkaSender(bootstrap, topic)
    say("READY")
    while not control.stop.is_set():
        version = outbox.version()
        rows = outbox.fetch(RELAY_BATCH)
        if not rows:
            _wait_for_commit(outbox, version, control)
            continue
        sender.send([payload for _, payload in rows])
        control.worst_moment()  # delivered to Kafka, not yet recorded: a restart re-sends
        outbox.record(rows[-1][0])
    sender.producer.close()
    outbox.close()


def relay(db: str, bootstrap: str, topic: str) -> None:
    control = Control()
    relay_outbox(SQLiteOutbox(db), bootstrap, topic, control)


def naive_producer(db: str, bootstrap: str, topic: str, total: int, rate: float, seed: int) -> None:
    control = Control()
    rng = random.Random(seed)
    conn = open_db(db)
    last = setup_producer_db(conn, outbox=False)
    sender = KafkaSender(bootstrap, topic)
    say("READY")
    control.wait_go()
    say("START", time.time())
    for transfers, dues in paced_transfers(control, rng, rate, last, total):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(DEBIT, debits(transfers))
        conn.executemany(JOURNAL, transfers)
        conn.execute("COMMIT")
        control.worst_moment()  # committed, deposits not yet produced: the dual-write gap
        sender.send(payloads(transfers, dues))
    say("DONE", time.time())
    control.wait_stop()
    sender.producer.close()
    conn.close()


# A deposit as the Kafka consumer received it: transfer id, to account, amount, due time,
# partition, offset.
KafkaDeposit = tuple[int, int, int, float, int, int]


class KafkaLedger(Protocol):
    """The ledger's database as the Kafka consumer uses it (one per engine)."""

    def offsets(self, topic: str) -> dict[int, int]:
        """{partition: next offset} as stored with the credits."""

    def apply(
        self, topic: str, deposits: list[KafkaDeposit], ends: dict[int, int], dedupe: bool
    ) -> list[KafkaDeposit]:
        """One transaction: every delivery in ``received``; the credits (with ``dedupe``,
        only of transfer ids not credited before); the offsets ``ends``. Returns the
        deposits credited."""

    def close(self) -> None: ...


class SQLiteKafkaLedger:
    def __init__(self, db: str) -> None:
        setup_consumer_db(db, KAFKA_CONSUMER_SCHEMA)
        self.conn = open_db(db)

    def offsets(self, topic: str) -> dict[int, int]:
        rows = self.conn.execute("SELECT part, next FROM offsets WHERE topic = ?", (topic,))
        return {int(part): int(end) for part, end in rows}

    def apply(
        self, topic: str, deposits: list[KafkaDeposit], ends: dict[int, int], dedupe: bool
    ) -> list[KafkaDeposit]:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO received (transfer_id, part, off) VALUES (?, ?, ?)",
            [(d[0], d[4], d[5]) for d in deposits],
        )
        fresh = deposits
        if dedupe:  # credit a transfer id once, however often the relay delivered it
            fresh = [
                d
                for d in deposits
                if conn.execute("INSERT OR IGNORE INTO seen VALUES (?)", (d[0],)).rowcount == 1
            ]
        conn.executemany(CREDIT, [(d[2], d[1]) for d in fresh])
        conn.executemany(RECORD_CREDIT, [(d[0], d[2]) for d in fresh])
        conn.executemany(
            "INSERT OR REPLACE INTO offsets (topic, part, next) VALUES (?, ?, ?)",
            [(topic, part, end) for part, end in ends.items()],
        )
        conn.execute("COMMIT")
        return fresh

    def close(self) -> None:
        self.conn.close()


def consume_deposits(
    ledger: KafkaLedger, bootstrap: str, topic: str, target: int, dedupe: bool, control: Control
) -> None:
    """The Kafka consumer's loop, whatever the engine: from the stored offsets, each poll's
    deposits credited with their offsets in one transaction; DONE after ``target``."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, **KAFKA_CONSUMER})
    try:
        partitions = c.list_topics(topic, timeout=30).topics[topic].partitions
        stored = ledger.offsets(topic)
        c.assign([TopicPartition(topic, p, stored.get(p, OFFSET_BEGINNING)) for p in partitions])
        say("READY")
        latencies = Latencies()
        credited, finished = 0, time.time()
        while not (target and credited >= target) and not control.stop.is_set():
            messages = receive(c)
            deposits: list[KafkaDeposit] = []
            for m in messages:
                error, value, part, offset = m.error(), m.value(), m.partition(), m.offset()
                if error is not None:
                    raise RuntimeError(f"kafka consumer: {error}")
                assert value is not None and part is not None and offset is not None
                deposits.append((*DEPOSIT.unpack(value), part, offset))
            if not deposits:
                continue
            ends: dict[int, int] = {}
            for d in deposits:
                ends[d[4]] = d[5] + 1
            fresh = ledger.apply(topic, deposits, ends, dedupe)
            finished = time.time()
            latencies.record([d[3] for d in fresh], finished)
            credited += len(fresh)
            control.worst_moment()  # committed (credits and offsets together)
        say("DONE", finished, *latencies.figures())
    finally:
        c.close()
        ledger.close()


def consumer(bootstrap: str, topic: str, db: str, target: int, dedupe: bool) -> None:
    control = Control()
    consume_deposits(SQLiteKafkaLedger(db), bootstrap, topic, target, dedupe, control)


def warm_up(broker: Any) -> None:
    """An idempotent produce and a consume in the ledger's group, so that no measured run
    waits for a fresh broker to set up its producer ids and its group coordinator."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

    topic = f"transfer-warm-up-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    # log_level 3: not the warning this is about ("Coordinator load in progress: retrying")
    producer = Producer({"bootstrap.servers": broker.bootstrap, **KAFKA_PRODUCER, "log_level": 3})
    producer.produce(topic, b"warm-up")
    left = producer.flush(120)
    producer.close()
    if left:
        raise RuntimeError("Kafka: the warm-up message was not delivered within 120 s")
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, **KAFKA_CONSUMER})
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 120
        while consumer.poll(1.0) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("Kafka: the warm-up message was not consumed within 120 s")
    finally:
        consumer.close()


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "outbox-producer":
        outbox_producer(args[0], int(args[1]), float(args[2]), int(args[3]))
    elif role == "outbox-handlers":
        outbox_handlers(args[0], int(args[1]), int(args[2]), int(args[3]), args[4])
    elif role == "relay":
        relay(args[0], args[1], args[2])
    elif role == "naive-producer":
        naive_producer(args[0], args[1], args[2], int(args[3]), float(args[4]), int(args[5]))
    elif role == "consumer":
        consumer(args[0], args[1], args[2], int(args[3]), args[4] == "1")
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
