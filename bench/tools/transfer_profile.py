"""Where the one-writer transfer's time goes: ``python -m bench.tools.transfer_profile
[--transfers N] [--rate HZ]``.

Runs streamq's one-writer transfer (``bench/transfer``: payments process, ledger consumer)
under py-spy, with the floor (the same SQL, no framework) beside it, and prints:

- each process's CPU a transfer and a transaction (µs, every thread, from ``/proc``),
  streamq's and the floor's;
- the payments process's event-loop thread, where SQLite's writes, the group commit and
  the push all run, split into parts by the frames py-spy sampled: the application's own
  SQL, BEGIN, COMMIT, the log row's insert, publish (numbering and encoding), the push
  and acknowledgements, the WAL watch, the group commit's Python, the event loop's own C
  (uvloop: system calls and callbacks) and the benchmark's own work (making transfers).

The parts the floor also runs (its SQL, its send, its transfers) against the rest tell
what a faster path could still win. The build is whatever ``import streamq`` chose
(``STREAMQ_PURE=1``: pure Python).
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import streamq.native

from ..common import say
from ..transfer.deployment import Deployment, cpu_seconds
from ..transfer.floor import floor_flow

# A sample's part: the benchmark's if its own code (making transfers, their statements'
# parameters and records) or ``random`` is on its stack; else the first of these parts one
# of whose functions (a name's prefix) is.
PARTS = (
    ("the application's SQL", ("BlockingSQL.executemany", "BlockingSQL.execute")),
    ("BEGIN", ("SQLiteBlockingWriter.begin",)),
    ("COMMIT", ("SQLiteBlockingWriter.commit",)),
    ("the log row's insert", ("_insert_buffered",)),
    ("publish: numbering, encoding", ("BlockingTransaction.publish",)),
    ("the push and acknowledgements", ("Server._push", "Server._read_acks")),
    ("the WAL watch", ("watch_commits", "_Inotify")),
    ("group commit, transaction bookkeeping", ("GroupCommit", "Producer.run_in_transaction")),
)
BENCHMARK = "the benchmark's own work"
BENCHMARK_FILES = ("bench/transfer/common.py", "/random.py")
LOOP = "the event loop's own C (uvloop)"
ON_THE_FLOOR = {"the application's SQL", "BEGIN", "COMMIT", "the log row's insert", BENCHMARK}


def part_of(frames: list[str]) -> str:
    """The part a sampled stack (outermost frame first) belongs to."""
    if any(frame.rpartition(":")[0].endswith(BENCHMARK_FILES) for frame in frames):
        return BENCHMARK
    names = [frame.partition(" (")[0] for frame in frames]
    for part, prefixes in PARTS:
        if any(name.startswith(prefixes) for name in names):
            return part
    return LOOP if names and names[-1] == "Runner.run" else "other"


def main_thread_parts(raw: Path) -> collections.Counter[str]:
    """Samples of the main thread by part, from py-spy's ``--format raw`` output."""
    parts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        if "MainThread" in thread:
            parts[part_of(frames)] += int(count)
    return parts


def profiled_flow(folder: Path, transfers: int, rate: int) -> tuple[dict[str, float], int, Path]:
    """One streamq run under py-spy: each process's CPU seconds, the producer's
    transactions, and py-spy's raw profile of the producer."""
    raw = folder / "producer.txt"
    with Deployment("streamq", folder, transfers, 0, target=transfers) as deployment:
        deployment.start_all()
        pids = {role: child.process.pid for role, child in deployment.children.items()}
        spy = subprocess.Popen(
            [
                *(str(Path(sys.executable).with_name("py-spy")), "record", "--threads"),
                *("--nonblocking", "-r", str(rate), "-f", "raw", "-o", str(raw)),
                *("-p", str(pids["producer"])),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # py-spy attaches (it says nothing when it has)
        before = {role: cpu_seconds(pid) for role, pid in pids.items()}
        deployment.go()
        deployment.children["consumer"].expect("DONE", 600)
        cpu = {role: cpu_seconds(pid) - before[role] for role, pid in pids.items()}
        spy.send_signal(2)  # SIGINT: py-spy writes its profile and exits
        spy.wait(60)
        # One writer, one stream: each transaction leaves one log row.
        with sqlite3.connect(deployment.producer_db) as conn:
            (transactions,) = conn.execute("SELECT COUNT(*) FROM streamq_log").fetchone()
    return cpu, int(transactions), raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=250, help="py-spy's samples a second")
    args = parser.parse_args(argv)
    n = args.transfers
    say(f"build: {streamq.native.build().describe()}")
    with tempfile.TemporaryDirectory(prefix="streamq-profile-") as folder:
        cpu, transactions, raw = profiled_flow(Path(folder), n, args.rate)
        parts = main_thread_parts(raw)
    with tempfile.TemporaryDirectory(prefix="streamq-floor-") as folder:
        floor_rate, floor_producer, floor_ledger = floor_flow(Path(folder), n)
    per_tx = n / transactions
    print(f"{n:,} transfers in {transactions:,} transactions ({per_tx:.1f} a transaction)")
    print(f"floor: {floor_rate:,.0f} transfers/s")
    for role, seconds in cpu.items():
        floor = floor_producer if role == "producer" else floor_ledger
        print(
            f"{role} CPU: {seconds / n * 1e6:.2f} µs a transfer, "
            f"{seconds / transactions * 1e6:.0f} µs a transaction "
            f"(floor: {floor:.2f} µs a transfer)"
        )
    total = sum(parts.values())
    producer_us = cpu["producer"] / n * 1e6
    print("the producer's event-loop thread, by part (µs a transfer, of its CPU):")
    for part, samples in parts.most_common():
        share = samples / total
        floor_mark = "  (the floor runs it too)" if part in ON_THE_FLOOR else ""
        print(f"  {share:6.1%} {share * producer_us:5.2f} µs  {part}{floor_mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
