"""``df.write.format("streamq")`` and ``df.writeStream.format("streamq")``: the sink.

Spark writes rows into a producer database with streamq's own append path (the engine's,
which ``streamq.publish`` takes through an application's connection), so the stream they
land in is an ordinary streamq stream: ``streamq serve DB`` serves it to consumers,
groups, retention and the console like any other.

Exactly once, per query and micro-batch. The executors encode their partition's rows as
the log stores them (``write``: ``records.Unnumbered``, each task beside the others) and
hand them to the driver in their commit message, writing nothing; the driver's
``commit(messages, batchId)`` appends the records of every message as they are, partition
0's first, in ONE transaction of the producer's database (a few INSERTs, no step a record
in Python), together with a marker row (the query, the batch) in the sink's own table,
``spark_streamq_batches``. A batch that Spark runs again (a driver killed after that
commit but before Spark's own commit log has it, a restart from the checkpoint) finds its
marker and publishes nothing; a task retried, or run twice by speculation, only counts
through the one message Spark commits; an aborted batch wrote nothing anywhere. A
connection lost while committing (PostgreSQL restarting) is retried for
``unreachableTimeoutMs``: the marker makes a commit that did land before the loss publish
nothing the second time.

The query's identity is the id Spark keeps in ``<checkpointLocation>/metadata`` (the
same across restarts from one checkpoint, and never the same for two queries): Spark
hands a Python sink the ``checkpointLocation`` option (as ``checkpointlocation``), and
nothing else that names the query (measured with PySpark 4.x: the writer's options are
the user's, plus that one; ``batchId`` reaches ``commit`` only). A checkpoint the
driver's Python cannot read (``s3a://``, ``hdfs://``) names the query by its location
instead, which is as stable, until the checkpoint is moved.

Why rows travel in commit messages rather than through a staging table in the producer's
database: measured on a local[4] session (``python -m bench.spark.sink_staging``: 200,000
rows, 100-byte values, SQLite, 2026-12-06 on a shared 2-core machine), shipping published
115,000 to 144,000 rows/s at 1 partition and 107,000 to 171,000 at 4; staging 106,000 to
112,000 and 104,000 to 109,000. Staging writes every row twice, once by the executors
(into one SQLite file, whose writers queue) and once as the driver moves the committed
attempts' rows into the log, which reads them back to number and encode them; its
leftovers (a killed attempt's rows, an aborted batch's) need sweeping; and executors
must reach the database, which a SQLite file on the driver's disk is not on a cluster.
Shipping's cost is memory: a micro-batch's rows pass through the driver, so keep
micro-batches to what the driver holds (``maxRecordsPerTrigger`` on streamq's source,
``maxOffsetsPerTrigger`` on Kafka's; Spark's ``spark.driver.maxResultSize``, 1 GiB by
default, bounds the messages).

A batch write (``df.write``) is one transaction too, marked with an id drawn when Spark
plans the write: the job commits everything or nothing, but running the same write again
is a second job, which publishes its rows again (as Kafka's sink would).

Options, named as the Kafka sink's where they mean the same (``SINK_OPTIONS``):

=======================  =============================================================
db                       the producer database: a SQLite file's absolute path (local: the
                         driver writes it) or a ``postgresql://`` URL. Its log tables
                         must exist (``streamq init DB``, or a ``streamq serve`` once)
stream                   the stream written to; without it, each row's ``stream`` column
                         (as Kafka's ``topic`` option and column: the option wins)
checkpointLocation       Spark's own, required for streaming queries: names the query
unreachableTimeoutMs     a database lost while committing is tried again this long
                         (default 120000); then the batch fails, and the query with it
=======================  =============================================================

Columns: ``value`` (binary or string, required, never null), ``key`` (binary or string),
``headers`` (``array<struct<key:string,value:binary>>``, Kafka's; string values too),
``stream`` (string), ``timestamp`` (timestamp, or long milliseconds; default: when the
task wrote the row, by its executor's clock, as a Kafka producer stamps a record it
sends). Other columns are ignored, as Kafka's sink ignores them, unless a name looks like
a misspelt one of these.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    LongType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from streamq import DatabaseOpenError
from streamq.engines import for_connection, for_target, is_postgres_url
from streamq.records import DEFAULT_MAX_RECORD_SIZE, Unnumbered, check_stream_name

from .datasource import _int, check_option_names
from .first_line import errors_said_first
from .planning import StreamQSourceError
from .shipping import Shipped

SINK_OPTIONS = ("db", "stream", "checkpointLocation", "unreachableTimeoutMs", "path")
# The Kafka sink's options a user moving from it may give, and this sink's for them.
_KAFKAS = {"topic": "stream", "kafka.bootstrap.servers": "db"}
COLUMNS = ("value", "key", "headers", "stream", "timestamp")
MARKERS = "spark_streamq_batches"
# Markers a query keeps: Spark replays only batches after the last one its checkpoint
# committed, and keeps 100 batches of history (spark.sql.streaming.minBatchesToRetain).
MARKERS_KEPT = 1000
_RETRY_PAUSE = (0.1, 2.0)  # seconds between tries to commit through a lost connection

# The normalized rows of a task: what a record is made of.
PART_SCHEMA = pa.schema(
    [
        ("stream", pa.string()),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        ("timestamp", pa.int64()),
    ]
)


@dataclass
class Part(WriterCommitMessage):
    """A task attempt's rows, encoded as stored, by stream, for the driver to append if
    Spark commits it."""

    partition: int
    streams: dict[str, Unnumbered]


# --- the options and columns, checked where Spark plans the write --------------------


@dataclass(frozen=True, slots=True)
class SinkSettings:
    """The options and the DataFrame's columns, checked once, before anything is
    written; plain data, pickled to the executors."""

    db: str
    stream: str | None  # None: each row's ``stream`` column
    checkpoint: str | None
    unreachable_timeout: float
    columns: tuple[str, ...]  # of COLUMNS, as the DataFrame has them
    timestamp_unit: str | None  # "ms" for a long column, "us" for a timestamp one


def sink_settings(options: Mapping[str, str], schema: StructType) -> SinkSettings:
    """``options`` and ``schema`` checked, or one line naming the fix."""
    for given in options:
        if given.lower() in _KAFKAS:
            raise StreamQSourceError(
                f"option {given!r} is the Kafka sink's: this sink's is {_KAFKAS[given.lower()]!r}"
            )
    check_option_names(options, SINK_OPTIONS)
    if options.get("path"):
        raise StreamQSourceError(
            "the sink writes to the database given as option 'db', not a path: "
            ".option('db', ...) instead of .save(path) or .start(path)"
        )
    db = options.get("db")
    if not db:
        raise StreamQSourceError(
            "set option 'db': the producer database to write into (a SQLite file's path "
            "or a postgresql:// URL)"
        )
    stream = options.get("stream") or None
    if stream is not None:
        _check_stream(stream, "option 'stream'")
    columns, unit = _columns(schema, stream is not None)
    timeout = (_int(options, "unreachableTimeoutMs", 120_000) or 0) / 1000
    _check_database(db)
    return SinkSettings(db, stream, options.get("checkpointLocation"), timeout, columns, unit)


_BYTES_LIKE = (BinaryType, StringType)
_HEADERS_TYPE = "array<struct<key:string,value:binary>>"


def _columns(schema: StructType, stream_option: bool) -> tuple[tuple[str, ...], str | None]:
    """The sink's columns in ``schema``, their types checked; and the timestamp's unit."""
    fields = {field.name.lower(): field for field in schema.fields}
    for name, field in fields.items():
        near = difflib.get_close_matches(name, COLUMNS, n=1, cutoff=0.75)
        if name not in COLUMNS and near and near[0] not in fields:
            raise StreamQSourceError(
                f"column {field.name!r} is not one the sink writes: did you mean "
                f"{near[0]!r}? (rename it: .withColumnRenamed({field.name!r}, {near[0]!r}))"
            )
    if "value" not in fields:
        have = ", ".join(schema.fieldNames()) or "none"
        raise StreamQSourceError(
            f"the sink needs a 'value' column (binary or string); the DataFrame has {have}: "
            "select one as value, e.g. .selectExpr('CAST(x AS STRING) AS value')"
        )
    for name in ("value", "key"):
        if name in fields and not isinstance(fields[name].dataType, _BYTES_LIKE):
            _wrong_type(name, fields[name].dataType, "binary or string")
    if "headers" in fields and not _headers_type(fields["headers"].dataType):
        _wrong_type("headers", fields["headers"].dataType, _HEADERS_TYPE)
    if "stream" in fields and not isinstance(fields["stream"].dataType, StringType):
        _wrong_type("stream", fields["stream"].dataType, "string")
    if "stream" not in fields and not stream_option:
        raise StreamQSourceError(
            "set option 'stream', or give the rows a 'stream' column: the stream to write to"
        )
    unit = None
    if "timestamp" in fields:
        kind = fields["timestamp"].dataType
        if isinstance(kind, TimestampType | TimestampNTZType):
            unit = "us"
        elif isinstance(kind, LongType):
            unit = "ms"
        else:
            _wrong_type("timestamp", kind, "timestamp or long (milliseconds)")
    return tuple(name for name in COLUMNS if name in fields), unit


def _headers_type(kind: DataType) -> bool:
    if not isinstance(kind, ArrayType) or not isinstance(kind.elementType, StructType):
        return False
    inner = {f.name: f.dataType for f in kind.elementType.fields}
    return (
        set(inner) == {"key", "value"}
        and isinstance(inner["key"], StringType)
        and isinstance(inner["value"], _BYTES_LIKE)
    )


def _wrong_type(name: str, kind: DataType, wanted: str) -> None:
    raise StreamQSourceError(
        f"column {name!r} is {kind.simpleString()}: the sink takes {wanted} (cast it)"
    )


def _check_stream(name: str, what: str) -> str:
    try:
        return check_stream_name(name)
    except (TypeError, ValueError) as exc:
        raise StreamQSourceError(f"{what}: {exc}") from None


def _check_database(db: str) -> None:
    """The database exists and has the log tables: refused now, on the driver, rather
    than in the first commit, after Spark ran the batch. Spark plans each micro-batch's
    write anew: a server that cannot be reached now (restarting) is left to the commit,
    which tries again for ``unreachableTimeoutMs``."""
    try:
        tables = for_target(db).tables(db)
    except (DatabaseOpenError, ImportError) as exc:
        if _Database(db).lost(exc):
            return
        raise StreamQSourceError(f"option db: {exc}") from None
    if not tables.log:
        raise StreamQSourceError(
            f"{tables.where} has no streamq log tables: create them with 'streamq init {db}' "
            "(or serve it once with 'streamq serve --init')"
        )


# --- on the executors: a partition's rows, converted ---------------------------------


def converted(settings: SinkSettings, batches: Iterator[pa.RecordBatch]) -> Part:
    """The task's rows as a ``Part``: each stream's records encoded as the log stores
    them, here, beside the other tasks, so that the driver's commit only inserts them; a
    null value or a row without a stream refused in one line. Rows without a timestamp
    are stamped now, as the task writes them."""
    context = TaskContext.get()
    partition = context.partitionId() if context is not None else 0
    now = int(time.time() * 1000)
    tables = [_normalized(settings, batch) for batch in batches]
    rows = pa.concat_tables(tables) if tables else PART_SCHEMA.empty_table()
    if settings.stream is not None:
        by_stream = {settings.stream: rows}
    else:
        streams = rows.column("stream")
        by_stream = {s: rows.filter(pc.equal(streams, s)) for s in pc.unique(streams).to_pylist()}
    return Part(partition, {s: _encoded(t, now) for s, t in by_stream.items() if t.num_rows})


def _encoded(rows: pa.Table, now: int) -> Unnumbered:
    values = rows.column("value").to_pylist()
    keys, headers, stamps = (rows.column(name) for name in ("key", "headers", "timestamp"))
    if keys.null_count == headers.null_count == stamps.null_count == rows.num_rows:
        return Unnumbered.of_values(values, now, DEFAULT_MAX_RECORD_SIZE)  # the common shape
    fields = [{h["key"]: h["value"] or b"" for h in hs or ()} for hs in headers.to_pylist()]
    timestamps = pc.fill_null(stamps, now).to_pylist()
    records = list(zip(values, keys.to_pylist(), fields, timestamps, strict=True))
    return Unnumbered.of(records, DEFAULT_MAX_RECORD_SIZE)


def _normalized(settings: SinkSettings, batch: pa.RecordBatch) -> pa.Table:
    by_name = {name.lower(): batch.column(i) for i, name in enumerate(batch.schema.names)}
    n = batch.num_rows
    arrays: list[pa.Array] = []
    for field in PART_SCHEMA:
        name = field.name
        if name not in settings.columns or (name == "stream" and settings.stream):
            arrays.append(pa.nulls(n, field.type))
            continue
        column = by_name[name]
        if name == "timestamp":
            column = pc.cast(column, pa.int64())
            if settings.timestamp_unit == "us":
                column = pc.divide(column, 1000)
        elif name == "headers":
            column = _headers(column)
        else:
            column = pc.cast(column, field.type)
        arrays.append(column)
    table = pa.Table.from_arrays(arrays, schema=PART_SCHEMA)
    if table.column("value").null_count:
        raise StreamQSourceError(
            "a row's value is null: streamq records always have one (filter the nulls "
            "out, or write an empty value: coalesce(value, ''))"
        )
    if settings.stream is None:
        streams = table.column("stream")
        if streams.null_count:
            raise StreamQSourceError(
                "a row's stream is null: fill the 'stream' column, or set option 'stream'"
            )
        for name in pc.unique(streams).to_pylist():
            _check_stream(name, "column 'stream'")
    return table


def _headers(column: pa.Array) -> pa.Array:
    """Kafka's headers, their values as binary whether given as binary or string."""
    wanted = PART_SCHEMA.field("headers").type
    if column.type != wanted:
        column = pc.cast(column, wanted)
    return column


# --- on the driver: one transaction per batch ----------------------------------------


def records_of(parts: Sequence[Part | None]) -> dict[str, Unnumbered]:
    """Each stream's records, in partition order then row order."""
    ordered = sorted((p for p in parts if p is not None), key=lambda p: p.partition)
    streams = dict.fromkeys(s for part in ordered for s in part.streams)
    return {
        s: Unnumbered.joined(part.streams[s] for part in ordered if s in part.streams)
        for s in streams
    }


class _Database:
    """What the sink's transaction needs from an engine: a connection in a transaction,
    its parameter style, and whether an error is the connection lost (worth a retry)."""

    def __init__(self, db: str) -> None:
        self.db = db
        self.postgres = is_postgres_url(db)
        self.mark = "%s" if self.postgres else "?"

    def connect(self) -> Any:
        if self.postgres:
            from streamq.engines.postgres.driver import connect

            return connect(self.db, "the sink's database", autocommit=False)
        conn = sqlite3.connect(self.db, timeout=60, isolation_level=None)
        conn.execute("PRAGMA busy_timeout = 60000")
        return conn

    def begin(self, conn: Any) -> None:
        if not self.postgres:  # the write lock first: no deadlock upgrading a read lock
            conn.execute("BEGIN IMMEDIATE")

    def lost(self, error: BaseException) -> bool:
        if not self.postgres:
            return False
        from streamq.engines.postgres.driver import connection_lost

        return connection_lost(error)


def publish_once(
    settings: SinkSettings, query: str, batch: int, parts: Sequence[Part | None]
) -> int | None:
    """Publish ``parts`` and the marker (``query``, ``batch``) in one transaction; returns
    the records published, or None where the marker was there already (a replay)."""
    records = records_of(parts)
    count = sum(map(len, records.values()))
    database = _Database(settings.db)
    deadline = time.monotonic() + settings.unreachable_timeout
    pause = _RETRY_PAUSE[0]
    while True:
        conn: Any = None
        try:
            conn = database.connect()
            return _transaction(database, conn, query, batch, records, count)
        except Exception as exc:
            if not database.lost(exc) or time.monotonic() + pause > deadline:
                raise
        finally:
            if conn is not None:
                conn.close()
        time.sleep(pause)  # the database restarting: try again, the marker says if it landed
        pause = min(pause * 2, _RETRY_PAUSE[1])


def _transaction(
    database: _Database,
    conn: Any,
    query: str,
    batch: int,
    records: Mapping[str, Unnumbered],
    count: int,
) -> int | None:
    m = database.mark
    cursor = conn.cursor()
    try:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {MARKERS} (query TEXT NOT NULL, "
            "batch BIGINT NOT NULL, records BIGINT NOT NULL, committed_ms BIGINT NOT NULL, "
            "PRIMARY KEY (query, batch))"
        )
        conn.commit()
        database.begin(conn)
        cursor.execute(
            f"INSERT INTO {MARKERS} (query, batch, records, committed_ms) "
            f"VALUES ({m}, {m}, {m}, {m}) ON CONFLICT DO NOTHING",
            (query, batch, count, int(time.time() * 1000)),
        )
        if cursor.rowcount == 0:  # published before: a replay
            conn.rollback()
            return None
        cursor.execute(
            f"DELETE FROM {MARKERS} WHERE query = {m} AND batch < {m}",
            (query, batch - MARKERS_KEPT),
        )
        engine, dbapi = for_connection(conn)
        for stream, stream_records in records.items():
            engine.append_unnumbered(dbapi, stream, stream_records)
        conn.commit()
        return count
    except BaseException:
        with contextlib.suppress(Exception):  # a lost connection rolled it back already
            conn.rollback()
        raise
    finally:
        cursor.close()


def query_identity(checkpoint: str | None) -> str:
    """The query's id from its checkpoint's ``metadata`` (see the module docstring)."""
    if not checkpoint:
        raise StreamQSourceError(
            "set option 'checkpointLocation' on the streaming query: the sink knows the query "
            "by its checkpoint, to publish each micro-batch once, and Spark does not show it "
            "spark.sql.streaming.checkpointLocation"
        )
    url = urlparse(checkpoint)
    if url.scheme not in ("", "file"):
        return f"checkpoint {checkpoint}"
    path = unquote(url.path) if url.scheme else checkpoint
    try:
        with open(os.path.join(os.path.abspath(path), "metadata"), encoding="utf-8") as meta:
            return f"query {json.loads(meta.readline())['id']}"
    except (OSError, ValueError, KeyError) as exc:
        raise StreamQSourceError(
            f"cannot read the query's id from {path}/metadata ({exc}): the sink names the "
            "query by it; give checkpointLocation as an absolute path"
        ) from None


# --- the writers Spark calls ---------------------------------------------------------


@errors_said_first
class StreamQWriter(Shipped, DataSourceArrowWriter):
    """``df.write.format("streamq")``: one transaction for the job, marked with an id
    drawn here, so a commit retried through a lost connection publishes once."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings
        self.job = f"write {uuid.uuid4()}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return converted(self.settings, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        publish_once(self.settings, self.job, 0, _parts(messages))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to undo: the executors wrote nothing but their messages."""


@errors_said_first
class StreamQStreamWriter(Shipped, DataSourceStreamArrowWriter):
    """``df.writeStream.format("streamq")``: one transaction per micro-batch, with its
    marker (module docstring)."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return converted(self.settings, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        query = query_identity(self.settings.checkpoint)
        publish_once(self.settings, query, batchId, _parts(messages))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: the executors wrote nothing but their messages."""


def _parts(messages: Sequence[WriterCommitMessage | None]) -> list[Part | None]:
    parts: list[Part | None] = []
    for message in messages:
        if message is not None and not isinstance(message, Part):
            kind = type(message).__name__
            raise StreamQSourceError(f"not a streamq sink's commit message: {kind}")
        parts.append(message)
    return parts


def batch_writer(options: Mapping[str, str], schema: StructType, overwrite: bool) -> StreamQWriter:
    """The batch writer, or one line: Kafka's sink refuses overwriting too."""
    if overwrite:
        raise StreamQSourceError(
            "the sink appends to a stream: use .mode('append') (a stream is never overwritten)"
        )
    return StreamQWriter(sink_settings(options, schema))


def stream_writer(options: Mapping[str, str], schema: StructType) -> StreamQStreamWriter:
    """The micro-batch writer, or one line; the checkpoint is required (``query_identity``)."""
    settings = sink_settings(options, schema)
    if not settings.checkpoint:
        query_identity(None)
    return StreamQStreamWriter(settings)
