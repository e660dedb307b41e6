"""What the Spark workload's two sources share: timing an AvailableNow query, and the
micro-batch latency measurement (a paced publisher, a ``foreachBatch`` sink)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..measure import Latencies, Pacer

RECORD = b"v" * 100
TICK = 0.01  # s between the publisher's batches
WARMUP = 3.0  # s of micro-batches not counted (query start-up)


def time_query(spark: Any, reader: Any, checkpoint: Path) -> float:
    started = time.perf_counter()
    query = (
        reader.load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    if not query.awaitTermination(1800):
        query.stop()
        raise TimeoutError("AvailableNow query did not finish in 30 minutes")
    rows: int = sum(p["numInputRows"] for p in query.recentProgress)
    return rows / (time.perf_counter() - started)


def paced(rate: float, seconds: float, send: Callable[[int], None]) -> int:
    """Call ``send(count)`` every TICK with the records due by then, for ``seconds``;
    returns the publish time (ms) of the last batch."""
    pacer, total, last_ms = Pacer(rate, clock=time.monotonic), int(rate * seconds), 0
    while pacer.taken < total:
        due = min(total - pacer.taken, pacer.owed())
        if due > 0:
            last_ms = int(time.time() * 1000)
            send(due)
            pacer.record(due)
        time.sleep(TICK)  # pacing a load generator, not synchronising a test
    return last_ms


class Sink:
    """foreachBatch: records each row's publish-to-visible latency, in microseconds."""

    def __init__(self, after: float) -> None:
        self.after = after  # epoch seconds; rows published earlier are start-up
        self.latencies = Latencies()
        self.newest_ms = 0  # the newest publish time seen

    def __call__(self, df: Any, batch_id: int) -> None:
        published = [row[0] for row in df.selectExpr("unix_millis(timestamp)").collect()]
        now = time.time()
        self.newest_ms = max([self.newest_ms, *published])
        self.latencies.record([ms / 1000 for ms in published if ms >= self.after * 1000], now)


def measure(spark: Any, reader: Any, checkpoint: Path, publish: Callable[[], int]) -> Sink:
    sink = Sink(after=time.time() + WARMUP)
    query = (
        reader.load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        last_ms = publish()
        deadline = time.monotonic() + 60
        while sink.newest_ms < last_ms and query.isActive and time.monotonic() < deadline:
            time.sleep(0.1)  # until the last batch published is visible in the sink
    finally:
        query.stop()
    return sink
