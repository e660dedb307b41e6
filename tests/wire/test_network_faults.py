"""Network faults between consumer and producer, through tests/faultproxy.py on loopback.

For each toxic: a producer publishes (some transactions rolled back) while a consumer,
connected through the proxy, applies with the oracle's non-idempotent effect; the toxic
strikes for a while, then clears. The consumer must catch up with the head within a
bounded time after the fault clears, and the oracle must find nothing: no record lost,
duplicated, reordered or phantom, position and sum in agreement with the effects.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from streamq import Consumer

from ..conftest import wait_for
from ..faultproxy import (
    Bandwidth,
    FaultProxy,
    Latency,
    LimitData,
    ResetAfterChunk,
    ResetPeer,
    Slicer,
    SlowClose,
    Stall,
    Toxic,
)
from ..pipeline import NAME, STREAM, Pipeline

HEARTBEAT_TIMEOUT = 0.5
CONNECT_TIMEOUT = 0.5
RECOVERY_BOUND = 10.0  # seconds from the fault clearing to the consumer reaching the head

# A link that breaks every connection: reconnects back off (0.05 s doubling), not a storm.
MAX_FLAPPING_RECONNECTS = 12

# name -> (toxic, how long it holds, the proxy statistic showing it struck, breaks connections)
TOXICS: dict[str, tuple[Callable[[], Toxic], float, str, bool]] = {
    "latency": (lambda: Latency(0.05, jitter=0.04), 0.4, "delayed chunks", False),
    "bandwidth": (lambda: Bandwidth(20_000), 0.4, "throttled bytes", False),
    "slicer": (lambda: Slicer(1), 0.4, "slices", False),
    "stall": (lambda: Stall(), 1.0, "stalled chunks", True),
    "reset mid-frame": (lambda: ResetPeer(after=150), 0.5, "resets", True),
    "close after N bytes": (lambda: LimitData(after=150), 0.5, "limited closes", True),
    "slow close": (lambda: SlowClose(1.0), 0.3, "slow closes", True),
}


def proxied_consumer(proxy: FaultProxy, pipeline: Pipeline) -> Consumer:
    """The pipeline's consumer, through ``proxy``: quick to see a connection lost, and
    connecting again (its first connection too) for as long as a recovery may take, so
    that a loaded machine's slow first SERVER_HELLO is waited for, not a failure."""
    return Consumer(
        proxy.address,
        STREAM,
        db=pipeline.consumer_db,
        name=NAME,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        connect_timeout=CONNECT_TIMEOUT,
        reconnect_timeout=RECOVERY_BOUND,
    )


@pytest.mark.parametrize("name", list(TOXICS))
async def test_consumer_recovers_from_network_fault(
    tmp_path: Path, name: str, figures: Callable[[str], None]
) -> None:
    make_toxic, hold, statistic, reconnects = TOXICS[name]
    pipeline = Pipeline(tmp_path, seed=zlib.crc32(name.encode()))
    producer = await pipeline.start_producer()
    try:
        async with FaultProxy("127.0.0.1", pipeline.port) as proxy:
            consumer = proxied_consumer(proxy, pipeline)
            async with consumer:
                applier = asyncio.create_task(pipeline.apply(consumer))
                try:
                    await pipeline.publish(10)
                    await wait_for(lambda: consumer.applied == producer.head(STREAM), 10)

                    proxy.toxic = make_toxic()
                    if name == "slow close":  # a close to slow down: the producer restarts
                        await producer.close()
                        producer = await pipeline.start_producer()
                    deadline = time.monotonic() + hold
                    while time.monotonic() < deadline:
                        await pipeline.publish(1, pause=0.02)
                    proxy.toxic = None
                    cleared = time.monotonic()

                    await pipeline.publish(5)
                    await wait_for(
                        lambda: consumer.applied == producer.head(STREAM),
                        RECOVERY_BOUND,
                        f"the consumer to catch up after {name}",
                    )
                    recovery = time.monotonic() - cleared
                finally:
                    applier.cancel()
                    await asyncio.gather(applier, return_exceptions=True)
        assert proxy.stats[statistic] > 0, proxy.stats
        if reconnects:  # the fault broke connections (others may, on a loaded machine)
            assert consumer.reconnects > 0, proxy.stats
        assert consumer.reconnects <= MAX_FLAPPING_RECONNECTS, (consumer.reconnects, proxy.stats)
    finally:
        await producer.close()
    report = pipeline.check()
    figures(
        f"runs 1, faults injected {proxy.stats[statistic]} ({statistic}), "
        f"records checked {report.records}, anomalies {report.anomalies}; "
        f"{consumer.reconnects} reconnects, caught up {recovery:.2f} s after the fault cleared"
    )


async def test_a_first_connection_reset_between_hello_and_subscribe_is_retried(
    tmp_path: Path,
) -> None:
    """A producer gone just after its SERVER_HELLO, while a starting consumer reads its
    stored position: the consumer's SUBSCRIBE finds the connection closed (uvloop's
    transport raises there, asyncio's drops the write), and it connects again, as after
    any lost connection, instead of failing."""
    pipeline = Pipeline(tmp_path, seed=7)
    producer = await pipeline.start_producer()
    try:
        await pipeline.publish(3)
        async with FaultProxy("127.0.0.1", pipeline.port) as proxy:
            proxy.toxic = ResetAfterChunk()
            consumer = proxied_consumer(proxy, pipeline)
            starting = asyncio.create_task(consumer.start())
            try:
                await wait_for(
                    lambda: proxy.stats["resets"] >= 3 or starting.done(),
                    10,
                    "three connections reset after the hello",
                )
                assert not starting.done(), starting  # not failed, not connected: retrying
                proxy.toxic = None
                async with asyncio.timeout(10):
                    await starting
                applier = asyncio.create_task(pipeline.apply(consumer))
                await wait_for(lambda: consumer.applied == producer.head(STREAM), 10)
                applier.cancel()
                await asyncio.gather(applier, return_exceptions=True)
            finally:
                await consumer.close()
    finally:
        await producer.close()
    assert pipeline.check().anomalies == 0
