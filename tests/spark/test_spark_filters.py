"""Server-side filters from Spark, on a real local Spark: ``filterKeyPrefix`` and
``filterHeaders`` on a streaming query, and a pushed-down ``key`` prefix on a batch read.
The producers' traffic counters prove the filtering happened on their side."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession
from pyspark.sql.functions import col, lit

import streamq

from .test_spark import run_available_now, seqs_by_producer
from .test_spark_history import read, scan_filters

KINDS = (b"created", b"paid", b"shipped")


def key_of(i: int) -> bytes:
    return b"order-%d" % (i % 9) if i % 2 else b"user-%d" % (i % 5)


@pytest.fixture
def typed(tmp_path: Path) -> Iterator[list[streamq.SyncProducer]]:
    """Two producers, 300 records each: alternating ``order-``/``user-`` keys, and a
    ``type`` header cycling through created, paid, shipped."""
    started = [streamq.SyncProducer(str(tmp_path / f"p{n}.db")) for n in range(2)]
    try:
        for producer in started:
            with producer.transaction() as tx:
                for i in range(300):
                    headers = {"type": KINDS[i % 3]}
                    tx.publish("orders", b"v%d" % i, key=key_of(i), headers=headers)
        yield started
    finally:
        for producer in started:
            producer.close()


def sent(producer: streamq.SyncProducer) -> int:
    with streamq.Client(producer.address) as client:
        return int(client.status()["sent"].get("orders", {}).get("records", 0))


def test_a_streaming_query_reads_only_what_its_filter_matches(
    spark: SparkSession, typed: list[streamq.SyncProducer], tmp_path: Path
) -> None:
    eps = ",".join(p.address for p in typed)
    before = [sent(p) for p in typed]
    run_available_now(
        spark,
        eps,
        tmp_path / "checkpoint",
        tmp_path / "out",
        filterKeyPrefix="order-",
        filterHeaders=json.dumps({"type": "paid"}),
    )
    expected = [i + 1 for i in range(300) if i % 2 and i % 3 == 1]
    out = spark.read.parquet(str(tmp_path / "out"))
    assert seqs_by_producer(out) == {p.producer_id: expected for p in typed}
    # The producers sent those records and no others.
    assert [sent(p) - b for p, b in zip(typed, before, strict=True)] == [len(expected)] * 2


def test_filter_options_on_a_batch_read_beside_pushed_down_filters(
    spark: SparkSession, typed: list[streamq.SyncProducer]
) -> None:
    before = [sent(p) for p in typed]
    df = read(spark, typed, filterKeyPrefix="order-").filter("seq > 100")
    expected = [i + 1 for i in range(100, 300) if i % 2]
    assert seqs_by_producer(df) == {p.producer_id: expected for p in typed}
    assert [sent(p) - b for p, b in zip(typed, before, strict=True)] == [len(expected)] * 2
    assert "seq#" not in scan_filters(df)  # the seq bound was pushed down as before
    # A key equality pushed down (history requests) holds with the options' filter too.
    one_key = read(spark, typed, filterHeaders=json.dumps({"type": "created"})).filter(
        col("key") == lit(b"order-3")
    )
    assert seqs_by_producer(one_key) == {
        p.producer_id: [i + 1 for i in range(300) if key_of(i) == b"order-3" and i % 3 == 0]
        for p in typed
    }
    # Spark cannot push a prefix of a binary column: it filters, the answer is the same.
    both = read(spark, typed, filterKeyPrefix="user-").filter(col("key").startswith(lit(b"order-")))
    assert both.count() == 0


def test_a_bad_filter_option_is_a_clear_error(
    spark: SparkSession, typed: list[streamq.SyncProducer]
) -> None:
    with pytest.raises(PySparkException, match="filterHeaders must be a JSON object of strings"):
        read(spark, typed, filterHeaders='{"type": 1}').count()
