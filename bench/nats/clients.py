"""nats-py's settings and helpers, the same in every workload's NATS processes.

Printed with every run (``SETTINGS``), as Kafka's client settings are.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import api

CONNECT: dict[str, Any] = {
    "connect_timeout": 5,
    "allow_reconnect": False,  # one loopback server: a lost connection is a failed run
    "pending_size": 2 * 1024 * 1024,  # nats-py's default outgoing buffer
}

# Throughput (pipe), as nats-py documents it: JetStream publish_async, acks collected as
# they come with a bound on how many may be outstanding; a pull consumer fetching batches
# of about 1 MB (the Kafka producer's batch.size, streamq's transaction), acked once per
# batch (ack_policy=all) after the batch's SQLite commit.
PUBLISH_THROUGHPUT: dict[str, Any] = {
    "publish": "publish_async",
    "publish_async_max_pending": 4000,  # nats-py's default bound on unacknowledged publishes
    # No per-publish wait_stall: nats-py then wraps every publish in a task, a loop turn
    # and a socket write each (40 % fewer publishes/s); the whole run has a deadline.
    "publish_deadline_s": 600.0,
}
FETCH_THROUGHPUT: dict[str, Any] = {
    "consumer": "pull, durable, from the sequence stored in SQLite",
    "fetch_bytes": 1_000_000,
    "fetch_max_messages": 5000,
    "fetch_timeout_s": 1.0,
    "ack_policy": "all",  # acking a batch's last message acks the batch
    "max_ack_pending": 100_000,  # above one batch, so fetches are never cut short
}

# Latency (latency): publish_async without waiting for its ack before the next record (as
# Kafka's produce with linger.ms=0); the ordered push consumer, which the NATS docs name
# for an application replaying a stream in order: the server pushes each message as it
# is stored, no pull round trip and no acks.
PUBLISH_LATENCY: dict[str, Any] = {
    "publish": "publish_async, flushed at once",
    "publish_async_max_pending": 4000,
}
CONSUMER_LATENCY: dict[str, Any] = {
    "consumer": "ordered push (ack_policy=none, flow_control)",
    "deliver_policy": "all",
}

SETTINGS = {
    "connect": CONNECT,
    "publish_throughput": PUBLISH_THROUGHPUT,
    "fetch_throughput": FETCH_THROUGHPUT,
    "publish_latency": PUBLISH_LATENCY,
    "consumer_latency": CONSUMER_LATENCY,
}


def fetch_size(record_bytes: int) -> int:
    """Messages per fetch: about ``fetch_bytes``, at most ``fetch_max_messages``."""
    per_fetch = int(FETCH_THROUGHPUT["fetch_bytes"]) // max(1, record_bytes)
    return max(1, min(int(FETCH_THROUGHPUT["fetch_max_messages"]), per_fetch))


@contextlib.asynccontextmanager
async def connected(url: str) -> AsyncIterator[Client]:
    """A connection on ``CONNECT``'s settings; at the end, what it has sent (the last acks)
    is flushed to the server, within a bound, before it closes."""
    client = await nats.connect(url, **CONNECT)
    try:
        yield client
    finally:
        if client.is_connected:
            with contextlib.suppress(Exception):
                await client.flush(timeout=5)
        await client.close()


async def add_stream(url: str, name: str) -> None:
    """A stream ``name`` on subject ``name``: FILE storage, one replica, no limits."""
    async with connected(url) as client:
        await client.jetstream().add_stream(
            name=name,
            subjects=[name],
            storage=api.StorageType.FILE,
            num_replicas=1,
            retention=api.RetentionPolicy.LIMITS,
        )


async def delete_stream(url: str, name: str) -> None:
    async with connected(url) as client:
        await client.jetstream().delete_stream(name)


async def round_trip(url: str, name: str, count: int) -> int:
    """Publish ``count`` messages to a new stream ``name`` and read them back: how many."""
    await add_stream(url, name)
    async with connected(url) as client:
        js = client.jetstream()
        for i in range(count):
            await js.publish(name, f"message {i}".encode())
        sub = await js.pull_subscribe(name, stream=name)
        got: list[bytes] = []
        while len(got) < count:
            got += [m.data for m in await sub.fetch(count - len(got), timeout=5)]
        return len(got)


def ack_checker(failed: list[BaseException]) -> Callable[[asyncio.Future[api.PubAck]], None]:
    """A ``publish_async`` ack callback noting every failed (or cancelled) publish in
    ``failed``: the run is checked once its acks are in."""

    def check(ack: asyncio.Future[api.PubAck]) -> None:
        error = ack.exception() if not ack.cancelled() else asyncio.CancelledError()
        if error is not None:
            failed.append(error)

    return check
