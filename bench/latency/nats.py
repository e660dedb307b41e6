"""NATS JetStream's side of the latency workload: ``producer URL STREAM RATE SECONDS`` and
``consumer URL STREAM TOTAL``, on nats-py's low-latency settings (``bench.nats.clients``).

The producer publishes every record due with ``publish_async`` and goes on without
waiting for its ack (as the Kafka producer's ``produce``); the consumer is an ordered push
consumer, the server pushing each record as it is stored.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from functools import partial

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from streamq import _loop

from ..common import say, wait_line
from ..measure import Latencies, Pacer
from ..nats.clients import PUBLISH_LATENCY, ack_checker, connected
from . import record_receipt, record_value, schedule_start

DEADLINE = 600.0  # s: the parent gives up on a run after as long


# Called with the time (``time.perf_counter``) a record was published, then its ack.
OnAck = Callable[[float, asyncio.Future[api.PubAck]], None]


async def publish_paced(
    js: JetStreamContext,
    stream: str,
    pacer: Pacer,
    total: int,
    on_ack: OnAck,
    *,
    spin: bool = True,
) -> None:
    """``total`` records on ``pacer``'s schedule, each published once it is due without
    waiting for its ack; then every ack awaited, within ``DEADLINE`` in all. ``spin`` as
    ``Pacer.until_due``'s."""

    async def paced() -> None:
        while pacer.taken < total:
            count = min(total - pacer.taken, pacer.owed())
            if count > 0:
                first = pacer.taken
                for number, due in enumerate(pacer.take(count), first):
                    ack = await js.publish_async(stream, record_value(due, number))
                    ack.add_done_callback(partial(on_ack, time.perf_counter()))
                await asyncio.sleep(0)  # nats-py's flusher writes them now
            else:
                await pacer.until_due(spin)  # as streamq's producer
        await js.publish_async_completed()

    await asyncio.wait_for(paced(), DEADLINE)


def publisher(client: Client) -> JetStreamContext:
    """The JetStream context the producers publish with (``PUBLISH_LATENCY``)."""
    return client.jetstream(publish_async_max_pending=PUBLISH_LATENCY["publish_async_max_pending"])


async def producer(url: str, stream: str, rate: float, seconds: float) -> None:
    failed: list[BaseException] = []
    check = ack_checker(failed)

    async with connected(url) as client:
        js = publisher(client)
        await js.stream_info(stream)
        say("READY")
        await asyncio.to_thread(wait_line, "GO")
        pacer, total = Pacer(rate, schedule_start()), int(rate * seconds)
        say("START", total)
        await publish_paced(js, stream, pacer, total, lambda sent, ack: check(ack))
        if failed:
            raise RuntimeError(f"{len(failed)} publishes failed, the first: {failed[0]!r}")
        await asyncio.to_thread(wait_line, "STOP")


async def consumer(url: str, stream: str, total: int) -> None:
    latencies = Latencies()
    received = asyncio.Event()

    async def on_message(message: Msg) -> None:
        record_receipt(latencies, [message.data], time.time())
        if latencies.count >= total:
            received.set()

    async with connected(url) as client:
        js = client.jetstream()
        sub = await js.subscribe(
            stream,
            stream=stream,
            cb=on_message,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
        )
        say("READY")
        await asyncio.wait_for(received.wait(), DEADLINE)
        await sub.unsubscribe()
    say("DONE", *latencies.figures())


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "producer":
        _loop.run(producer(args[0], args[1], float(args[2]), float(args[3])))
    else:
        _loop.run(consumer(args[0], args[1], int(args[2])))
