"""A streaming query streamq -> Spark -> streamq, in a process of its own (a local[2,3]
session: a failed task is tried again, up to 3 times), for the sink's tests.

``sink_query.py SOURCE OUT_DB CHECKPOINT [--fail-first-attempts DIR]``: reads stream
``orders`` from the producer at SOURCE from the earliest record, 100 records per
micro-batch in 2 partitions, and writes key, value and headers into stream ``scores``
of OUT_DB until it has read everything (``availableNow``); prints "done" then. With
``--fail-first-attempts``, each micro-batch's partition 1 fails its first attempt after
reading its rows (a file in DIR says it did). The sink pauses after a commit as
``sink_hooks`` says.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pyspark import TaskContext
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType

from spark_source.session import local_spark
from tests.spark.programs.sink_hooks import PausingSource


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("checkpoint")
    parser.add_argument("--fail-first-attempts", type=Path)
    args = parser.parse_args()
    failures: Path | None = args.fail_first_attempts

    spark = local_spark("sink-query", master="local[2,3]")
    spark.dataSource.register(PausingSource)
    df = (
        spark.readStream.format("streamq")
        .option("endpoints", args.source)
        .option("stream", "orders")
        .option("startingOffsets", "earliest")
        .option("maxRecordsPerTrigger", "100")
        .option("minPartitions", "2")
        .load()
    )
    value = F.col("value")
    if failures is not None:

        @F.udf(BinaryType())
        def fail_first_attempt(value: bytes) -> bytes:
            context = TaskContext.get()
            assert context is not None
            if context.partitionId() == 1 and context.attemptNumber() == 0:
                (failures / f"stage-{context.stageId()}").touch()
                raise RuntimeError("failed on purpose, the first attempt")
            return value

        value = fail_first_attempt(value)
    query = (
        df.select("key", value.alias("value"), "headers")
        .writeStream.format("streamq")
        .option("db", args.out)
        .option("stream", "scores")
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    print("started", query.id, flush=True)
    query.awaitTermination()
    print("done", flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
