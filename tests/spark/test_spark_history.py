"""Key and seq filters pushed down to producers, and startingTimestamp, on a real local Spark."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.functions import col, lit

import streamq

from .test_spark import run_available_now, seqs_by_producer

T0 = 1_700_000_000_000


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[list[streamq.SyncProducer]]:
    """Two producers, 100 records each: key ``k{i % 7}``, timestamp ``T0 + 1000 * i``."""
    started = [streamq.SyncProducer(str(tmp_path / f"p{n}.db")) for n in range(2)]
    try:
        for n, producer in enumerate(started):
            producer.create_stream("orders", key_index=n == 0)  # one indexed, one scanned
            with producer.transaction() as tx:
                for i in range(100):
                    key = b"k%d" % (i % 7)
                    tx.publish("orders", b"v%d" % i, key=key, timestamp=T0 + 1000 * i)
        yield started
    finally:
        for producer in started:
            producer.close()


def read(spark: SparkSession, producers: list[streamq.SyncProducer], **options: str) -> DataFrame:
    reader = (
        spark.read.format("streamq")
        .option("endpoints", ",".join(p.address for p in producers))
        .option("stream", "orders")
        .option("minPartitions", "6")
    )
    for name, value in {"filterPushdown": "true", **options}.items():
        reader = reader.option(name, value)
    return reader.load()


def scan_filters(df: DataFrame) -> str:
    """The filters Spark still applies after the scan, from the physical plan."""
    plan = df._jdf.queryExecution().executedPlan().toString()
    return " ".join(line for line in plan.splitlines() if re.search(r"\bFilter\b", line))


def seqs_of_key(key: int, first: int = 1, stop: int = 101) -> list[int]:
    return [i + 1 for i in range(100) if i % 7 == key and first <= i + 1 < stop]


def test_key_and_seq_filters_reach_the_producers(
    spark: SparkSession, keyed: list[streamq.SyncProducer]
) -> None:
    df = read(spark, keyed)
    one_key = df.filter(col("key") == lit(b"k3")).filter("seq > 20 AND seq <= 80")
    expected = seqs_of_key(3, 21, 81)
    assert seqs_by_producer(one_key) == {p.producer_id: expected for p in keyed}
    # Spark applies neither filter itself: the producers answered exactly; one history
    # request per producer, whatever minPartitions says.
    assert "key#" not in scan_filters(one_key).replace("isnotnull(key#", "")
    assert "seq#" not in scan_filters(one_key)
    assert one_key.rdd.getNumPartitions() == 2
    assert {r.value for r in one_key.collect()} == {b"v%d" % (s - 1) for s in expected}

    two_keys = df.filter(col("key").isin(b"k1", b"k2")).filter("value != 'v8'")
    both = sorted(seqs_of_key(1) + seqs_of_key(2))
    both.remove(9)  # value v8, filtered by Spark
    assert seqs_by_producer(two_keys) == {p.producer_id: both for p in keyed}
    assert "value#" in scan_filters(two_keys)
    assert "key#" not in scan_filters(two_keys).replace("isnotnull(key#", "")

    window = df.filter("seq >= 90")
    assert seqs_by_producer(window) == {p.producer_id: list(range(90, 101)) for p in keyed}
    assert "seq#" not in scan_filters(window)
    assert df.filter("seq < 1").count() == 0
    assert df.filter(col("key") == lit(b"k1")).filter(col("key") == lit(b"k2")).count() == 0
    # Filters on other columns, or other comparisons, are left to Spark and still hold.
    assert df.filter("key IS NULL").count() == 0
    assert df.filter("seq % 50 = 0").count() == 4


def test_without_pushdown_the_same_answer(
    spark: SparkSession, keyed: list[streamq.SyncProducer]
) -> None:
    df = read(spark, keyed, filterPushdown="false")
    one_key = df.filter(col("key") == lit(b"k3")).filter("seq > 20")
    assert seqs_by_producer(one_key) == {p.producer_id: seqs_of_key(3, 21) for p in keyed}
    assert "(key#" in scan_filters(one_key) and "(seq#" in scan_filters(one_key)


def test_key_filter_reports_data_loss(
    spark: SparkSession, keyed: list[streamq.SyncProducer]
) -> None:
    a = keyed[0]
    a.truncate("orders", 50)
    one_key = read(spark, [a], startingOffsets=json.dumps({a.producer_id: 10})).filter(
        col("key") == lit(b"k3")
    )
    with pytest.raises(PySparkException, match=r"seqs 10\.\.49 are gone"):
        one_key.count()
    lenient = read(spark, [a], failOnDataLoss="false").filter(col("key") == lit(b"k3"))
    assert seqs_by_producer(lenient) == {a.producer_id: seqs_of_key(3, 50)}


def test_starting_timestamp(
    spark: SparkSession, keyed: list[streamq.SyncProducer], tmp_path: Path
) -> None:
    df = read(spark, keyed, startingTimestamp=str(T0 + 89_500))
    assert seqs_by_producer(df) == {p.producer_id: list(range(91, 101)) for p in keyed}
    late = read(spark, keyed, startingTimestamp=str(T0 * 2))
    assert late.count() == 0

    # A streaming query starts there too (startingOffsets is then ignored).
    run_available_now(
        spark,
        ",".join(p.address for p in keyed),
        tmp_path / "ck",
        tmp_path / "out",
        startingTimestamp=str(T0 + 95_000),
    )
    written = spark.read.parquet(str(tmp_path / "out"))
    assert seqs_by_producer(written) == {p.producer_id: list(range(96, 101)) for p in keyed}


def test_compacted_stream_reads_without_data_loss(
    spark: SparkSession, keyed: list[streamq.SyncProducer]
) -> None:
    """Compaction gaps are skipped by range reads (no failOnDataLoss error), retention's not."""
    a = keyed[0]  # its stream has the key index
    removed = a.compact("orders")
    assert len(removed) == 93  # 100 records of 7 keys: the latest of each stays
    survivors = list(range(94, 101))
    assert seqs_by_producer(read(spark, [a])) == {a.producer_id: survivors}
    assert seqs_by_producer(read(spark, [a]).filter("seq >= 50")) == {a.producer_id: survivors}
    a.truncate("orders", 97)
    starting = json.dumps({a.producer_id: 1})
    with pytest.raises(PySparkException, match=r"seqs \d+\.\.96 are gone"):
        read(spark, [a], startingOffsets=starting).count()
