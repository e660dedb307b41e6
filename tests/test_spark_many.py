"""One Spark query over 64 producer processes on this machine."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import streamq

PRODUCERS = 64


def records_of(i: int) -> int:
    return 100 + 20 * i  # uneven backlogs: 100 .. 1360


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """64 ``streamq serve`` processes, each on its own database: {producer id: endpoint}."""
    folder = tmp_path_factory.mktemp("fleet")
    for i in range(PRODUCERS):
        with (
            streamq.SyncProducer(str(folder / f"p{i}.db"), serve=False) as producer,
            producer.transaction() as tx,
        ):
            tx.publish_many("orders", [b"%d-%d" % (i, n) for n in range(records_of(i))])
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "streamq", "serve", str(folder / f"p{i}.db"), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(PRODUCERS)
    ]
    try:
        ids = {}
        for process in processes:
            assert process.stdout is not None
            line = process.stdout.readline()  # "serving producer ID (epoch N) on HOST:PORT"
            assert line.startswith("serving producer"), line
            ids[line.split()[2]] = line.rsplit(" on ", 1)[1].strip()
        yield ids
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.communicate(timeout=30)


def test_one_query_reads_64_producers_in_balanced_partitions(
    spark: SparkSession,
    fleet: dict[str, str],
) -> None:
    df = (
        spark.read.format("streamq")
        .option("endpoints", ",".join(fleet.values()))
        .option("stream", "orders")
        .option("minPartitions", "32")
        .load()
    )
    sizes = df.rdd.glom().map(len).collect()
    total = sum(records_of(i) for i in range(PRODUCERS))
    assert sum(sizes) == total
    # At least one partition per producer, and none much larger than a fair share.
    assert len(sizes) >= PRODUCERS
    assert max(sizes) <= 2 * total / len(sizes) + 1, sorted(sizes)
    per_producer = {row.producer: row["count"] for row in df.groupBy("producer").count().collect()}
    assert set(per_producer) == set(fleet)
    assert sorted(per_producer.values()) == sorted(records_of(i) for i in range(PRODUCERS))
    endpoints = {row.producer: row.endpoint for row in df.select("producer", "endpoint").collect()}
    assert endpoints == fleet


def test_streaming_query_over_64_producers(
    spark: SparkSession,
    fleet: dict[str, str],
    tmp_path: Path,
) -> None:
    query = (
        spark.readStream.format("streamq")
        .option("endpoints", ",".join(fleet.values()))
        .option("stream", "orders")
        .option("startingOffsets", "earliest")
        .option("maxRecordsPerTrigger", "20000")
        .load()
        .writeStream.format("parquet")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start(str(tmp_path / "out"))
    )
    assert query.awaitTermination(180)
    rows = spark.read.parquet(str(tmp_path / "out"))
    total = sum(records_of(i) for i in range(PRODUCERS))
    assert rows.count() == total
    assert rows.select("producer", "seq").distinct().count() == total
    assert max(p["numInputRows"] for p in query.recentProgress) <= 20000
