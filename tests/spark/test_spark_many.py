"""One Spark query over 64 producer processes on this machine."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.functions import count, count_distinct

import streamq

PRODUCERS = 64
FLEET = Path(__file__).resolve().parent / "programs" / "fleet.py"


def records_of(i: int) -> int:
    return 100 + 20 * i  # uneven backlogs: 100 .. 1360


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """64 ``streamq serve`` processes, each on its own database: {producer id: endpoint}.
    They are forked from one process that imports streamq once (``FLEET``)."""
    folder = tmp_path_factory.mktemp("fleet")
    for i in range(PRODUCERS):
        with (
            streamq.SyncProducer(str(folder / f"p{i}.db"), serve=False) as producer,
            producer.transaction() as tx,
        ):
            tx.publish_many("orders", [b"%d-%d" % (i, n) for n in range(records_of(i))])
    process = subprocess.Popen(
        [sys.executable, str(FLEET), *(str(folder / f"p{i}.db") for i in range(PRODUCERS))],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        ids = {}
        while len(ids) < PRODUCERS:
            line = process.stdout.readline()  # "serving producer ID (epoch N) on HOST:PORT"
            assert line and not line.startswith("exited"), line
            if line.startswith("serving producer"):
                ids[line.split()[2]] = line.rsplit(" on ", 1)[1].strip()
        yield ids
    finally:
        process.terminate()  # it passes SIGTERM on to every server
        process.communicate(timeout=30)


def test_one_query_reads_64_producers_in_a_few_balanced_partitions(
    spark: SparkSession,
    fleet: dict[str, str],
) -> None:
    """A Python task costs Spark tens of milliseconds whatever it reads: partitions pack
    several producers' ranges, as many as minPartitions asks, balanced by records."""
    df = (
        spark.read.format("streamq")
        .option("endpoints", ",".join(fleet.values()))
        .option("stream", "orders")
        .option("minPartitions", "8")
        .load()
    )
    # One read (each costs a Python task per partition), its rows kept partition by partition.
    partitions = df.select("producer", "endpoint").rdd.glom().collect()
    sizes = [len(rows) for rows in partitions]
    total = sum(records_of(i) for i in range(PRODUCERS))
    assert sum(sizes) == total
    assert len(sizes) == 8
    # Within one producer's share of a fair split (the largest piece goes to the lightest).
    largest = max(records_of(i) for i in range(PRODUCERS))
    assert max(sizes) - min(sizes) <= largest, sorted(sizes)
    assert all(len({row.producer for row in part}) > 1 for part in partitions)
    rows = [row for part in partitions for row in part]
    per_producer = Counter(row.producer for row in rows)
    assert set(per_producer) == set(fleet)
    assert sorted(per_producer.values()) == sorted(records_of(i) for i in range(PRODUCERS))
    endpoints = {row.producer: row.endpoint for row in rows}
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
    counts = rows.agg(count("*").alias("rows"), count_distinct("producer", "seq").alias("once"))
    assert tuple(counts.first() or ()) == (total, total)  # every record, each once
    assert max(p["numInputRows"] for p in query.recentProgress) <= 20000
