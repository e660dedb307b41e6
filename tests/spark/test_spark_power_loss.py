"""A Spark streaming query against a producer whose database a power loss rolled back.

A real producer (``durability="normal"``) commits three transactions; a real local Spark
query reads them (``Trigger.AvailableNow``) into a parquet sink and commits its checkpoint.
The producer's database is then replaced by the image a power loss leaves when the WAL
was synced only up to the first commit (built from its WAL frames: tests/powerloss.py,
``WalTape``), and the restarted producer (a new epoch) publishes other records under the
lost seqs and beyond. The query's next micro-batch must fail, naming the producer, the
stream and the seqs it read that the producer no longer holds; with failOnDataLoss=false
it goes on from the first seq lost, reading what the producer holds there now.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from streamq import SyncProducer

from ..powerloss import WalTape
from .test_spark import run_available_now


def last_offset(checkpoint: Path) -> dict[str, Any]:
    """The source's offset in the query's last offset log entry."""
    entries = sorted((checkpoint / "offsets").glob("[0-9]*"), key=lambda path: int(path.name))
    offset: dict[str, Any] = json.loads(entries[-1].read_text().splitlines()[-1])
    return offset


def sink(spark: SparkSession, out: Path) -> list[tuple[int, bytes]]:
    rows = spark.read.parquet(str(out)).select("seq", "value").collect()
    return sorted((row.seq, row.value) for row in rows)


def test_a_query_fails_on_seqs_a_producer_reused_after_a_power_loss(
    spark: SparkSession, tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    db, port = tmp_path / "p.db", reserve_port()
    checkpoint, out = tmp_path / "ck", tmp_path / "out"
    tape = WalTape(db)
    producer = SyncProducer(str(db), durability="normal", port=port)
    try:
        tape.mark()  # the start: its epoch's commit synced the WAL
        for k in range(3):  # seqs 1..10, 11..20, 21..30
            with producer.transaction() as tx:
                tx.publish_many("orders", [b"before %d" % (10 * k + n) for n in range(1, 11)])
            tape.mark()
        run_available_now(spark, producer.address, checkpoint, out)
        tape.freeze(tmp_path)
        pid, epoch = producer.producer_id, producer._producer.epoch
    finally:
        producer.close()
    read = [(seq, b"before %d" % seq) for seq in range(1, 31)]
    assert sink(spark, out) == read
    # The checkpoint holds, beside each producer's next seq, the epoch that wrote its head.
    assert last_offset(checkpoint) == {pid: 31, "epochs": {pid: epoch}}

    tape.lose_after(1, tmp_path)  # synced up to the first commit: seqs 11..30 are lost
    with SyncProducer(str(db), port=port) as restarted:
        assert restarted.producer_id == pid and restarted.head("orders") == 10
        with restarted.transaction() as tx:  # other records under seqs 11..30, then 31..35
            tx.publish_many("orders", [b"after %d" % seq for seq in range(11, 36)])

        with pytest.raises(
            PySparkException,
            match=(
                rf"producer {pid} at {restarted.address} lost commits of stream 'orders' and "
                r"re-used their seqs: the query already read up to seq 30, but the producer's "
                r"log no longer holds seqs 11\.\.30 as the query read them"
            ),
        ):
            run_available_now(spark, restarted.address, checkpoint, out)
        assert sink(spark, out) == read  # nothing more

        # failOnDataLoss=false: a warning, then on from seq 11 as the producer holds it now.
        run_available_now(spark, restarted.address, checkpoint, out, failOnDataLoss="false")
        after = [(seq, b"after %d" % seq) for seq in range(11, 36)]
        assert sink(spark, out) == sorted(read + after)
        new_epoch = restarted._producer.epoch
        assert new_epoch > epoch
        assert last_offset(checkpoint) == {pid: 36, "epochs": {pid: new_epoch}}
