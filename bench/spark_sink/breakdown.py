"""Where the streamq sink's micro-batch goes: ``python -m bench.spark_sink.breakdown
[--partitions 1,4,16] [--batches N]``.

Two measures, in one process, of micro-batches of ``--rows`` rows (``run.BATCH_ROWS``, as
the rows/s cases) of the workload's 100 bytes (``consumers.VALUE_SQL``):

- **the sink's own work**, outside Spark, on one micro-batch cut into the partitions:
  each task's (``sink.converted``: its rows encoded as the log stores them), the size of
  its commit message as Spark pickles it, and the driver's commit (``sink.publish_once``:
  the marker and every record in one SQLite transaction, synced); medians of ``--batches``;
- **Spark's ``addBatch``** (its ``durationMs``, median over ``--batches`` micro-batches)
  in one ``local[2]`` session, for three sinks written the same rows:
  Spark's ``noop`` (in the JVM, nothing written), ``NullSink`` (a Python data source
  whose tasks read their rows and return an empty message: what any Python sink pays
  Spark, the floor under this one) and streamq's (no consumer).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StringType, StructField, StructType
from rich.table import Table

from ..common import console, int_list, wait_until
from .consumers import ROW_BYTES, rows_from
from .run import BATCH_ROWS
from .targets import STREAM, producer_db, start_query

SPARK_ROWS = 10_000  # rows per Arrow batch Spark hands a Python task (its default)


@dataclass
class Empty(WriterCommitMessage):
    rows: int


class NullWriter(DataSourceStreamArrowWriter):
    """Reads every row Spark sends, writes nothing, returns a message of a few bytes."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return Empty(sum(batch.num_rows for batch in iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to publish."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo."""


class NullSink(DataSource):
    @classmethod
    def name(cls) -> str:
        return "streamq_bench_null"

    def streamWriter(self, schema: StructType, overwrite: bool) -> NullWriter:
        return NullWriter()


def the_rows(rows: int, partitions: int, batch: int) -> list[list[pa.RecordBatch]]:
    """Micro-batch ``batch``'s ``rows`` as Spark hands them to each of ``partitions`` tasks:
    Arrow batches of their own (a slice of a larger one would pickle all of it)."""
    now_us = int(time.time() * 1e6)
    first, per_task = batch * rows, rows // partitions
    tasks = []
    for task in range(partitions):
        start, end = first + task * per_task, first + (task + 1) * per_task
        batches = []
        for at in range(start, end, SPARK_ROWS):
            ids = range(at, min(at + SPARK_ROWS, end))
            values = pa.array([f"{i},{now_us},".ljust(ROW_BYTES, ".") for i in ids])
            batches.append(pa.record_batch([values], names=["value"]))
        tasks.append(batches)
    return tasks


def sink_work(folder: Path, rows: int, partitions: int, batches: int) -> dict[str, float]:
    """The sink's own work on ``batches`` micro-batches (see the module docstring)."""
    from spark_source.sink import converted, publish_once, sink_settings

    schema = StructType([StructField("value", StringType())])
    settings = sink_settings({"db": producer_db(folder), "stream": STREAM}, schema)
    task_ms, sizes, commit_ms = [], [], []
    for batch in range(batches):
        parts = []
        for task in the_rows(rows, partitions, batch):
            started = time.perf_counter()
            parts.append(converted(settings, iter(task)))
            task_ms.append((time.perf_counter() - started) * 1000)
            sizes.append(len(pickle.dumps(parts[-1])))
        started = time.perf_counter()
        publish_once(settings, "breakdown", batch, parts)
        commit_ms.append((time.perf_counter() - started) * 1000)
    return {
        "task ms": statistics.median(task_ms),
        "message KiB": statistics.median(sizes) / 1024,
        "commit ms": statistics.median(commit_ms),
    }


def add_batch_ms(
    spark: Any, sink: dict[str, str], folder: Path, batch: tuple[int, int], batches: int
) -> float:
    """Spark's median ``addBatch`` over ``batches`` micro-batches of ``batch`` (rows,
    partitions) written into ``sink``."""
    per_batch, partitions = batch
    rows = per_batch * batches
    source = rows_from(
        spark, "rate-micro-batch", rows, rowsPerBatch=per_batch, numPartitions=partitions
    )
    query = start_query(source, sink, folder / f"ck-{uuid.uuid4().hex[:8]}")
    try:

        def done() -> bool:
            if query.exception() is not None:
                raise RuntimeError(f"the query failed: {query.exception()}")
            written: int = sum(p["numInputRows"] for p in query.recentProgress)
            return written >= rows

        wait_until(f"{rows} rows written", done, 600, every=0.05)
        progress = [p for p in query.recentProgress if p["numInputRows"]]
    finally:
        query.stop()
    return statistics.median(float(p["durationMs"]["addBatch"]) for p in progress)


def sinks(folder: Path) -> dict[str, dict[str, str]]:
    return {
        "noop (JVM)": {"format": "noop"},
        "Python, empty": {"format": NullSink.name()},
        "streamq": {"format": "streamq", "db": producer_db(folder), "stream": STREAM},
    }


def main(argv: list[str] | None = None) -> int:
    prog = "python -m bench.spark_sink.breakdown"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--partitions", type=int_list, default=[1, 4, 16])
    parser.add_argument("--batches", type=int, default=10, help="micro-batches a case (10)")
    parser.add_argument("--rows", type=int, default=BATCH_ROWS, help="rows a micro-batch")
    args = parser.parse_args(argv)
    from pyspark import cloudpickle

    from ..spark.run import spark_session

    shipped = sys.modules[__name__]  # the null sink, by value: bench is not installed
    cloudpickle.register_pickle_by_value(shipped)  # type: ignore[no-untyped-call]
    table = Table(title=f"spark sink: a micro-batch of {args.rows:,} rows, medians")
    for column in ("partitions", "task (encode)", "message", "commit", *sinks(Path("."))):
        table.add_column(column, justify="right")
    spark = spark_session(with_kafka=False)
    spark.dataSource.register(NullSink)
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "100000")
    try:
        with tempfile.TemporaryDirectory() as name:
            folder = Path(name)
            for sink in sinks(folder).values():  # warm-up: classes loaded, workers started
                add_batch_ms(spark, sink, folder, (args.rows, 4), 2)
            for n in args.partitions:
                work = sink_work(folder, args.rows, n, args.batches)
                spark_ms = {
                    label: add_batch_ms(spark, sink, folder, (args.rows, n), args.batches)
                    for label, sink in sinks(folder).items()
                }
                table.add_row(
                    str(n),
                    f"{work['task ms']:,.1f} ms",
                    f"{work['message KiB']:,.0f} KiB",
                    f"{work['commit ms']:,.1f} ms",
                    *(f"{ms:,.0f} ms" for ms in spark_ms.values()),
                )
    finally:
        spark.stop()
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
