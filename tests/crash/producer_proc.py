"""A producer process for the crash tests (tests/crashrun.py).

    producer_proc.py DB PORT TOTAL [--allow FILE] [--seed S] [--journal FILE]

Serves DB on 127.0.0.1:PORT and runs transactions that each insert orders
(business rows: ``orders`` and the running ``totals``) and publish one record
per order, ``b"order-<id>:<amount>"``, until the stream ``orders`` has TOTAL
records. A restarted producer continues from the committed head. Then it keeps
serving until it is killed.

``--allow FILE``: never publish beyond the number written in FILE (the test
releases records a little at a time, so the consumer always has work while it
is being killed). ``--journal FILE``: every record published (``publish``) and
every transaction that committed (``commit``) is journalled for the oracle.

Fault points (``STREAMQ_FAULT=POINT:N``, see faults.py): ``mid-tx``: the N-th
transaction kills the process after its business SQL and its publishes, before
COMMIT (whatever the allowance; sooner if all TOTAL records are published).
``mid-push``: the N-th RECORDS frame pushed to a consumer is cut in half and the
process dies right after writing the first half.

Prints ``READY <port> head=<head>`` once serving, and
``FAULT mid-tx <n> head=<head> records=<k>`` just before killing itself mid-transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import streamq
from streamq._loop import run
from streamq.protocol import ServerConnection
from tests.crash.faults import FAULTS
from tests.oracle import Journal

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


def arm_mid_push() -> None:
    """Cut the N-th RECORDS frame in half and die once its first half is written."""
    send_records = ServerConnection.send_records

    dying: list[str] = []  # the fault's detail, once the half frame is out

    def cut(
        self: ServerConnection, encoded_records: Sequence[bytes], epoch: int | None = None
    ) -> bytes:
        if dying:  # the half frame was handed to the socket: die before any further frame
            FAULTS.fire("mid-push", dying[0])
        data = send_records(self, encoded_records, epoch)
        if FAULTS.due("mid-push"):
            dying.append(f"frame={len(data)} bytes records={len(encoded_records)}")
            asyncio.get_running_loop().call_soon(FAULTS.fire, "mid-push", dying[0])
            return data[: len(data) // 2]
        return data

    ServerConnection.send_records = cut  # type: ignore[method-assign]


async def one_transaction(
    producer: streamq.Producer,
    rng: random.Random,
    count: int,
    kill: bool,
    journal: Journal,
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
            seqs: Sequence[int] = [await tx.publish(STREAM, values[0], key=b"%d" % orders[0][0])]
        else:
            seqs = await tx.publish_many(STREAM, values)
        journal.write("publish", zip(seqs, values, strict=True))
        if not business_first:
            await tx.executemany("INSERT INTO orders (id, amount) VALUES (?, ?)", orders)
        await tx.execute(
            "UPDATE totals SET n = n + ?, amount = amount + ? WHERE name = 'orders'",
            (count, sum(amount for _, amount in orders)),
        )
        if kill:
            FAULTS.fire("mid-tx", f"head={producer.head(STREAM)} records={count}")
    journal.write("commit", zip(seqs, values, strict=True))


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    journal = Journal(args.journal)
    if FAULTS.armed("mid-push"):
        arm_mid_push()
    # Small timeouts, so that a pause (SIGSTOP) outlasts every one of them.
    settings = streamq.ServerSettings(
        heartbeat_interval=args.heartbeat_interval,
        handshake_timeout=1.0,
        idle_timeout=1.0,
        frame_timeout=1.0,
    )
    async with streamq.Producer(
        args.db, host="127.0.0.1", port=args.port, flush_records=FLUSH_RECORDS, settings=settings
    ) as producer:
        await setup(producer)
        print(f"READY {args.port} head={producer.head(STREAM)}", flush=True)
        while True:
            head = producer.head(STREAM)
            # The N-th transaction is killed; so is the next one once all is published.
            kill = FAULTS.armed("mid-tx") and head >= args.total
            limit = allowance(args.allow, args.total)
            if head >= limit and not kill:
                if head >= args.total:
                    break
                await asyncio.sleep(0.005)
                continue
            kill = FAULTS.due("mid-tx") or kill
            count = rng.randint(1, MAX_BATCH)
            if not kill:
                count = min(count, limit - head)
            await one_transaction(producer, rng, count, kill, journal)
            if args.pace:
                await asyncio.sleep(count / args.pace * rng.uniform(0.5, 1.5))
        print(f"COMPLETE head={producer.head(STREAM)}", flush=True)
        await asyncio.Event().wait()  # serve until killed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("port", type=int)
    parser.add_argument("total", type=int)
    parser.add_argument("--journal", default=None)
    parser.add_argument("--heartbeat-interval", type=float, default=0.2)
    parser.add_argument("--allow", default=None)
    parser.add_argument("--pace", type=float, default=0.0, help="records per second (0: no pause)")
    parser.add_argument("--seed", type=int, default=None)
    sys.exit(run(main(parser.parse_args())))
