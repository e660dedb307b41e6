"""The ``streamq`` Spark sink with a real local SparkSession, real SQLite files, a real
PostgreSQL server, and a real consumer copying what it published into its own database."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

import streamq
from spark_source.sink import MARKERS

from ..conftest import started_server
from ..pgserver import PostgresServer
from ..waiting import wait_until
from .programs.sink_hooks import PAUSE_AFTER_COMMIT
from .test_spark_exactly_once import Proc, adopting_orphans

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
    # The same write again is a second job: its rows are published again, after the first
    # (values alone this time: no key, no headers).
    write(rows_frame(spark, 300, 4).select("value"), db, stream=STREAM)
    again = [(None, value, {}) for _, value, _ in expected(300)]
    assert consumed(db, str(tmp_path / "c2.db"), least=600) == expected(300) + again


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


@pytest.fixture
def orders(tmp_path: Path) -> Iterator[streamq.SyncProducer]:
    """A producer serving stream ``orders``: 500 records ``source_rows(0, 500)``."""
    with streamq.SyncProducer(str(tmp_path / "orders.db"), host="127.0.0.1", port=0) as producer:
        publish_orders(producer, 0, 500)
        yield producer


def publish_orders(producer: streamq.SyncProducer, start: int, end: int) -> None:
    with producer.transaction() as tx:
        for i in range(start, end):
            tx.publish("orders", b"v%d" % i, key=b"k%d" % (i % 5), headers={"n": b"%d" % i})


def source_rows(start: int, end: int) -> list[Copied]:
    return [(b"k%d" % (i % 5), b"v%d" % i, {"n": b"%d" % i}) for i in range(start, end)]


def pipeline(
    spark: SparkSession, source: str, db: str, checkpoint: Path, *, wait: bool = True
) -> StreamingQuery:
    """streamq -> Spark -> streamq until the source's head: 100 records per micro-batch,
    in 2 partitions; returns once it is done (or at once, without ``wait``)."""
    query = (
        spark.readStream.format("streamq")
        .option("endpoints", source)
        .option("stream", "orders")
        .option("startingOffsets", "earliest")
        .option("maxRecordsPerTrigger", "100")
        .option("minPartitions", "2")
        .load()
        .select("key", "value", "headers")
        .writeStream.format("streamq")
        .option("db", db)
        .option("stream", STREAM)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    if wait:
        assert query.awaitTermination(120), "the query did not finish"
    return query


def markers(db: str) -> list[tuple[str, int, int]]:
    """The sink's (query, batch, records) rows, on SQLite."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(
            f"SELECT query, batch, records FROM {MARKERS} ORDER BY batch"
        ).fetchall()


def test_a_streaming_query_publishes_each_micro_batch_once_and_a_replay_nothing(
    spark: SparkSession, orders: streamq.SyncProducer, tmp_path: Path
) -> None:
    db, checkpoint = str(tmp_path / "out.db"), tmp_path / "ck"
    make_db(db)
    query = pipeline(spark, orders.address, db, checkpoint)
    assert consumed(db, str(tmp_path / "c1.db"), least=500) == source_rows(0, 500)
    # The query is known by the id Spark keeps in its checkpoint, every batch once.
    assert markers(db) == [(f"query {query.id}", batch, 100) for batch in range(5)]

    # Spark runs a batch again when its checkpoint has no commit for it (the driver died
    # after the sink's commit, before its own): the sink publishes nothing the second time.
    for name in ("4", ".4.crc"):
        (checkpoint / "commits" / name).unlink(missing_ok=True)
    again = pipeline(spark, orders.address, db, checkpoint)
    assert again.id == query.id and again.runId != query.runId
    assert (checkpoint / "commits" / "4").exists()  # it did run batch 4 again
    publish_orders(orders, 500, 650)
    pipeline(spark, orders.address, db, checkpoint)
    assert consumed(db, str(tmp_path / "c2.db"), least=650) == source_rows(0, 650)
    assert [batch for _, batch, _ in markers(db)] == list(range(7))


QUERY_PROGRAM = Path(__file__).resolve().parent / "programs" / "sink_query.py"
RUN_TIMEOUT = 150.0  # a program's run: its JVM's start (10 to 20 s) and 5 to 7 micro-batches


def run_query(tmp_path: Path, name: str, source: str, db: str, *extra: str) -> Proc:
    """``programs/sink_query.py`` in a process (session) of its own."""
    checkpoint = str(tmp_path / "ck")
    return Proc([str(QUERY_PROGRAM), source, db, checkpoint, *extra], tmp_path / f"{name}.log")


def test_a_task_attempt_failed_on_purpose_publishes_its_rows_once(
    orders: streamq.SyncProducer, tmp_path: Path
) -> None:
    db, failed = str(tmp_path / "out.db"), tmp_path / "failed"
    make_db(db)
    failed.mkdir()
    run = run_query(tmp_path, "run", orders.address, db, "--fail-first-attempts", str(failed))
    assert run.wait(RUN_TIMEOUT) == 0, run.tail()
    assert "done" in run.lines()
    assert len(list(failed.iterdir())) == 5  # each batch's partition 1 failed once
    assert consumed(db, str(tmp_path / "c.db"), least=500) == source_rows(0, 500)


def test_a_driver_killed_after_the_sinks_commit_restarts_with_no_duplicate(
    orders: streamq.SyncProducer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of the whole driver (Python, JVM, workers) once batch 2's transaction has
    committed, before Spark's checkpoint has the batch; the restarted query runs batch 2
    again, and the sink publishes nothing for it."""
    db, flag = str(tmp_path / "out.db"), tmp_path / "committed"
    make_db(db)
    monkeypatch.setenv(PAUSE_AFTER_COMMIT, f"2:{flag}")
    with adopting_orphans():
        first = run_query(tmp_path, "first", orders.address, db)
        try:
            wait_until(lambda: flag.exists() or not first.alive(), "batch 2's commit", RUN_TIMEOUT)
            assert flag.exists(), first.tail()
            assert not (tmp_path / "ck" / "commits" / "2").exists()  # Spark's own: not yet
            assert [batch for _, batch, _ in markers(db)] == [0, 1, 2]
        finally:
            assert first.kill_all() == -signal.SIGKILL
        monkeypatch.delenv(PAUSE_AFTER_COMMIT)
        second = run_query(tmp_path, "second", orders.address, db)
        assert second.wait(RUN_TIMEOUT) == 0, second.tail()
    assert (tmp_path / "ck" / "commits" / "2").exists()  # batch 2 ran again
    assert consumed(db, str(tmp_path / "c.db"), least=500) == source_rows(0, 500)
    assert [(batch, n) for _, batch, n in markers(db)] == [(b, 100) for b in range(5)]


def first_line(error: PySparkException) -> str:
    return str(error).splitlines()[0]


def test_each_wrong_option_or_column_is_refused_in_one_line_before_anything_is_written(
    spark: SparkSession, tmp_path: Path
) -> None:
    db = str(tmp_path / "out.db")
    make_db(db)
    good = rows_frame(spark, 10, 2)
    bare = str(tmp_path / "bare.db")
    sqlite3.connect(bare).close()  # a database, without the log tables
    named = {"db": db, "stream": STREAM}
    refused: list[tuple[DataFrame, dict[str, str], str]] = [
        (good, {**named, "strem": "x"}, "unknown option 'strem' (did you mean 'stream'?)"),
        (
            good,
            {"db": db, "topic": "t"},
            "option 'topic' is the Kafka sink's: this sink's is 'stream'",
        ),
        (good, {"stream": STREAM}, "set option 'db': the producer database to write into"),
        (good, {**named, "db": str(tmp_path / "no.db")}, "option db: cannot open SQLite database"),
        (
            good,
            {**named, "db": bare},
            f"no streamq log tables: create them with 'streamq init {bare}'",
        ),
        (good, {"db": db}, "set option 'stream', or give the rows a 'stream' column"),
        (good, {"db": db, "stream": ""}, "set option 'stream', or give the rows a 'stream' column"),
        (good, {"db": db, "stream": "x" * 300}, "option 'stream': stream name must have 1 to"),
        (
            good.withColumnRenamed("value", "vaule"),
            named,
            "column 'vaule' is not one the sink writes: did you mean 'value'?",
        ),
        (
            good.drop("value"),
            named,
            "the sink needs a 'value' column (binary or string); the DataFrame has key, headers",
        ),
        (
            good.selectExpr("1 AS value"),
            named,
            "column 'value' is int: the sink takes binary or string (cast it)",
        ),
        (
            good.selectExpr("value", "array('a') AS headers"),
            named,
            "column 'headers' is array<string>: the sink takes array<struct<key:string,value:bi",
        ),
        (
            good.selectExpr("value", "1 AS stream"),
            {"db": db},
            "column 'stream' is int: the sink takes string",
        ),
        (
            good.selectExpr("value", "'x' AS timestamp"),
            named,
            "column 'timestamp' is string: the sink takes timestamp or long (milliseconds)",
        ),
    ]
    for df, options, line in refused:
        writer = df.write.format("streamq").mode("append")
        for name, value in options.items():
            writer = writer.option(name, value)
        with pytest.raises(PySparkException) as error:
            writer.save()
        assert line in first_line(error.value), (options, str(error.value)[:2000])
    with pytest.raises(PySparkException) as error:
        good.write.format("streamq").mode("overwrite").option("db", db).option(
            "stream", STREAM
        ).save()
    assert "the sink appends to a stream: use .mode('append')" in first_line(error.value)
    # A null value is found as the executors convert the rows: the job fails whole.
    with pytest.raises(PySparkException, match="a row's value is null: streamq records always"):
        write(good.selectExpr("IF(value = 'r5', NULL, value) AS value"), db, stream=STREAM)
    with pytest.raises(PySparkException, match="a row's stream is null: fill the 'stream' column"):
        write(good.selectExpr("value", "IF(value = 'r5', NULL, 's') AS stream"), db)

    # Streaming queries: Spark refuses one without a checkpoint itself; one whose checkpoint
    # is the session's default, which the sink is not shown, and a misspelt option.
    rate = spark.readStream.format("rate").load().selectExpr("CAST(value AS STRING) AS value")
    default = "spark.sql.streaming.checkpointLocation"
    for options, line in [
        ({"db": db, "stream": STREAM}, "checkpointLocation must be specified either through"),
        ({"db": db, "stream": STREAM, default: str(tmp_path / "cks")},
         "set option 'checkpointLocation' on the streaming query"),
        ({"db": db, "stream": STREAM, "checkpointLocation": str(tmp_path / "ck"), "dbb": "x"},
         "unknown option 'dbb' (did you mean 'db'?)"),
    ]:  # fmt: skip
        stream_writer = rate.writeStream.format("streamq")
        if default in options:
            spark.conf.set(default, options.pop(default))
        for name, value in options.items():
            stream_writer = stream_writer.option(name, value)
        try:
            with pytest.raises(PySparkException) as error:
                query = stream_writer.start()
                try:
                    query.awaitTermination(60)
                finally:
                    query.stop()
        finally:
            spark.conf.unset(default)
        assert line in first_line(error.value), str(error.value)[:2000]
    with contextlib.closing(sqlite3.connect(db)) as conn:  # nothing written, not a marker
        assert not conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (MARKERS,)).fetchall()
    with streamq.SyncProducer(db, serve=False) as producer:
        assert _head(producer, STREAM) == 0


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of the test's own: it restarts it."""
    yield from started_server()


def test_postgresql_restarted_mid_query_leaves_an_exact_copy(
    spark: SparkSession, orders: streamq.SyncProducer, own_postgres: PostgresServer, tmp_path: Path
) -> None:
    """``pg_ctl restart`` while micro-batches commit: a commit that meets the server gone
    (its connection cut, or refused while it starts) is tried again, and the marker tells
    one that landed before the cut; had the query failed, a restart from its checkpoint
    would finish it. Either way the copy is exact."""
    pg_url = own_postgres.create_database("sink")
    make_db(pg_url)
    publish_orders(orders, 500, 2000)  # 20 micro-batches
    checkpoint = tmp_path / "ck"
    query = pipeline(spark, orders.address, pg_url, checkpoint, wait=False)
    try:
        wait_until(lambda: len(pg_markers(pg_url)) >= 3, "3 micro-batches committed", 60)
        committed = len(pg_markers(pg_url))
        own_postgres.reconfigure()  # pg_ctl stop -m fast (sessions ended), then start
        assert query.awaitTermination(120), "the query did not finish"
    finally:
        query.stop()
    assert committed < 20  # the restart came while batches committed
    assert query.exception() is None  # a commit meeting the server gone was tried again
    assert consumed(pg_url, str(tmp_path / "c.db"), least=2000) == source_rows(0, 2000)
    assert pg_markers(pg_url) == list(range(20))


def pg_markers(url: str) -> list[int]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        try:
            rows = conn.execute(f"SELECT batch FROM {MARKERS} ORDER BY batch").fetchall()
        except psycopg.errors.UndefinedTable:
            return []
    return [batch for (batch,) in rows]
