"""What streamq adds to each transaction, SQL and Python apart: ``python -m
bench.tools.tx_cost [--transactions N] [--records N] [--repeats N] [--sync]``.

One producer with no subscriber and no application SQL: each transaction publishes
``records`` values of 100 bytes (``Producer.run_in_transaction``, one writer, so each is
a group of one, committed inline on the event loop's thread). Against it the floor: on
plain ``sqlite3`` with the same pragmas, BEGIN IMMEDIATE, the values joined, one INSERT
of them as one row, COMMIT. Timed where they run, in µs a transaction (wall time):

- BEGIN: the writer's, with its data-version read (the floor's: BEGIN IMMEDIATE);
- publish: ``publish_many``, numbering and encoding the records into rows (the floor's:
  joining the values);
- insert: the log's rows, with the check that nobody else appended and the time index;
- COMMIT;
- hand-over: the committed records handed to the log, for subscribers;
- around: the rest of the call (``run_in_transaction``'s future, the committer task, the
  writer's lock, the loop's turns);
- elsewhere: the process's CPU beyond the calls (the WAL watch, the checkpoints' thread,
  the loop between calls); negative where the statements waited on the disk.

Each build, and the floor, runs in a process of its own, alternating; medians.

This is the cost the application's own SQL does not dilute: the transfer workload's
transactions run about 26 transfers' statements besides (``bench.tools.transfer_profile``).

``--sync``: the synchronous paths instead (``bench/workers``' order: its row and a
100-byte event, one transaction, one thread), each in a process of its own, alternating:
plain ``sqlite3`` with an outbox row, ``streamq.publish`` on that connection, a
``SyncProducer(serve=False)``; and the statements of each with no Python of streamq's
around them (publish's one INSERT, ``APPEND``; a session's ``PRAGMA data_version`` and
INSERT of the record numbered in memory). The thread's CPU in µs a transaction, timed
around each part: BEGIN (with ``SyncProducer.transaction()``), the order's INSERT, the
event, COMMIT (with what follows it).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..common import say
from . import BUILDS

VALUE = b"v" * 100
PARTS = ("BEGIN", "publish", "insert", "COMMIT", "hand-over")


def timed(parts: dict[str, float], part: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, its time added to ``parts[part]`` at each call."""

    def run(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args)
        finally:
            parts[part] += time.perf_counter() - started

    return run


def streamq_run(transactions: int, records: int) -> dict[str, Any]:
    """In this process: streamq's transactions, with the writer's statements timed."""
    import streamq
    import streamq.native
    from streamq import _loop
    from streamq.engines.sqlite.storage import SQLiteBlockingWriter as Writer
    from streamq.producer.group_commit import GroupCommit

    parts = dict.fromkeys((*PARTS, "call"), 0.0)
    Writer.begin = timed(parts, "BEGIN", Writer.begin)  # type: ignore[method-assign]
    Writer.insert = timed(parts, "insert", Writer.insert)  # type: ignore[method-assign]
    Writer.commit = timed(parts, "COMMIT", Writer.commit)  # type: ignore[method-assign]
    GroupCommit._committed = timed(parts, "hand-over", GroupCommit._committed)  # type: ignore[method-assign]
    values = [VALUE] * records
    publish_many = timed(parts, "publish", streamq.BlockingTransaction.publish_many)

    def publish(tx: streamq.BlockingTransaction) -> None:
        publish_many(tx, "s", values)

    async def run(folder: str) -> tuple[float, float]:
        async with streamq.Producer(os.path.join(folder, "p.db"), port=0) as producer:
            await producer.create_stream("s")
            for _ in range(transactions // 10):  # warm: SQL prepared, pages in the cache
                await producer.run_in_transaction(publish)
            for part in parts:
                parts[part] = 0.0
            cpu, started = time.process_time(), time.perf_counter()
            for _ in range(transactions):
                called = time.perf_counter()
                await producer.run_in_transaction(publish)
                parts["call"] += time.perf_counter() - called
            return time.perf_counter() - started, time.process_time() - cpu

    with tempfile.TemporaryDirectory() as folder:
        seconds, cpu = _loop.run(run(folder))
    return {
        "compiled": streamq.native.build().compiled,
        **per_transaction(transactions, seconds, cpu, parts),
    }


def floor_run(transactions: int, records: int) -> dict[str, Any]:
    """In this process: the floor's transactions, each statement timed."""
    values = [VALUE] * records
    parts = dict.fromkeys(PARTS, 0.0)
    with tempfile.TemporaryDirectory() as folder:
        conn = sqlite3.connect(os.path.join(folder, "f.db"), isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE log (pos INTEGER PRIMARY KEY, count INTEGER, record BLOB)")
        last, cpu, started = 0, 0.0, 0.0
        for n in range(-(transactions // 10), transactions):  # warm first, as streamq's
            if n == 0:
                parts = dict.fromkeys(PARTS, 0.0)
                cpu, started = time.process_time(), time.perf_counter()
            at = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            begun = time.perf_counter()
            row = b"".join(values)
            joined = time.perf_counter()
            last += records
            conn.execute("INSERT INTO log VALUES (?, ?, ?)", (last, records, row))
            inserted = time.perf_counter()
            conn.execute("COMMIT")
            committed = time.perf_counter()
            parts["BEGIN"] += begun - at
            parts["publish"] += joined - begun
            parts["insert"] += inserted - joined
            parts["COMMIT"] += committed - inserted
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        conn.close()
    return per_transaction(transactions, seconds, cpu, parts)


SYNC_SIDES = ("sqlite3", "publish", "APPEND alone", "SyncProducer", "its statements alone")
SYNC_PARTS = ("BEGIN", "order", "event", "COMMIT")


def sync_run(side: str, transactions: int) -> dict[str, float]:
    """In this process: ``side``'s transactions, each part's thread CPU (µs a transaction)."""
    import importlib

    import streamq
    from streamq.engines.sqlite import storage
    from streamq.protocol import encode_record

    from ..transfer.common import open_db
    from ..workers.common import AMOUNT, EVENT_SIZE, INSERT_ORDER, INSERT_OUTBOX, setup_database

    append = importlib.import_module("streamq.engines.sqlite.append")  # not the function
    event, clock = b"e" * EVENT_SIZE, time.thread_time_ns
    spent = dict.fromkeys(SYNC_PARTS, 0)
    with tempfile.TemporaryDirectory() as folder:
        db = os.path.join(folder, "sync.db")
        setup_database(db, log=side != "sqlite3")
        conn = open_db(db)
        producer = streamq.SyncProducer(db, serve=False) if side == "SyncProducer" else None
        boot, seq = storage.boot_id(), [0]

        def emit() -> None:  # the event, as the side writes it
            if side == "sqlite3":
                conn.execute(INSERT_OUTBOX, (event,))
            elif side == "publish":
                streamq.publish(conn, "orders", event)
            elif side == "APPEND alone":
                ts = int(time.time() * 1000)
                record = encode_record(0, ts, None, event, {})
                conn.execute(append.APPEND, ("orders", 1, boot, ts, record, None))
            else:  # a session's statements, the stream's id 1
                conn.execute("PRAGMA data_version").fetchone()
                seq[0] += 1
                ts = int(time.time() * 1000)
                record = encode_record(seq[0], ts, None, event, {})
                conn.execute(storage.INSERT_RECORDS, (storage.pos(1, seq[0]), ts, record, None, 1))

        def order(number: int) -> None:
            if producer is not None:
                at = clock()
                tx = producer.transaction()
                tx.__enter__()
                begun = clock()
                tx.execute(INSERT_ORDER, (0, number, AMOUNT, 0))
                ordered = clock()
                tx.publish("orders", event)
                emitted = clock()
                tx.__exit__(None, None, None)
            else:
                at = clock()
                conn.execute("BEGIN IMMEDIATE")
                begun = clock()
                conn.execute(INSERT_ORDER, (0, number, AMOUNT, 0))
                ordered = clock()
                emit()
                emitted = clock()
                conn.execute("COMMIT")
            done = clock()
            for part, took in zip(
                SYNC_PARTS,
                (begun - at, ordered - begun, emitted - ordered, done - emitted),
                strict=True,
            ):
                spent[part] += took

        if side != "sqlite3":  # the stream's first records: its segment (the full path)
            conn.execute("BEGIN IMMEDIATE")
            first = streamq.publish(conn, "orders", event)
            assert isinstance(first, int)
            seq[0] = first
            conn.execute("COMMIT")
        for number in range(transactions // 10):  # warm: statements prepared, pages cached
            order(number)
        spent = dict.fromkeys(SYNC_PARTS, 0)
        started = time.perf_counter()
        for number in range(transactions):
            order(transactions + number)
        seconds = time.perf_counter() - started
        if producer is not None:
            producer.close()
        conn.close()
    figures = {part: ns / transactions / 1000 for part, ns in spent.items()}
    return {"per_second": transactions / seconds, **figures, "CPU": sum(figures.values())}


def sync_main(transactions: int, repeats: int) -> None:
    """The sync sides, alternating in processes of their own; a table of medians."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(repeats):
        for side in SYNC_SIDES:
            runs.setdefault(side, []).append(in_process(side, transactions, 0))
        say(f"round {round_ + 1} of {repeats}")
    print(
        f"{transactions:,} orders (a row and a 100 B event, one transaction each), one thread; "
        f"medians of {repeats}: the thread's CPU, µs a transaction"
    )
    print(f"{'':21} {'tx/s':>8} " + " ".join(f"{h:>7}" for h in (*SYNC_PARTS, "CPU", "/ sqlite3")))
    medians = {
        side: {k: statistics.median(r[k] for r in results) for k in results[0]}
        for side, results in runs.items()
    }
    base = medians["sqlite3"]["CPU"]
    for side, m in medians.items():
        figures = " ".join(f"{m[part]:7.1f}" for part in (*SYNC_PARTS, "CPU"))
        print(f"{side:21} {m['per_second']:8,.0f} {figures} {base / m['CPU']:8.2f}x")


def per_transaction(
    transactions: int, seconds: float, cpu: float, parts: dict[str, float]
) -> dict[str, float]:
    """A side's figures: transactions a second, and its CPU and each part in µs a
    transaction."""
    return {
        "per_second": transactions / seconds,
        "cpu_us": cpu / transactions * 1e6,
        **{part: spent / transactions * 1e6 for part, spent in parts.items()},
    }


def in_process(side: str, transactions: int, records: int) -> dict[str, Any]:
    """``side`` (a build's name, "floor", or one of ``SYNC_SIDES``) run in a fresh process."""
    counts = ("--transactions", str(transactions), "--records", str(records))
    done = subprocess.run(
        [sys.executable, "-m", "bench.tools.tx_cost", "--side", side, *counts],
        env={**os.environ, "STREAMQ_PURE": BUILDS[side]} if side in BUILDS else None,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    if side in BUILDS:
        assert result.pop("compiled") == (side == "compiled"), f"{side} ran another build"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=20_000)
    parser.add_argument("--records", type=int, default=26, help="published a transaction")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync", action="store_true", help="the synchronous paths instead")
    parser.add_argument("--side", choices=[*BUILDS, "floor", *SYNC_SIDES], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side in SYNC_SIDES:
        print(json.dumps(sync_run(args.side, args.transactions)))
        return 0
    if args.sync:
        sync_main(args.transactions, args.repeats)
        return 0
    if args.side == "floor":
        print(json.dumps(floor_run(args.transactions, args.records)))
        return 0
    if args.side is not None:
        print(json.dumps(streamq_run(args.transactions, args.records)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.repeats):
        for side in [*BUILDS, "floor"]:
            runs.setdefault(side, []).append(in_process(side, args.transactions, args.records))
        say(f"round {round_ + 1} of {args.repeats}")
    print(
        f"{args.transactions:,} transactions of {args.records} records of {len(VALUE)} B, "
        "one writer, no subscriber; medians of "
        f"{args.repeats} (µs a transaction, the parts' wall time where they run)"
    )
    heading = ("tx/s", "CPU", *PARTS, "around", "elsewhere")
    print(f"{'':8} {heading[0]:>7} " + " ".join(f"{h:>9}" for h in heading[1:]))
    floor_rate = statistics.median(r["per_second"] for r in runs["floor"])
    for side, results in runs.items():
        median = {k: statistics.median(r[k] for r in results) for k in results[0]}
        figures = [median["cpu_us"], *(median.get(part, 0.0) for part in PARTS)]
        ratio = ""
        if side != "floor":
            figures += [
                median["call"] - sum(median[part] for part in PARTS),
                median["cpu_us"] - median["call"],
            ]
            ratio = f"  ({median['per_second'] / floor_rate:.2f}x the floor)"
        line = " ".join(f"{figure:9.1f}" for figure in figures)
        print(f"{side:8} {median['per_second']:7,.0f} {line}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
