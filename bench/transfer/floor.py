"""The one-writer transfer's floor: the SQL both of streamq's processes must run, with no
framework around it, measured beside streamq's one-writer flow.

Two processes of plain Python and ``sqlite3``, joined by loopback TCP. The producer runs
streamq's statements per transaction (BEGIN IMMEDIATE, the debits, the journal rows, one
log row holding the transaction's deposits, COMMIT), then sends that row's bytes. The
ledger takes whatever has arrived, credits it, and moves its position, in one
transaction. No asyncio, no encoding per record, no acknowledgements, no tail, no
protocol: what is left when everything streamq adds is free. The gap between the two is
streamq's own cost; the floor bounds what any producer and consumer of this design
written in Python could do on this machine.

``python -m bench --only transfer`` measures it beside streamq and Kafka + outbox;
``python -m bench.transfer.floor [--repeats N] [--transfers N] [--floor-only]
[--streamq-sql]`` prints transfers/s end to end for it and streamq alone, and the floor's
CPU per transfer, and saves nothing. ``--streamq-sql`` runs the floor again with the
statements streamq's SQLite engine adds around the same ones, on its tables
(``STREAMQ_TABLES``): what streamq's SQL costs, apart from its Python.
"""

from __future__ import annotations

import argparse
import random
import resource
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from ..common import Child, Series, alternating, console, say, wait_line
from .common import (
    CONSUMER_SCHEMA,
    CREDIT,
    DEBIT,
    DEPOSIT,
    JOURNAL,
    MAX_BATCH,
    RECORD_CREDIT,
    debits,
    make_transfers,
    open_db,
    payloads,
    setup_consumer_db,
    setup_producer_db,
)
from .deployment import FULL, flow

FRAME = struct.Struct("<I")  # a log row's length, before its bytes
TITLE = "transfer, one writer: streamq against the floor (the same SQL, no framework)"
FLOOR, STREAMQ_SQL = "floor", "floor, streamq's SQL"
TIMEOUT = 600.0  # s for one run, at most


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ``streamq_sql``: the statements streamq's SQLite engine runs around the same ones in a
# transaction, on its tables (``engines/sqlite/storage.py``): BEGIN without waiting for the
# write lock and the data version read under it, the check that nobody else appended, the
# log row with its timestamp and key, the time-index row.
STREAMQ_TABLES = (
    "CREATE TABLE log (pos INTEGER PRIMARY KEY, ts INTEGER NOT NULL, record BLOB NOT NULL, "
    "key BLOB, count INTEGER NOT NULL DEFAULT 1)",
    "CREATE TABLE times (stream_id INTEGER NOT NULL, ts INTEGER NOT NULL, seq INTEGER NOT NULL, "
    "PRIMARY KEY (stream_id, ts)) WITHOUT ROWID",
)


def producer(path: str, total: int, port: int, streamq_sql: bool = False) -> None:
    """``producer DB TOTAL PORT [streamq-sql]``: READY once connected to the ledger, then,
    told GO, commits and sends ``total`` transfers; DONE with its CPU seconds."""
    conn = open_db(path)
    setup_producer_db(conn, outbox=False)
    for table in STREAMQ_TABLES if streamq_sql else (_LOG,):
        conn.execute(table)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rng = random.Random(1)
    say("READY")
    wait_line("GO")
    cpu, last = _cpu_seconds(), 0
    while last < total:
        transfers = make_transfers(rng, last + 1, min(total - last, rng.randint(1, MAX_BATCH)))
        first, last = last + 1, last + len(transfers)
        if streamq_sql:
            conn.execute("PRAGMA busy_timeout=0")
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("PRAGMA data_version").fetchone()
            conn.execute("PRAGMA busy_timeout=10000")
        else:
            conn.execute("BEGIN IMMEDIATE")
        conn.executemany(DEBIT, debits(transfers))
        conn.executemany(JOURNAL, transfers)
        row = b"".join(payloads(transfers, None))
        if streamq_sql:
            ts = int(time.time() * 1000)
            conn.execute(_ANY_FROM, (first, 1 << 40)).fetchone()
            conn.executemany(_INSERT_LOG, [(last, ts, row, None, len(transfers))])
            conn.executemany(_INSERT_TIME, [(1, ts, first)])
        else:
            conn.execute("INSERT INTO log VALUES (?, ?, ?)", (last, len(transfers), row))
        conn.execute("COMMIT")
        sock.sendall(FRAME.pack(len(row)) + row)
    say("DONE", _cpu_seconds() - cpu)
    wait_line("STOP")


_LOG = "CREATE TABLE log (pos INTEGER PRIMARY KEY, count INTEGER, record BLOB)"
_ANY_FROM = "SELECT 1 FROM log WHERE pos >= ? AND pos < ? LIMIT 1"
_INSERT_LOG = "INSERT INTO log VALUES (?, ?, ?, ?, ?)"
_INSERT_TIME = "INSERT OR IGNORE INTO times VALUES (?, ?, ?)"


def ledger(path: str, total: int) -> None:
    """``ledger DB TOTAL``: READY with the port it listens on; credits what arrives, each
    read in one transaction with its position; DONE when it credited the last
    (``time.time()``) with its CPU seconds."""
    setup_consumer_db(path, CONSUMER_SCHEMA)
    conn = open_db(path)
    conn.execute("CREATE TABLE position (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")
    conn.execute("INSERT INTO position VALUES (0, 0)")
    with socket.create_server(("127.0.0.1", 0)) as server:
        say("READY", server.getsockname()[1])
        sock, _ = server.accept()
    cpu, buffer, credited = _cpu_seconds(), bytearray(), 0
    while credited < total:
        received = sock.recv(1 << 20)
        if not received:
            raise ConnectionError(f"the producer closed after {credited} of {total}")
        buffer += received
        rows, start = [], 0
        while len(buffer) - start >= FRAME.size:
            (size,) = FRAME.unpack_from(buffer, start)
            if len(buffer) - start - FRAME.size < size:
                break
            rows.append(bytes(buffer[start + FRAME.size : start + FRAME.size + size]))
            start += FRAME.size + size
        del buffer[:start]
        deposits = [d for row in rows for d in DEPOSIT.iter_unpack(row)]
        if not deposits:
            continue
        credited += len(deposits)
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(CREDIT, [(amount, to) for _, to, amount, _ in deposits])
        conn.executemany(RECORD_CREDIT, [(tid, amount) for tid, _, amount, _ in deposits])
        conn.execute("UPDATE position SET seq = ? WHERE id = 0", (credited,))
        conn.execute("COMMIT")
    say("DONE", time.time(), _cpu_seconds() - cpu)
    sock.close()


def floor_flow(folder: Path, total: int, streamq_sql: bool = False) -> tuple[float, float, float]:
    """One run of the floor (``streamq_sql``: with streamq's statements and tables):
    (transfers/s end to end, producer's and ledger's CPU microseconds per transfer)."""
    module = "bench.transfer.floor"
    extra = ["streamq-sql"] if streamq_sql else []
    with Child(module, "ledger", folder / "ledger.db", total) as credits:
        (port,) = credits.expect("READY")
        with Child(module, "producer", folder / "payments.db", total, port, *extra) as payments:
            payments.expect("READY")
            started = time.time()
            payments.send("GO")
            finished, ledger_cpu = map(float, credits.expect("DONE", TIMEOUT))
            (producer_cpu,) = map(float, payments.expect("DONE", TIMEOUT))
            payments.send("STOP")
    return total / (finished - started), producer_cpu / total * 1e6, ledger_cpu / total * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer.floor", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="runs per system (3)")
    parser.add_argument("--transfers", type=int, default=FULL.transfers, help="transfers per run")
    parser.add_argument("--floor-only", action="store_true", help="the floor alone")
    parser.add_argument(
        "--streamq-sql",
        action="store_true",
        help="the floor again with streamq's statements and tables: what they cost",
    )
    args = parser.parse_args(argv)
    floors = {FLOOR: False, **({STREAMQ_SQL: True} if args.streamq_sql else {})}
    systems = [*floors, *([] if args.floor_only else ["streamq"])]
    case = f"{args.transfers:,} transfers"
    series = {s: Series(s, case, "tr/s") for s in systems}
    cpu = {
        (floor, role): Series(floor, f"{role}'s CPU a transfer", "µs")
        for floor in floors
        for role in ("producer", "ledger")
    }
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("transfer: the floor", total=args.repeats * len(systems))
        for system in alternating(systems, args.repeats):
            with tempfile.TemporaryDirectory(prefix="streamq-floor-") as folder:
                if system in floors:
                    rate, producer_us, ledger_us = floor_flow(
                        Path(folder), args.transfers, floors[system]
                    )
                    cpu[(system, "producer")].values.append(producer_us)
                    cpu[(system, "ledger")].values.append(ledger_us)
                else:
                    measured = flow("streamq", None, Path(folder), args.transfers, 0)
                    rate = args.transfers / measured.seconds
            series[system].values.append(rate)
            progress.advance(task)
    table = Table(title=TITLE)
    for column in ("case", "system", "median", "spread", "runs", "of the floor"):
        table.add_column(column, justify="left" if column == "system" else "right")
    floor = series[FLOOR].median
    for s in [*series.values(), *cpu.values()]:
        share = f"{s.median / floor:.0%}" if s.unit == "tr/s" else ""
        table.add_row(
            s.case,
            s.system,
            f"{s.median:,.1f} {s.unit}",
            f"{s.spread:.0%}",
            str(len(s.values)),
            share,
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    role, *args = sys.argv[1:] or [""]
    if role == "producer":
        producer(args[0], int(args[1]), int(args[2]), args[3:] == ["streamq-sql"])
    elif role == "ledger":
        ledger(args[0], int(args[1]))
    else:
        raise SystemExit(main())
