"""NATS JetStream's side of the fan-out workload: ``producer URL STREAM RATE SECONDS`` and
``consumers URL STREAM COUNT TOTAL``.

The producer is the latency workload's (``publish_async``, not waiting for each ack
before the next record); each consumer is an ordered push consumer on a connection of its
own, as each streamq consumer has its own connection to the producer.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js import api

from streamq import _loop

from ..common import say, wait_line
from ..latency import schedule_start
from ..latency.nats import publish_paced, publisher
from ..measure import Latencies, Pacer
from ..nats.clients import ack_checker, connected
from . import Tally, on_stop


async def producer(url: str, stream: str, rate: float, seconds: float) -> None:
    failed: list[BaseException] = []
    check = ack_checker(failed)
    publishes = Latencies()

    def on_ack(sent: float, ack: asyncio.Future[api.PubAck]) -> None:
        publishes.record_micros([int((time.perf_counter() - sent) * 1e6)])
        check(ack)

    async with connected(url) as client:
        js = publisher(client)
        await js.stream_info(stream)
        say("READY")
        await asyncio.to_thread(wait_line, "GO")
        start = schedule_start()
        pacer, total = Pacer(rate, start), int(rate * seconds)
        say("START", total)
        await publish_paced(js, stream, pacer, total, on_ack, spin=False)  # as streamq's
        elapsed = time.time() - start
        if failed:
            raise RuntimeError(f"{len(failed)} publishes failed, the first: {failed[0]!r}")
        p50, p99, *_ = publishes.figures()
        say("PUBLISHED", total / elapsed, p50, p99)
        await asyncio.to_thread(wait_line, "STOP")


async def consumers(url: str, stream: str, count: int, total: int) -> None:
    tally = Tally(count, total)
    finished = asyncio.Event()
    loop = asyncio.get_running_loop()

    def receiver(index: int) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(message: Msg) -> None:
            if tally.receive(index, [message.data], time.time()) and tally.all_complete:
                finished.set()

        return on_message

    async with contextlib.AsyncExitStack() as stack:
        for index in range(count):
            client = await stack.enter_async_context(connected(url))
            await client.jetstream().subscribe(
                stream,
                stream=stream,
                cb=receiver(index),
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.ALL,
            )
        say("READY")
        on_stop(lambda: loop.call_soon_threadsafe(finished.set))
        await finished.wait()
        tally.say_done()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        _loop.run(producer(args[0], args[1], float(args[2]), float(args[3])))
    else:
        _loop.run(consumers(args[0], args[1], int(args[2]), int(args[3])))
