"""``spark.readStream.format("streamq")`` and ``spark.read.format("streamq")``.

The driver asks each producer for its head (``planning``) on connections it
keeps from one trigger to the next; executors read exactly ``[start, end)`` per
partition with a range request and yield Arrow record batches of the columns the
query reads (``schema``). Nothing is buffered between producer and Spark: the producer's
own log is the durable, re-readable source, so a restarted query re-reads the
same seqs from its checkpointed offsets and sinks get every record once.

Options (names follow Spark's Kafka source where the meaning is the same; any other is
refused, naming the nearest of these: ``check_option_names``):

=======================  =============================================================
endpoints                comma-separated ``host:port`` of the producers
endpointsFile            a file with one endpoint per line (instead of, or beside, it)
endpointsProvider        ``module:function`` returning endpoints (e.g. a registry lookup);
                         list, file and provider are read again at every trigger
stream                   the stream to read; a producer without it fails the read (the
                         query's first trigger) naming it and the streams it has
startingOffsets          ``earliest``, ``latest`` or JSON ``{producer id: seq}``
                         (-2 earliest, -1 latest); default: latest (stream),
                         earliest (batch)
startingTimestamp        ms since the epoch: start each producer at its first record
                         stamped at or after it (an index seek); wins over
                         startingOffsets
filterPushdown           batch only: ``true`` hands filters on ``key`` (``=``, ``IN``) and
                         ``seq`` to the producers (needs Spark's
                         ``spark.sql.python.filterPushdown.enabled``, without which
                         Spark refuses every read of a source offering pushdown);
                         ``false`` (default): Spark filters. Spark pushes filters to batch
                         reads of Python sources only, and never a ``startswith`` on a
                         binary column or a match inside ``headers``: the two options
                         below ask the producers for those, in streams and batches
filterKeyPrefix          only records whose key starts with this (UTF-8), chosen by the
                         producers ("Filters" in docs/protocol.md); stream and batch
filterHeaders            JSON ``{"name": "value"}``: only records with these header
                         values (UTF-8), chosen by the producers; stream and batch
endingOffsets            batch only: ``latest`` or JSON; default latest
maxRecordsPerTrigger     at most this many records per micro-batch, in all
minPartitions            at least this many Spark partitions per batch (default 1):
                         set it to the executor cores a read should keep busy
maxRecordsPerPartition   at most about this many records per Spark partition (default
                         1,000,000): larger ranges are split. A partition reads several
                         producers' ranges: a trigger over hundreds of producers costs
                         a few Python tasks, not one per producer
failOnDataLoss           ``true`` (default): fail if needed seqs are gone (retention), or if
                         a producer lost commits the query read (its head went back below
                         the query's offset, or it re-used their seqs: "Epochs");
                         ``false``: skip what retention deleted, and after lost commits
                         go on from the first seq lost, reading what the producer holds now
consumerName             name positions are reported under (default ``spark``;
                         with a token, the producer counts them under its name)
includeHeaders           ``false``: no ``headers`` column (Kafka's source has none by
                         default); default ``true``, the schema before the option existed.
                         A schema given with ``.schema(...)`` picks columns by name instead
changeColumns            ``true``: a captured table's stream (docs/guides/capture.md) as
                         its changes' fields instead of ``value``: ``op``, ``table``,
                         ``xid``, ``lsn``, ``index``, ``changes``, ``unchanged``, and
                         ``new`` and ``old``, structs of the table's columns typed from its
                         catalog (the producer's status report: an admin token); a schema
                         given with ``.schema(...)`` may name them too, typed as it says.
                         Default ``false``: ``value`` as it is, the change's msgpack
readOnDriver             streams: ``true`` reads each micro-batch on the driver as it is
                         planned, with no Python task on the executors: lower latency for
                         small micro-batches; default ``false`` (executors read, for ingest)
timeoutMs                connect and read timeout per request (default 30000)
unreachableTimeoutMs     a producer that cannot be reached while a task reads its planned
                         range (restarting, since the batch was planned) is tried again,
                         from the first seq not yet read, for this long (default 120000,
                         Spark's ``spark.network.timeout``); then the task fails
slowProducerMs           streams: a producer the query reads that has not answered a
                         trigger's questions within this (default 2000) is passed over for
                         that trigger, its records read at a later one; the others go on
ssl.enabled              ``true``: TLS, trusting the system's CAs (implied by ssl.ca)
ssl.ca                   PEM file of the CA that signed the producers' certificates
ssl.cert, ssl.key        client certificate and key (mutual TLS)
ssl.serverName           the name producers' certificates must have (default: the host)
token, tokenFile         the token naming this query's consumer; tokenFile is read on the
                         driver. Files given to ssl.* must exist on every executor.
=======================  =============================================================
"""

from __future__ import annotations

import difflib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
from pyspark import cloudpickle
from pyspark.errors import PySparkNotImplementedError
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
    SimpleDataSourceStreamReader,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from streamq import (
    Client,
    ClientTLS,
    NotAuthorizedError,
    OffsetOutOfRangeError,
    SeqsReusedError,
    StreamQError,
)
from streamq import Filter as RecordFilter
from streamq.errors import IdleTimeoutError
from streamq.protocol import RecordColumns, RecordRows, collector_paused, first_and_last_seq
from streamq.wire.client import RangeRead

from . import planning, shipping
from .first_line import errors_said_first
from .planning import (
    BatchEpochs,
    Connect,
    Connections,
    Offsets,
    Position,
    ProducerState,
    Range,
    Reports,
    StreamQSourceError,
)
from .schema import EVERY_COLUMN, Columns, Part, change_schema, default_schema
from .shipping import Shipped

# Its code travels inside the pickles executors receive: see ``shipping``.
cloudpickle.register_pickle_by_value(shipping)  # type: ignore[no-untyped-call]
logger = logging.getLogger("spark_source")
T = TypeVar("T")

# Rows per Arrow batch: about a RECORDS frame's worth (producers send at most 8,192 records
# per frame by default). Larger batches only make the rows outgrow the CPU's caches.
_ROWS_PER_BATCH = 8192
# An unchanged position is reported again once this many seconds have passed, with the
# next request sent to the producer anyway (a watch renewed at its wait's end, every 1 to
# 2 minutes): a query idle at the head stays "heard of" (producers forget positions not
# reported for days) at no write of its own.
_REPORT_AGAIN = 30.0


# Every option the table above names. Spark hands a source its options with their names
# in lower case (``CaseInsensitiveDict``): each is known by that.
OPTIONS = (
    "endpoints", "endpointsFile", "endpointsProvider", "stream", "startingOffsets",
    "startingTimestamp", "filterPushdown", "filterKeyPrefix", "filterHeaders",
    "endingOffsets", "maxRecordsPerTrigger", "minPartitions", "maxRecordsPerPartition",
    "failOnDataLoss", "consumerName", "includeHeaders", "changeColumns", "readOnDriver",
    "timeoutMs", "unreachableTimeoutMs", "slowProducerMs", "ssl.enabled", "ssl.ca",
    "ssl.cert", "ssl.key", "ssl.serverName", "token", "tokenFile",
)  # fmt: skip
_KNOWN = {name.lower(): name for name in OPTIONS}


def check_option_names(options: Mapping[str, str], known: Sequence[str] = OPTIONS) -> None:
    """Refuse an option not in ``known`` (the source's, by default), naming the nearest
    that is: a misspelt option would otherwise be ignored, and the query read (or write)
    something else than asked. Spark hands the names over in lower case, the user's
    spelling lost on its side (its ``CaseInsensitiveMap`` iterates over lowered keys), so
    the hint spells the known one."""
    by_lower = _KNOWN if known is OPTIONS else {name.lower(): name for name in known}
    for given in options:
        if given.lower() in by_lower:
            continue
        near = difflib.get_close_matches(given.lower(), list(by_lower), n=1, cutoff=0.6)
        hint = f"did you mean {by_lower[near[0]]!r}?" if near else "docs/guides/spark.md"
        raise StreamQSourceError(f"unknown option {given!r} ({hint})")


def _flag(options: Mapping[str, str], name: str, default: bool) -> bool:
    value = options.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false"):
        raise StreamQSourceError(f"option {name} must be true or false, not {value!r}")
    return value.lower() == "true"


def _int(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = options.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise StreamQSourceError(f"option {name} must be an integer, not {value!r}") from None
    if number <= 0:
        raise StreamQSourceError(f"option {name} must be positive, not {number}")
    return number


def _tls(options: Mapping[str, str]) -> ClientTLS | None:
    ca, cert, key = options.get("ssl.ca"), options.get("ssl.cert"), options.get("ssl.key")
    server_name = options.get("ssl.serverName")
    if not (_flag(options, "ssl.enabled", False) or ca or cert or key or server_name):
        return None
    try:
        return ClientTLS(ca, cert, key, server_name)
    except ValueError as exc:
        raise StreamQSourceError(f"ssl options: {exc}") from None


def _record_filter(options: Mapping[str, str]) -> RecordFilter | None:
    """``filterKeyPrefix`` and ``filterHeaders`` as the filter ranges ask producers for."""
    prefix, headers = options.get("filterKeyPrefix"), options.get("filterHeaders")
    if prefix is None and headers is None:
        return None
    matches: dict[str, bytes] = {}
    if headers is not None:
        try:
            given = json.loads(headers)
        except ValueError:
            given = None
        if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
            raise StreamQSourceError(
                f'option filterHeaders must be a JSON object of strings, such as {{"type": '
                f'"order.created"}}, not {headers!r}'
            )
        matches = {name: value.encode() for name, value in given.items()}
    try:
        return RecordFilter(None if prefix is None else prefix.encode(), matches)
    except ValueError as exc:
        raise StreamQSourceError(f"options filterKeyPrefix/filterHeaders: {exc}") from None


def _token(options: Mapping[str, str]) -> str | None:
    token, token_file = options.get("token"), options.get("tokenFile")
    if token_file is None:
        return token
    try:
        with open(token_file) as file:
            return file.readline().strip()
    except OSError as exc:
        raise StreamQSourceError(f"option tokenFile: {exc}") from None


def _default_schema(options: Mapping[str, str]) -> StructType:
    include_headers = _flag(options, "includeHeaders", True)
    if _flag(options, "changeColumns", False):
        return change_schema(_captured_columns(options), include_headers)
    return default_schema(include_headers)


def _captured_columns(options: Mapping[str, str]) -> list[dict[str, Any]]:
    """The columns of the table captured into the stream, as the first producer that
    answers reports them (its status report: ``capture.columns``)."""
    stream = options.get("stream")
    if not stream:
        raise StreamQSourceError("set option 'stream'")
    connect, failures = _connect(options), []
    for endpoint in planning.parse_endpoints(*_endpoint_options(options)):
        try:
            with connect.client(endpoint, "spark schema") as client:
                status = client.status()
        except NotAuthorizedError:
            raise StreamQSourceError(
                f"changeColumns types new and old from the producer's catalog, in its status "
                f"report, which {endpoint} gives only to an admin token: use one, or give "
                "the columns with .schema(...)"
            ) from None
        except (OSError, StreamQError) as exc:
            failures.append(f"{endpoint}: {exc}")
            continue
        columns = (status.get("capture") or {}).get("columns", {}).get(stream)
        if columns is None:
            raise StreamQSourceError(
                f"changeColumns: the producer at {endpoint} captures no table into stream "
                f"{stream!r}"
            )
        return list(columns)
    raise StreamQSourceError(
        f"changeColumns: no producer told the columns of stream {stream!r} ({'; '.join(failures)})"
    )


def _endpoint_options(options: Mapping[str, str]) -> tuple[str | None, ...]:
    """The endpoints list, file and provider, for ``planning.parse_endpoints``."""
    return tuple(options.get(name) for name in ("endpoints", "endpointsFile", "endpointsProvider"))


def _connect(options: Mapping[str, str]) -> Connect:
    """How the query reaches producers: its timeouts, TLS and token."""
    timeout = (_int(options, "timeoutMs", 30_000) or 30_000) / 1000
    patience = (_int(options, "slowProducerMs", 2_000) or 2_000) / 1000
    unreachable = (_int(options, "unreachableTimeoutMs", 120_000) or 120_000) / 1000
    return Connect(timeout, _tls(options), _token(options), patience, unreachable)


def _columns(options: Mapping[str, str], schema: StructType | None) -> Columns:
    """The columns to build: the schema Spark hands the reader (ours, or one given with
    ``.schema(...)``), or ours (None). Ours, with ``changeColumns``, holds the captured
    table's columns as they were: changes with others then stop the query
    (``TableChangedError``); a schema given names the columns it wants, and others are
    left out. The catalog is asked once."""
    include_headers = _flag(options, "includeHeaders", True)
    table_columns = None
    if schema is None and _flag(options, "changeColumns", False):
        schema = change_schema(_captured_columns(options), include_headers)
        table_columns = _row_columns(schema)
    elif schema is None:
        schema = default_schema(include_headers)
    elif _flag(options, "changeColumns", False) and "new" in schema.fieldNames():
        try:  # a schema given needs no catalog: without an admin token, there is none
            ours = change_schema(_captured_columns(options), include_headers)
        except StreamQSourceError:
            ours = None
        if ours is not None and ours["new"].dataType == schema["new"].dataType:
            table_columns = _row_columns(ours)
    if not include_headers and "headers" in schema.fieldNames():
        raise StreamQSourceError("includeHeaders=false, but the schema given has headers")
    try:
        return Columns(schema, table_columns)
    except ValueError as exc:
        raise StreamQSourceError(f"schema: {exc}") from None


def _row_columns(schema: StructType) -> list[str]:
    """The table's columns in a change schema: the fields of ``new``."""
    row = schema["new"].dataType
    assert isinstance(row, StructType)
    return row.fieldNames()


class _Settings:
    """The options, parsed and checked once."""

    def __init__(self, options: Mapping[str, str], schema: StructType | None = None) -> None:
        check_option_names(options)
        self.columns = _columns(options, schema)
        self._endpoint_options = _endpoint_options(options)
        self.endpoints()  # fail early on a missing or bad option
        stream = options.get("stream")
        if not stream:
            raise StreamQSourceError("set option 'stream'")
        self.stream = stream
        self.starting = options.get("startingOffsets")
        self.starting_timestamp = _int(options, "startingTimestamp", None)
        self.filter_pushdown = _flag(options, "filterPushdown", False)
        self.record_filter = _record_filter(options)
        self.ending = options.get("endingOffsets", "latest")
        self.max_per_trigger = _int(options, "maxRecordsPerTrigger", None)
        self.min_partitions = _int(options, "minPartitions", 1) or 1
        self.max_per_partition = _int(options, "maxRecordsPerPartition", 1_000_000) or 1_000_000
        self.fail_on_data_loss = _flag(options, "failOnDataLoss", True)
        self.consumer_name = options.get("consumerName", "spark")
        self.read_on_driver = _flag(options, "readOnDriver", False)
        self.connect = _connect(options)

    def endpoints(self) -> list[str]:
        """Read anew at each call: a file or registry may list new producers."""
        return planning.parse_endpoints(*self._endpoint_options)

    def discover(
        self,
        positions: Mapping[str, Position] | None = None,
        via: Connections | None = None,
        reports: Reports | None = None,
        known: Mapping[str, ProducerState] | None = None,
    ) -> dict[str, ProducerState]:
        return planning.discover(
            self.endpoints(), self.stream, via or self.connect, positions, reports, known
        )

    def initial(self, states: Mapping[str, ProducerState], default: str) -> Offsets:
        """Where a query starts: ``startingTimestamp`` if set, else ``startingOffsets``."""
        if self.starting_timestamp is not None:
            return planning.seek_time(states, self.stream, self.starting_timestamp, self.connect)
        return planning.resolve(self.starting or default, states, "startingOffsets")


class StreamQPartition(Shipped, InputPartition):
    """One producer's seqs ``[start, end)``: all an executor needs to read them."""

    def __init__(
        self,
        rng: Range,
        stream: str,
        fail_on_data_loss: bool,
        connect: Connect,
        keys: frozenset[bytes] | None = None,
        epochs: BatchEpochs | None = None,
        record_filter: RecordFilter | None = None,
    ) -> None:
        super().__init__(rng)
        self.range = rng
        self.stream = stream
        self.fail_on_data_loss = fail_on_data_loss
        self.connect = connect
        self.keys = keys  # only these keys' records (a pushed-down filter), read by history
        self.epochs = epochs  # a micro-batch's, for its producer; None: read without epochs
        self.filter = record_filter  # only the records it matches, chosen by the producer


class StreamQTask(Shipped, InputPartition):
    """One Spark partition: several producers' ranges (``planning.pack``), read one after
    another, each on a connection of its own, each asked for ahead (``read_task``)."""

    def __init__(self, parts: list[StreamQPartition]) -> None:
        super().__init__(len(parts))
        self.parts = parts


def _partitions(
    settings: _Settings,
    ranges: Sequence[Range],
    keys: frozenset[bytes] | None = None,
    epochs: Mapping[str, BatchEpochs] | None = None,
) -> list[StreamQTask]:
    if keys is None:
        pieces = planning.plan(ranges, settings.min_partitions, settings.max_per_partition)
    else:  # a few keys' records: one history request per producer and key
        pieces = [r for r in ranges if r.size > 0 and keys]
    epochs = epochs or {}
    return [
        StreamQTask(
            [
                StreamQPartition(
                    r,
                    settings.stream,
                    settings.fail_on_data_loss,
                    settings.connect,
                    keys,
                    epochs.get(r.producer_id),
                    settings.record_filter,
                )
                for r in task
            ]
        )
        for task in planning.pack(pieces, settings.min_partitions, settings.max_per_partition)
    ]


# Ranges of a task whose connections an executor opens together (``read_task``): enough
# that a handshake's round trip is paid once for many, few enough for any fd limit.
OPENED_TOGETHER = 64


def read_task(
    task: StreamQTask, columns: Columns = EVERY_COLUMN, connections: Connections | None = None
) -> Iterator[pa.RecordBatch]:
    """Every range of a Spark partition, in turn (``read_partition``). On an executor, the
    ranges' connections are opened together, ``OPENED_TOGETHER`` at a time, and each range
    is asked for as the one before it is read: a producer prepares its answer while the
    task reads another's, and a range costs no round trip of its own."""
    parts = task.parts
    if connections is not None or any(part.keys is not None for part in parts):
        for part in parts:
            yield from read_partition(part, columns, connections)
        return
    for first in range(0, len(parts), OPENED_TOGETHER):
        group = parts[first : first + OPENED_TOGETHER]
        endpoints = [part.range.endpoint for part in group]
        # One after another: on an executor, threads would only compete with the task's
        # own work for the GIL (a connect to a live producer takes microseconds).
        clients = group[0].connect.clients(endpoints, "spark executor")
        asked: list[_Asked | None] = [None] * len(group)
        try:
            for i, part in enumerate(group):
                asked[i] = asked[i] or _Asked.ask(part, clients[i], columns)
                if i + 1 < len(group):
                    asked[i + 1] = _Asked.ask(group[i + 1], clients[i + 1], columns)
                yield from read_partition(part, columns, asked=asked[i])
        finally:
            for client in clients:
                if isinstance(client, Client):
                    client.close()


@dataclass(frozen=True, slots=True)
class _Asked:
    """A range asked for ahead of its read: its connection, the request sent, and where
    the read stands."""

    client: Client
    reader: RangeRead[RecordRows | RecordColumns]
    state: _PartitionRead

    @classmethod
    def ask(
        cls, partition: StreamQPartition, client: Client | StreamQError, columns: Columns
    ) -> _Asked | None:
        """None if the connection failed or is not the planned producer's: the read then
        makes its own and fails, or tries again, as any read would."""
        if not isinstance(client, Client) or client.producer_id != partition.range.producer_id:
            return None
        state = _PartitionRead(partition)
        reader = _request(client, state, columns)
        try:
            reader.send()
        except StreamQError:
            client.close()
            return None
        return cls(client, reader, state)


def _batch(columns: Columns, rng: Range, stream: str, parts: Sequence[Part]) -> pa.RecordBatch:
    try:
        return columns.batch_of(rng.producer_id, rng.endpoint, stream, parts)
    except ValueError as exc:
        raise StreamQSourceError(f"producer at {rng.endpoint}: {exc}") from exc


def _check_producer(client: Client, rng: Range) -> None:
    if client.producer_id != rng.producer_id:
        raise StreamQSourceError(
            f"{rng.endpoint} now serves producer {client.producer_id}, not "
            f"{rng.producer_id} whose seqs [{rng.start}, {rng.end}) this task reads: "
            "was its database replaced?"
        )


def _read_keys(
    partition: StreamQPartition, keys: frozenset[bytes], columns: Columns
) -> Iterator[pa.RecordBatch]:
    """The records of a few keys in the partition's range, by history requests."""
    rng, stream = partition.range, partition.stream
    try:
        with partition.connect.client(rng.endpoint, "spark executor") as client:
            _check_producer(client, rng)
            low = client.head(stream).low
            if low > rng.start and partition.fail_on_data_loss:
                raise StreamQSourceError(
                    f"producer {rng.producer_id} at {rng.endpoint}, stream {stream!r}: seqs "
                    f"{rng.start}..{low - 1} are gone (retention); set failOnDataLoss=false "
                    "to skip them."
                )
            records = [r for key in keys for r in client.history(stream, key, rng.start, rng.end)]
            if partition.filter is not None:  # history requests take no filter
                matches = partition.filter.matches
                records = [r for r in records if matches(r.key, r.headers)]
    except StreamQError as exc:
        raise StreamQSourceError(f"producer at {rng.endpoint}: {exc}") from exc
    records.sort(key=lambda record: record.seq)
    yield _batch(columns, rng, stream, [[list(record) for record in records]])


class _PartitionRead:
    """Reading one partition's range: where it stands, and what it does on data loss."""

    def __init__(self, partition: StreamQPartition) -> None:
        self.partition = partition
        rng, batch = partition.range, partition.epochs
        self.start, self.end = rng.start, rng.end
        # "Epochs": the range starting the micro-batch sends the epoch stored with the
        # query's offset, so the producer vouches for the seqs the query read before it;
        # the others ask for epochs without a position to vouch for (0).
        self.seen_epoch: int | None = None
        self.max_epoch: int | None = None  # a frame written by a later epoch: rewritten
        if batch is not None:
            self.seen_epoch = (batch.start_epoch or 0) if rng.start == batch.start else 0
            self.max_epoch = batch.end_epoch or None
        self.where = f"producer {rng.producer_id} at {rng.endpoint}, stream {partition.stream!r}"

    def lost(self, message: str, skipped: str) -> None:
        """Fail (failOnDataLoss, the default), or log a warning and go on."""
        if self.partition.fail_on_data_loss:
            raise StreamQSourceError(
                f"{self.where}: {message} Set failOnDataLoss=false to {skipped}."
            )
        logger.warning("%s: %s failOnDataLoss=false: %s.", self.where, message, skipped)

    def out_of_range(self, exc: OffsetOutOfRangeError) -> None:
        """The range was refused: seqs deleted by retention, or commits the producer lost."""
        details = exc.details
        start, end = self.start, self.end
        low = int(details.get("low", start))
        head = int(details.get("head", end - 1))
        rewritten = int(details.get("rewritten_from", 0))
        if rewritten or head + 1 < end:
            first = rewritten or head + 1
            self.lost(
                f"this micro-batch reads seqs {start}..{end - 1}, but the producer's head is "
                f"now {head} and it no longer holds seqs {first}..{end - 1} as the query read "
                "them or planned to: it lost commits (a power loss with durability='normal', "
                f"or a database restored from an older copy). ({exc})",
                f"read only what it holds up to its head ({head})",
            )
        if low > start:
            self.lost(f"seqs {start}..{low - 1} are gone (retention). ({exc})", "skip them")
        narrowed = (max(start, low), min(end, head + 1))
        if narrowed == (start, end):
            raise StreamQSourceError(f"{self.where}: {exc}") from exc
        self.start, self.end = narrowed
        self.seen_epoch = None if self.seen_epoch is None else 0

    def reused(self, exc: SeqsReusedError) -> None:
        """The producer no longer holds the seqs the query read before this micro-batch."""
        assert exc.lost is not None
        first, last = exc.lost[0], exc.lost[-1]
        self.lost(
            f"the query already read up to seq {last}, but the producer's log no longer holds "
            f"seqs {first}..{last} as the query read them: it lost commits and re-used their "
            "seqs (a power loss rolled back commits that were not synced, "
            "durability='normal').",
            f"read seqs {self.start}..{self.end - 1} as the producer holds them now",
        )
        self.seen_epoch = 0

    def check_epoch(self, epoch: int | None, first: int) -> None:
        """A frame written after the micro-batch was planned: its seqs were rewritten."""
        if self.max_epoch is not None and epoch is not None and epoch > self.max_epoch:
            self.max_epoch = None  # said once
            self.lost(
                f"seqs {first}..{self.end - 1}, which this micro-batch reads, were written "
                f"again (by epoch {epoch}) after it was planned: the producer lost commits "
                "(a power loss with durability='normal').",
                "read them as the producer holds them now",
            )


class _Unreachable:
    """Tries again at a producer a planned read cannot reach: the batch's offsets are in the
    checkpoint, so its range must be read, and a producer restarting is back in seconds.
    Waits double from ``FIRST`` up to ``LONGEST``, for ``Connect.unreachable`` from the
    first failure since the read last moved on; then the task fails, naming the option."""

    FIRST, LONGEST = 0.05, 2.0  # s

    def __init__(self, state: _PartitionRead) -> None:
        self.state = state
        self.since: int | None = None  # the seq the read stood at when the failures began
        self.deadline = self.wait = 0.0

    def wait_or_fail(self, exc: StreamQError) -> None:
        state, limit, now = self.state, self.state.partition.connect.unreachable, time.monotonic()
        if self.since != state.start:  # the first failure, or the read moved on since
            self.since, self.deadline, self.wait = state.start, now + limit, self.FIRST
            logger.warning(
                "%s: cannot read seqs %d..%d (%s); trying again for up to %g s "
                "(unreachableTimeoutMs)",
                state.where,
                state.start,
                state.end - 1,
                exc,
                limit,
            )
        if now >= self.deadline:
            raise StreamQSourceError(
                f"{state.where}: unreachable from {socket.gethostname()} (this executor's "
                f"host) for {limit:g} s (unreachableTimeoutMs) while "
                f"reading seqs {state.start}..{state.end - 1}, planned for this micro-batch: "
                f"{exc}"
            ) from exc
        time.sleep(min(self.wait, self.deadline - now))
        self.wait = min(2 * self.wait, self.LONGEST)


def read_partition(
    partition: StreamQPartition,
    columns: Columns = EVERY_COLUMN,
    connections: Connections | None = None,
    asked: _Asked | None = None,
) -> Iterator[pa.RecordBatch]:
    """Read exactly the partition's range from its producer, as Arrow batches of ``columns``:
    on a connection of its own (an executor; ``asked``: already asked on it), or on one of
    ``connections`` (the driver). A producer that cannot be reached is tried again
    (``_Unreachable``)."""
    if partition.keys is not None:
        yield from _read_keys(partition, partition.keys, columns)
        return
    rng = partition.range
    state = _PartitionRead(partition) if asked is None else asked.state
    unreachable = _Unreachable(state)
    while state.start < state.end:
        try:
            if asked is not None:
                client, reader, asked = asked.client, asked.reader, None
                with client:
                    yield from _read_range(client, state, columns, reader)
            elif connections is None:
                with partition.connect.client(rng.endpoint, "spark executor") as client:
                    yield from _read_range(client, state, columns)
            else:
                yield from _read_kept(connections, state, columns)
            return
        except SeqsReusedError as exc:
            state.reused(exc)
        except OffsetOutOfRangeError as exc:
            state.out_of_range(exc)
        except _READ_AGAIN as exc:
            unreachable.wait_or_fail(exc)
        except StreamQError as exc:
            raise StreamQSourceError(f"producer at {rng.endpoint}: {exc}") from exc


# A planned read is tried again where its producer cannot be reached, and where it closed
# the read's connection for idleness: one opened with its task's others, that waited for
# its turn past the producer's ``idle_timeout`` (``read_task``).
_READ_AGAIN = (*planning.UNREACHABLE, IdleTimeoutError)


def _request(
    client: Client, state: _PartitionRead, columns: Columns
) -> RangeRead[RecordRows | RecordColumns]:
    """The range request from where ``state`` stands."""
    partition = state.partition
    return client.read_range_frames(
        partition.stream,
        state.start,
        state.end,
        seen_epoch=state.seen_epoch,
        filter=partition.filter,
        columnar=columns.columnar,
    )


def _read_range(
    client: Client,
    state: _PartitionRead,
    columns: Columns,
    reader: RangeRead[RecordRows | RecordColumns] | None = None,
) -> Iterator[pa.RecordBatch]:
    """One range request from where ``state`` stands (``reader``: already made, perhaps
    sent); it moves on as batches are taken."""
    _check_producer(client, state.partition.range)
    if reader is None:
        reader = _request(client, state, columns)
    while True:
        # Rows live only while one batch is built: the collector need not scan them at all.
        with collector_paused():
            taken = _next_batch(reader, state, columns)
        if taken is None:
            break
        batch, last = taken
        yield batch
        state.start = last + 1
        state.seen_epoch = None if state.seen_epoch is None else 0
    state.start = state.end


def _next_batch(
    reader: RangeRead[RecordRows | RecordColumns], state: _PartitionRead, columns: Columns
) -> tuple[pa.RecordBatch, int] | None:
    """The next frames' records, at least ``_ROWS_PER_BATCH`` unless the range ends first,
    as one batch and its last seq; None at the end of the range."""
    pending: list[Part] = []
    count = last = 0
    for frame in reader:
        seqs = first_and_last_seq(frame)
        if seqs is not None:
            state.check_epoch(reader.epoch, seqs[0])
            last = seqs[1]
            if isinstance(frame, RecordColumns):
                pending.append(frame.columns)
                count += frame.columns.length
            else:
                pending.append(frame.rows)
                count += len(frame.rows)
            if count >= _ROWS_PER_BATCH:
                break
    if not pending:
        return None
    partition = state.partition
    return _batch(columns, partition.range, partition.stream, pending), last


def _read_kept(
    connections: Connections, state: _PartitionRead, columns: Columns
) -> Iterator[pa.RecordBatch]:
    """``_read_range`` on a kept connection, which only a whole request can use: the batches
    read before a failure are still handed on, as ``state`` has moved past them."""
    batches: list[pa.RecordBatch] = []

    def read(client: Client) -> None:
        for batch in _read_range(client, state, columns):
            batches.append(batch)

    try:
        connections.ask(state.partition.range.endpoint, read)
    finally:
        yield from batches


@dataclass(frozen=True, slots=True)
class _Idle:
    """A trigger that found no producer moved: its offset, the positions in it, and the
    producers it asked, for the next triggers at the same start to repeat
    (``StreamQStreamReader._repeats``)."""

    offset: dict[str, Any]
    positions: dict[str, Position]
    endpoints: list[str]


@errors_said_first
class StreamQStreamReader(Shipped, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of every producer's new records. Offsets ``{producer id: next seq}``,
    with ``"epochs": {producer id: epoch}`` beside them ("Epochs" in docs/protocol.md): the
    epoch that wrote the producer's head when the offset was planned, at least the highest
    that wrote a seq the query read. Each trigger, every producer vouches for the query's
    position with it, and every range read sends it."""

    def __init__(self, settings: _Settings) -> None:
        self.settings = settings
        self._states: dict[str, ProducerState] = {}
        self._target: Offsets | None = None  # Trigger.AvailableNow's end
        # The driver's, made at first use: kept open from one trigger to the next.
        self._connections: Connections | None = None
        # Positions to report to producers, with the next discovery ({producer id: last
        # seq the sink holds}); sent ones leave.
        self._unreported: dict[str, int] = {}
        self._initial: Offsets | None = None  # a new query's start: nothing applied yet
        self._started: dict[str, ProducerState] | None = None  # ``_starting``'s, till a trigger
        # What was last reported to each producer: (last seq held, when, monotonic).
        self._reported: dict[str, tuple[int, float]] = {}
        self._down: set[str] = set()  # producers down at the last trigger (logged)
        self._idle: _Idle | None = None  # the last trigger's, if it found nothing moved

    def _shipped_state(self) -> dict[str, Any]:
        """Pickled to the executors: the driver's connections stay behind."""
        return {**self.__dict__, "_connections": None}

    def connections(self) -> Connections:
        if self._connections is None:
            self._connections = Connections(self.settings.connect)
        return self._connections

    def _refresh(self, positions: Mapping[str, Position] | None = None) -> dict[str, ProducerState]:
        """Every producer's state now. With ``positions`` (a trigger of a running query), a
        producer it reads that is down is its last known state (``ProducerState.down``),
        but not under ``Trigger.AvailableNow``: a run that promised everything available
        when it began fails instead of ending without that producer's records."""
        settings = self.settings
        tolerant = positions is not None and self._target is None
        known = self._states if tolerant else None
        self._states = self._reporting(
            lambda reports: settings.discover(positions, self.connections(), reports, known)
        )
        return self._states

    def _reporting(self, send: Callable[[Reports], T]) -> T:
        """``send(reports)``, with the positions still to report, and those to report
        again (``_again``); those sent leave them."""
        reports = Reports(self.settings.consumer_name, dict(self._unreported), self._again)
        try:
            return send(reports)
        finally:
            now = time.monotonic()
            for pid in reports.sent:
                seq = reports.seqs.get(pid)
                if seq is None:
                    seq = self._reported[pid][0]
                elif self._unreported.get(pid) == seq:
                    del self._unreported[pid]
                self._reported[pid] = (seq, now)

    def _again(self, pid: str) -> int | None:
        """The position last reported to the producer, if reported ``_REPORT_AGAIN`` ago
        or more and still the query's (``Reports.again``)."""
        reported, state = self._reported.get(pid), self._states.get(pid)
        if reported is None or state is None or state.lost or pid in self._unreported:
            return None
        seq, at = reported
        return seq if time.monotonic() - at >= _REPORT_AGAIN else None

    def initialOffset(self) -> dict[str, Any]:
        """Found once: Spark asks again as it plans the first batch, and a second answer
        could be later (``latest`` with new commits: records lost between the two), and
        its discovery would take each kept connection's watch."""
        settings = self.settings
        if self._initial is None:
            self._initial = settings.initial(self._starting(), "latest")
        # startingOffsets copied from a query's offsets keeps the epochs beside the seqs.
        given = settings.starting if settings.starting_timestamp is None else None
        return planning.join_offset(self._initial, planning.given_epochs(given))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.settings.max_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.settings.max_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {pid: s.head + 1 for pid, s in self._starting().items()}
        self._idle = None

    def _starting(self) -> dict[str, ProducerState]:
        """The producers' states as the query starts, found once for ``initialOffset`` and
        ``prepareForTriggerAvailableNow``, which Spark calls one after the other before
        the first trigger: the heads of that moment are both where ``latest`` starts and
        what Trigger.AvailableNow promises to read (one round over every producer less)."""
        if self._started is None:
            self._started = self._refresh()
        return self._started

    def _lost(self, pid: str, seq: int) -> int:
        """A producer lost seqs the query read: fail, or (failOnDataLoss=false) warn and
        return the seq to go on from, the first one lost."""
        state = self._states[pid]
        assert state.lost is not None
        first = state.lost[0]
        message = planning.data_loss(state, self.settings.stream)
        if self.settings.fail_on_data_loss:
            raise StreamQSourceError(
                f"{message} Refusing to skip or re-read records silently: set "
                f"failOnDataLoss=false to go on from seq {first}, reading what the producer "
                "holds from there now, or start a new query (new checkpoint)."
            )
        logger.warning(
            "%s failOnDataLoss=false: going on from seq %d, reading what the producer holds "
            "from there now (the query's offset was %d).",
            message,
            first,
            seq,
        )
        return first

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        idle, self._idle, self._started = self._idle, None, None
        if idle is not None and self._repeats(idle, start):
            self._idle = idle
            return idle.offset
        seqs, epochs = planning.split_offset(start)
        positions = {pid: Position(seq, epochs.get(pid)) for pid, seq in seqs.items()}
        if seqs != self._initial:  # the end of the last batch, which the sink holds
            self._committed(seqs)  # reported with the discovery below
        offset = self._latest(seqs, epochs, positions, limit)
        self._idle = self._still(start, offset, positions)
        return offset

    def _repeats(self, idle: _Idle, start: Mapping[str, Any]) -> bool:
        """Whether this trigger finds what ``idle`` found: the same position and
        producers, no watch answered but at its wait's end with the head unchanged, none
        past belief (``planning.tend``, which also sends the positions to report). An
        idle trigger over a thousand producers is then a poll and the few connections
        that answered, not a pass over each, however long the query idles."""
        if self._target is not None or start != idle.offset:
            return False
        if self.settings.endpoints() != idle.endpoints:
            return False
        connections, stream, positions = self.connections(), self.settings.stream, idle.positions
        still = self._reporting(
            lambda reports: planning.tend(connections, stream, positions, reports, self._states)
        )
        return still is not None

    def _still(
        self,
        start: Mapping[str, Any],
        offset: dict[str, Any],
        positions: dict[str, Position],
    ) -> _Idle | None:
        """The trigger just planned, to repeat (``_repeats``) if it moved nothing and its
        discovery found every producer's watch quiet (``Connections.still``)."""
        still = self.connections().still
        if still is None or offset != start or self._target is not None or self._down:
            return None
        return _Idle(offset, positions, self.settings.endpoints())

    def _latest(
        self,
        seqs: Offsets,
        epochs: Mapping[str, int],
        positions: Mapping[str, Position],
        limit: ReadLimit,
    ) -> dict[str, Any]:
        states = self._refresh(positions)
        planning.check_producers(seqs, states)
        self._say_down(states, seqs)
        back = {pid: self._lost(pid, seq) for pid, seq in seqs.items() if states[pid].lost}
        # Producers that appeared since the query started are read from their earliest seq.
        begin = {**{pid: s.low for pid, s in states.items()}, **seqs}
        end = {
            pid: b if states[pid].down else max(b, states[pid].head + 1)
            for pid, b in begin.items()
            if pid not in back
        }
        if self._target is not None:
            end = {
                pid: max(begin[pid], min(e, self._target.get(pid, begin[pid])))
                for pid, e in end.items()
            }
        if isinstance(limit, ReadMaxRows):
            end = planning.limit(begin, end, limit.max_rows)
        # After lost commits (failOnDataLoss=false) the offset goes back to the first seq
        # lost: this batch reads nothing of that producer, the next reads on from there.
        end.update(back)
        end_epochs = {}
        for pid, seq in end.items():
            unchanged = pid in seqs and seq == seqs[pid] and pid not in back
            epoch = epochs.get(pid) if unchanged else states[pid].epoch
            if epoch is not None:
                end_epochs[pid] = epoch
        return planning.join_offset(end, end_epochs)

    def _say_down(self, states: Mapping[str, ProducerState], seqs: Offsets) -> None:
        """A producer down (or back) is logged once, naming it: the query reads the others
        meanwhile, and that one's records from where it stopped once it is back."""
        for pid, state in states.items():
            if state.down and pid not in self._down:
                self._down.add(pid)
                logger.warning(
                    "producer %s at %s cannot be read now; reading the other producers "
                    "meanwhile, and its records from seq %d on once it is back: %s",
                    pid,
                    state.endpoint,
                    seqs.get(pid, state.low),
                    state.down,
                )
            elif not state.down and pid in self._down:
                self._down.discard(pid)
                logger.warning("producer %s at %s is back", pid, state.endpoint)

    def reportLatestOffset(self) -> dict[str, int] | None:
        return {pid: s.head + 1 for pid, s in self._states.items()} or None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return self.plan(start, end)

    def plan(self, start: dict[str, Any], end: dict[str, Any]) -> list[StreamQTask]:
        start_seqs, start_epochs = planning.split_offset(start)
        end_seqs, end_epochs = planning.split_offset(end)
        if not set(end_seqs) <= set(self._states):
            self._refresh()
        ranges, epochs = [], {}
        for pid, stop in end_seqs.items():
            state = self._states.get(pid)
            if state is None:
                planning.check_producers({pid: stop}, self._states)
                continue
            # A producer new since the previous batch starts at its earliest seq, as
            # latestOffset planned it. A stop below the start (lost commits, going back)
            # reads nothing.
            first = start_seqs.get(pid, state.low)
            ranges.append(Range(pid, state.endpoint, first, stop))
            if pid in end_epochs:
                epochs[pid] = BatchEpochs(first, start_epochs.get(pid), end_epochs[pid])
        return _partitions(self.settings, ranges, epochs=epochs)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, StreamQTask)
        return read_task(partition, self.settings.columns)

    def commit(self, end: dict[str, Any]) -> None:
        """Spark calls it for a batch only as it plans the next one (at that batch's
        walCommit): the last batch before the query stops, or idles at the head, is never
        committed here. ``latestOffset`` reports it: its ``start`` is where the last batch
        ended, which the sink holds once Spark plans again."""
        self._committed(planning.split_offset(end)[0])

    def _committed(self, seqs: Offsets) -> None:
        """Advisory: tell each producer how far this query's sink durably holds its stream
        (``seqs``: the next seq to read), with the next discovery, on its connections
        (``planning.Reports``); again (``_again``) while it stays. Not to a producer that
        lost seqs the query read (it will read them again)."""
        for pid, seq in seqs.items():
            state, reported = self._states.get(pid), self._reported.get(pid)
            if state is None or state.lost or seq <= 1:
                continue
            if reported is None or reported[0] != seq - 1:
                self._unreported[pid] = seq - 1

    def stop(self) -> None:
        try:
            if self._unreported and self._connections is not None:
                self._refresh()  # the last positions, with one more discovery
        except StreamQSourceError as exc:
            logger.warning("could not report the last positions: %s", exc)
        finally:
            if self._connections is not None:
                self._connections.close()


@errors_said_first
class StreamQDriverStreamReader(SimpleDataSourceStreamReader, SupportsTriggerAvailableNow):
    """``readOnDriver=true``: the driver reads each micro-batch itself, as it plans it, on the
    connections it keeps, and hands Spark the Arrow batches: no Python task on the executors
    (a worker round trip, a new connection per producer), so small micro-batches come
    sooner. Every record then passes through the driver: for low rates and latency, not for
    ingest. Planning, epochs and position reports are ``StreamQStreamReader``'s; a batch
    replayed after a restart is read on an executor (``readBetweenOffsets``)."""

    def __init__(self, settings: _Settings) -> None:
        self.planner = StreamQStreamReader(settings)

    def initialOffset(self) -> dict[str, Any]:
        return self.planner.initialOffset()

    def prepareForTriggerAvailableNow(self) -> None:
        self.planner.prepareForTriggerAvailableNow()

    def read(self, start: dict[str, Any]) -> tuple[Iterator[pa.RecordBatch], dict[str, Any]]:
        planner = self.planner
        end = planner.latestOffset(start, planner.getDefaultReadLimit())
        if end == start:
            return iter(()), end
        connections = planner.connections()
        batches = [
            batch
            for task in planner.plan(start, end)
            for batch in read_task(task, planner.settings.columns, connections)
        ]
        return iter(batches), end  # a list's iterator: Spark copies it (copy.copy)

    def readBetweenOffsets(
        self, start: dict[str, Any], end: dict[str, Any]
    ) -> Iterator[pa.RecordBatch]:
        columns = self.planner.settings.columns
        for task in self.planner.plan(start, end):
            yield from read_task(task, columns)

    def commit(self, end: dict[str, Any]) -> None:
        self.planner.commit(end)


@errors_said_first
class StreamQBatchReader(Shipped, DataSourceReader):
    """A one-off read of ``[startingOffsets, endingOffsets)`` from every producer."""

    def __init__(self, settings: _Settings) -> None:
        self.settings = settings

    def _ranges(self, first: int = 1, stop: int | None = None) -> list[Range]:
        """Each producer's range, narrowed to seqs ``first <= seq < stop``."""
        states = self.settings.discover()
        start = self.settings.initial(states, "earliest")
        end = planning.resolve(self.settings.ending, states, "endingOffsets", planning.LATEST)
        ranges = [Range(pid, states[pid].endpoint, start[pid], end[pid]) for pid in states]
        for r in ranges:
            if r.end > states[r.producer_id].head + 1:
                raise StreamQSourceError(
                    f"endingOffsets {r.end} for producer {r.producer_id} is beyond its head "
                    f"({states[r.producer_id].head})"
                )
        narrowed = []
        for r in ranges:
            a = max(r.start, first)
            b = max(a, r.end if stop is None else min(r.end, stop))
            narrowed.append(Range(r.producer_id, r.endpoint, a, b))
        return narrowed

    def partitions(self) -> Sequence[InputPartition]:
        return _partitions(self.settings, self._ranges())

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, StreamQTask):
            # Spark turns an empty list of partitions into one InputPartition(None).
            return iter(())
        return read_task(partition, self.settings.columns)


def _seq_bounds(pushed: Filter) -> tuple[int, int | None] | None:
    """``seq`` comparisons as seqs ``[first, stop)`` (stop None: no bound)."""
    comparisons = (EqualTo, GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual)
    if not isinstance(pushed, comparisons) or pushed.attribute != ("seq",):
        return None
    value = pushed.value
    if type(value) is not int:
        return None
    if isinstance(pushed, EqualTo):
        return value, value + 1
    if isinstance(pushed, GreaterThan):
        return value + 1, None
    if isinstance(pushed, GreaterThanOrEqual):
        return value, None
    if isinstance(pushed, LessThan):
        return 1, value
    return 1, value + 1


@errors_said_first
class StreamQFilteringBatchReader(StreamQBatchReader):
    """A batch read that hands Spark's filters on ``key`` and ``seq`` to the producers:
    a key's records are found by a history request (an index seek with ``key_index``),
    a seq bound narrows every range. Other filters stay with Spark."""

    def __init__(self, settings: _Settings) -> None:
        super().__init__(settings)
        self.keys: frozenset[bytes] | None = None  # None: every key
        self.first = 1
        self.stop: int | None = None  # exclusive

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        for pushed in filters:
            if not self._push(pushed):
                yield pushed

    def _push(self, pushed: Filter) -> bool:
        """Apply a filter this source evaluates exactly; False leaves it to Spark."""
        if isinstance(pushed, EqualTo | In) and pushed.attribute == ("key",):
            keys = pushed.value if isinstance(pushed, In) else (pushed.value,)
            if not all(isinstance(k, bytes | bytearray) for k in keys):
                return False
            wanted = frozenset(bytes(k) for k in keys)
            self.keys = wanted if self.keys is None else self.keys & wanted
            return True
        bounds = _seq_bounds(pushed)
        if bounds is None:
            return False
        self.first = max(self.first, bounds[0])
        if bounds[1] is not None:
            self.stop = bounds[1] if self.stop is None else min(self.stop, bounds[1])
        return True

    def partitions(self) -> Sequence[InputPartition]:
        return _partitions(self.settings, self._ranges(self.first, self.stop), self.keys)


@errors_said_first
class StreamQDataSource(Shipped, DataSource):
    """Registered as ``streamq``: ``spark.dataSource.register(StreamQDataSource)``."""

    @classmethod
    def name(cls) -> str:
        return "streamq"

    def schema(self) -> StructType:
        check_option_names(self.options)
        return _default_schema(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        settings = _Settings(self.options, schema)
        if settings.filter_pushdown:
            return StreamQFilteringBatchReader(settings)
        return StreamQBatchReader(settings)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        settings = _Settings(self.options, schema)
        if settings.read_on_driver:  # Spark turns to simpleStreamReader
            raise PySparkNotImplementedError(
                errorClass="NOT_IMPLEMENTED", messageParameters={"feature": "streamReader"}
            )
        return StreamQStreamReader(settings)

    def simpleStreamReader(self, schema: StructType) -> SimpleDataSourceStreamReader:
        return StreamQDriverStreamReader(_Settings(self.options, schema))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from .sink import batch_writer  # the sink: its own module

        return batch_writer(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from .sink import stream_writer

        return stream_writer(self.options, schema)
