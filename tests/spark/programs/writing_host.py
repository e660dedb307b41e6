"""Many producers in one process, each committing transactions while it serves, for
tests/spark/test_spark_exactly_once.py at hundreds of producers (as a host runs them: one
process per 16 producers, not one each).

    writing_host.py TOTAL DB... [--allow FILE] [--pace P] [--seed S]

Serves each DB (SQLite) with a ``Producer`` on one event loop, on a port of its own, and
has each commit transactions of 1 to ``MAX_BATCH`` records to stream ``orders``, a
business row per record in the same transaction, until its stream holds TOTAL records,
never beyond the number written in FILE (``--allow``: the test releases records a little
at a time), at about P records per second each (``--pace``).

Prints ``READY <producer id> <host:port>`` per producer once all serve, and ``COMPLETE``
once every one holds TOTAL records; then serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys

import streamq
from streamq import _loop

STREAM = "orders"
MAX_BATCH = 5
ALLOWANCE_CHECK = 0.05  # seconds between looks at the allowance file, when at it


def allowance(path: str | None, total: int) -> int:
    if path is None:
        return total
    try:
        with open(path) as file:
            return min(total, int(file.read().strip() or 0))
    except FileNotFoundError:
        return 0


async def write(producer: streamq.Producer, args: argparse.Namespace, rng: random.Random) -> None:
    """Commit transactions until the stream holds ``args.total`` records."""
    async with producer.transaction() as tx:
        await tx.execute("CREATE TABLE IF NOT EXISTS orders (seq INTEGER PRIMARY KEY, value BLOB)")
    while (head := producer.head(STREAM)) < args.total:
        room = allowance(args.allow, args.total) - head
        if room <= 0:
            await asyncio.sleep(ALLOWANCE_CHECK)
            continue
        count = min(rng.randint(1, MAX_BATCH), room)
        values = [b"%s-%d" % (producer.producer_id.encode(), head + n) for n in range(1, count + 1)]
        async with producer.transaction() as tx:
            seqs = await tx.publish_many(STREAM, values)
            assert isinstance(seqs, range)
            await tx.executemany(
                "INSERT INTO orders (seq, value) VALUES (?, ?)", zip(seqs, values, strict=True)
            )
        if args.pace:
            await asyncio.sleep(count / args.pace * rng.uniform(0.5, 1.5))


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    async with contextlib.AsyncExitStack() as stack:
        producers = []
        for db in args.dbs:
            producer = await stack.enter_async_context(streamq.Producer(db, port=0))
            await producer.create_stream(STREAM)
            producers.append(producer)
        for producer in producers:
            print(f"READY {producer.producer_id} {producer.address}", flush=True)
        seeds = [rng.randrange(2**32) for _ in producers]
        await asyncio.gather(
            *(write(p, args, random.Random(s)) for p, s in zip(producers, seeds, strict=True))
        )
        print("COMPLETE", flush=True)
        await asyncio.Event().wait()  # serve until killed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("total", type=int)
    parser.add_argument("dbs", nargs="+")
    parser.add_argument("--allow", default=None)
    parser.add_argument("--pace", type=float, default=0.0, help="records per second (0: no pause)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    sys.exit(_loop.run(main(args)))
