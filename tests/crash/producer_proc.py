"""A producer process for the crash test (tests/test_crash.py).

    producer_proc.py DB PORT TOTAL [--kill-mid-tx-after N] [--allow FILE] [--seed S]

Serves DB on 127.0.0.1:PORT and runs transactions that each insert orders
(business rows: ``orders`` and the running ``totals``) and publish one record
per order, ``b"order-<id>:<amount>"``, until the stream ``orders`` has TOTAL
records. A restarted producer continues from the committed head. Then it keeps
serving until it is killed.

``--allow FILE``: never publish beyond the number written in FILE (the test
releases records a little at a time, so the consumer always has work while it
is being killed). ``--kill-mid-tx-after N``: the N-th transaction of this
process SIGKILLs the process after its business SQL and its publishes, before
COMMIT (whatever the allowance; sooner if all TOTAL records are published).

Prints ``READY <port> head=<head>`` once serving, and
``KILL-MID-TX tx=<n> head=<head> records=<k>`` just before killing itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
from pathlib import Path

import streamq
from streamq._loop import run

STREAM = "orders"
MAX_BATCH = 200
# Records per executemany into streamq_log, so big transactions write part of
# the log before COMMIT (and the mid-transaction kill leaves uncommitted rows).
FLUSH_RECORDS = 64


def allowance(path: str | None, total: int) -> int:
    if path is None:
        return total
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return 0
    return min(total, int(text)) if text else 0


async def setup(producer: streamq.Producer) -> None:
    async with producer.transaction() as tx:
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)"
        )
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS totals "
            "(name TEXT PRIMARY KEY, n INTEGER NOT NULL, amount INTEGER NOT NULL)"
        )
        await tx.execute("INSERT OR IGNORE INTO totals (name, n, amount) VALUES ('orders', 0, 0)")
    await producer.create_stream(STREAM)


async def one_transaction(
    producer: streamq.Producer, rng: random.Random, count: int, kill: bool, txno: int
) -> None:
    async with producer.transaction() as tx:
        cursor = await tx.execute("SELECT COALESCE(MAX(id), 0) FROM orders")
        row = await cursor.fetchone()
        assert row is not None
        order_id = int(row[0])
        orders = []
        for _ in range(count):
            order_id += rng.randint(1, 3)  # ids with gaps: not the same numbers as seqs
            orders.append((order_id, rng.randint(1, 10_000)))
        values = [b"order-%d:%d" % order for order in orders]
        business_first = rng.random() < 0.5
        if business_first:
            await tx.executemany("INSERT INTO orders (id, amount) VALUES (?, ?)", orders)
        if count == 1:
            await tx.publish(STREAM, values[0], key=b"%d" % orders[0][0])
        else:
            await tx.publish_many(STREAM, values)
        if not business_first:
            await tx.executemany("INSERT INTO orders (id, amount) VALUES (?, ?)", orders)
        await tx.execute(
            "UPDATE totals SET n = n + ?, amount = amount + ? WHERE name = 'orders'",
            (count, sum(amount for _, amount in orders)),
        )
        if kill:
            print(f"KILL-MID-TX tx={txno} head={producer.head(STREAM)} records={count}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    async with streamq.Producer(
        args.db, host="127.0.0.1", port=args.port, flush_records=FLUSH_RECORDS
    ) as producer:
        await setup(producer)
        print(f"READY {args.port} head={producer.head(STREAM)}", flush=True)
        txno = 0
        while True:
            head = producer.head(STREAM)
            # The N-th transaction is killed; so is the next one once all is published.
            kill = args.kill_mid_tx_after > 0 and (
                args.kill_mid_tx_after == txno + 1 or head >= args.total
            )
            limit = allowance(args.allow, args.total)
            if head >= limit and not kill:
                if head >= args.total:
                    break
                await asyncio.sleep(0.005)
                continue
            txno += 1
            count = rng.randint(1, MAX_BATCH)
            if not kill:
                count = min(count, limit - head)
            await one_transaction(producer, rng, count, kill, txno)
            if args.pace:
                await asyncio.sleep(count / args.pace * rng.uniform(0.5, 1.5))
        print(f"COMPLETE head={producer.head(STREAM)}", flush=True)
        await asyncio.Event().wait()  # serve until killed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("port", type=int)
    parser.add_argument("total", type=int)
    parser.add_argument("--kill-mid-tx-after", type=int, default=0)
    parser.add_argument("--allow", default=None)
    parser.add_argument("--pace", type=float, default=0.0, help="records per second (0: no pause)")
    parser.add_argument("--seed", type=int, default=None)
    sys.exit(run(main(parser.parse_args())))
