"""streamq's side of the fan-out workload: ``producer DB RATE SECONDS`` (serving, its
address on READY), ``publisher DB RATE SECONDS`` (``serve=False``, beside ``streamq serve
DB``) and ``consumers ADDRESS COUNT TOTAL [--by-second]`` (``Tally``'s)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import streamq
from streamq import _loop

from ..common import say, wait_line
from ..latency import schedule_start
from ..latency.streamq import STREAM, publish_paced
from ..measure import Latencies, Pacer
from . import Tally, on_stop


async def publish(producer: streamq.Producer, rate: float, seconds: float) -> None:
    """From GO: the records on schedule, then PUBLISHED with the rate reached and each
    record's publish latency (its transaction's, from the call to the commit)."""
    await asyncio.to_thread(wait_line, "GO")
    start = schedule_start()
    pacer, total = Pacer(rate, start), int(rate * seconds)
    publishes = Latencies()

    def on_commit(dues: list[float], late: float, took: float) -> None:
        publishes.record_micros([int(took * 1e6)] * len(dues))

    say("START", total)
    # No spinning: the embedded server's process CPU is the serving and publishing.
    await publish_paced(producer, pacer, total, on_commit, spin=False)
    elapsed = time.time() - start
    p50, p99, *_ = publishes.figures()
    say("PUBLISHED", total / elapsed, p50, p99)
    await asyncio.to_thread(wait_line, "STOP")


async def producer(db: str, rate: float, seconds: float) -> None:
    async with streamq.Producer(db, port=0) as served:
        await served.create_stream(STREAM)
        say("READY", served.address)
        await publish(served, rate, seconds)


async def publisher(db: str, rate: float, seconds: float) -> None:
    async with streamq.Producer(db, serve=False) as unserved:
        await unserved.create_stream(STREAM)
        say("READY")
        await publish(unserved, rate, seconds)


async def consumers(address: str, count: int, total: int, by_second: bool = False) -> None:
    tally = Tally(count, total, by_second)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def consume(index: int, c: streamq.Consumer) -> None:
        async for batch in c:
            if tally.receive(index, [r.value for r in batch], time.time()):
                return

    started = [streamq.Consumer(address, STREAM, start_seq=1) for _ in range(count)]
    for c in started:
        await c.start()
    say("READY")
    on_stop(lambda: loop.call_soon_threadsafe(stopped.set))
    receiving = asyncio.gather(*(consume(i, c) for i, c in enumerate(started)))
    stop = asyncio.ensure_future(stopped.wait())
    try:
        either: list[asyncio.Future[Any]] = [receiving, stop]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if receiving.done():
            receiving.result()  # a consumer's failure ends the run with its traceback
        tally.say_done()
    finally:
        receiving.cancel()
        stop.cancel()
        for c in started:
            await c.close()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "consumers":
        _loop.run(consumers(args[0], int(args[1]), int(args[2]), "--by-second" in args[3:]))
    elif role == "publisher":
        _loop.run(publisher(args[0], float(args[1]), float(args[2])))
    else:
        _loop.run(producer(args[0], float(args[1]), float(args[2])))
