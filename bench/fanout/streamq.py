"""streamq's side of the fan-out workload: ``producer DB RATE SECONDS`` and
``consumers ADDRESS COUNT TOTAL``."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import streamq
from streamq import _loop

from ..common import say, wait_line
from ..latency import record_receipt, schedule_start
from ..latency.streamq import STREAM, publish_paced
from ..measure import Latencies, Pacer


def pin(cpu: int) -> None:
    """This process on ``cpu`` only (the producer alone on its core)."""
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {cpu})


async def producer(db: str, rate: float, seconds: float) -> None:
    pin(0)
    async with streamq.Producer(db, port=0) as served:
        await served.create_stream(STREAM)
        say("READY", served.address)
        await asyncio.to_thread(wait_line, "GO")
        start = schedule_start()
        pacer, total = Pacer(rate, start), int(rate * seconds)
        publishes = Latencies()

        def on_commit(dues: list[float], late: float, took: float) -> None:
            publishes.record_micros([int(took * 1e6)])

        say("START", total)
        cpu = time.process_time()
        await publish_paced(served, pacer, total, on_commit)
        elapsed, cpu = time.time() - start, time.process_time() - cpu
        p50, p99, *_ = publishes.figures()
        say("PUBLISHED", total / elapsed, cpu, publishes.count, p50, p99)
        await asyncio.to_thread(wait_line, "STOP")


async def consumers(address: str, count: int, total: int) -> None:
    pin(1)
    latencies = Latencies()

    async def consume(c: streamq.Consumer) -> None:
        async for batch in c:
            record_receipt(latencies, [r.value for r in batch], time.time())
            if batch.last_seq >= total:
                return

    started = [streamq.Consumer(address, STREAM, start_seq=1) for _ in range(count)]
    for c in started:
        await c.start()
    say("READY")
    try:
        await asyncio.gather(*(consume(c) for c in started))
    finally:
        for c in started:
            await c.close()
    say("DONE", latencies.count, latencies.encode())


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        _loop.run(producer(args[0], float(args[1]), float(args[2])))
    else:
        _loop.run(consumers(args[0], int(args[1]), int(args[2])))
