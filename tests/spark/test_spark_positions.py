"""A Spark query's position reaches its producers when it stops at the head.

Spark commits a micro-batch to its source (``commit``) only as it plans the next one, so
the last batch before a query idles or stops was never reported: status showed the query
a batch behind (lag 540) for ever. The source reports where the last batch ended at the
next trigger's planning instead; the producer stores it, so a restart keeps it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

import streamq

from ..conftest import wait_for


def reported(address: str) -> list[tuple[str, int, int]]:
    with streamq.Client(address) as client:
        return [(p["consumer"], p["applied"], p["lag"]) for p in client.status()["positions"]]


def test_a_query_stopped_at_the_head_has_reported_it(spark: SparkSession, tmp_path: Path) -> None:
    db, checkpoint = str(tmp_path / "p.db"), str(tmp_path / "ck")

    def start(address: str, available_now: bool = False) -> StreamingQuery:
        writer = (
            spark.readStream.format("streamq")
            .option("endpoints", address)
            .option("stream", "orders")
            .option("startingOffsets", "earliest")
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", checkpoint)
        )
        return (writer.trigger(availableNow=True) if available_now else writer).start()

    producer = streamq.SyncProducer(db)
    try:
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"x"] * 540)
        query = start(producer.address)
        query.processAllAvailable()  # one batch: 1..540, committed by the sink
        asyncio.run(
            wait_for(
                lambda: reported(producer.address) == [("spark", 540, 0)],
                what="the position of the query's last batch",
            )
        )
        query.stop()
    finally:
        producer.close()
    producer = streamq.SyncProducer(db)  # restarted: the position was stored
    try:
        assert reported(producer.address) == [("spark", 540, 0)]
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"y"] * 60)
        asyncio.run(  # the head the status reports moves once the producer has served them
            wait_for(
                lambda: reported(producer.address) == [("spark", 540, 60)],
                what="the lag behind 60 more records",
            )
        )
        # The query restarted from its checkpoint: its one batch is reported before it ends.
        query = start(producer.address, available_now=True)
        assert query.awaitTermination(120), "AvailableNow query did not finish"
        assert reported(producer.address) == [("spark", 600, 0)]
    finally:
        producer.close()
