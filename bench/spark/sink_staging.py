"""How the Spark sink's executors should hand rows over: the measurement behind its choice.

(a) shipping: the sink as it is (``spark_source.sink``), rows in the commit messages;
(b) staging: each task attempt inserts its rows into a staging table of the producer's
database, keyed by (attempt, partition, row), and the driver's commit moves the committed
attempts' rows into the log (read back, numbered and encoded by the same append path) and
deletes them, in one transaction.

``python -m bench.spark.sink_staging [--rows N]``: rows/s of a batch write of N rows with
100-byte values into a SQLite producer database, at 1 and 4 partitions, a local[4] session.
Not part of ``python -m bench``: it only backs the choice the sink's docstring explains.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

import streamq
from spark_source.session import local_spark
from streamq.engines import for_connection
from streamq.records import DEFAULT_MAX_RECORD_SIZE, CheckedRecord

STAGING = "spark_streamq_staging"


@dataclass
class Staged(WriterCommitMessage):
    partition: int
    attempt: str


class StagingWriter(DataSourceArrowWriter):
    def __init__(self, db: str) -> None:
        self.db = db

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        attempt = str(uuid.uuid4())
        conn = sqlite3.connect(self.db, timeout=60, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            n = 0
            for batch in iterator:
                keys = batch.column("key").to_pylist()
                values = batch.column("value").to_pylist()
                conn.executemany(
                    f"INSERT INTO {STAGING} VALUES (?, ?, ?, ?, ?)",
                    [
                        (attempt, partition, n + i, k.encode(), v.encode())
                        for i, (k, v) in enumerate(zip(keys, values, strict=True))
                    ],
                )
                n += len(values)
            conn.execute("COMMIT")
        finally:
            conn.close()
        return Staged(partition, attempt)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        staged = sorted((m for m in messages if isinstance(m, Staged)), key=lambda m: m.partition)
        conn = sqlite3.connect(self.db, timeout=60, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            engine, dbapi = for_connection(conn)
            now = int(time.time() * 1000)
            for message in staged:
                rows = conn.execute(
                    f"SELECT key, value FROM {STAGING} WHERE attempt = ? ORDER BY n",
                    (message.attempt,),
                ).fetchall()
                records: list[CheckedRecord] = [(value, key, {}, now) for key, value in rows]
                engine.append(dbapi, "bench", records, max_record_size=DEFAULT_MAX_RECORD_SIZE)
                conn.execute(f"DELETE FROM {STAGING} WHERE attempt = ?", (message.attempt,))
            conn.execute("COMMIT")
        finally:
            conn.close()


class StagingSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "streamq_staging"

    def writer(self, schema: StructType, overwrite: bool) -> StagingWriter:
        return StagingWriter(self.options["db"])


def _database(folder: Path, name: str) -> str:
    db = str(folder / f"{name}-{uuid.uuid4().hex[:8]}.db")
    with streamq.SyncProducer(db, serve=False):
        pass
    with sqlite3.connect(db) as conn:
        conn.execute(
            f"CREATE TABLE {STAGING} (attempt TEXT, partition INTEGER, n INTEGER, key BLOB, "
            "value BLOB, PRIMARY KEY (attempt, n))"
        )
    conn.close()
    return db


def measure(spark: Any, folder: Path, rows: int, partitions: int) -> dict[str, float]:
    df = spark.range(0, rows, 1, partitions).selectExpr(
        "CAST(id AS STRING) AS key", "LPAD(CAST(id AS STRING), 100, 'x') AS value"
    )
    rates = {}
    for how, source in (("shipping", "streamq"), ("staging", "streamq_staging")):
        db = _database(folder, f"{how}-{partitions}")
        writer = df.write.format(source).mode("append").option("db", db)
        if source == "streamq":
            writer = writer.option("stream", "bench")
        started = time.perf_counter()
        writer.save()
        rates[how] = rows / (time.perf_counter() - started)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    spark = local_spark("sink-staging", master="local[4]")
    spark.dataSource.register(StagingSource)
    try:
        with tempfile.TemporaryDirectory() as folder:
            measure(spark, Path(folder), 20_000, 2)  # warm-up: the JVM's first write
            for partitions in (1, 4):
                for round_ in range(2):
                    rates = measure(spark, Path(folder), args.rows, partitions)
                    shown = ", ".join(f"{how} {rate:,.0f} rows/s" for how, rate in rates.items())
                    print(f"{partitions} partition(s), round {round_ + 1}: {shown}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
