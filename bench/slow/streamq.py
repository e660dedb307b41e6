"""streamq's side of the slow-consumer workload: ``producer DB RATE SECONDS`` and
``consumer ADDRESS DB RATE``."""

from __future__ import annotations

import asyncio
import sys
import time

import streamq
from streamq import _loop

from ..common import say, wait_line
from ..measure import Pacer
from . import VALUE, report


async def producer(db: str, rate: float, seconds: float) -> None:
    async with streamq.Producer(db, port=0) as served:
        await served.create_stream("slow")
        say("READY", served.address)
        await asyncio.to_thread(wait_line, "GO")
        pacer, total = Pacer(rate, clock=time.monotonic), int(rate * seconds)
        while pacer.taken < total:
            due = min(pacer.owed(), total - pacer.taken)
            if due > 0:
                async with served.transaction() as tx:
                    await tx.publish_many("slow", [VALUE] * due)
                pacer.record(due)
            await asyncio.sleep(max(0.001, pacer.wait()))
        report(pacer, seconds)
        await asyncio.to_thread(wait_line, "STOP")


async def consumer(address: str, db: str, rate: float) -> None:
    async with streamq.Consumer(address, "slow", db=db, name="slow", queue_batches=4) as c:
        assert c._db is not None
        await c._db.execute("CREATE TABLE IF NOT EXISTS applied (seq INTEGER, value BLOB)")
        say("READY")
        pacer = Pacer(rate, clock=time.monotonic)
        async for batch in c:
            async with c.transaction(batch) as tx:
                await tx.executemany(
                    "INSERT INTO applied VALUES (?, ?)", [(r.seq, r.value) for r in batch]
                )
            pacer.record(len(batch))
            await asyncio.sleep(pacer.wait())


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        _loop.run(producer(args[0], float(args[1]), float(args[2])))
    else:
        _loop.run(consumer(args[0], args[1], float(args[2])))
