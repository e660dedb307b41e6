"""The ``streamq`` Spark sink with a real local SparkSession, real SQLite files, a real
PostgreSQL server, and a real consumer copying what it published into its own database."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession

import streamq

from ..waiting import wait_until

STREAM = "scores"
Copied = tuple[bytes | None, bytes, dict[str, bytes]]  # key, value, headers


def make_db(db: str) -> None:
    """A producer database with its log tables (``streamq init``), nobody serving it."""
    with streamq.SyncProducer(db, serve=False):
        pass


def is_postgres(db: str) -> bool:
    return db.startswith("postgresql://")


def pending(db: str) -> int:
    """Records committed on PostgreSQL that the serving producer has not numbered yet."""
    if not is_postgres(db):
        return 0
    import psycopg

    with psycopg.connect(db, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM streamq_pending").fetchone()
        assert row is not None
        return int(row[0])


def consumed(db: str, consumer_db: str, stream: str = STREAM, least: int = 1) -> list[Copied]:
    """What a real consumer copies into its own database from ``stream``, served by a
    ``SyncProducer`` on ``db``: every record the stream holds (at least ``least``),
    in seq order, once all commits are numbered."""
    with streamq.SyncProducer(db, host="127.0.0.1", port=0) as producer:
        wait_until(
            lambda: _head(producer, stream) >= least and pending(db) == 0,
            f"{least} records in {stream}, all numbered",
            timeout=30,
        )
        head = _head(producer, stream)
        asyncio.run(asyncio.wait_for(_copy(producer.address, stream, consumer_db, head), 30))
    with contextlib.closing(sqlite3.connect(consumer_db)) as conn:
        rows = conn.execute("SELECT key, value, headers FROM copy ORDER BY seq").fetchall()
    return [(key, value, _headers(headers)) for key, value, headers in rows]


def _head(producer: streamq.SyncProducer, stream: str) -> int:
    try:
        return producer.head(stream)
    except streamq.UnknownStreamError:
        return 0


def _headers(text: bytes) -> dict[str, bytes]:
    pairs = (item.partition(b"=") for item in text.split(b";") if item)
    return {name.decode(): value for name, _, value in pairs}


async def _copy(address: str, stream: str, consumer_db: str, head: int) -> None:
    async with streamq.Consumer(address, stream, db=consumer_db, name="copy") as consumer:
        async for batch in consumer:
            async with consumer.transaction(batch) as tx:
                await tx.execute(
                    "CREATE TABLE IF NOT EXISTS copy (seq PRIMARY KEY, key, value, headers, ts)"
                )
                for rec in batch:
                    headers = b";".join(b"%s=%s" % (k.encode(), v) for k, v in rec.headers.items())
                    await tx.execute(
                        "INSERT INTO copy VALUES (?, ?, ?, ?, ?)",
                        (rec.seq, rec.key, rec.value, headers, rec.timestamp),
                    )
            if batch.last_seq >= head:
                return


def rows_frame(spark: SparkSession, n: int, partitions: int, prefix: str = "r") -> DataFrame:
    """``n`` rows in ``partitions`` partitions, in order: partition 0 holds the first."""
    return spark.range(0, n, 1, partitions).selectExpr(
        "CAST(id % 7 AS STRING) AS key",
        f"CONCAT('{prefix}', CAST(id AS STRING)) AS value",
        "ARRAY(NAMED_STRUCT('key', 'n', 'value', CAST(CAST(id AS STRING) AS BINARY))) AS headers",
    )


def expected(n: int, prefix: str = "r") -> list[Copied]:
    return [(b"%d" % (i % 7), f"{prefix}{i}".encode(), {"n": b"%d" % i}) for i in range(n)]


def write(df: DataFrame, db: str, **options: str) -> None:
    writer = df.write.format("streamq").mode("append").option("db", db)
    for name, value in options.items():
        writer = writer.option(name, value)
    writer.save()


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_a_batch_write_is_one_transaction_read_in_partition_order(
    spark: SparkSession, engine: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db = str(tmp_path / "out.db") if engine == "sqlite" else request.getfixturevalue("pg_url")
    make_db(db)
    write(rows_frame(spark, 300, 4), db, stream=STREAM)
    assert consumed(db, str(tmp_path / "c1.db"), least=300) == expected(300)
    # The same write again is a second job: its rows are published again, after the first.
    write(rows_frame(spark, 300, 4), db, stream=STREAM)
    assert consumed(db, str(tmp_path / "c2.db"), least=600) == expected(300) * 2


def test_a_stream_column_routes_each_row_and_a_timestamp_column_stamps_it(
    spark: SparkSession, tmp_path: Path
) -> None:
    db = str(tmp_path / "out.db")
    make_db(db)
    df = spark.range(0, 10, 1, 2).selectExpr(
        "IF(id % 2 = 0, 'even', 'odd') AS stream",
        "CAST(CAST(id AS STRING) AS BINARY) AS value",
        "id * 1000 AS timestamp",
    )
    write(df, db)
    assert [v for _, v, _ in consumed(db, str(tmp_path / "e.db"), "even", 5)] == [
        b"0",
        b"2",
        b"4",
        b"6",
        b"8",
    ]
    assert [v for _, v, _ in consumed(db, str(tmp_path / "o.db"), "odd", 5)] == [
        b"1",
        b"3",
        b"5",
        b"7",
        b"9",
    ]
    with contextlib.closing(sqlite3.connect(tmp_path / "o.db")) as conn:
        stamps = [ts for (ts,) in conn.execute("SELECT ts FROM copy ORDER BY seq")]
    assert stamps == [1000, 3000, 5000, 7000, 9000]
