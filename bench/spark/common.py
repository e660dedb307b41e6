"""What the Spark workload's two sources share: timing an AvailableNow query, and the
micro-batch latency measurement (a ``foreachBatch`` sink fed by the latency workload's
paced publisher, run as a process of its own)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from ..common import Child
from ..latency import DUE, START_DELAY
from ..measure import Latencies

RECORD = b"v" * 100
WARMUP = 3.0  # s of micro-batches not counted (query start-up)
# The parts of a micro-batch's ``durationMs`` worth comparing between sources (in order).
PHASES = ("latestOffset", "walCommit", "queryPlanning", "addBatch", "commitOffsets")


def noop_query(reader: Any, checkpoint: Path, **trigger: Any) -> Any:
    """``reader``'s stream started into a noop sink (what the source costs, nothing else)."""
    return (
        reader.load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(**trigger)
        .start()
    )


def time_query(spark: Any, reader: Any, checkpoint: Path) -> float:
    started = time.perf_counter()
    query = noop_query(reader, checkpoint, availableNow=True)
    if not query.awaitTermination(1800):
        query.stop()
        raise TimeoutError("AvailableNow query did not finish in 30 minutes")
    rows: int = sum(p["numInputRows"] for p in query.recentProgress)
    return rows / (time.perf_counter() - started)


class Sink:
    """foreachBatch: each row's latency from the due time its value carries (the latency
    workload's records: measured from the schedule, no coordinated omission) to when it is
    visible in the sink."""

    def __init__(self, after: float) -> None:
        self.after = after  # epoch seconds; rows due earlier are start-up
        self.latencies = Latencies()
        self.rows = 0  # every row seen, start-up included

    def __call__(self, df: Any, batch_id: int) -> None:
        dues = [DUE.unpack_from(row[0])[0] for row in df.select("value").collect()]
        now = time.time()
        self.rows += len(dues)
        self.latencies.record([due for due in dues if due >= self.after], now)


class Latency:
    """One latency run: the sink's figures and the query's micro-batch phases."""

    def __init__(self, sink: Sink, progress: list[dict[str, Any]]) -> None:
        self.sink = sink
        # Median ms per phase over the micro-batches that read rows (the newest ones Spark
        # keeps: 100 by default, after the warm-up at this workload's rates).
        batches = [p for p in progress if p["numInputRows"]]
        self.phases = {
            name: statistics.median(p["durationMs"].get(name, 0) for p in batches)
            for name in (*PHASES, "triggerExecution")
            if batches
        }


def measure(
    spark: Any, reader: Any, checkpoint: Path, publisher: Child, rate: float, seconds: float
) -> Latency:
    """Start the query on a fresh, empty stream (read from its earliest record), tell the
    publisher to go (``rate`` records/s for ``seconds``), and wait until the sink has seen
    every record."""
    total = int(rate * seconds)
    sink = Sink(after=time.time() + START_DELAY + WARMUP)
    query = (
        reader.option("startingOffsets", "earliest")
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        publisher.send("GO")
        publisher.expect("START")
        deadline = time.monotonic() + seconds + 60
        while sink.rows < total and query.isActive and time.monotonic() < deadline:
            time.sleep(0.1)  # until the last record published is visible in the sink
        progress = query.recentProgress
    finally:
        query.stop()
        publisher.send("STOP")
    if sink.rows < total:
        raise RuntimeError(f"the sink saw {sink.rows} of {total} records")
    return Latency(sink, progress)
