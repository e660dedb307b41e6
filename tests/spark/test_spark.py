"""The ``streamq`` Spark source with a real local SparkSession and real producers."""

from __future__ import annotations

import json
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import DataStreamReader, StreamingQuery

import streamq
from spark_source.schema import SCHEMA
from streamq.wire.transport import parse_address

from ..hosted import hosted, unread
from ..waiting import wait_until


@pytest.fixture
def producers(tmp_path: Path) -> Iterator[list[streamq.SyncProducer]]:
    """Three producers with 1000, 2000 and 3000 records in stream ``orders``."""
    started = [streamq.SyncProducer(str(tmp_path / f"p{i}.db")) for i in range(3)]
    try:
        for i, producer in enumerate(started):
            with producer.transaction() as tx:
                tx.publish_many("orders", [b"p%d-%d" % (i, n) for n in range(1, 1000 * (i + 1))])
                tx.publish("orders", b"last", key=b"k%d" % i, headers={"h": b"v"})
        yield started
    finally:
        for producer in started:
            producer.close()


def endpoints(producers: list[streamq.SyncProducer]) -> str:
    return ",".join(p.address for p in producers)


def read(spark: SparkSession, eps: str, **options: str) -> DataFrame:
    reader = spark.read.format("streamq").option("endpoints", eps).option("stream", "orders")
    for name, value in options.items():
        reader = reader.option(name, value)
    return reader.load()


def seqs_by_producer(df: DataFrame) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for row in df.select("producer", "seq").collect():
        found.setdefault(row.producer, []).append(row.seq)
    return {pid: sorted(seqs) for pid, seqs in found.items()}


def test_batch_read_every_producer(
    spark: SparkSession, producers: list[streamq.SyncProducer]
) -> None:
    df = read(spark, endpoints(producers), minPartitions="5")
    assert df.schema == SCHEMA
    assert df.rdd.getNumPartitions() >= 5
    assert seqs_by_producer(df) == {
        p.producer_id: list(range(1, 1000 * (i + 1) + 1)) for i, p in enumerate(producers)
    }
    last = df.filter("key is not null").orderBy("seq").collect()
    assert [(r.endpoint, r.key, r.value, [(h.key, h.value) for h in r.headers]) for r in last] == [
        (p.address, b"k%d" % i, b"last", [("h", b"v")]) for i, p in enumerate(producers)
    ]
    first = df.filter("seq = 1").select("producer", "value", "timestamp").collect()
    assert {r.producer: r.value for r in first} == {
        p.producer_id: b"p%d-1" % i for i, p in enumerate(producers)
    }
    assert all(abs(r.timestamp.timestamp() - time.time()) < 600 for r in first)


def test_batch_read_honours_starting_and_ending_offsets(
    spark: SparkSession, producers: list[streamq.SyncProducer]
) -> None:
    a, b, _ = producers
    starting = json.dumps({a.producer_id: 5, b.producer_id: -1})
    ending = json.dumps({a.producer_id: 10})
    df = read(spark, endpoints(producers), startingOffsets=starting, endingOffsets=ending)
    found = seqs_by_producer(df)
    assert found[a.producer_id] == [5, 6, 7, 8, 9]
    assert b.producer_id not in found  # from latest to latest: nothing
    assert len(found) == 2 and len(next(v for k, v in found.items() if k != a.producer_id)) == 3000


def run_available_now(
    spark: SparkSession, eps: str, checkpoint: Path, out: Path, **options: str
) -> StreamingQuery:
    reader = (
        spark.readStream.format("streamq")
        .option("endpoints", eps)
        .option("stream", "orders")
        .option("startingOffsets", "earliest")
    )
    for name, value in options.items():
        reader = reader.option(name, value)
    query = (
        reader.load()
        .writeStream.format("parquet")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start(str(out))
    )
    assert query.awaitTermination(120), "AvailableNow query did not finish"
    return query


def test_available_now_with_admission_control(
    spark: SparkSession, producers: list[streamq.SyncProducer], tmp_path: Path
) -> None:
    eps = endpoints(producers)
    query = run_available_now(
        spark, eps, tmp_path / "ck", tmp_path / "out", maxRecordsPerTrigger="700"
    )
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sum(sizes) == 6000 and max(sizes) <= 700 and len(sizes) >= 9
    # Shared in proportion to backlog (1000:2000:3000): 116.7, 233.3, 350 rounded to 700.
    first = json.loads(query.recentProgress[0]["sources"][0]["endOffset"])
    assert sorted(seq - 1 for pid, seq in first.items() if pid != "epochs") == [117, 233, 350]
    # Beside the seqs, the epoch that wrote each producer's head ("Epochs").
    assert first["epochs"] == {p.producer_id: p._producer.epoch for p in producers}
    assert seqs_by_producer(spark.read.parquet(str(tmp_path / "out"))) == {
        p.producer_id: list(range(1, 1000 * (i + 1) + 1)) for i, p in enumerate(producers)
    }
    # New commits, the same checkpoint: only the new records, once.
    producers[0].publish("orders", b"new")
    run_available_now(spark, eps, tmp_path / "ck", tmp_path / "out")
    rows = spark.read.parquet(str(tmp_path / "out")).filter("value = 'new'").collect()
    assert [(r.producer, r.seq) for r in rows] == [(producers[0].producer_id, 1001)]
    assert spark.read.parquet(str(tmp_path / "out")).count() == 6001
    # commit(end) reported the query's durable position to the producers.
    with streamq.Client(producers[1].address) as client:
        reported = client.status()["positions"]
    assert [(r["consumer"], r["stream"], r["applied"]) for r in reported] == [
        ("spark", "orders", 2000)
    ]


def test_failures_name_the_producer(
    spark: SparkSession,
    producers: list[streamq.SyncProducer],
    tmp_path: Path,
    reserve_port: Callable[[], int],
) -> None:
    dead = f"127.0.0.1:{reserve_port()}"  # nothing listens there
    with pytest.raises(PySparkException, match=f"producer at {dead}: cannot connect"):
        read(spark, f"{producers[0].address},{dead}").count()

    # Records gone to retention: an error saying which, unless failOnDataLoss=false.
    a = producers[0]
    a.truncate("orders", 600)
    starting = json.dumps({a.producer_id: 100})
    with pytest.raises(PySparkException, match=r"seqs 100\.\.599 are gone"):
        read(spark, a.address, startingOffsets=starting).count()
    lenient = read(spark, a.address, startingOffsets=starting, failOnDataLoss="false")
    assert seqs_by_producer(lenient) == {a.producer_id: list(range(600, 1001))}


def stream_query(
    spark: SparkSession, eps: str, stream: str, checkpoint: Path, seen: list[int], **options: str
) -> StreamingQuery:
    """A query of ``stream`` from the earliest seqs, collecting its batch ids in ``seen``."""
    reader = spark.readStream.format("streamq").option("endpoints", eps).option("stream", stream)
    return (
        reader.options(startingOffsets="earliest", **options)
        .load()
        .writeStream.foreachBatch(lambda df, batch: seen.append(batch))
        .option("checkpointLocation", str(checkpoint))
        .start()
    )


def fails_at_first_trigger(query: StreamingQuery, message: str) -> None:
    """The query ends with an error matching ``message`` before any micro-batch."""
    try:
        with pytest.raises(PySparkException, match=message):
            query.awaitTermination(120)
    finally:
        query.stop()


def test_an_unknown_stream_fails_the_first_plan_naming_each_producer_lacking_it(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``stream`` that a producer lacks (a misspelt name, say) is never read as empty: the
    batch read and the streaming query's first trigger fail, naming the stream asked for and
    each producer lacking it with the streams it has."""
    with (
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
        streamq.SyncProducer(str(tmp_path / "b.db")) as b,
        streamq.SyncProducer(str(tmp_path / "c.db")) as c,
    ):
        for producer in (a, b):
            producer.publish("sales", b"sold")
        c.create_stream("returns")
        two, three = endpoints([a, b]), endpoints([a, b, c])
        on_both = re.escape(
            f"unknown stream 'sale' at 2 of 2 producers: the producer at {a.address} has "
            f"['sales']; the producer at {b.address} has ['sales'] (every producer the query "
            "reads must have the stream"
        )
        with pytest.raises(PySparkException, match=on_both):
            spark.read.format("streamq").options(endpoints=two, stream="sale").load().count()
        on_c = re.escape(
            f"unknown stream 'sales' at 1 of 3 producers: the producer at {c.address} has "
            "['returns'] ("
        )
        with pytest.raises(PySparkException, match=on_c):
            spark.read.format("streamq").options(endpoints=three, stream="sales").load().count()

        for on_driver in ("false", "true"):
            seen: list[int] = []
            ck = tmp_path / f"ck-{on_driver}"
            query = stream_query(spark, three, "sales", ck, seen, readOnDriver=on_driver)
            fails_at_first_trigger(query, on_c)
            assert seen == []
        seen = []
        query = stream_query(spark, two, "sale", tmp_path / "ck-sale", seen)
        fails_at_first_trigger(query, on_both)
        assert seen == []

        # Once c has the stream, the same query reads every producer.
        c.create_stream("sales")
        read = spark.read.format("streamq").options(endpoints=three, stream="sales").load()
        assert seqs_by_producer(read) == {a.producer_id: [1], b.producer_id: [1]}


def test_wrong_endpoints_fail_the_first_plan_naming_the_address(
    spark: SparkSession, tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    """Nothing listening, a port that never answers, an endpoint not of the form host:port:
    an error naming the address (within timeoutMs), not a hang or an empty answer."""
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a:
        a.publish("orders", b"1")
        dead = f"127.0.0.1:{reserve_port()}"  # nothing listens there
        seen: list[int] = []
        query = stream_query(spark, f"{a.address},{dead}", "orders", tmp_path / "ck", seen)
        fails_at_first_trigger(query, f"producer at {dead}: cannot connect")
        assert seen == []

        with socket.socket() as silent:  # connections complete in its backlog, unanswered
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            mute = f"127.0.0.1:{silent.getsockname()[1]}"
            with pytest.raises(PySparkException, match=f"no SERVER_HELLO from {mute} within 0.5 s"):
                read(spark, f"{a.address},{mute}", timeoutMs="500").count()

        with pytest.raises(PySparkException, match="endpoints: address must be HOST:PORT, not"):
            read(spark, f"{a.address},localhost").count()


def first_line(error: PySparkException) -> str:
    return str(error).splitlines()[0]


def test_an_option_error_comes_before_sparks_traceback_not_under_it(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Spark puts a source's error under the traceback its Python worker formats (7 to 22
    lines): the line opens the message instead, when Spark plans a batch read, creates a
    streaming query's source, and asks that source for offsets."""
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a:
        a.publish("orders", b"1")
        # A misspelt option is refused, naming the option it resembles as it is spelt:
        # Spark hands a source the names in lower case.
        with pytest.raises(PySparkException) as misspelt:
            read(spark, a.address, changeColumn="true").count()
        line = "unknown option 'changecolumn' (did you mean 'changeColumns'?)"
        assert line in first_line(misspelt.value)
        seen: list[int] = []
        with pytest.raises(PySparkException) as misspelt:
            stream_query(spark, a.address, "orders", tmp_path / "ck", seen, startingOffset="x")
        line = "unknown option 'startingoffset' (did you mean 'startingOffsets'?)"
        assert line in first_line(misspelt.value)
        assert read(spark, a.address, CHANGECOLUMNS="false").count() == 1  # names: any case
        with pytest.raises(PySparkException) as invalid:
            read(spark, a.address, startingOffsets="first").count()  # planning the read
        assert "startingOffsets must be 'earliest', 'latest' or" in first_line(invalid.value)

        query = stream_query(
            spark, a.address, "orders", tmp_path / "ck2", seen, maxRecordsPerTrigger="x"
        )
        try:
            with pytest.raises(PySparkException) as invalid:
                query.awaitTermination(120)
        finally:
            query.stop()
        assert "option maxRecordsPerTrigger must be an integer" in first_line(invalid.value)
        assert seen == []


def test_replaced_producer_fails_a_running_query(
    spark: SparkSession, tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    port = reserve_port()  # the original's, then its replacement's
    original = streamq.SyncProducer(str(tmp_path / "a.db"), port=port)
    original.publish("orders", b"1")
    run_available_now(spark, original.address, tmp_path / "ck", tmp_path / "out")
    original_id = original.producer_id
    original.close()
    with streamq.SyncProducer(str(tmp_path / "replacement.db"), port=port) as replacement:
        replacement.publish("orders", b"other 1")
        replacement.publish("orders", b"other 2")
        with pytest.raises(PySparkException, match=f"producer {original_id}, read up to seq 1"):
            run_available_now(spark, replacement.address, tmp_path / "ck", tmp_path / "out")
    assert spark.read.parquet(str(tmp_path / "out")).count() == 1


@pytest.mark.slow
def test_spark_demo_counts_every_sale_once() -> None:
    demo = subprocess.run(
        [sys.executable, "-m", "spark_source.demo", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "each shop's own database" in demo.stdout and "FAIL" not in demo.stdout
    # Spark starts quiet (spark_source.session): no log lines, no hostname or log4j notices.
    spark_noise = re.compile(
        r"\b(WARN|INFO)\b|log4j|loopback address|native-hadoop|Setting default log level"
    )
    noise = [line for line in demo.stderr.splitlines() if spark_noise.search(line)]
    assert noise == [], noise


def test_producer_added_to_a_running_query_is_read_from_its_start(
    spark: SparkSession, producers: list[streamq.SyncProducer], tmp_path: Path
) -> None:
    a, b, _ = producers
    run_available_now(spark, a.address, tmp_path / "ck", tmp_path / "out")
    run_available_now(spark, f"{a.address},{b.address}", tmp_path / "ck", tmp_path / "out")
    assert seqs_by_producer(spark.read.parquet(str(tmp_path / "out"))) == {
        a.producer_id: list(range(1, 1001)),
        b.producer_id: list(range(1, 2001)),
    }


def test_batch_read_a_postgresql_producer_beside_a_sqlite_one(
    spark: SparkSession, pg_url: str, tmp_path: Path
) -> None:
    """The source speaks the protocol, so the producer's engine is invisible to Spark."""
    with (
        streamq.SyncProducer(pg_url) as on_postgres,
        streamq.SyncProducer(str(tmp_path / "p.db")) as on_sqlite,
    ):
        for producer, name in ((on_postgres, b"pg"), (on_sqlite, b"sqlite")):
            with producer.transaction() as tx:
                tx.publish_many("orders", [b"%s-%d" % (name, n) for n in range(1, 501)])
        df = read(spark, endpoints([on_postgres, on_sqlite]))
        assert seqs_by_producer(df) == {
            on_postgres.producer_id: list(range(1, 501)),
            on_sqlite.producer_id: list(range(1, 501)),
        }
        values = {r.value for r in df.filter("seq = 500").collect()}
        assert values == {b"pg-500", b"sqlite-500"}


def test_a_query_reads_only_the_columns_it_asks_for(
    spark: SparkSession, producers: list[streamq.SyncProducer]
) -> None:
    """includeHeaders=false drops headers (the Kafka source's default columns); a schema
    given with .schema(...) picks columns by name, in its order."""
    eps = endpoints(producers)
    no_headers = read(spark, eps, includeHeaders="false")
    assert no_headers.columns == [f.name for f in SCHEMA.fields if f.name != "headers"]
    assert no_headers.count() == 6000
    picked = (
        spark.read.format("streamq")
        .option("endpoints", eps)
        .option("stream", "orders")
        .schema(
            "value binary, seq long, key binary, headers array<struct<key:string,value:binary>>"
        )
        .load()
    )
    assert picked.columns == ["value", "seq", "key", "headers"]
    last = sorted(tuple(r) for r in picked.filter("key is not null").collect())
    assert [(r[0], r[2], [tuple(h) for h in r[3]]) for r in last] == [
        (b"last", b"k%d" % i, [("h", b"v")]) for i in range(3)
    ]
    stream = (
        spark.readStream.format("streamq")
        .option("endpoints", eps)
        .option("stream", "orders")
        .option("startingOffsets", "earliest")
        .schema("seq long")
        .load()
    )
    assert stream.columns == ["seq"]
    headers = "headers array<struct<key:string,value:binary>>"
    for schema, options, error in [
        ("nope int", {}, "no column 'nope'"),
        ("seq string", {}, "column 'seq' is bigint, not string"),
        ("key binary not null", {}, "column 'key' is nullable"),
        (headers, {"includeHeaders": "false"}, "includeHeaders=false, but the schema given"),
    ]:
        given = spark.read.format("streamq").schema(schema).options(**options)
        with pytest.raises(PySparkException, match=error):
            given.option("endpoints", eps).option("stream", "orders").load().count()


def test_read_on_driver_and_a_batch_replayed_after_a_restart(
    spark: SparkSession, producers: list[streamq.SyncProducer], tmp_path: Path
) -> None:
    """readOnDriver=true: the driver reads each micro-batch as it plans it (maxRecordsPerTrigger
    still applies); a batch replayed after a restart is read again from the producers."""
    seen: dict[int, list[tuple[str, int]]] = {}

    def sink(df: DataFrame, batch_id: int) -> None:
        seen[batch_id] = sorted((r.producer, r.seq) for r in df.select("producer", "seq").collect())

    def run() -> None:
        query = (
            spark.readStream.format("streamq")
            .option("endpoints", endpoints(producers))
            .option("stream", "orders")
            .option("startingOffsets", "earliest")
            .option("readOnDriver", "true")
            .option("maxRecordsPerTrigger", "2500")
            .load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        assert query.awaitTermination(120), "AvailableNow query did not finish"

    run()
    assert [len(seen[b]) for b in sorted(seen)] == [2500, 2500, 1000]
    assert sorted(r for rows in seen.values() for r in rows) == sorted(
        (p.producer_id, seq)
        for i, p in enumerate(producers)
        for seq in range(1, 1000 * (i + 1) + 1)
    )
    # The sink never committed the last batch: the restarted query reads it again, the same.
    for name in ("2", ".2.crc"):
        (tmp_path / "ck" / "commits" / name).unlink()
    last = seen.pop(2)
    run()
    assert seen[2] == last


class Seen:
    """A ``foreachBatch`` sink that keeps each row's (producer, seq)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int]] = []

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        self.rows.extend((r.producer, r.seq) for r in df.select("producer", "seq").collect())

    def read(self, producer_id: str, seq: int) -> bool:
        return (producer_id, seq) in list(self.rows)


def start_into(seen: Seen, reader: DataStreamReader, checkpoint: Path) -> StreamingQuery:
    """``reader``'s stream of ``orders``, from the earliest seq, into ``seen``."""
    return (
        reader.format("streamq")
        .options(stream="orders", startingOffsets="earliest")
        .load()
        .writeStream.foreachBatch(seen)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )


@pytest.mark.parametrize("on_driver", ["false", "true"])
def test_a_producer_down_delays_only_its_own_records(
    spark: SparkSession, tmp_path: Path, on_driver: str
) -> None:
    """A producer the running query reads stops: the query goes on with the others, then
    reads the stopped one's records from where it stopped once it is back on its address.
    Every record once."""
    seen = Seen()
    a = streamq.SyncProducer(str(tmp_path / "a.db"))
    b = streamq.SyncProducer(str(tmp_path / "b.db"))
    query = None
    try:
        for producer in (a, b):
            producer.publish("orders", b"first")
        b_address, b_id = b.address, b.producer_id
        reader = spark.readStream.options(
            endpoints=f"{a.address},{b_address}", readOnDriver=on_driver
        )
        query = start_into(seen, reader, tmp_path / "ck")
        wait_until(lambda: seen.read(b_id, 1) and seen.read(a.producer_id, 1), "seq 1", 120)
        b.close()
        a.publish("orders", b"while b is down")
        wait_until(lambda: seen.read(a.producer_id, 2), "a's seq 2 while b is down", 120)
        assert query.isActive
        b = streamq.SyncProducer(str(tmp_path / "b.db"), port=parse_address(b_address)[1])
        b.publish("orders", b"back")
        wait_until(lambda: seen.read(b_id, 2), "b's seq 2 once it is back", 120)
    finally:
        if query is not None:
            query.stop()
        a.close()
        b.close()
    assert sorted(seen.rows) == sorted(
        [(a.producer_id, 1), (a.producer_id, 2), (b_id, 1), (b_id, 2)]
    )


def test_a_paused_producer_delays_only_its_own_records(spark: SparkSession, tmp_path: Path) -> None:
    """A producer the running query reads stops answering (SIGSTOP, as an overloaded or
    stuck machine would) with records it has not served: once a trigger asks it (after
    its quiet watch is no longer believed), each passes it over after ``slowProducerMs``
    and reads the others; once it answers again, its records are read. Every record once."""
    seen = Seen()
    db = str(tmp_path / "b.db")
    with streamq.SyncProducer(db, serve=False) as b:
        b.publish("orders", b"first")
    query = None
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a, hosted(db) as (b_id, address, b):
        try:
            a.publish("orders", b"first")
            reader = spark.readStream.options(
                endpoints=f"{a.address},{address}", slowProducerMs="500", timeoutMs="120000"
            )
            query = start_into(seen, reader, tmp_path / "ck")
            wait_until(lambda: seen.read(b_id, 1) and seen.read(a.producer_id, 1), "seq 1", 120)
            b.send_signal(signal.SIGSTOP)
            with sqlite3.connect(db) as conn:  # another process's commit, unseen by b
                streamq.publish(conn, "orders", b"while paused")
            wait_until(lambda: unread(address) > 0, "the query to ask paused b", 120)
            a.publish("orders", b"after b was asked")
            # Well within timeoutMs: the trigger did not wait for b to answer or time out.
            wait_until(lambda: seen.read(a.producer_id, 2), "a's seq 2 while b is paused", 60)
            assert query.isActive and not seen.read(b_id, 2)
            b.send_signal(signal.SIGCONT)
            wait_until(lambda: seen.read(b_id, 2), "b's seq 2 once it answers", 120)
        finally:
            if query is not None:
                query.stop()
    assert sorted(seen.rows) == sorted(
        [(a.producer_id, 1), (a.producer_id, 2), (b_id, 1), (b_id, 2)]
    )
