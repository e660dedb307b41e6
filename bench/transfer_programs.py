"""The transfer workload's processes (``bench/transfer.py`` runs them), for three systems.

A payments service debits an account and emits a deposit; a ledger service credits it in
its own database. Roles (``python -m bench.transfer_programs ROLE ARGS``):

- ``sq-producer DB PORT TOTAL RATE SEED``: streamq. The debit, the transfer's journal row and
  ``tx.publish("deposits", ...)`` commit in ONE transaction of the service's database.
- ``sq-consumer ADDRESS DB TARGET``: ``streamq.Consumer(..., name="ledger")``; credits in
  ``consumer.transaction(batch)`` (the position is stored in the same transaction).
- ``outbox-producer DB TOTAL RATE SEED``: Kafka with a transactional outbox: the debit, the
  journal row and ``INSERT INTO outbox`` commit in one SQLite transaction.
- ``relay DB BOOTSTRAP TOPIC``: the outbox relay. Reads outbox rows after the last relayed
  id (``relay_state``, in the producer's database), produces them with an idempotent
  producer (``acks=all``), waits for their delivery, then records the last relayed id:
  at least once (killed after delivery and before recording, it re-sends).
- ``naive-producer DB BOOTSTRAP TOPIC TOTAL RATE SEED``: Kafka, dual write: commits the debit
  and the journal row, THEN produces the deposits and waits for their delivery.
- ``kafka-consumer BOOTSTRAP TOPIC DB TARGET DEDUPE``: stores its offsets in its SQLite
  database in the same transaction as the credits and starts from them; with DEDUPE=1 it
  also skips transfer ids it has already credited (table ``seen``), as a careful consumer
  of an at-least-once relay must.

Every consumer keeps ``credits(transfer_id, amount)`` WITHOUT a unique index, so a deposit
applied twice shows as two rows; Kafka's consumer also keeps every delivery it received in
``received`` (duplicates delivered by the relay show there, whether deduped or not).

Producers publish TOTAL transfers in all (a restarted producer continues from its
committed journal), at RATE transfers/s (each due at start + i / RATE, carried in the
deposit; 0: as fast as possible, 1 to 50 transfers per transaction). Consumers stop after
crediting TARGET deposits (0: never).

Lines on stdin: ``GO`` (producers start), ``ARM N`` (SIGKILL yourself at the N-th
"worst moment" from now: right after a COMMIT for producers and consumers, after delivery
and before recording the position for the relay), ``STOP`` (also the end of stdin: the
process exits within 5 s, so none outlives the benchmark). On stdout: ``READY
[address]``, ``START <time>``, ``DONE <time> [p50 p99 p99.9 max count]`` (consumers:
latency from each transfer's due time to the commit of its credit, microseconds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sqlite3
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from hdrh.histogram import HdrHistogram

import streamq
from streamq import _loop

from .common import say
from .kafka_pipe import PRODUCER_THROUGHPUT, receive

STREAM = "deposits"
LEDGER = "ledger"  # the consumer's name, under which streamq stores its position
ACCOUNTS = 1000
OPENING_BALANCE = 1_000_000_000
MAX_BATCH = 50  # transfers per producer transaction, at most
MAX_AMOUNT = 10_000
RELAY_BATCH = 5000  # outbox rows per relay round
RELAY_POLL = 0.001  # s between the relay's checks for new commits (PRAGMA data_version)
CONNECT_TIMEOUT = 60.0  # s a consumer keeps trying to reach a (restarting) producer

DEPOSIT = struct.Struct("<qiqd")  # transfer id, to account, amount, due time (s since epoch)

PRODUCER_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)",
    # The service's journal of its transfers: what the checker compares the credits with.
    "CREATE TABLE IF NOT EXISTS transfers (transfer_id INTEGER PRIMARY KEY, "
    "account INTEGER NOT NULL, to_account INTEGER NOT NULL, amount INTEGER NOT NULL)",
)
OUTBOX_SCHEMA = "CREATE TABLE IF NOT EXISTS outbox (id INTEGER PRIMARY KEY, payload BLOB NOT NULL)"
RELAY_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS relay_state "
    "(id INTEGER PRIMARY KEY CHECK (id = 0), last INTEGER NOT NULL)"
)
CONSUMER_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS balances (account INTEGER PRIMARY KEY, balance INTEGER NOT NULL)",
    # No unique index: a deposit applied twice is two rows.
    "CREATE TABLE IF NOT EXISTS credits (transfer_id INTEGER NOT NULL, amount INTEGER NOT NULL)",
)
KAFKA_CONSUMER_SCHEMA = (
    *CONSUMER_SCHEMA,
    "CREATE TABLE IF NOT EXISTS seen (transfer_id INTEGER PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS received "
    "(transfer_id INTEGER NOT NULL, part INTEGER NOT NULL, off INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS offsets (topic TEXT NOT NULL, part INTEGER NOT NULL, "
    "next INTEGER NOT NULL, PRIMARY KEY (topic, part))",
)
DEBIT = "UPDATE accounts SET balance = balance - ? WHERE id = ?"
JOURNAL = "INSERT INTO transfers (transfer_id, account, to_account, amount) VALUES (?, ?, ?, ?)"
CREDIT = "UPDATE balances SET balance = balance + ? WHERE account = ?"
RECORD_CREDIT = "INSERT INTO credits (transfer_id, amount) VALUES (?, ?)"

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


class Transfer(NamedTuple):
    transfer_id: int
    account: int
    to_account: int
    amount: int


def make_transfers(
    rng: random.Random, first_id: int, count: int, stride: int = 1
) -> list[Transfer]:
    """``count`` random transfers, numbered from ``first_id`` every ``stride`` (W writers
    of one service: writer i numbers i + 1, i + 1 + W, ...)."""
    return [
        Transfer(
            first_id + i * stride,
            rng.randrange(ACCOUNTS),
            rng.randrange(ACCOUNTS),
            rng.randint(1, MAX_AMOUNT),
        )
        for i in range(count)
    ]


def deposit(transfer: Transfer, due: float) -> bytes:
    return DEPOSIT.pack(transfer.transfer_id, transfer.to_account, transfer.amount, due)


def debits(transfers: Sequence[Transfer]) -> list[tuple[int, int]]:
    return [(t.amount, t.account) for t in transfers]


class Control:
    """The parent's lines on stdin, read by a thread: GO [START], ARM N, STOP (or end of
    input). START (``time.time()``, optional) is when several writers start together."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.stop = threading.Event()
        self.start_at: float | None = None
        self._armed = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="control", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            word, *rest = line.split() or [""]
            if word == "GO":
                self.start_at = float(rest[0]) if rest else None
                self.go.set()
            elif word == "ARM":
                with self._lock:
                    self._armed = max(1, int(rest[0]))
            elif word == "STOP":
                break
        self.stop.set()  # STOP, or the parent went away: end
        self.go.set()
        time.sleep(5.0)  # time to end by itself; then never outlive the parent
        os._exit(0)

    def worst_moment(self) -> None:
        """Right after a commit (relay: after delivery, before recording): die here if armed."""
        with self._lock:
            if self._armed == 0:
                return
            self._armed -= 1
            if self._armed > 0:
                return
        os.kill(os.getpid(), signal.SIGKILL)

    def wait_go(self) -> None:
        while not self.go.wait(1.0):
            pass

    def wait_stop(self) -> None:
        while not self.stop.wait(1.0):
            pass


class Schedule:
    """How many transfers the next transaction takes, and when they are due.

    RATE > 0: transfer i (of this process) is due at start + i / RATE; a transaction takes
    those due by now (at most MAX_BATCH). RATE 0: as fast as possible, 1 to MAX_BATCH per
    transaction, due when taken (the deposit's due time is then stamped just before COMMIT).
    """

    def __init__(self, rate: float, rng: random.Random, start: float | None = None) -> None:
        self.rate = rate
        self.rng = rng
        self.start = time.time() if start is None else start
        self.taken = 0

    def take(self, remaining: int) -> tuple[int, list[float] | None, float]:
        """(count, due times or None for "at commit", seconds to wait first when count is 0)."""
        if self.rate <= 0:
            count = min(remaining, self.rng.randint(1, MAX_BATCH))
            self.taken += count
            return count, None, 0.0
        now = time.time()
        due_now = int((now - self.start) * self.rate) + 1
        if due_now <= self.taken:
            return 0, None, max(0.0, self.start + self.taken / self.rate - now)
        count = min(remaining, due_now - self.taken, MAX_BATCH)
        dues = [self.start + (self.taken + i) / self.rate for i in range(count)]
        self.taken += count
        return count, dues, 0.0


def payloads(transfers: Sequence[Transfer], dues: list[float] | None) -> list[bytes]:
    if dues is None:
        stamp = time.time()
        return [deposit(t, stamp) for t in transfers]
    return [deposit(t, due) for t, due in zip(transfers, dues, strict=True)]


class Latencies:
    """From each transfer's due time to the commit of its credit, in microseconds."""

    def __init__(self) -> None:
        self.histogram = HdrHistogram(1, 600_000_000, 3)  # up to 10 min
        self.count = 0

    def record(self, dues: Sequence[float], credited: float) -> None:
        for due in dues:
            self.histogram.record_value(min(600_000_000, max(1, int((credited - due) * 1e6))))
        self.count += len(dues)

    def figures(self) -> list[int]:
        h = self.histogram
        return [
            *(int(h.get_value_at_percentile(p)) for p in (50, 99, 99.9)),
            int(h.get_max_value()),
            self.count,
        ]


def open_db(path: str) -> sqlite3.Connection:
    """A connection as the Kafka-side services use it: WAL, synchronous=NORMAL (as streamq)."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def setup_producer_db(conn: sqlite3.Connection, outbox: bool) -> int:
    """The payments service's tables; returns the last committed transfer id."""
    conn.execute("BEGIN IMMEDIATE")
    for statement in PRODUCER_SCHEMA:
        conn.execute(statement)
    if outbox:
        conn.execute(OUTBOX_SCHEMA)
    conn.executemany(
        "INSERT OR IGNORE INTO accounts (id, balance) VALUES (?, ?)",
        [(i, OPENING_BALANCE) for i in range(ACCOUNTS)],
    )
    conn.execute("COMMIT")
    return int(conn.execute("SELECT COALESCE(MAX(transfer_id), 0) FROM transfers").fetchone()[0])


def setup_consumer_db(path: str, schema: Sequence[str]) -> None:
    conn = open_db(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for statement in schema:
            conn.execute(statement)
        conn.executemany(
            "INSERT OR IGNORE INTO balances (account, balance) VALUES (?, 0)",
            [(i,) for i in range(ACCOUNTS)],
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


# --- streamq -----------------------------------------------------------------


def transfer(
    tx: streamq.BlockingTransaction, batch: list[Transfer], dues: list[float] | None
) -> None:
    """Debit, journal and deposit: one commit, run on the producer's writer thread."""
    tx.executemany(DEBIT, debits(batch))
    tx.executemany(JOURNAL, batch)
    tx.publish_many(STREAM, payloads(batch, dues))


async def sq_producer(db: str, port: int, total: int, rate: float, seed: int) -> None:
    control = Control()
    rng = random.Random(seed)
    async with streamq.Producer(db, port=port) as producer:
        async with producer.transaction() as tx:
            for statement in PRODUCER_SCHEMA:
                await tx.execute(statement)
            await tx.executemany(
                "INSERT OR IGNORE INTO accounts (id, balance) VALUES (?, ?)",
                [(i, OPENING_BALANCE) for i in range(ACCOUNTS)],
            )
            cursor = await tx.execute("SELECT COALESCE(MAX(transfer_id), 0) FROM transfers")
            row = await cursor.fetchone()
            assert row is not None
            last = int(row[0])
        await producer.create_stream(STREAM)
        say("READY", producer.address)
        await asyncio.to_thread(control.wait_go)
        say("START", time.time())
        schedule = Schedule(rate, rng)
        while last < total and not control.stop.is_set():
            count, dues, wait = schedule.take(total - last)
            if count == 0:
                await asyncio.sleep(wait)
                continue
            transfers = make_transfers(rng, last + 1, count)
            await producer.run_in_transaction(transfer, transfers, dues)
            last += count
            control.worst_moment()  # committed; not yet pushed to the ledger
            await asyncio.sleep(0)  # let the server push between commits
        say("DONE", time.time())
        while not control.stop.is_set():  # keep serving until told to stop
            await asyncio.sleep(0.05)


def credit(tx: streamq.BlockingSQL, batch: streamq.Batch) -> list[tuple[int, int, int, float]]:
    """Credit a batch of deposits, on the ledger database's own thread; returns them."""
    deposits = [DEPOSIT.unpack(record.value) for record in batch]
    tx.executemany(CREDIT, [(amount, to) for _, to, amount, _ in deposits])
    tx.executemany(RECORD_CREDIT, [(tid, amount) for tid, _, amount, _ in deposits])
    return deposits


# Credits a batch of deposits in the ledger's transaction; returns them (unpacked).
Credit = Callable[[Any, streamq.Batch], list[tuple[int, int, int, float]]]


async def sq_consumer(
    address: str, db: str, target: int, apply_credits: Credit | None = None
) -> None:
    """The ledger as a ``streamq.Consumer``; ``apply_credits``: the SQL of a ledger on
    another engine than SQLite (whose tables then exist already)."""
    control = Control()
    # A restarted producer makes the consumer log a reconnect warning: expected here.
    logging.getLogger("streamq").setLevel(logging.ERROR)
    if apply_credits is None:
        setup_consumer_db(db, CONSUMER_SCHEMA)
    # reconnect_timeout: start() waits for a producer that is being restarted, too.
    consumer = streamq.Consumer(
        address, STREAM, db=db, name=LEDGER, reconnect_timeout=CONNECT_TIMEOUT
    )
    await consumer.start()
    latencies = Latencies()
    credited, finished = 0, time.time()
    try:
        say("READY")
        async for batch in consumer:
            deposits = await consumer.apply(batch, apply_credits or credit)
            finished = time.time()
            latencies.record([due for *_, due in deposits], finished)
            credited += len(deposits)
            control.worst_moment()  # committed; the ack may not have reached the producer
            if (target and credited >= target) or control.stop.is_set():
                break
    finally:
        await consumer.close()
    say("DONE", finished, *latencies.figures())


# --- Kafka -------------------------------------------------------------------


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


def paced_transfers(
    control: Control,
    rng: random.Random,
    rate: float,
    last: int,
    total: int,
    *,
    first_id: int = 1,
    stride: int = 1,
    start: float | None = None,
) -> Iterator[tuple[list[Transfer], list[float] | None]]:
    """The next batches of transfers (and their due times), on schedule, until ``total``
    (``last`` already done). Transfer n (from 0) is numbered ``first_id + n * stride``;
    ``start``: when the schedule starts (default: now)."""
    schedule = Schedule(rate, rng, start)
    while last < total and not control.stop.is_set():
        count, dues, wait = schedule.take(total - last)
        if count == 0:
            time.sleep(wait)
            continue
        yield make_transfers(rng, first_id + last * stride, count, stride), dues
        last += count


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


def kafka_consumer(bootstrap: str, topic: str, db: str, target: int, dedupe: bool) -> None:
    control = Control()
    consume_deposits(SQLiteKafkaLedger(db), bootstrap, topic, target, dedupe, control)


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "sq-producer":
        _loop.run(sq_producer(args[0], int(args[1]), int(args[2]), float(args[3]), int(args[4])))
    elif role == "sq-consumer":
        _loop.run(sq_consumer(args[0], args[1], int(args[2])))
    elif role == "outbox-producer":
        outbox_producer(args[0], int(args[1]), float(args[2]), int(args[3]))
    elif role == "relay":
        relay(args[0], args[1], args[2])
    elif role == "naive-producer":
        naive_producer(args[0], args[1], args[2], int(args[3]), float(args[4]), int(args[5]))
    elif role == "kafka-consumer":
        kafka_consumer(args[0], args[1], args[2], int(args[3]), args[4] == "1")
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
