"""Where a PostgreSQL transaction's CPU goes: ``python -m bench.tools.pg_cpu``.

Writer processes commit a business row and its event for ``--seconds`` on a throwaway
server (+``--fsync-delay-us`` on each flush), as ``bench.pg_load``'s do. The event:
``streamq.publish``, numbered by ``streamq serve`` for a consumer (``--system streamq``);
the same with the writer running the WAL path's statement itself, which tells what
``publish`` costs around it (``statement``); an outbox row nothing reads (``outbox``).
Prints CPU per committed transaction of each part: the writers' Python, their database
sessions, the serving process, its database sessions (the numbering session, the
walsender of its slot), the consumer, and the whole machine.

``python -m bench.tools.pg_cpu [--system streamq|outbox] [--writers 32] [--seconds 8]
[--wal-level logical|replica] [--fsync-delay-us 1000]``
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import struct
import subprocess
import time
from typing import Any

import psycopg

import streamq
from streamq.engines.postgres.append import PUBLISH_WAL, wal_message
from streamq.records import Unnumbered, checked_record

from ..common import Child, proc_cpu_seconds
from ..pg_load.run import busy_seconds, publishing_path
from .fsync_delay import server_env

EVENT = struct.Struct(">iq88x")  # bench.pg_load's


def _cpu(pid: int) -> float:
    try:
        return proc_cpu_seconds(pid)
    except FileNotFoundError:  # gone meanwhile
        return 0.0


def _server_processes() -> dict[int, float]:
    found = subprocess.run(["pgrep", "-u", "postgres"], capture_output=True, text=True)
    return {pid: _cpu(pid) for pid in map(int, found.stdout.split())}


def _writer(url: str, system: str, index: int, seconds: float, out: Any, done: Any) -> None:
    with psycopg.connect(url, application_name="writer") as conn:
        conn.execute("SET synchronous_commit = on")
        conn.commit()
        deadline, n = time.time() + seconds, 0
        while time.time() < deadline:
            conn.execute("INSERT INTO orders (writer, n) VALUES (%s, %s)", (index, n))
            event = EVENT.pack(index, n)
            if system == "streamq":
                streamq.publish(conn, "orders", event)
            elif system == "statement":  # the WAL path's statement, with none of publish's
                record = checked_record(event, None, None, None)  # dispatch and steps around
                payload = wal_message("orders", Unnumbered.of([record], 1 << 20))
                conn.execute(PUBLISH_WAL, (payload,)).fetchone()
            else:
                conn.execute("INSERT INTO outbox (payload) VALUES (%s)", (event,))
            conn.commit()
            n += 1
        out.put((n, time.process_time()))
        done.wait()  # its session's CPU is read before it ends


def measure(url: str, system: str, writers: int, seconds: float) -> dict[str, float]:
    """CPU µs per committed transaction, by part."""
    with contextlib.ExitStack() as stack:
        readers: list[Child] = []
        if system != "outbox":
            serve = stack.enter_context(Child("streamq", "serve", url, "--init", "--port", 0))
            address = serve.expect("serving", 60)[-1]
            consumer = stack.enter_context(
                Child("bench.pg_load.procs", "consumer", address, os.devnull, "orders")
            )
            consumer.expect("READY", 60)
            readers = [serve, consumer]
            publishing_path(url)
        with psycopg.connect(url) as conn:
            named = {
                pid: name or kind
                for pid, name, kind in conn.execute(
                    "SELECT pid, application_name, backend_type FROM pg_stat_activity"
                )
            }
        out: Any = multiprocessing.Queue()
        done = multiprocessing.Event()
        procs = [
            multiprocessing.Process(target=_writer, args=(url, system, i, seconds, out, done))
            for i in range(writers)
        ]
        before = _server_processes()
        readers_before = [_cpu(r.process.pid) for r in readers]
        busy = busy_seconds()
        for proc in procs:
            proc.start()
        results = [out.get() for _ in procs]
        after = _server_processes()
        done.set()
        for proc in procs:
            proc.join()
        total = sum(n for n, _ in results)
        if readers:
            readers[1].send(f"EXPECT {total}")
            readers[1].expect("DONE", 120)
        whole = busy_seconds() - busy
        readers_used = [
            _cpu(r.process.pid) - b for r, b in zip(readers, readers_before, strict=True)
        ]
    per = 1e6 / max(total, 1)
    used = {pid: cpu - before.get(pid, 0) for pid, cpu in after.items()}
    parts = {
        "transactions/s": total / seconds,
        "writers' Python": sum(cpu for _, cpu in results) * per,
        "writers' sessions": sum(cpu for pid, cpu in used.items() if pid not in named) * per,
    }
    for pid, name in named.items():
        if used.get(pid, 0) > 0.001:
            parts[f"session: {name}"] = used[pid] * per
    for label, cpu in zip(
        ("streamq serve", "consumer")[: len(readers_used)], readers_used, strict=True
    ):
        parts[label] = cpu * per
    parts["whole machine"] = whole * per
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.pg_cpu", description=__doc__)
    parser.add_argument("--system", choices=("streamq", "statement", "outbox"), default="streamq")
    parser.add_argument("--writers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--wal-level", choices=("logical", "replica"), default="logical")
    parser.add_argument("--fsync-delay-us", type=int, default=1000)
    args = parser.parse_args()
    from tests.pgserver import PostgresServer

    settings = {"wal_level": args.wal_level, "max_replication_slots": "10"}
    server = PostgresServer(settings=settings, env=server_env(args.fsync_delay_us))
    server.start()
    try:
        url = server.create_database("cpu")
        with psycopg.connect(url) as conn:
            conn.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, writer integer, n bigint)")
            conn.execute("CREATE TABLE outbox (id bigserial PRIMARY KEY, payload bytea)")
            streamq.create_tables(conn)
            conn.execute("INSERT INTO streamq_streams (name) VALUES ('orders')")
        parts = measure(url, args.system, args.writers, args.seconds)
    finally:
        server.stop()
    print(f"{args.system}, {args.writers} writers, wal_level {args.wal_level}:")
    for part, value in parts.items():
        unit = "" if part == "transactions/s" else " µs per transaction"
        print(f"  {part:40s} {value:10,.0f}{unit}")


if __name__ == "__main__":
    main()
