"""The Spark workload's driver: rows/s into a noop sink with Trigger.AvailableNow.

streamq: N producers, 16 to a process (``host.py``), read directly by the ``streamq`` source.
Kafka: one topic with N partitions holding the same records, read by Spark's own Kafka
source (``spark-sql-kafka-0-10``, resolved through Maven). N sweeps 1, 4, 16, 64.
Then micro-batch latency, publish to visible in the sink (``common.measure``), with the
median of each micro-batch phase (Spark's ``durationMs``) to say where the time goes.

``python -m bench.spark.run [--quick] [--repeats N] [--no-kafka] [--producers 1,4]
[--rows N] [--no-ingest] [--no-latency] [--save-as NAME]``: the whole workload (saved like
``python -m bench --only spark``), or part of it at a chosen size (printed, and saved as
``bench/results/NAME.json`` with ``--save-as``: the sweep at scale is ``spark_many``).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from ..common import (
    Series,
    alternating,
    comparison_table,
    console,
    save,
)
from . import kafka, streamq
from .common import PHASES, WARMUP, Latency

SWEEP = [1, 4, 16, 64]
LATENCY_FULL = (1000, 20.0)  # records/s, seconds
LATENCY_QUICK = (500, 6.0)
# Latency is measured as the source reads by default (executors, "streamq") and in its
# mode for small micro-batches from many producers (readOnDriver) too.
ON_DRIVER = "streamq readOnDriver"
PERCENTILES = {"p50": 50.0, "p99": 99.0, "max": 100.0}


# Rows of each source's untimed first query (16 producers, or partitions).
WARM_UP_ROWS = 1_000_000
WARM_UP_QUICK = 20_000


def _warm_up(spark: Any, broker: Any | None, rows: int) -> None:
    """One untimed query per source first, large enough that Spark's JVM has compiled each
    source's path (class loading, then the JIT), which would be charged to whichever source
    ran first: 4,096,000 rows from 256 producers took 5.7 to 6.1 s as a session's first
    large query, 4.4 to 4.5 s after one of 1,000,000 rows (streamq, 2026-12-05)."""
    with tempfile.TemporaryDirectory() as folder:
        streamq.ingest(spark, Path(folder), 16, rows)
    if broker is not None:
        with tempfile.TemporaryDirectory() as folder:
            kafka.ingest(spark, broker, Path(folder), 16, rows)


def _latency_run(
    spark: Any, broker: Any | None, system: str, rate: float, seconds: float
) -> Latency:
    with tempfile.TemporaryDirectory() as folder:
        if system == "kafka":
            return kafka.latency(spark, broker, Path(folder), rate, seconds)
        return streamq.latency(spark, Path(folder), rate, seconds, system == ON_DRIVER)


def _latency(
    spark: Any, broker: Any | None, systems: list[str], quick: bool, repeats: int
) -> tuple[list[Series], list[Series]]:
    """Percentiles of publish -> visible, and the median ms of each micro-batch phase."""
    rate, seconds = LATENCY_QUICK if quick else LATENCY_FULL
    systems = [*systems, ON_DRIVER]
    for system in systems:
        # Not counted: the session's first foreachBatch starts Py4J's callback server, and
        # each way of reading has its first micro-batch (class loading, JIT) to pay.
        _latency_run(spark, broker, system, *LATENCY_QUICK)
    series = {
        (system, name): Series(system, f"{rate:,}/s {name}", "ms")
        for system in systems
        for name in PERCENTILES
    }
    phases = {
        (system, name): Series(system, name, "ms")
        for system in systems
        for name in (*PHASES, "triggerExecution")
    }
    for system in alternating(systems, repeats):
        run = _latency_run(spark, broker, system, rate, seconds)
        histogram = run.sink.latencies.histogram
        for name, percentile in PERCENTILES.items():
            value = histogram.get_value_at_percentile(percentile) / 1000
            series[system, name].values.append(value)
        for name, ms in run.phases.items():
            phases[system, name].values.append(ms)
    return list(series.values()), [s for s in phases.values() if s.values]


def phase_table(title: str, phases: list[Series]) -> Table:
    table = Table(title=title)
    systems = list(dict.fromkeys(s.system for s in phases))
    for column in ("phase", *systems):
        table.add_column(column, justify="right")
    by_phase: dict[str, dict[str, float]] = {}
    for s in phases:
        by_phase.setdefault(s.case, {})[s.system] = s.median
    for phase, medians in by_phase.items():
        table.add_row(phase, *(f"{medians.get(system, 0):,.0f} ms" for system in systems))
    return table


def spark_session(with_kafka: bool, master: str = "local[2]") -> Any:
    from spark_source.session import local_spark

    jars = None
    if with_kafka:
        from ..kafka.broker import spark_kafka_jars

        jars = [str(p) for p in spark_kafka_jars()]
    return local_spark("streamq bench", driver_memory="2g", jars=jars, master=master)


def run(
    broker: Any | None,
    quick: bool,
    repeats: int,
    *,
    sweep: list[int] | None = None,
    total: int | None = None,
    ingest: bool = True,
    latency: bool = True,
    saved: bool = True,
    name: str = "spark",
    master: str = "local[2]",
) -> dict[str, Any]:
    sweep = SWEEP if sweep is None else sweep
    total = total or (200_000 if quick else 2_000_000)
    systems = ["streamq"] + (["kafka"] if broker is not None else [])
    spark = spark_session(broker is not None, master)
    series: list[Series] = []
    percentiles: list[Series] = []
    phases: list[Series] = []
    try:
        _warm_up(spark, broker, WARM_UP_QUICK if quick else WARM_UP_ROWS)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("spark", total=len(sweep) * repeats * len(systems))
            for n in sweep if ingest else []:
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
        if latency:
            percentiles, phases = _latency(spark, broker, systems, quick, repeats)
    finally:
        spark.stop()
    rate, seconds = LATENCY_QUICK if quick else LATENCY_FULL
    if series:
        title = f"spark: rows/s into a noop sink, AvailableNow, {total:,} rows of 100 B"
        console.print(comparison_table(title, series))
    if percentiles:
        title = (
            f"spark: publish to visible in a foreachBatch sink, ms, {rate:,} records/s for "
            f"{seconds:.0f} s (first {WARMUP:.0f} s not counted)"
        )
        console.print(comparison_table(title, percentiles, better="lower"))
        console.print(phase_table("spark: median ms per micro-batch phase", phases))
    results = {
        "rows": total,
        "series": [asdict(s) for s in series],
        "latency": {
            "rate": rate,
            "seconds": seconds,
            "series": [asdict(s) for s in percentiles],
            "phases": [asdict(s) for s in phases],
        },
    }
    if saved:
        save(name, results, quick, partial=broker is None)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spark.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--repeats", type=int, default=None, help="runs per case (3; quick: 1)")
    parser.add_argument("--no-kafka", action="store_true", help="streamq alone (no broker)")
    parser.add_argument("--producers", help="comma-separated producer counts (not saved)")
    parser.add_argument("--rows", type=int, help="rows per ingest case (not saved)")
    parser.add_argument("--no-ingest", action="store_true", help="latency only (not saved)")
    parser.add_argument("--no-latency", action="store_true", help="ingest only (not saved)")
    parser.add_argument(
        "--save-as", metavar="NAME", help="save a partial run as bench/results/NAME.json"
    )
    parser.add_argument(
        "--cluster",
        type=int,
        metavar="WORKERS",
        help="on a standalone cluster of WORKERS workers of one core each, started for the "
        "run (2: as many cores as local[2]), both sources on it",
    )
    parser.add_argument("--master", help="on this Spark master (spark://HOST:PORT)")
    args = parser.parse_args(argv)
    sweep = [int(n) for n in args.producers.split(",")] if args.producers else None
    partial = sweep is not None or args.rows or args.no_ingest or args.no_latency
    partial = partial or args.cluster or args.master
    with contextlib.ExitStack() as stack:
        master = args.master or "local[2]"
        if args.cluster:
            from .cluster import Cluster

            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            cluster = Cluster(folder, workers=args.cluster)
            stack.callback(cluster.close)
            master = cluster.master
        broker: Any = None
        if not args.no_kafka:
            from ..kafka.broker import KafkaBroker

            broker = stack.enter_context(KafkaBroker())
        run(
            broker,
            args.quick,
            args.repeats or (1 if args.quick else 3),
            sweep=sweep,
            total=args.rows,
            ingest=not args.no_ingest,
            latency=not args.no_latency,
            saved=not partial or args.save_as is not None,
            name=args.save_as or "spark",
            master=master,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
