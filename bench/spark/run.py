"""The Spark workload's driver: rows/s into a noop sink with Trigger.AvailableNow.

streamq: N producer processes (``streamq serve``), read directly by the ``streamq`` source.
Kafka: one topic with N partitions holding the same records, read by Spark's own Kafka
source (``spark-sql-kafka-0-10``, resolved through Maven). N sweeps 1, 4, 16, 64.
Then micro-batch latency, publish to visible in the sink (``common.measure``).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import Progress

from ..common import (
    Series,
    alternating,
    comparison_table,
    console,
    save,
)
from . import kafka, streamq
from .common import WARMUP

SWEEP = [1, 4, 16, 64]
LATENCY_FULL = (1000, 20.0)  # records/s, seconds
LATENCY_QUICK = (500, 6.0)
PERCENTILES = {"p50": 50.0, "p99": 99.0, "max": 100.0}


def _warm_up(spark: Any, broker: Any | None) -> None:
    """One small query per source first: the session's first query pays JVM start-up costs
    (class loading, JIT, Python workers) that would be charged to whichever system ran first."""
    with tempfile.TemporaryDirectory() as folder:
        streamq.ingest(spark, Path(folder), 1, 20_000)
    if broker is not None:
        with tempfile.TemporaryDirectory() as folder:
            kafka.ingest(spark, broker, Path(folder), 1, 20_000)


def _latency(
    spark: Any, broker: Any | None, systems: list[str], quick: bool, repeats: int
) -> list[Series]:
    rate, seconds = LATENCY_QUICK if quick else LATENCY_FULL
    series = {
        (system, name): Series(system, f"{rate:,}/s {name}", "ms")
        for system in systems
        for name in PERCENTILES
    }
    for system in alternating(systems, repeats):
        with tempfile.TemporaryDirectory() as folder:
            if system == "streamq":
                sink = streamq.latency(spark, Path(folder), rate, seconds)
            else:
                sink = kafka.latency(spark, broker, Path(folder), rate, seconds)
        for name, percentile in PERCENTILES.items():
            value = sink.latencies.histogram.get_value_at_percentile(percentile) / 1000
            series[system, name].values.append(value)
    return list(series.values())


def spark_session(with_kafka: bool) -> Any:
    from spark_source.session import local_spark

    jars = None
    if with_kafka:
        from ..kafka.broker import spark_kafka_jars

        jars = [str(p) for p in spark_kafka_jars()]
    return local_spark("streamq bench", driver_memory="2g", jars=jars)


def run(broker: Any | None, quick: bool, repeats: int) -> dict[str, Any]:
    total = 200_000 if quick else 2_000_000
    systems = ["streamq"] + (["kafka"] if broker is not None else [])
    spark = spark_session(broker is not None)
    series: list[Series] = []
    latency: list[Series] = []
    try:
        _warm_up(spark, broker)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("spark", total=len(SWEEP) * repeats * len(systems))
            for n in SWEEP:
                rates = {
                    s: Series(s, f"{n} producers" if n > 1 else "1 producer", "rows/s")
                    for s in systems
                }
                for system in alternating(systems, repeats):
                    with tempfile.TemporaryDirectory() as folder:
                        if system == "streamq":
                            rate = streamq.ingest(spark, Path(folder), n, total)
                        else:
                            rate = kafka.ingest(spark, broker, Path(folder), n, total)
                    rates[system].values.append(rate)
                    progress.advance(task)
                series += rates.values()
        latency = _latency(spark, broker, systems, quick, repeats)
    finally:
        spark.stop()
    console.print(
        comparison_table(
            f"spark: rows/s into a noop sink, AvailableNow, {total:,} rows of 100 B", series
        )
    )
    rate, seconds = LATENCY_QUICK if quick else LATENCY_FULL
    console.print(
        comparison_table(
            f"spark: publish to visible in a foreachBatch sink, ms, {rate:,} records/s for "
            f"{seconds:.0f} s (first {WARMUP:.0f} s not counted)",
            latency,
            better="lower",
        )
    )
    results = {
        "rows": total,
        "series": [asdict(s) for s in series],
        "latency": {"rate": rate, "seconds": seconds, "series": [asdict(s) for s in latency]},
    }
    save("spark", results, quick)
    return results
