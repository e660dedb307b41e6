"""A Spark streaming query from streamq producers into a parquet sink, for
tests/spark/test_spark_exactly_once.py.

    query.py ENDPOINTS CHECKPOINT OUT [--available-now] [--stop-file FILE] [--dump FILE]
             [--max-seconds S] [--wait-go] [--max-per-trigger N]

Reads stream ``orders`` of every producer in ENDPOINTS (comma-separated
host:port) from the earliest seq, at most N records per micro-batch (500), and
writes it as parquet to OUT with its checkpoint in CHECKPOINT: a restarted
query continues from the checkpoint.

Prints ``STARTED id=<query id>`` once the query runs and ``BATCH <id>
rows=<n> end=<offsets>`` per completed micro-batch. ``--stop-file``: once
FILE exists, stop the query gracefully (``query.stop()``), print ``STOPPED``
and exit 0. ``--available-now``: read what the producers hold when the query
starts (``trigger(availableNow=True)``), print ``DONE`` and exit 0.
``--dump FILE``: afterwards, read OUT back with ``spark.read.parquet`` (which
reads only the files the sink committed in ``OUT/_spark_metadata``) and write
its rows to FILE as one parquet file; prints ``DUMPED rows=<n>``.
``--max-seconds``: give up (exit 3) if the query still runs after this long.
``--wait-go``: once the SparkSession runs, print ``SESSION`` and start the query only
when a line ``go`` comes on stdin (anything else, or its end: print ``ABANDONED``, exit
0), so that the JVM can start while another run still uses the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from spark_source.session import local_spark

STREAM = "orders"
POLL_SECONDS = 0.1


def session() -> SparkSession:
    return local_spark("streamq-exactly-once")


def start(spark: SparkSession, args: argparse.Namespace) -> StreamingQuery:
    source = (
        spark.readStream.format("streamq")
        .option("endpoints", args.endpoints)
        .option("stream", STREAM)
        .option("startingOffsets", "earliest")
        .option("maxRecordsPerTrigger", str(args.max_per_trigger))
        .load()
    )
    writer = source.writeStream.format("parquet").option("checkpointLocation", args.checkpoint)
    if args.available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="200 milliseconds")
    return writer.start(args.out)


def report_batches(query: StreamingQuery, reported: int) -> int:
    """Print the micro-batches completed since ``reported``; returns the last one printed."""
    for progress in query.recentProgress:
        # Progress without "addBatch" is an idle report: no batch ran.
        if progress.batchId <= reported or "addBatch" not in progress.durationMs:
            continue
        ends = [json.loads(source.endOffset) for source in progress.sources]
        print(
            f"BATCH {progress.batchId} rows={progress.numInputRows} "
            f"end={json.dumps(ends, sort_keys=True, separators=(',', ':'))}",
            flush=True,
        )
        reported = progress.batchId
    return reported


def dump(spark: SparkSession, out: str, path: str) -> None:
    rows = (
        spark.read.parquet(out)
        .selectExpr(
            "producer", "endpoint", "stream", "seq", "key", "value", "unix_millis(timestamp) AS ts"
        )
        .collect()
    )
    columns = ["producer", "endpoint", "stream", "seq", "key", "value", "ts"]
    types = [pa.string(), pa.string(), pa.string(), pa.int64(), pa.binary(), pa.binary()]
    types.append(pa.int64())
    table = pa.table(
        {
            name: pa.array([row[name] for row in rows], kind)
            for name, kind in zip(columns, types, strict=True)
        }
    )
    pq.write_table(table, path)
    print(f"DUMPED rows={table.num_rows}", flush=True)


def main(args: argparse.Namespace) -> int:
    spark = session()
    if args.wait_go:
        print("SESSION", flush=True)
        if sys.stdin.readline().strip() != "go":
            print("ABANDONED", flush=True)
            spark.stop()
            return 0
    query = start(spark, args)
    print(f"STARTED id={query.id}", flush=True)
    deadline = time.monotonic() + args.max_seconds
    stop_file = Path(args.stop_file) if args.stop_file else None
    reported = -1
    while not query.awaitTermination(POLL_SECONDS):  # raises if the query failed
        reported = report_batches(query, reported)
        if stop_file is not None and stop_file.exists():
            query.stop()
            query.awaitTermination(POLL_SECONDS)
            reported = report_batches(query, reported)
            print("STOPPED", flush=True)
            break
        if time.monotonic() > deadline:
            print(f"GAVE UP after {args.max_seconds} s", flush=True)
            query.stop()
            spark.stop()
            return 3
    else:
        report_batches(query, reported)
        print("DONE", flush=True)
    if args.dump:
        dump(spark, args.out, args.dump)
    spark.stop()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoints")
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--available-now", action="store_true")
    parser.add_argument("--stop-file", default=None)
    parser.add_argument("--dump", default=None)
    parser.add_argument("--max-seconds", type=float, default=240.0)
    parser.add_argument("--wait-go", action="store_true")
    parser.add_argument("--max-per-trigger", type=int, default=500)
    sys.exit(main(parser.parse_args()))
