"""A consumer process for the crash test (tests/test_crash.py).

    consumer_proc.py ADDRESS DB TARGET [--kill-after-commit K]

Consumer "billing" of stream ``orders``: applies every batch into
``applied(seq, value)`` (no unique index, so a record applied twice shows as two
rows) in the transaction that stores its position. Exits 0 once its position
reaches TARGET. ``--kill-after-commit K``: SIGKILLs itself right after its K-th
committed transaction, before reading the next batch.

Prints ``SUBSCRIBED applied=<seq>`` once connected, ``COMMIT <n> last=<seq>``
after each transaction, ``KILL-AFTER-COMMIT ...`` before killing itself and
``DONE applied=<seq>`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys

import streamq
from streamq._loop import run

STREAM = "orders"
NAME = "billing"


def create_table(path: str) -> None:
    with sqlite3.connect(path, timeout=10) as db:
        db.execute("CREATE TABLE IF NOT EXISTS applied (seq INTEGER NOT NULL, value BLOB NOT NULL)")
    db.close()


async def main(args: argparse.Namespace) -> int:
    create_table(args.db)
    # reconnect_timeout: start() also waits for a producer that is down (being restarted).
    consumer = streamq.Consumer(
        args.address,
        STREAM,
        db=args.db,
        name=NAME,
        reconnect_timeout=args.connect_timeout,
        connect_timeout=5.0,
    )
    await consumer.start()
    try:
        print(f"SUBSCRIBED applied={consumer.applied}", flush=True)
        commits = 0
        if consumer.applied < args.target:
            async for batch in consumer:
                async with consumer.transaction(batch) as tx:
                    await tx.executemany(
                        "INSERT INTO applied (seq, value) VALUES (?, ?)",
                        [(record.seq, record.value) for record in batch],
                    )
                commits += 1
                print(f"COMMIT {commits} last={batch.last_seq}", flush=True)
                if commits == args.kill_after_commit:
                    print(f"KILL-AFTER-COMMIT {commits} last={batch.last_seq}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if batch.last_seq >= args.target:
                    break
        print(f"DONE applied={consumer.applied}", flush=True)
    finally:
        await consumer.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("db")
    parser.add_argument("target", type=int)
    parser.add_argument("--kill-after-commit", type=int, default=0)
    parser.add_argument("--connect-timeout", type=float, default=30.0)
    sys.exit(run(main(parser.parse_args())))
