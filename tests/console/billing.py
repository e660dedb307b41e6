"""The consumer the console's tests watch: it applies ``orders`` into its own SQLite
database (table ``credits``), and parks a value that is not a number until the file
FIXED exists (the fix, deployed).

    python -m tests.console.billing ADDRESS DB FIXED [--ack-interval S]

``--ack-interval``: at most one ``ACK`` per S seconds (one hour: only the first commit
is reported, so a kill leaves the producer a position older than the database's)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3

import streamq


async def main(address: str, db: str, fixed: str, ack_interval: float) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS credits (seq INTEGER PRIMARY KEY, value TEXT)")

    def credit(tx: streamq.BlockingSQL, batch: streamq.Batch) -> None:
        for rec in batch:
            if not rec.value.isdigit() and not os.path.exists(fixed):
                raise ValueError(f"not a number: {rec.value!r}")
            tx.execute("INSERT INTO credits VALUES (?, ?)", (rec.seq, rec.value.decode()))

    async with streamq.Consumer(
        address,
        "orders",
        db=db,
        name="billing",
        on_failure=streamq.DeadLetter(),
        ack_interval=ack_interval,
    ) as consumer:
        print("consuming", flush=True)
        async for batch in consumer:
            await consumer.apply(batch, credit)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("db")
    parser.add_argument("fixed")
    parser.add_argument(
        "--ack-interval", type=float, default=streamq.ConsumerSettings().ack_interval
    )
    args = parser.parse_args()
    asyncio.run(main(args.address, args.db, args.fixed, args.ack_interval))
