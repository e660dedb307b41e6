"""The Spark sink workload: the same rows written by a Spark streaming query into a
consumer's database, through streamq's sink or through Kafka's.

- streamq: Spark -> ``format("streamq")`` (a SQLite producer database, local mode) ->
  ``streamq serve`` -> a ``streamq.Consumer`` applying into its SQLite database;
- Kafka: Spark -> ``format("kafka")`` (spark-sql-kafka-0-10) -> a Kafka broker -> a
  confluent-kafka consumer applying into its SQLite database, its offsets with the rows.

The consumers (``consumers``) store each row with its creation time and when they
applied it; every figure is read from their databases afterwards:

- rows/s: ``rows`` rows of 100 bytes from the ``rate-micro-batch`` source, ``BATCH_ROWS``
  a micro-batch, in 1, 4 and 16 partitions (the Kafka topic has as many), from the first
  micro-batch's start (Spark's progress) to the last row applied by the consumer;
- latency: the ``rate`` source at ``LATENCY_RATE`` rows/s in 2 partitions, each row from
  its creation (the source's ``timestamp``: the time it was due) to its application;
- duplicates after a fault: a driver killed with kill -9 mid-query, restarted from its
  checkpoint (``faults``): the rows the consumer applied more than once.

``python -m bench.spark_sink.run [--quick] [--repeats N]`` (or ``python -m bench --only
spark_sink``): a Kafka broker is started for the run. Spark is local[2].
"""

from __future__ import annotations

import sqlite3
import tempfile
import uuid
from contextlib import closing
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.table import Table

from ..common import (
    LatencyRuns,
    Series,
    alternating,
    comparison_table,
    console,
    latency_table,
    percentile_series,
    save,
    wait_until,
    workload_main,
)
from ..measure import Latencies
from ..spark.common import PHASES
from ..spark.run import phase_table, spark_session
from .consumers import rows_from
from .targets import Target, start_query, target

SYSTEMS = ("streamq", "kafka")
SWEEP = (1, 4, 16)
ROWS = {True: 200_000, False: 500_000}  # rows per rows/s case (True: --quick)
BATCH_ROWS = 50_000  # rows per micro-batch in the rows/s cases
LATENCY_RATE = 2_000  # rows/s
LATENCY_SECONDS = {True: 6.0, False: 20.0}
LATENCY_PARTITIONS = 2
WARMUP = 3.0  # s of the latency run not counted (the query's first micro-batches)
APPLY_TIMEOUT = 300.0  # s for the consumer to apply every row


def wait_applied(where: Target, rows: int, query: Any) -> None:
    """Until the consumer applied ``rows`` distinct rows (the query failing: its error).
    Polled by the last rowid, counted only once that many are there: a poll that counts
    every row, 50 times a second, would take most of a core from the systems measured."""

    def done() -> bool:
        if query.exception() is not None:
            raise RuntimeError(f"{where.system}'s query failed: {query.exception()}")
        return where.rows() >= rows and where.applied()[1] >= rows

    wait_until(f"{rows} rows applied through {where.system}", done, APPLY_TIMEOUT, every=0.02)


def _progress_start(query: Any) -> float:
    """When micro-batch 0 started (epoch seconds), from the query's progress."""
    first = min(query.recentProgress, key=lambda p: p["batchId"])
    assert first["batchId"] == 0, "batch 0's progress was dropped"
    stamp: str = first["timestamp"]
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@dataclass
class Throughput:
    """One rows/s case's run: its rate, the rows applied twice, and the ms of each phase
    of its micro-batches that carried rows (Spark's ``durationMs``)."""

    rate: float
    duplicates: int
    phases: list[dict[str, int]]


def rows_per_second(
    spark: Any, where: Target, folder: Path, partitions: int, rows: int
) -> Throughput:
    """``rows`` rows in ``partitions`` partitions: rows/s from micro-batch 0's start to the
    consumer's last apply."""
    source = rows_from(
        spark, "rate-micro-batch", rows, rowsPerBatch=BATCH_ROWS, numPartitions=partitions
    )
    query = start_query(source, where.options, folder / f"ck-{uuid.uuid4().hex[:8]}")
    try:
        wait_applied(where, rows, query)
        started = _progress_start(query)
        phases = [p["durationMs"] for p in query.recentProgress if p["numInputRows"]]
    finally:
        query.stop()
    with closing(sqlite3.connect(where.consumer_db)) as conn:
        (last,) = conn.execute("SELECT max(applied_us) FROM applied").fetchone()
    total, distinct = where.applied()
    return Throughput(rows / (last / 1e6 - started), total - distinct, phases)


def latency(spark: Any, where: Target, folder: Path, rate: int, seconds: float) -> Latencies:
    """``rate`` rows/s for ``seconds``: each row's creation to its application (µs), the
    first ``WARMUP`` seconds' rows not counted."""
    rows = int(rate * seconds)
    source = rows_from(spark, "rate", rows, rowsPerSecond=rate, numPartitions=LATENCY_PARTITIONS)
    query = start_query(source, where.options, folder / f"ck-{uuid.uuid4().hex[:8]}")
    try:
        wait_applied(where, rows, query)
    finally:
        query.stop()
    with closing(sqlite3.connect(where.consumer_db)) as conn:
        (first,) = conn.execute("SELECT min(created_us) FROM applied").fetchone()
        cursor = conn.execute(
            "SELECT applied_us - created_us FROM applied WHERE created_us >= ?",
            (first + int(WARMUP * 1e6),),
        )
        latencies = Latencies()
        latencies.record_micros(value for (value,) in cursor)
    return latencies


def session() -> Any:
    """local[2] with Kafka's connector; every micro-batch's progress kept (batch 0's
    start is the rows/s cases' start)."""
    spark = spark_session(with_kafka=True)
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "100000")
    return spark


def _warm_up(spark: Any, broker: Any, folder: Path) -> None:
    """Each sink's first query, not counted: the JVM's class loading and JIT for its path,
    Python workers started."""
    for system in SYSTEMS:
        with target(system, broker, folder, 4) as where:
            rows_per_second(spark, where, folder, 4, BATCH_ROWS * 2)


def run(broker: Any, quick: bool, repeats: int, seed: int | None = None) -> dict[str, Any]:
    """Every case for both sinks, alternating which goes first; the faults last."""
    from .faults import FAULTS, fault_run

    if broker is None:
        raise SystemExit("the Spark sink workload compares with Kafka's sink: run it with Kafka")
    rows = ROWS[quick]
    rate, seconds = LATENCY_RATE, LATENCY_SECONDS[quick]
    rates = {
        (system, n): Series(system, f"{n} partition{'s' * (n > 1)}", "rows/s")
        for n in SWEEP
        for system in SYSTEMS
    }
    duplicates: dict[str, int] = dict.fromkeys(SYSTEMS, 0)
    batches: dict[str, list[dict[str, int]]] = {system: [] for system in SYSTEMS}
    runs: LatencyRuns = {}
    spark = session()
    try:
        with tempfile.TemporaryDirectory() as name:
            folder = Path(name)
            _warm_up(spark, broker, folder)
            for n in SWEEP:
                for system in alternating(SYSTEMS, repeats):
                    with target(system, broker, folder, n) as where:
                        done = rows_per_second(spark, where, folder, n, rows)
                    rates[system, n].values.append(done.rate)
                    duplicates[system] += done.duplicates
                    batches[system] += done.phases
                    console.print(f"{system}, {n} partitions: {done.rate:,.0f} rows/s")
            case = f"{rate:,} rows/s"
            for system in alternating(SYSTEMS, repeats):
                with target(system, broker, folder, LATENCY_PARTITIONS) as where:
                    figures = latency(spark, where, folder, rate, seconds).figures()
                runs.setdefault((system, case), []).append(figures[:4])
                console.print(f"{system} latency: p50 {figures[0]:,} p99 {figures[1]:,} µs")
    finally:
        spark.stop()
    with tempfile.TemporaryDirectory() as name:
        faults = [fault_run(system, broker, Path(name)) for system in SYSTEMS]
    title = f"spark sink: rows/s, Spark -> sink -> consumer DB, {rows:,} rows of 100 B"
    console.print(comparison_table(title, list(rates.values())))
    title = f"spark sink: row created -> applied by the consumer, µs, {rate:,} rows/s"
    console.print(latency_table(title, runs))
    phases = phase_series(batches)
    console.print(phase_table("spark sink: median ms per micro-batch phase (rows/s cases)", phases))
    console.print(fault_table(faults))
    results = {
        "rows": rows,
        "batch_rows": BATCH_ROWS,
        "latency": {"rate": rate, "seconds": seconds, "partitions": LATENCY_PARTITIONS},
        "series": [asdict(s) for s in rates.values()]
        + [asdict(s) for s in percentile_series(runs)],
        "phases": [asdict(s) for s in phases],
        "duplicates_without_faults": duplicates,
        "faults": [asdict(f) for f in faults],
        "fault_plan": FAULTS,
    }
    save("spark_sink", results, quick)
    return results


def phase_series(batches: dict[str, list[dict[str, int]]]) -> list[Series]:
    """Each phase's ms in every micro-batch that carried rows, per system."""
    return [
        Series(system, name, "ms", [float(d.get(name, 0)) for d in durations])
        for system, durations in batches.items()
        for name in (*PHASES, "triggerExecution")
        if durations
    ]


def fault_table(faults: list[Any]) -> Table:
    from .faults import FAULT_BATCH, KILLED_BATCH

    title = (
        f"spark sink: driver killed (kill -9) in micro-batch {KILLED_BATCH} "
        f"({FAULT_BATCH:,} rows), restarted from its checkpoint"
    )
    table = Table(title=title)
    columns = ("system", "batch's rows in the sink", "Spark committed it", "rows", "applied")
    for column in (*columns, "duplicates", "missing"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for f in faults:
        numbers = (f.rows, f.applied, f.duplicates, f.missing)
        committed = "yes" if f.spark_committed else "no"
        table.add_row(f.system, f"{f.in_sink:,}", committed, *(f"{n:,}" for n in numbers))
    return table


def main(argv: list[str] | None = None) -> int:
    return workload_main("python -m bench.spark_sink.run", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
