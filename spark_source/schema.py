"""The rows a streamq source yields, and their Arrow encoding.

Columns follow Spark's Kafka source where the meaning is the same (key,
value, timestamp, headers); producer, endpoint and seq take the place of
topic, partition and offset. A query may read fewer: ``includeHeaders=false``
drops ``headers``, and a schema given with ``.schema(...)`` names the columns
it wants. Python sources get no column pruning from Spark, so every column the
source builds costs the executor's Python and the JVM per row.

A captured table's stream (docs/guides/capture.md) reads as its changes' fields
instead of ``value``: ``op``, ``table``, ``xid``, ``lsn``, ``index``, ``changes``,
``unchanged``, and ``new`` and ``old`` as structs of the table's columns, typed from
its catalog (``change_schema``) or as a schema given with ``.schema(...)`` types them.
"""

from __future__ import annotations

import datetime
import decimal
import json
import sys
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from streamq.captured import decode_change
from streamq.protocol import ColumnBuffers

# A batch's records as they come: rows [seq, timestamp, key, value, headers] as the
# client decodes them, or a frame's column buffers where the compiled decoder reads it.
Part = Sequence[Sequence[Any]] | ColumnBuffers

HEADER_TYPE = StructType(
    [StructField("key", StringType(), False), StructField("value", BinaryType(), True)]
)

SCHEMA = StructType(
    [
        StructField("producer", StringType(), False),  # the producer's stable id
        StructField("endpoint", StringType(), False),  # host:port it was read from
        StructField("stream", StringType(), False),
        StructField("seq", LongType(), False),
        StructField("key", BinaryType(), True),
        StructField("value", BinaryType(), False),
        StructField("timestamp", TimestampType(), False),  # when it was published
        StructField("headers", ArrayType(HEADER_TYPE, False), False),
    ]
)
FIELDS = {field.name: field for field in SCHEMA.fields}
# A change's fields, read from its value (``new`` and ``old``: structs of any columns).
CHANGE_FIELDS = {
    field.name: field
    for field in (
        StructField("op", StringType(), False),
        StructField("table", StringType(), False),
        StructField("xid", LongType(), True),  # None in a snapshot's rows
        StructField("lsn", LongType(), False),
        StructField("index", IntegerType(), False),
        StructField("changes", IntegerType(), False),
        StructField("unchanged", ArrayType(StringType(), False), True),
    )
}
ROWS = ("new", "old")
# Spark's type for PostgreSQL's (pg_type.typname); any other is its text.
_SPARK_TYPES: dict[str, DataType] = {
    "bool": BooleanType(),
    "int2": ShortType(),
    "int4": IntegerType(),
    "int8": LongType(),
    "oid": LongType(),
    "float4": FloatType(),
    "float8": DoubleType(),
    "bytea": BinaryType(),
    "timestamptz": TimestampType(),
    "timestamp": TimestampNTZType(),
    "date": DateType(),
}

# How each column is built: from the partition's constants, or from rows [seq, timestamp,
# key, value, headers] as the client decodes records.
_CONSTANTS = ("producer", "endpoint", "stream")
_ROW_INDEX = {"seq": 0, "timestamp": 1, "key": 2, "value": 3, "headers": 4}

ARROW_SCHEMA: pa.Schema = to_arrow_schema(SCHEMA, timezone="UTC")
_HEADERS_TYPE = ARROW_SCHEMA.field("headers").type
_TIMESTAMP = ARROW_SCHEMA.field("timestamp").type
_MILLISECONDS = pa.timestamp("ms", tz="UTC")  # records carry milliseconds since the epoch
# Not pa.array([]): its first call imports pandas (pyarrow looks for pandas arrays), which
# the driver, planning a micro-batch, never needs: Spark starts a new Python process for
# each streaming query, and pandas would add about 0.15 s to its start.
_NO_HEADER_VALUES = pa.nulls(0, _HEADERS_TYPE.value_type)


def default_schema(include_headers: bool) -> StructType:
    """The schema without ``.schema(...)``: every column, ``headers`` if asked for."""
    if include_headers:
        return SCHEMA
    return StructType([field for field in SCHEMA.fields if field.name != "headers"])


def change_schema(columns: Sequence[dict[str, Any]], include_headers: bool) -> StructType:
    """A captured table's stream without ``.schema(...)``: the record's columns but
    ``value``, then the change's, ``new`` and ``old`` typed from the table's columns as
    the producer reports them (``{"name", "type", "array"}``, and a numeric's
    ``"precision"`` and ``"scale"``)."""
    row = StructType([StructField(c["name"], spark_type(c), True) for c in columns])
    fields = [f for f in default_schema(include_headers).fields if f.name != "value"]
    fields += [*CHANGE_FIELDS.values(), StructField("new", row), StructField("old", row)]
    return StructType(fields)


def spark_type(column: dict[str, Any]) -> DataType:
    """A column's Spark type from its PostgreSQL type, as the change format carries its
    values: numeric as a decimal when it declares a precision Spark holds (else text),
    json and jsonb as their JSON text, every type without a Spark twin as its text."""
    name = column["type"]
    precision, scale = column.get("precision", -1), column.get("scale", -1)
    if name == "numeric" and 0 <= scale <= precision <= 38:
        element: DataType = DecimalType(precision, scale)
    else:
        element = _SPARK_TYPES.get(name, StringType())
    return ArrayType(element, True) if column.get("array") else element


def _check_schema(schema: StructType) -> None:
    """A schema given with ``.schema(...)`` must pick columns of ``SCHEMA`` (or of a
    change: ``CHANGE_FIELDS``, ``new``, ``old``) by name, with their types (nested
    nullability aside); raises ``ValueError`` saying what is wrong."""
    if not schema.fields:
        raise ValueError("the schema names no column")
    for field in schema.fields:
        if field.name in ROWS:
            if not isinstance(field.dataType, StructType):
                raise ValueError(f"column {field.name!r} is a struct of the table's columns")
            if not field.nullable:
                raise ValueError(f"column {field.name!r} is nullable")
            continue
        ours = FIELDS.get(field.name) or CHANGE_FIELDS.get(field.name)
        if ours is None:
            raise ValueError(
                f"no column {field.name!r}; the columns are {', '.join(FIELDS)}, and for "
                f"a captured table's changes {', '.join([*CHANGE_FIELDS, *ROWS])} "
                "(pick any of them, in any order)"
            )
        if field.dataType.simpleString() != ours.dataType.simpleString():
            raise ValueError(
                f"column {field.name!r} is {ours.dataType.simpleString()}, "
                f"not {field.dataType.simpleString()}"
            )
        if ours.nullable and not field.nullable:
            raise ValueError(f"column {field.name!r} is nullable")


class TableChangedError(ValueError):
    """A captured table has columns the query's schema, typed from its catalog when the
    query started, does not: the query must start again to read them."""


class Columns:
    """Builds Arrow record batches of one schema's columns, and no others, from rows
    [seq, timestamp, key, value, headers] as the client decodes them: one list per column
    read, then one Arrow array each, which checks every field's type as it is built.

    ``table_columns``: a captured table's columns as the schema was typed from them
    (``change_schema``); a change with another column raises ``TableChangedError``
    rather than drop it."""

    def __init__(self, schema: StructType, table_columns: Sequence[str] | None = None) -> None:
        _check_schema(schema)
        self.table_columns = None if table_columns is None else frozenset(table_columns)
        self.names = tuple(schema.fieldNames())
        self.arrow_schema: pa.Schema = to_arrow_schema(schema, timezone="UTC")
        # A given schema may declare nested fields nullable where ours are not.
        self._casts = {
            name: self.arrow_schema.field(name).type
            for name in self.names
            if name in FIELDS
            and self.arrow_schema.field(name).type != ARROW_SCHEMA.field(name).type
        }
        # The change's fields, read from each record's value: how each becomes Arrow's.
        self._changes = {
            field.name: _converter(field.dataType)
            for field in schema.fields
            if field.name in CHANGE_FIELDS or field.name in ROWS
        }

    @property
    def columnar(self) -> bool:
        """Whether records may come as column buffers (``ColumnBuffers``): not for a
        change's fields, which are read from each record's value as Python objects."""
        return not self._changes

    def batch(
        self, producer: str, endpoint: str, stream: str, rows: Sequence[Sequence[Any]]
    ) -> pa.RecordBatch:
        """One RecordBatch of ``rows``; raises ``ValueError`` for malformed rows or rows out
        of seq order."""
        return self.batch_of(producer, endpoint, stream, [rows])

    def batch_of(
        self, producer: str, endpoint: str, stream: str, parts: Sequence[Part]
    ) -> pa.RecordBatch:
        """One RecordBatch of the records of ``parts`` in turn, each rows as the client
        decodes them or a frame's column buffers as the compiled decoder reads them (the
        same batch either way); raises ``ValueError`` as ``batch``."""
        constants = {"producer": producer, "endpoint": endpoint, "stream": stream}
        try:
            built = [self._part_columns(part) for part in parts]
            record_columns = {
                name: _joined([columns[name] for columns, _ in built]) for name in built[0][0]
            }
            seqs = record_columns["seq"]
            count = len(seqs)
            changes = [_change(v) for _, values in built for v in values]
            if self.table_columns is not None:
                self._check_columns(changes)
            columns = []
            for name in self.names:
                if name in self._changes:
                    convert = self._changes[name]
                    values = [convert(change.get(name)) for change in changes]
                    column = pa.array(values, self.arrow_schema.field(name).type)
                elif name in _CONSTANTS:
                    column = pa.repeat(pa.scalar(constants[name], pa.string()), count)
                else:
                    column = record_columns[name]
                cast = self._casts.get(name)
                columns.append(column if cast is None else column.cast(cast))
        except TableChangedError:
            raise
        except (pa.ArrowException, TypeError, ValueError, LookupError, ArithmeticError) as exc:
            raise ValueError(f"malformed records from producer {producer}: {exc}") from None
        # Imported here: pyarrow.compute takes 38 ms to import, and the driver's process,
        # new for each streaming query, never builds a batch.
        import pyarrow.compute as pc

        if count > 1 and not pc.all(pc.less(seqs[:-1], seqs[1:])).as_py():
            raise ValueError(f"records from producer {producer} are not in increasing seq order")
        return pa.RecordBatch.from_arrays(columns, schema=self.arrow_schema)

    def _part_columns(self, part: Part) -> tuple[dict[str, pa.Array], Sequence[Any]]:
        """The record columns the schema has (and ``seq``) of one part, and its records'
        values if a change's fields are read from them."""
        names = ("seq", *(name for name in self.names if name in _ROW_INDEX and name != "seq"))
        if isinstance(part, ColumnBuffers):
            columns = {name: _from_buffers(name, part) for name in names}
            values = _from_buffers("value", part).to_pylist() if self._changes else ()
            return columns, values
        # Rows to fields in one pass in C (a tuple per field), not a list per column.
        fields = _fields(part) if part else [()] * 5
        columns = {name: _build(name, fields[_ROW_INDEX[name]]) for name in names}
        return columns, fields[3] if self._changes else ()

    def _check_columns(self, changes: Sequence[dict[str, Any]]) -> None:
        known = self.table_columns
        assert known is not None
        for change in changes:
            for row in ROWS:
                values = change.get(row)
                if isinstance(values, dict) and not known.issuperset(values):
                    added = sorted(set(values) - known)
                    raise TableChangedError(
                        f"table {change.get('table')} gained column {', '.join(added)}; "
                        "restart the query to read it"
                    )


EVERY_COLUMN = Columns(SCHEMA)


def _fields(rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """``rows`` of 5 fields each as 5 tuples, one per field."""
    try:
        fields = list(zip(*rows, strict=True))
    except ValueError:  # rows of different lengths
        fields = []
    if len(fields) != 5:
        raise ValueError("a record must have 5 fields")
    return fields


def _build(name: str, values: Sequence[Any]) -> pa.Array:
    if name == "seq":
        return pa.array(values, pa.int64())
    if name == "timestamp":
        return pa.array(values, pa.int64()).cast(_MILLISECONDS).cast(_TIMESTAMP)
    if name == "headers":
        return _headers(values)
    return pa.array(values, pa.binary())  # key, value


def _joined(arrays: Sequence[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


def _from_buffers(name: str, columns: ColumnBuffers) -> pa.Array:
    """Column ``name`` of a frame's records on the buffers the compiled decoder wrote, no
    copy made."""
    count = columns.length
    if name == "seq":
        return pa.Array.from_buffers(pa.int64(), count, [None, pa.py_buffer(columns.seqs)])
    if name == "timestamp":
        return pa.Array.from_buffers(_TIMESTAMP, count, [None, pa.py_buffer(columns.timestamps)])
    if name == "key":
        return _binary(count, columns.key_validity, columns.key_offsets, columns.key_data)
    if name == "value":
        return _binary(count, None, columns.value_offsets, columns.value_data)
    if columns.headers is None:
        return _no_headers(count)
    offsets, key_offsets, key_data, value_offsets, value_data, value_validity = columns.headers
    entries = int.from_bytes(offsets[-4:], sys.byteorder)
    keys = pa.Array.from_buffers(
        pa.string(), entries, [None, pa.py_buffer(key_offsets), pa.py_buffer(key_data)]
    )
    values = _binary(entries, value_validity, value_offsets, value_data)
    header = _HEADERS_TYPE.value_type
    entry = pa.StructArray.from_arrays([keys, values], fields=[header.field(0), header.field(1)])
    offsets_array = pa.Array.from_buffers(pa.int32(), count + 1, [None, pa.py_buffer(offsets)])
    return pa.ListArray.from_arrays(offsets_array, entry, type=_HEADERS_TYPE)


def _binary(count: int, validity: bytes | None, offsets: bytes, data: bytes) -> pa.Array:
    buffers = [None if validity is None else pa.py_buffer(validity)]
    return pa.Array.from_buffers(
        pa.binary(), count, [*buffers, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def _no_headers(count: int) -> pa.Array:
    """``count`` records' headers when none has any: one shared empty list."""
    offsets = pa.repeat(pa.scalar(0, pa.int32()), count + 1)
    return pa.ListArray.from_arrays(offsets, _NO_HEADER_VALUES, type=_HEADERS_TYPE)


def _headers(headers: Sequence[Any]) -> pa.Array:
    if not any(headers):  # the common case: no headers at all
        return _no_headers(len(headers))
    if not all(type(h) is dict for h in headers):
        raise TypeError("headers must be maps")
    rows = [[{"key": k, "value": v} for k, v in h.items()] for h in headers]
    return pa.array(rows, _HEADERS_TYPE)


def _change(value: bytes) -> dict[str, Any]:
    """A captured change's fields; ``ValueError`` for a record that is not one."""
    try:
        change = decode_change(value)
    except (ValueError, TypeError):  # msgpack's errors on what is not msgpack
        change = None
    if not isinstance(change, dict) or "op" not in change:
        raise ValueError("a record is not a captured change: read its value, not op/new/old")
    return change


def _converter(data_type: DataType) -> Any:
    """How a change's value (docs/guides/capture.md: "The change format") becomes what
    Arrow builds ``data_type`` from; None stays None."""
    if isinstance(data_type, StructType):
        fields = [(f.name, _converter(f.dataType)) for f in data_type.fields]
        return lambda row: None if row is None else {n: c(row.get(n)) for n, c in fields}
    if isinstance(data_type, ArrayType):
        element = _converter(data_type.elementType)
        return lambda items: None if items is None else [element(i) for i in items]
    parse = _PARSERS.get(type(data_type))
    if parse is None:
        return _same
    return lambda value: None if value is None else parse(value)


def _same(value: Any) -> Any:
    return value


def _text(value: Any) -> str:
    """Text as itself; what json and jsonb hold as its JSON."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


_PARSERS: dict[type, Any] = {
    StringType: _text,
    TimestampType: datetime.datetime.fromisoformat,
    TimestampNTZType: datetime.datetime.fromisoformat,
    DateType: datetime.date.fromisoformat,
    DecimalType: decimal.Decimal,
}
