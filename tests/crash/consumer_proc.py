"""A consumer process for the crash tests (tests/crashrun.py).

    consumer_proc.py ADDRESS DB TARGET [--journal FILE] [--heartbeat-timeout S]

Consumer "billing" of stream ``orders``: applies every batch with the oracle's
deliberately non-idempotent effect (a row per record in ``applied``, which has no
unique index, and the record's amount added to ``applied_sum``) in the transaction
that stores its position. Exits 0 once its position reaches TARGET. Every batch
received is journalled as a push before it is applied.

Fault points (``STREAMQ_FAULT=POINT:N``, see faults.py): ``before-tx`` (the N-th
batch received, before its transaction), ``after-apply`` (inside the N-th
transaction, effects written, before COMMIT), ``after-commit`` (right after the
N-th COMMIT, before reading the next batch).

Prints ``SUBSCRIBED applied=<seq>`` once connected, ``COMMIT <n> last=<seq>``
after each transaction and ``DONE applied=<seq>`` at the end.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys

import streamq
from streamq._loop import run
from tests.crash.faults import FAULTS
from tests.oracle import ADD_TO_SUM, APPLY_ROWS, EFFECT_SCHEMA, Journal, amount

STREAM = "orders"
NAME = "billing"


def create_tables(path: str) -> None:
    with sqlite3.connect(path, timeout=10) as db:
        for statement in EFFECT_SCHEMA:
            db.execute(statement)
    db.close()


async def main(args: argparse.Namespace) -> int:
    create_tables(args.db)
    journal = Journal(args.journal)
    # reconnect_timeout: start() also waits for a producer that is down (being restarted).
    consumer = streamq.Consumer(
        args.address,
        STREAM,
        db=args.db,
        name=NAME,
        reconnect_timeout=args.reconnect_timeout,
        connect_timeout=args.connect_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
    )
    await consumer.start()
    try:
        print(f"SUBSCRIBED applied={consumer.applied}", flush=True)
        commits = 0
        if consumer.applied < args.target:
            async for batch in consumer:
                rows = [(record.seq, record.value) for record in batch]
                journal.write("push", rows)
                if FAULTS.due("before-tx"):
                    FAULTS.fire("before-tx", f"last={batch.last_seq}")
                async with consumer.transaction(batch) as tx:
                    await tx.executemany(APPLY_ROWS, rows)
                    await tx.execute(ADD_TO_SUM, (sum(amount(value) for _, value in rows),))
                    if FAULTS.due("after-apply"):
                        FAULTS.fire("after-apply", f"last={batch.last_seq}")
                commits += 1
                print(f"COMMIT {commits} last={batch.last_seq}", flush=True)
                if FAULTS.due("after-commit"):
                    FAULTS.fire("after-commit", f"last={batch.last_seq}")
                if batch.last_seq >= args.target:
                    break
        print(f"DONE applied={consumer.applied}", flush=True)
    finally:
        await consumer.close()
        journal.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("db")
    parser.add_argument("target", type=int)
    parser.add_argument("--journal", default=None)
    parser.add_argument("--reconnect-timeout", type=float, default=30.0)
    parser.add_argument("--connect-timeout", type=float, default=5.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=30.0)
    sys.exit(run(main(parser.parse_args())))
