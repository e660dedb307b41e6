"""Workload 5, spark: rows/s into a noop sink with Trigger.AvailableNow.

streamq: N producer processes (``streamq serve``), read directly by the ``streamq`` source.
Kafka: one topic with N partitions holding the same records, read by Spark's own Kafka
source (``spark-sql-kafka-0-10``, resolved through Maven). N sweeps 1, 4, 16, 64.
Then micro-batch latency, publish to visible in the sink (``spark_latency``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import Progress

import streamq

from . import spark_latency
from .common import (
    Series,
    alternating,
    bar_chart,
    comparison_table,
    console,
    results_dir,
    save,
)

SWEEP = [1, 4, 16, 64]
LATENCY_FULL = (1000, 20.0)  # records/s, seconds
LATENCY_QUICK = (500, 6.0)
PERCENTILES = {"p50": 50.0, "p99": 99.0, "max": 100.0}
RECORD = b"v" * 100


def _fill_producers(folder: Path, producers: int, total: int) -> list[Path]:
    paths = []
    for i in range(producers):
        path = folder / f"p{i}.db"
        count = total // producers
        with streamq.SyncProducer(str(path), serve=False) as producer:
            for first in range(0, count, 50_000):
                with producer.transaction() as tx:
                    tx.publish_many("ingest", [RECORD] * min(50_000, count - first))
        paths.append(path)
    return paths


class Fleet:
    """``streamq serve`` processes, one per database."""

    def __init__(self, paths: list[Path]) -> None:
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "streamq", "serve", str(path), "--port", "0"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for path in paths
        ]
        self.endpoints = []
        for process in self.processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line.startswith("serving producer"):
                raise RuntimeError(f"streamq serve failed: {line!r}")
            self.endpoints.append(line.rsplit(" on ", 1)[1].strip())

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.communicate(timeout=30)


def _time_query(spark: Any, reader: Any, checkpoint: Path) -> float:
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


def run_streamq(spark: Any, folder: Path, producers: int, total: int) -> float:
    fleet = Fleet(_fill_producers(folder, producers, total))
    try:
        reader = (
            spark.readStream.format("streamq")
            .option("endpoints", ",".join(fleet.endpoints))
            .option("stream", "ingest")
            .option("startingOffsets", "earliest")
        )
        return _time_query(spark, reader, folder / "ck")
    finally:
        fleet.stop()


def _fill_topic(broker: Any, topic: str, partitions: int, total: int) -> None:
    from confluent_kafka import Producer

    broker.create_topic(topic, partitions)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 20})
    for i in range(total):
        while True:
            try:
                producer.produce(topic, RECORD, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(300)


def run_kafka(spark: Any, broker: Any, folder: Path, partitions: int, total: int) -> float:
    topic = f"ingest-{uuid.uuid4().hex[:8]}"
    _fill_topic(broker, topic, partitions, total)
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
    )
    return _time_query(spark, reader, folder / "ck")


def _warm_up(spark: Any, broker: Any | None) -> None:
    """One small query per source first: the session's first query pays JVM start-up costs
    (class loading, JIT, Python workers) that would be charged to whichever system ran first."""
    with tempfile.TemporaryDirectory() as folder:
        run_streamq(spark, Path(folder), 1, 20_000)
    if broker is not None:
        with tempfile.TemporaryDirectory() as folder:
            run_kafka(spark, broker, Path(folder), 1, 20_000)


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
                sink = spark_latency.run_streamq(spark, Path(folder), rate, seconds)
            else:
                sink = spark_latency.run_kafka(spark, broker, Path(folder), rate, seconds)
        for name, percentile in PERCENTILES.items():
            value = sink.histogram.get_value_at_percentile(percentile) / 1000
            series[system, name].values.append(value)
    return list(series.values())


def spark_session(with_kafka: bool) -> Any:
    from spark_source.session import local_spark

    jars = None
    if with_kafka:
        from .kafka.broker import spark_kafka_jars

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
                            rate = run_streamq(spark, Path(folder), n, total)
                        else:
                            rate = run_kafka(spark, broker, Path(folder), n, total)
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
    bar_chart(
        results_dir(quick) / "spark.png",
        "Spark ingest rows/s (noop sink, local[2])",
        series,
        "rows/s",
    )
    rate, seconds = LATENCY_QUICK if quick else LATENCY_FULL
    console.print(
        comparison_table(
            f"spark: publish to visible in a foreachBatch sink, ms, {rate:,} records/s for "
            f"{seconds:.0f} s (first {spark_latency.WARMUP:.0f} s not counted)",
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
