"""Spark reads a captured table's stream as typed columns (``changeColumns``): ``op``,
``new`` and ``old`` as structs of the table's columns typed from its catalog, with a
real local SparkSession and a real PostgreSQL server with ``wal_level = logical``."""

from __future__ import annotations

import datetime
import decimal
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql.utils import AnalysisException, PythonException

import streamq

from ..engines.test_pg_capture import sql

TABLE = """CREATE TABLE orders (
    id integer PRIMARY KEY, note text, amount numeric(10, 2), at timestamptz, day date,
    doc jsonb, tags text[], blob bytea, n bigint, ok boolean, ratio double precision,
    span interval, big numeric)"""
ROW = (
    "'first', 12.50, '2026-12-01 17:00:00.25+01', '2026-12-01', '{\"a\": [1, null]}', "
    "'{x,\"y z\"}', '\\x00ff', 9007199254740993, true, 0.1, '1 mon 2 days', 1e40"
)


def test_a_captured_stream_reads_as_the_tables_typed_columns(
    spark: SparkSession, capture_url: str
) -> None:
    sql(capture_url, TABLE, f"INSERT INTO orders VALUES (1, {ROW})")
    with streamq.SyncProducer(capture_url, capture=["orders"], snapshot=True) as producer:
        with streamq.Client(producer.address) as client:
            streamq_wait(client, 1)  # the snapshot
            sql(capture_url, "INSERT INTO orders (id, note) VALUES (2, 'second')")
            sql(capture_url, "UPDATE orders SET amount = 7.25 WHERE id = 2")
            sql(capture_url, "DELETE FROM orders WHERE id = 1")
            streamq_wait(client, 4)
        frame = (
            spark.read.format("streamq")
            .option("endpoints", producer.address)
            .option("stream", "public.orders")
            .option("changeColumns", "true")
            .load()
        )
        rows = frame.orderBy("seq").collect()
        types = dict(frame.select("new.*").dtypes)
        assert "value" not in frame.columns
        assert frame.schema["xid"].dataType.simpleString() == "bigint"
    assert types == {
        "id": "int",
        "note": "string",
        "amount": "decimal(10,2)",
        "at": "timestamp",
        "day": "date",
        "doc": "string",
        "tags": "array<string>",
        "blob": "binary",
        "n": "bigint",
        "ok": "boolean",
        "ratio": "double",
        "span": "string",
        "big": "string",  # no precision declared: its exact text
    }
    assert [(r.seq, r.op, r.key) for r in rows] == [
        (1, "snapshot", b'{"id":1}'),
        (2, "insert", b'{"id":2}'),
        (3, "update", b'{"id":2}'),
        (4, "delete", b'{"id":1}'),
    ]
    first = rows[0].new.asDict()
    assert first["amount"] == decimal.Decimal("12.50")
    assert first["at"] == datetime.datetime(2026, 12, 1, 16, 0, 0, 250000)  # the session's UTC
    assert first["day"] == datetime.date(2026, 12, 1)
    assert first["doc"] == '{"a":[1,null]}' and first["tags"] == ["x", "y z"]
    assert first["blob"] == b"\x00\xff" and first["n"] == 9007199254740993 and first["ok"]
    assert first["big"] == "1" + "0" * 40 and first["span"] == "1 mon 2 days"
    assert rows[0].xid is None and rows[1].xid is not None and rows[0].lsn < rows[1].lsn
    assert rows[2].new.amount == decimal.Decimal("7.25") and rows[2].new.note == "second"
    assert rows[3].new is None and rows[3].old.id == 1 and rows[3].old.note is None
    assert [(r["index"], r["changes"]) for r in rows] == [(0, 1)] * 4  # Row.index: a method


def test_change_columns_of_a_stream_no_table_is_captured_into_fail_saying_so(
    spark: SparkSession, capture_url: str
) -> None:
    sql(capture_url, "CREATE TABLE orders (id integer PRIMARY KEY)")
    with streamq.SyncProducer(capture_url, capture=["orders"]) as producer:
        producer.create_stream("events")
        reader = (
            spark.read.format("streamq")
            .option("endpoints", producer.address)
            .option("changeColumns", "true")
        )
        with pytest.raises((AnalysisException, PythonException)) as failed:
            reader.option("stream", "events").load()
        assert "captures no table into stream 'events'" in str(failed.value)
        producer.publish("events", b"not a change")
        given = "seq long, op string, new struct<id:int>"
        rows = reader.option("stream", "public.orders").schema(given).load().collect()
        assert rows == []
        with pytest.raises(Exception, match="not a captured change"):
            reader.option("stream", "events").schema(given).load().collect()


def streamq_wait(client: streamq.Client, head: int, stream: str = "public.orders") -> None:
    """Until the captured stream's head is ``head``."""
    from ..waiting import wait_until

    def served() -> bool:
        (info,) = [s for s in client.streams() if s.stream == stream]
        return info.head >= head

    wait_until(served, f"{head} changes served", timeout=60)


def test_a_table_that_gains_a_column_stops_the_query_until_it_restarts(
    spark: SparkSession, capture_url: str, tmp_path: Path
) -> None:
    """The producer's status follows the table's columns; a streaming query typed from the
    old ones stops in one line at the first change with the new column, and started again
    from its checkpoint reads it, nothing lost or doubled. A schema given with
    ``.schema(...)`` names its columns: a new one is left out, and the query goes on."""
    from ..waiting import wait_until

    sql(capture_url, "CREATE TABLE customers (id integer PRIMARY KEY, name text)")
    sql(capture_url, "INSERT INTO customers VALUES (1, 'a')")
    seen: list[dict[str, Any]] = []
    given: list[dict[str, Any]] = []

    def start(schema: str | None, into: list[dict[str, Any]], checkpoint: str) -> Any:
        reader = spark.readStream.format("streamq").options(
            endpoints=producer.address,
            stream="public.customers",
            changeColumns="true",
            startingOffsets="earliest",
        )
        if schema is not None:
            reader = reader.schema(schema)
        return (
            reader.load()
            .writeStream.foreachBatch(
                lambda frame, _: into.extend(r.new.asDict() for r in frame.orderBy("seq").collect())
            )
            .option("checkpointLocation", str(tmp_path / checkpoint))
            .start()
        )

    def columns() -> list[str]:
        with streamq.Client(producer.address) as client:
            found = client.status()["capture"]["columns"]["public.customers"]
        return [column["name"] for column in found]

    with streamq.SyncProducer(capture_url, capture=["customers"], snapshot=True) as producer:
        assert columns() == ["id", "name"]
        query = start(None, seen, "ours")
        subset = start("seq long, new struct<id:int>", given, "given")
        query.processAllAvailable()
        subset.processAllAvailable()
        assert seen == [{"id": 1, "name": "a"}] and given == [{"id": 1}]

        sql(capture_url, "ALTER TABLE customers ADD COLUMN city text")
        sql(capture_url, "INSERT INTO customers VALUES (2, 'b', 'Paris')")
        wait_until(lambda: columns() == ["id", "name", "city"], "the status to follow", 60)
        with streamq.Client(producer.address) as client:
            streamq_wait(client, 2, "public.customers")  # the change served: the query sees it
        with pytest.raises(StreamingQueryException) as stopped:
            query.processAllAvailable()
        assert "table public.customers gained column city; restart the query to read it" in (
            str(stopped.value)
        )
        subset.processAllAvailable()
        subset.stop()
        assert given == [{"id": 1}, {"id": 2}]

        query = start(None, seen, "ours")  # again, from its checkpoint
        query.processAllAvailable()
        query.stop()
    assert seen == [{"id": 1, "name": "a"}, {"id": 2, "name": "b", "city": "Paris"}]
