"""streamq's side of the pipe workload: ``producer DB N SIZE DURABILITY`` and
``consumer ADDRESS DB N DURABILITY``.

The consumer applies every record into its own SQLite database; its position
is stored in the same transaction (streamq does that in ``Consumer.transaction``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import cast

import streamq
from streamq import _loop
from streamq.sql import Durability

from ..common import say, wait_line

TRANSACTION_RECORDS = 5000
TRANSACTION_BYTES = 1_000_000  # as the Kafka producer's batch.size: both send ~1 MB units


async def producer(db: str, count: int, size: int, durability: Durability) -> None:
    value = os.urandom(size)
    async with streamq.Producer(db, port=0, durability=durability) as p:
        await p.create_stream("pipe")
        say("READY", p.address)
        await asyncio.to_thread(wait_line, "GO")
        say("START", time.time())
        per_transaction = max(1, min(TRANSACTION_RECORDS, TRANSACTION_BYTES // size))
        for first in range(0, count, per_transaction):
            async with p.transaction() as tx:
                await tx.publish_many("pipe", [value] * min(per_transaction, count - first))
        say("PRODUCED", time.time())
        await asyncio.to_thread(wait_line, "STOP")


async def consumer(address: str, db: str, count: int, durability: Durability) -> None:
    async with streamq.Consumer(address, "pipe", db=db, name="bench", durability=durability) as c:
        assert c._db is not None
        await c._db.execute("CREATE TABLE IF NOT EXISTS applied (seq INTEGER, value BLOB)")
        say("READY")
        async for batch in c:
            async with c.transaction(batch) as tx:
                await tx.executemany(
                    "INSERT INTO applied VALUES (?, ?)", [(r.seq, r.value) for r in batch]
                )
            if batch.last_seq >= count:
                break
        say("DONE", time.time())


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    mode = cast(Durability, args[-1])
    if role == "producer":
        _loop.run(producer(args[0], int(args[1]), int(args[2]), mode))
    else:
        _loop.run(consumer(args[0], args[1], int(args[2]), mode))
