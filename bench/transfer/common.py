"""What the transfer workload's processes share, whatever the system: the services'
schema, the transfers and their deposits, the parent's control lines, the schedule."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from ..measure import Pacer

STREAM = "deposits"
LEDGER = "ledger"  # the consumer's name, under which streamq stores its position
ACCOUNTS = 1000
OPENING_BALANCE = 1_000_000_000
MAX_BATCH = 50  # transfers per producer transaction, at most
MAX_AMOUNT = 10_000
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

    RATE > 0: on a ``Pacer``'s schedule, a transaction takes the transfers due by now (at
    most MAX_BATCH). RATE 0: as fast as possible, 1 to MAX_BATCH per transaction, due when
    taken (the deposit's due time is then stamped just before COMMIT).
    """

    def __init__(self, rate: float, rng: random.Random, start: float | None = None) -> None:
        self.pacer = Pacer(rate, start) if rate > 0 else None
        self.rng = rng

    def take(self, remaining: int) -> tuple[int, list[float] | None, float]:
        """(count, due times or None for "at commit", seconds to wait first when count is 0)."""
        if self.pacer is None:
            return min(remaining, self.rng.randint(1, MAX_BATCH)), None, 0.0
        count = min(remaining, self.pacer.owed(), MAX_BATCH)
        if count <= 0:
            return 0, None, self.pacer.wait()
        return count, self.pacer.take(count), 0.0


def payloads(transfers: Sequence[Transfer], dues: list[float] | None) -> list[bytes]:
    if dues is None:
        stamp = time.time()
        return [deposit(t, stamp) for t in transfers]
    return [deposit(t, due) for t, due in zip(transfers, dues, strict=True)]


def open_db(path: str, durability: str = "normal") -> sqlite3.Connection:
    """A connection as the Kafka-side services use it: WAL, synchronous=NORMAL, or FULL
    with ``durability="full"`` (as streamq's)."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={durability.upper()}")
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
