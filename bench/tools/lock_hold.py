"""How long each write path holds SQLite's write lock, against a plain outbox, in one run:
``python -m bench.tools.lock_hold [--transactions N] [--rounds N] [--out PATH]``.

Every path commits the same transaction, one at a time from one thread: an order's row
(``bench/workers``' ``orders`` table) and its 100-byte event.

- outbox: plain ``sqlite3``, BEGIN IMMEDIATE, the row, the event as an ``outbox`` row, COMMIT;
- publish sqlite3: the same with ``streamq.publish(conn, ...)`` for the event;
- publish SQLAlchemy: a SQLAlchemy ``Connection``, BEGIN IMMEDIATE from its ``begin``
  event (``tests/recipes/sqlalchemy_app.py``), ``exec_driver_sql`` for the row;
- SyncProducer: ``with p.transaction() as tx`` (``serve=False``);
- run_in_transaction, Producer.transaction(): a ``Producer`` (``serve=False``) on an
  event loop, one transaction awaited at a time; "a side writer": another connection
  commits a record before each (untimed), so each BEGIN finds it and catches up.

How the lock is timed: from just before the call that runs BEGIN IMMEDIATE to the return
of the call that ran COMMIT, on the thread that ran it: the tool's own calls on plain
``sqlite3``; on SQLAlchemy, its ``begin`` event (BEGIN IMMEDIATE on the driver's
connection) and the dialect's ``do_commit``; in the producer, ``storage.begin_immediate``
and ``SQLiteSession.begin`` (every BEGIN of the writer's and of a session's) and
``SQLiteBlockingWriter.commit`` (every COMMIT), wrapped here. So the figure is the time
another writer would wait, and no more: not the hop back to the event loop after a COMMIT
on the writer's thread, not the work before BEGIN. (A trace callback,
``set_trace_callback``, would time BEGIN from inside SQLite, but it costs every statement
a call into Python: 1 µs each here, a third of the outbox's hold.) Paths run in turn,
``rounds`` times each, so that a disturbance of the machine falls on all of them. The
serving process is left out (``serve=False``): what it does to a writer is measured
elsewhere (issue #62 item 3). "outbox SQLAlchemy" is the outbox through the same
SQLAlchemy calls: what SQLAlchemy itself holds the lock for.

Results: a table, and ``bench/results/lock_hold.json`` (``--out``: elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.table import Table

from ..common import RESULTS, console, machine
from ..transfer.common import open_db
from ..workers.common import (
    AMOUNT,
    EVENT_SIZE,
    INSERT_ORDER,
    INSERT_OUTBOX,
    STREAM,
    setup_database,
)

EVENT = b"e" * EVENT_SIZE
OUTBOX = "outbox"
SIDE = "run_in_transaction, a side writer"
PATHS = (
    OUTBOX,
    "publish sqlite3",
    "outbox SQLAlchemy",
    "publish SQLAlchemy",
    "SyncProducer",
    "run_in_transaction",
    SIDE,
    "Producer.transaction()",
)


class LockClock:
    """One path's lock holds: from BEGIN called (``begin``) to COMMIT returned
    (``committed``), in ns, while ``on``."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.begun = 0
        self.on = False

    def begin(self) -> None:
        self.begun = time.perf_counter_ns()

    def committed(self) -> None:
        at = time.perf_counter_ns()
        if self.on and self.begun:
            self.held.append(at - self.begun)
        self.begun = 0


# The clock of the path running now: the producer-side COMMIT's wrapper reports to it.
_running: list[LockClock] = [LockClock()]


@contextlib.contextmanager
def producer_timed() -> Iterator[None]:
    """Every producer-side BEGIN IMMEDIATE (``storage.begin_immediate``: the writer's on
    its thread or inline; ``SQLiteSession.begin``) and COMMIT
    (``SQLiteBlockingWriter.commit``) reported to the running path's clock, until the
    block ends."""
    from streamq.engines.sqlite import storage

    append = importlib.import_module("streamq.engines.sqlite.append")  # not the function
    begin_immediate = storage.begin_immediate
    session_begin = append.SQLiteSession.begin
    commit = storage.SQLiteBlockingWriter.commit

    def timed_begin_immediate(conn: sqlite3.Connection) -> int:
        _running[0].begin()
        return begin_immediate(conn)

    def timed_session_begin(self: Any) -> None:
        _running[0].begin()
        session_begin(self)

    def timed_commit(self: storage.SQLiteBlockingWriter) -> None:
        commit(self)
        _running[0].committed()

    storage.begin_immediate = timed_begin_immediate
    append.SQLiteSession.begin = timed_session_begin
    storage.SQLiteBlockingWriter.commit = timed_commit  # type: ignore[method-assign]
    try:
        yield
    finally:
        storage.begin_immediate = begin_immediate
        append.SQLiteSession.begin = session_begin
        storage.SQLiteBlockingWriter.commit = commit  # type: ignore[method-assign]


class WritePath:
    """One write path: ``run(n)`` commits n transactions, each timed by ``clock``."""

    def __init__(self, name: str, folder: str) -> None:
        self.name = name
        self.clock = LockClock()
        self.db = os.path.join(folder, name.replace(" ", "_").strip("()") + ".db")
        self.close: Callable[[], None] = lambda: None
        self.number = 0

    def run(self, n: int) -> None:
        raise NotImplementedError


class Sqlite3(WritePath):
    """Plain ``sqlite3``: the outbox or ``streamq.publish``."""

    def __init__(self, name: str, folder: str) -> None:
        super().__init__(name, folder)
        setup_database(self.db, log=name != OUTBOX)
        self.conn = open_db(self.db)
        self.close = self.conn.close

    def run(self, n: int) -> None:
        import streamq

        conn, clock, publish = self.conn, self.clock, self.name.startswith("publish")
        for _ in range(n):
            self.number += 1
            clock.begin()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(INSERT_ORDER, (0, self.number, AMOUNT, 0))
            if publish:
                streamq.publish(conn, STREAM, EVENT)
            else:
                conn.execute(INSERT_OUTBOX, (EVENT,))
            conn.execute("COMMIT")
            clock.committed()


class Alchemy(WritePath):
    """``streamq.publish`` (or an outbox row) on a SQLAlchemy ``Connection`` that begins
    with BEGIN IMMEDIATE."""

    def __init__(self, name: str, folder: str) -> None:
        super().__init__(name, folder)
        from sqlalchemy import create_engine, event

        self.publish = name.startswith("publish")
        setup_database(self.db, log=self.publish)
        engine = create_engine(f"sqlite:///{self.db}", connect_args={"timeout": 30})
        clock = self.clock

        @event.listens_for(engine, "connect")
        def no_implicit_begin(dbapi_connection: sqlite3.Connection, record: Any) -> None:
            dbapi_connection.isolation_level = None
            dbapi_connection.execute("PRAGMA synchronous=NORMAL")  # as every other path's

        @event.listens_for(engine, "begin")
        def begin_immediate(conn: Any) -> None:
            clock.begin()
            conn.connection.driver_connection.execute("BEGIN IMMEDIATE")

        do_commit = engine.dialect.do_commit

        def timed_commit(dbapi_connection: Any) -> None:
            do_commit(dbapi_connection)
            clock.committed()

        engine.dialect.do_commit = timed_commit  # type: ignore[method-assign]
        self.engine = engine
        self.conn = engine.connect()

        def close() -> None:
            self.conn.close()
            engine.dispose()

        self.close = close

    def run(self, n: int) -> None:
        import streamq

        conn = self.conn
        for _ in range(n):
            self.number += 1
            with conn.begin():
                conn.exec_driver_sql(INSERT_ORDER, (0, self.number, AMOUNT, 0))
                if self.publish:
                    streamq.publish(conn, STREAM, EVENT)
                else:
                    conn.exec_driver_sql(INSERT_OUTBOX, (EVENT,))


class Sync(WritePath):
    """``SyncProducer.transaction()``."""

    def __init__(self, name: str, folder: str) -> None:
        super().__init__(name, folder)
        import streamq

        setup_database(self.db, log=True)
        self.producer = streamq.SyncProducer(self.db, serve=False)
        self.close = self.producer.close

    def run(self, n: int) -> None:
        producer = self.producer
        for _ in range(n):
            self.number += 1
            with producer.transaction() as tx:
                tx.execute(INSERT_ORDER, (0, self.number, AMOUNT, 0))
                tx.publish(STREAM, EVENT)


class Async(WritePath):
    """A ``Producer`` on an event loop: ``run_in_transaction`` or ``transaction()``."""

    def __init__(self, name: str, folder: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name, folder)
        import streamq

        setup_database(self.db, log=True)
        self.loop = loop
        self.producer = streamq.Producer(self.db, serve=False)
        loop.run_until_complete(self.producer.__aenter__())
        self.side = open_db(self.db)  # another process's connection, say

        def close() -> None:
            self.side.close()
            loop.run_until_complete(self.producer.__aexit__(None, None, None))

        self.close = close

    def _side(self) -> None:
        """Another connection's commit: the producer's next BEGIN finds it."""
        import streamq

        self.side.execute("BEGIN IMMEDIATE")
        streamq.publish(self.side, STREAM, EVENT)
        self.side.execute("COMMIT")

    def run(self, n: int) -> None:
        self.loop.run_until_complete(self._run(n))

    async def _run(self, n: int) -> None:
        producer = self.producer
        if self.name == "run_in_transaction":
            for _ in range(n):
                self.number += 1
                await producer.run_in_transaction(_order, self.number)
        elif self.name == SIDE:
            for _ in range(n):
                self.number += 1
                self._side()
                await producer.run_in_transaction(_order, self.number)
        else:
            for _ in range(n):
                self.number += 1
                async with producer.transaction() as tx:
                    await tx.execute(INSERT_ORDER, (0, self.number, AMOUNT, 0))
                    await tx.publish(STREAM, EVENT)


def _order(tx: Any, number: int) -> None:
    tx.execute(INSERT_ORDER, (0, number, AMOUNT, 0))
    tx.publish(STREAM, EVENT)


@contextlib.contextmanager
def paths(folder: str) -> Iterator[list[WritePath]]:
    """Every path, set up in ``folder`` (one database each), closed after."""
    from streamq._loop import loop_factory

    loop = (loop_factory() or asyncio.new_event_loop)()
    made: list[WritePath] = []
    try:
        for name in PATHS:
            if name in (OUTBOX, "publish sqlite3"):
                made.append(Sqlite3(name, folder))
            elif name.endswith("SQLAlchemy"):
                made.append(Alchemy(name, folder))
            elif name == "SyncProducer":
                made.append(Sync(name, folder))
            else:
                made.append(Async(name, folder, loop))
        yield made
    finally:
        for path in reversed(made):
            path.close()
        loop.close()


def percentile(sorted_ns: list[int], q: float) -> float:
    """The ``q`` quantile of sorted durations, in µs (nearest rank)."""
    index = min(len(sorted_ns) - 1, max(0, round(q * len(sorted_ns)) - 1))
    return sorted_ns[index] / 1000


def measure(transactions: int, rounds: int, warm: int) -> dict[str, dict[str, float]]:
    """Each path's p50 and p99 lock hold (µs) over ``transactions``, in ``rounds`` turns."""
    with (
        producer_timed(),
        tempfile.TemporaryDirectory(prefix="streamq-lock-hold-") as folder,
        paths(folder) as all_,
    ):
        for path in all_:
            _running[0] = path.clock
            path.run(warm)  # statements prepared, pages cached
        per_round = max(1, transactions // rounds)
        for round_ in range(rounds):
            turn = all_[round_ % len(all_) :] + all_[: round_ % len(all_)]
            for path in turn:
                _running[0] = path.clock
                path.clock.on = True
                path.run(per_round)
                path.clock.on = False
        figures = {}
        for path in all_:
            held = sorted(path.clock.held)
            assert held, f"{path.name}: no transaction timed"
            figures[path.name] = {
                "transactions": len(held),
                "p50_us": percentile(held, 0.5),
                "p99_us": percentile(held, 0.99),
            }
    base = figures[OUTBOX]
    for figure in figures.values():
        figure["p50_ratio"] = figure["p50_us"] / base["p50_us"]
        figure["p99_ratio"] = figure["p99_us"] / base["p99_us"]
    return figures


def table(figures: dict[str, dict[str, float]]) -> Table:
    out = Table(title="SQLite write lock held, BEGIN to COMMIT returned (µs)")
    for column in ("path", "transactions", "p50", "p99", "p50 / outbox", "p99 / outbox"):
        left = column == "path"
        out.add_column(column, justify="left" if left else "right", no_wrap=left)
    for name, f in figures.items():
        out.add_row(
            name,
            f"{f['transactions']:,.0f}",
            f"{f['p50_us']:.1f}",
            f"{f['p99_us']:.1f}",
            f"{f['p50_ratio']:.2f}x",
            f"{f['p99_ratio']:.2f}x",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=3000, help="timed, per path")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warm", type=int, default=300, help="untimed, per path, first")
    parser.add_argument("--out", type=Path, default=RESULTS / "lock_hold.json")
    args = parser.parse_args(argv)
    import streamq.native

    figures = measure(args.transactions, args.rounds, args.warm)
    console.print(table(figures))
    result = {
        "workload": "lock_hold",
        "machine": machine(),
        "at": time.time(),
        "compiled": streamq.native.build().compiled,
        "transactions": args.transactions,
        "rounds": args.rounds,
        "paths": figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
