"""What the workers workload's processes share: the service's schema, placing orders on
schedule, the workers' loop and the consumers' receipts."""

from __future__ import annotations

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

from ..common import say
from ..measure import Latencies, Pacer
from ..transfer.common import OUTBOX_SCHEMA, open_db

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
# The sync path's variants: a SyncProducer serving from the process (as a web service
# runs it), one that does not (a worker beside ``streamq serve``), ``streamq.publish`` on
# the application's connection, and plain sqlite3 writing an outbox row.
SYNC_VARIANTS = ("SyncProducer serving", "SyncProducer", "publish", "sqlite3")
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


@dataclass
class Outcome:
    """What one worker (or thread) did."""

    committed: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # by exception type
    end_ns: int = 0
    last_begun_ns: int = 0  # the last committed order's transaction began (its receipt follows)
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
    # Order n of this worker is due at start + (n * workers + worker) / rate.
    pacer = None
    if rate > 0:
        pacer = Pacer(rate / workers, start_ns / 1e9 + worker / rate, time.monotonic)
    for number in range(count):
        now = time.monotonic_ns()
        due = int(pacer.due(number) * 1e9) if pacer else max(now, start_ns)
        if max(now, due) > deadline_ns:
            break
        if due > now:
            time.sleep((due - now) / 1e9)
        begun = time.monotonic_ns()
        try:
            place(worker, number, due)
        except Exception as error:
            if not outcome.refused:  # the first one in full, for whoever reads the log
                traceback.print_exc(file=sys.stderr)
            outcome.refused[type(error).__name__] += 1
        else:
            outcome.committed += 1
            outcome.last_begun_ns = begun
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
        outcome.commit_latency.encode(),
        time.process_time() - cpu_at_go,
        outcome.last_begun_ns,
    )
    conn.close()


def wait_word(word: str) -> list[str]:
    """Block until the parent sends a line starting with ``word``; returns its other fields."""
    for line in sys.stdin:
        fields = line.split()
        if fields and fields[0] == word:
            return fields[1:]
    raise SystemExit(0)  # the parent went away


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
    """Each event's latency from its due time, (position, order id) in arrival order, and
    when the last one arrived (monotonic ns, as the workers' clocks: where delivery ends)."""

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


def main(system: str, argv: list[str], consume: Callable[[list[str]], None]) -> None:
    """A system's processes: ``worker ...`` or ``consumer ...`` (``consume``'s arguments)."""
    role, *args = argv
    if role == "worker":
        db, index, workers, rate, count, seconds = args
        worker(system, db, int(index), int(workers), float(rate), int(count), float(seconds))
    elif role == "consumer":
        consume(args)
    else:
        raise SystemExit(f"unknown role {role!r}")
