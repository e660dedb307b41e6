"""The workers workload's processes (``bench/workers.py`` runs them).

A service runs as several worker processes (gunicorn, a Celery pool) on ONE SQLite
database. Each order is a business row in ``orders`` and its event, committed together in
one ``BEGIN IMMEDIATE`` transaction on the worker's own sqlite3 connection. Roles
(``python -m bench.workers_programs ROLE ARGS``):

- ``worker SYSTEM DB INDEX WORKERS RATE COUNT SECONDS``: worker INDEX of WORKERS commits
  COUNT orders. SYSTEM ``streamq``: the event is ``streamq.publish(conn, ...)``;
  ``outbox``: ``INSERT INTO outbox``, shipped to Kafka by the transfer workload's relay
  (``python -m bench.transfer_programs relay``). RATE > 0 is the whole service's rate in
  orders/s: order n of worker i is due at GO + (n * WORKERS + i) / RATE and carries that
  time (a late worker does not skip: what was due during a stall is measured from its
  due time); RATE 0: as fast as it can, each order stamped when its transaction begins.
  Any exception is a refused transaction; the worker goes on with the next order. Before
  READY each worker commits one order numbered -1, as a long-running worker would have its
  connection open and its statements prepared; consumers receive it but do not time it.
- ``sq-consumer ADDRESS OUT SECONDS DRAIN``: a ``streamq.Consumer`` tailing the stream from
  seq 1.
- ``kafka-consumer BOOTSTRAP TOPIC OUT SECONDS DRAIN``: a confluent-kafka consumer with the
  latency workload's settings, from offset 0.
- ``sync VARIANT DB THREADS COUNT SECONDS``: the synchronous path alone, THREADS threads of
  one process committing COUNT orders in all, as fast as they can, no server:
  ``SyncProducer`` (``tx.execute`` + ``tx.publish``), ``publish`` (``streamq.publish`` on a
  plain sqlite3 connection per thread) or ``sqlite3`` (the business row and an outbox row
  of the event's size: what the database alone costs).

Times are ``time.monotonic_ns()``: CLOCK_MONOTONIC, one clock for every process on the
machine. SECONDS bounds every loop. Lines: workers say ``READY <PRAGMA synchronous>``,
wait for ``GO <start ns>``, say ``DONE <committed> <refused> <end ns> <errors> <histogram>
<CPU s since GO>`` (HdrHistogram, encoded: microseconds from each order's due time to its
COMMIT returning, which separates waiting for the write lock from delivery). Consumers say
``READY``, receive until ``EXPECT <N>`` records have come (or stdin closes; at most DRAIN
seconds after EXPECT, SECONDS in all), write what they received to OUT
(``received(position, order_id)``, in arrival order) and say ``DONE <p50> <p99> <p99.9>
<max> <count> <last receipt ns> <CPU s since READY>`` (microseconds from each order's due
time to its receipt). ``sync`` says ``DONE <orders/s> <committed> <refused> <synchronous>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
import struct
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import streamq
from streamq import _loop

from .common import say
from .kafka_pipe import receive
from .latency_programs import CONSUMER_LATENCY
from .transfer_programs import OUTBOX_SCHEMA, Latencies, open_db

STREAM = "orders"
EVENT_SIZE = 100  # bytes of each order's event (a streamq record's value, an outbox payload)
AMOUNT = 4200
ORDER = struct.Struct("<qqiq")  # due time (monotonic ns), order id, worker, number
ORDERS_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, worker INTEGER NOT NULL, "
    "number INTEGER NOT NULL, amount INTEGER NOT NULL, due_ns INTEGER NOT NULL)"
)
INSERT_ORDER = "INSERT INTO orders (worker, number, amount, due_ns) VALUES (?, ?, ?, ?)"
INSERT_OUTBOX = "INSERT INTO outbox (payload) VALUES (?)"
RECEIVED_SCHEMA = "CREATE TABLE received (position INTEGER NOT NULL, order_id INTEGER NOT NULL)"
SYNC_VARIANTS = ("SyncProducer", "publish", "sqlite3")
WARM_UP = -1  # the number of each worker's first order, committed before READY, not timed

# Places one order: (worker, number, due ns); raises if its transaction is refused.
PlaceOrder = Callable[[int, int, int], None]


def order_event(due_ns: int, order_id: int, worker: int, number: int) -> bytes:
    return ORDER.pack(due_ns, order_id, worker, number).ljust(EVENT_SIZE, b".")


def setup_database(path: str, *, log: bool) -> None:
    """The service's tables: ``orders`` and ``outbox``; with ``log``, streamq's tables and
    the stream too (a ``SyncProducer`` that does not serve creates them)."""
    if log:
        with streamq.SyncProducer(path, serve=False) as producer:
            producer.create_stream(STREAM)
    with contextlib.closing(open_db(path)) as conn:
        conn.execute(ORDERS_SCHEMA)
        conn.execute(OUTBOX_SCHEMA)


def synchronous(conn: sqlite3.Connection) -> int:
    """``PRAGMA synchronous`` as the connection has it (1: NORMAL)."""
    return int(conn.execute("PRAGMA synchronous").fetchone()[0])


def publish_event(conn: sqlite3.Connection, event: bytes) -> None:
    streamq.publish(conn, STREAM, event)


def outbox_event(conn: sqlite3.Connection, event: bytes) -> None:
    conn.execute(INSERT_OUTBOX, (event,))


EMIT = {"streamq": publish_event, "outbox": outbox_event}


def place_order(
    conn: sqlite3.Connection,
    emit: Callable[[sqlite3.Connection, bytes], None],
    worker: int,
    number: int,
    due_ns: int,
) -> None:
    """One order, as a worker commits it: the row and its event, one transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        cursor = conn.execute(INSERT_ORDER, (worker, number, AMOUNT, due_ns))
        assert cursor.lastrowid is not None
        emit(conn, order_event(due_ns, cursor.lastrowid, worker, number))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def place_order_sync(producer: streamq.SyncProducer, worker: int, number: int, due_ns: int) -> None:
    """One order through ``SyncProducer.transaction`` (its connection for this thread)."""
    with producer.transaction() as tx:
        order_id = tx.execute(INSERT_ORDER, (worker, number, AMOUNT, due_ns)).lastrowid
        assert order_id is not None
        tx.publish(STREAM, order_event(due_ns, order_id, worker, number))


@dataclass
class Outcome:
    """What one worker (or thread) did."""

    committed: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # by exception type
    end_ns: int = 0
    commit_latency: Latencies = field(default_factory=Latencies)  # due -> COMMIT returned

    def errors(self) -> str:
        return ",".join(f"{name}:{count}" for name, count in self.refused.items()) or "-"


def commit_orders(
    place: PlaceOrder,
    worker: int,
    workers: int,
    count: int,
    rate: float,
    start_ns: int,
    deadline_ns: int,
) -> Outcome:
    """Place ``count`` orders from ``start_ns``, one transaction each, on schedule if ``rate``
    (the whole service's orders/s), else back to back; stop at ``deadline_ns`` in any case."""
    outcome = Outcome()
    for number in range(count):
        now = time.monotonic_ns()
        if rate > 0:
            due = start_ns + int((number * workers + worker) * 1e9 / rate)
        else:
            due = max(now, start_ns)
        if max(now, due) > deadline_ns:
            break
        if due > now:
            time.sleep((due - now) / 1e9)
        try:
            place(worker, number, due)
        except Exception as error:
            if not outcome.refused:  # the first one in full, for whoever reads the log
                traceback.print_exc(file=sys.stderr)
            outcome.refused[type(error).__name__] += 1
        else:
            outcome.committed += 1
            outcome.commit_latency.record([due / 1e9], time.monotonic_ns() / 1e9)
    outcome.end_ns = time.monotonic_ns()
    return outcome


def worker(
    system: str, db: str, index: int, workers: int, rate: float, count: int, seconds: float
) -> None:
    conn = open_db(db)
    place = functools.partial(place_order, conn, EMIT[system])
    place(index, WARM_UP, time.monotonic_ns())  # as a long-running worker: connected, SQL prepared
    say("READY", synchronous(conn))
    start_ns = int(wait_word("GO")[0])
    cpu_at_go = time.process_time()
    outcome = commit_orders(
        place, index, workers, count, rate, start_ns, start_ns + int(seconds * 1e9)
    )
    say(
        "DONE",
        outcome.committed,
        sum(outcome.refused.values()),
        outcome.end_ns,
        outcome.errors(),
        outcome.commit_latency.histogram.encode().decode(),
        time.process_time() - cpu_at_go,
    )
    conn.close()


def wait_word(word: str) -> list[str]:
    """Block until the parent sends a line starting with ``word``; returns its other fields."""
    for line in sys.stdin:
        fields = line.split()
        if fields and fields[0] == word:
            return fields[1:]
    raise SystemExit(0)  # the parent went away


# --- consumers ---------------------------------------------------------------


class Expected:
    """The parent's ``EXPECT N`` (orders the workers committed), read by a thread; stdin
    closing without it means stop now. ``on_arrival`` is called from that thread."""

    def __init__(self, on_arrival: Callable[[], object] = lambda: None) -> None:
        self.count: int | None = None
        self.arrived = threading.Event()
        self.arrived_at = 0.0  # time.monotonic() when it did
        self._on_arrival = on_arrival
        threading.Thread(target=self._read, name="expected", daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(SystemExit):
            self.count = int(wait_word("EXPECT")[0])
        self.arrived_at = time.monotonic()
        self.arrived.set()
        self._on_arrival()

    def reached(self, received: int) -> bool:
        return self.arrived.is_set() and (self.count is None or received >= self.count)


class Receipts:
    """Each event's latency from its due time, and (position, order id) in arrival order."""

    def __init__(self) -> None:
        self.latencies = Latencies()
        self.received: list[tuple[int, int]] = []
        self.last_ns = 0
        self.cpu_at_ready = 0.0

    def ready(self) -> None:
        self.cpu_at_ready = time.process_time()
        say("READY")

    def record(self, events: Sequence[tuple[int, bytes]]) -> None:
        now = time.monotonic_ns()
        dues = []
        for position, value in events:
            due_ns, order_id, _, number = ORDER.unpack_from(value)
            if number != WARM_UP:
                dues.append(due_ns / 1e9)
            self.received.append((position, order_id))
        self.latencies.record(dues, now / 1e9)
        self.last_ns = now

    def report(self, out: str) -> None:
        with contextlib.closing(sqlite3.connect(out)) as conn, conn:
            conn.execute(RECEIVED_SCHEMA)
            conn.executemany("INSERT INTO received VALUES (?, ?)", self.received)
        cpu = time.process_time() - self.cpu_at_ready
        say("DONE", *self.latencies.figures(), self.last_ns, cpu)


async def sq_consumer(address: str, out: str, seconds: float, drain: float) -> None:
    loop = asyncio.get_running_loop()
    arrival = asyncio.Event()
    expected = Expected(lambda: loop.call_soon_threadsafe(arrival.set))
    receipts = Receipts()
    async with streamq.Consumer(address, STREAM, start_seq=1) as consumer:

        async def receive_until_expected() -> None:
            async for batch in consumer:
                receipts.record([(r.seq, r.value) for r in batch])
                if expected.reached(len(receipts.received)):
                    return

        receipts.ready()
        receiving = asyncio.create_task(receive_until_expected())
        try:
            async with asyncio.timeout(seconds):
                await arrival.wait()
            if not expected.reached(len(receipts.received)):  # else all came before EXPECT
                with contextlib.suppress(TimeoutError):  # what is missing shows in the receipts
                    async with asyncio.timeout(drain):
                        await asyncio.wait([receiving])
        finally:
            receiving.cancel()
            await asyncio.wait([receiving])
        if not receiving.cancelled():
            receiving.result()  # its error, if it had one
    receipts.report(out)


def kafka_consumer(bootstrap: str, topic: str, out: str, seconds: float, drain: float) -> None:
    from confluent_kafka import Consumer, TopicPartition

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


# --- the synchronous path alone ------------------------------------------------


def sync_path(variant: str, db: str, threads: int, count: int, seconds: float) -> None:
    """``count`` orders from ``threads`` threads of this process, each on its own connection."""
    if variant not in SYNC_VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; choose from {SYNC_VARIANTS}")
    outcomes: list[Outcome] = []
    settings: list[int] = []
    start_ns = [0]  # set when every thread is warm and waiting

    def mark_start() -> None:
        start_ns[0] = time.monotonic_ns()

    started = threading.Barrier(threads, action=mark_start)
    with contextlib.ExitStack() as stack:
        producer = None
        if variant == "SyncProducer":
            producer = stack.enter_context(streamq.SyncProducer(db, serve=False))

        def run(index: int) -> None:
            with contextlib.ExitStack() as own:
                place: PlaceOrder
                if producer is not None:
                    place = functools.partial(place_order_sync, producer)
                    setting = int(producer.query("PRAGMA synchronous")[0][0])
                else:
                    conn = own.enter_context(contextlib.closing(open_db(db)))
                    emit = publish_event if variant == "publish" else outbox_event
                    place = functools.partial(place_order, conn, emit)
                    setting = synchronous(conn)
                place(index, WARM_UP, time.monotonic_ns())  # connected, SQL prepared
                settings.append(setting)
                started.wait(seconds)
                deadline_ns = start_ns[0] + int(seconds * 1e9)
                outcome = commit_orders(
                    place, index, threads, count // threads, 0, start_ns[0], deadline_ns
                )
                outcomes.append(outcome)

        workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(2 * seconds + 60)
    if len(outcomes) != threads:
        raise SystemExit(f"sync {variant}: {threads - len(outcomes)} threads did not finish")
    committed = sum(o.committed for o in outcomes)
    elapsed = (max(o.end_ns for o in outcomes) - start_ns[0]) / 1e9
    refused = sum(sum(o.refused.values()) for o in outcomes)
    say("DONE", committed / elapsed, committed, refused, ",".join(map(str, sorted(set(settings)))))


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "worker":
        worker(
            args[0],
            args[1],
            int(args[2]),
            int(args[3]),
            float(args[4]),
            int(args[5]),
            float(args[6]),
        )
    elif role == "sq-consumer":
        _loop.run(sq_consumer(args[0], args[1], float(args[2]), float(args[3])))
    elif role == "kafka-consumer":
        kafka_consumer(args[0], args[1], args[2], float(args[3]), float(args[4]))
    elif role == "sync":
        sync_path(args[0], args[1], int(args[2]), int(args[3]), float(args[4]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
