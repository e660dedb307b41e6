"""streamq's side of the latency workload: ``producer DB RATE SECONDS DURABILITY`` and
``consumer ADDRESS TOTAL``.

The producer commits the records due by now in one ``run_in_transaction`` (one
``publish`` each, as the Kafka producer sends them); the consumer reports receipt latency.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import cast

import streamq
from streamq import _loop
from streamq.sql import Durability

from ..common import say, wait_line
from ..measure import Latencies, Pacer
from . import record_receipt, record_value, schedule_start

STREAM = "latency"

# What ``publish_paced`` reports of each commit: the records' due times, how late (s) the
# commit started after the first was due, how long (s) it took.
OnCommit = Callable[[list[float], float, float], None]


def _publish(tx: streamq.BlockingTransaction, values: list[bytes]) -> None:
    for value in values:  # one record each, as the Kafka producer sends them
        tx.publish(STREAM, value)


async def publish_paced(
    producer: streamq.Producer,
    pacer: Pacer,
    total: int,
    on_commit: OnCommit | None = None,
    *,
    spin: bool = True,
) -> None:
    """``total`` records on ``pacer``'s schedule, each commit taking every record due;
    ``spin`` as ``Pacer.until_due``'s."""
    while pacer.taken < total:
        count = min(total - pacer.taken, pacer.owed())
        if count > 0:
            first = pacer.taken
            dues = pacer.take(count)
            values = [record_value(due, n) for n, due in enumerate(dues, first)]
            began, late = time.perf_counter(), time.time() - dues[0]
            await producer.run_in_transaction(_publish, values)
            if on_commit is not None:
                on_commit(dues, late, time.perf_counter() - began)
        else:
            await pacer.until_due(spin)


async def producer(db: str, rate: float, seconds: float, durability: Durability) -> None:
    async with streamq.Producer(db, port=0, durability=durability) as served:
        await served.create_stream(STREAM)
        say("READY", served.address)
        await asyncio.to_thread(wait_line, "GO")
        pacer, total = Pacer(rate, schedule_start()), int(rate * seconds)
        say("START", total)
        await publish_paced(served, pacer, total)
        await asyncio.to_thread(wait_line, "STOP")


async def consumer(address: str, total: int) -> None:
    latencies = Latencies()
    async with streamq.Consumer(address, STREAM, start_seq=1) as c:
        say("READY")
        async for batch in c:
            record_receipt(latencies, [r.value for r in batch], time.time())
            if latencies.count >= total:
                break
    say("DONE", *latencies.figures())


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        _loop.run(producer(args[0], float(args[1]), float(args[2]), cast(Durability, args[3])))
    else:
        _loop.run(consumer(args[0], int(args[1])))
