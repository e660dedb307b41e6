"""The rows a streamq source yields, and their Arrow encoding.

Columns follow Spark's Kafka source where the meaning is the same (key,
value, timestamp, headers); producer, endpoint and seq take the place of
topic, partition and offset. A query may read fewer: ``includeHeaders=false``
drops ``headers``, and a schema given with ``.schema(...)`` names the columns
it wants. Python sources get no column pruning from Spark, so every column the
source builds costs the executor's Python and the JVM per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

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

# How each column is built: from the partition's constants, or from rows [seq, timestamp,
# key, value, headers] as the client decodes records.
_CONSTANTS = ("producer", "endpoint", "stream")
_ROW_INDEX = {"seq": 0, "timestamp": 1, "key": 2, "value": 3, "headers": 4}

ARROW_SCHEMA: pa.Schema = to_arrow_schema(SCHEMA, timezone="UTC")
_HEADERS_TYPE = ARROW_SCHEMA.field("headers").type
_TIMESTAMP = ARROW_SCHEMA.field("timestamp").type
_MILLISECONDS = pa.timestamp("ms", tz="UTC")  # records carry milliseconds since the epoch
_NO_HEADER_VALUES = pa.array([], _HEADERS_TYPE.value_type)


def default_schema(include_headers: bool) -> StructType:
    """The schema without ``.schema(...)``: every column, ``headers`` if asked for."""
    if include_headers:
        return SCHEMA
    return StructType([field for field in SCHEMA.fields if field.name != "headers"])


def _check_schema(schema: StructType) -> None:
    """A schema given with ``.schema(...)`` must pick columns of ``SCHEMA`` by name, with
    their types (nested nullability aside); raises ``ValueError`` saying what is wrong."""
    if not schema.fields:
        raise ValueError("the schema names no column")
    for field in schema.fields:
        ours = FIELDS.get(field.name)
        if ours is None:
            raise ValueError(
                f"no column {field.name!r}; the columns are {', '.join(FIELDS)} "
                "(pick any of them, in any order)"
            )
        if field.dataType.simpleString() != ours.dataType.simpleString():
            raise ValueError(
                f"column {field.name!r} is {ours.dataType.simpleString()}, "
                f"not {field.dataType.simpleString()}"
            )
        if ours.nullable and not field.nullable:
            raise ValueError(f"column {field.name!r} is nullable")


class Columns:
    """Builds Arrow record batches of one schema's columns, and no others, from rows
    [seq, timestamp, key, value, headers] as the client decodes them: one list per column
    read, then one Arrow array each, which checks every field's type as it is built."""

    def __init__(self, schema: StructType) -> None:
        _check_schema(schema)
        self.names = tuple(schema.fieldNames())
        self.arrow_schema: pa.Schema = to_arrow_schema(schema, timezone="UTC")
        # A given schema may declare nested fields nullable where ours are not.
        self._casts = {
            name: self.arrow_schema.field(name).type
            for name in self.names
            if self.arrow_schema.field(name).type != ARROW_SCHEMA.field(name).type
        }

    def batch(
        self, producer: str, endpoint: str, stream: str, rows: Sequence[Sequence[Any]]
    ) -> pa.RecordBatch:
        """One RecordBatch of ``rows``; raises ``ValueError`` for malformed rows or rows out
        of seq order."""
        count = len(rows)
        constants = {"producer": producer, "endpoint": endpoint, "stream": stream}
        try:
            # Rows to fields in one pass in C (a tuple per field), not a list per column.
            fields = _fields(rows) if count else [()] * 5
            seqs = pa.array(fields[0], pa.int64())
            columns = []
            for name in self.names:
                if name in _CONSTANTS:
                    column = pa.repeat(pa.scalar(constants[name], pa.string()), count)
                elif name == "seq":
                    column = seqs
                else:
                    column = _build(name, fields[_ROW_INDEX[name]])
                cast = self._casts.get(name)
                columns.append(column if cast is None else column.cast(cast))
        except (pa.ArrowException, TypeError, ValueError, LookupError) as exc:
            raise ValueError(f"malformed records from producer {producer}: {exc}") from None
        if count > 1 and not pc.all(pc.less(seqs[:-1], seqs[1:])).as_py():
            raise ValueError(f"records from producer {producer} are not in increasing seq order")
        return pa.RecordBatch.from_arrays(columns, schema=self.arrow_schema)


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
    if name == "timestamp":
        return pa.array(values, pa.int64()).cast(_MILLISECONDS).cast(_TIMESTAMP)
    if name == "headers":
        return _headers(values)
    return pa.array(values, pa.binary())  # key, value


def _headers(headers: Sequence[Any]) -> pa.Array:
    if not any(headers):  # the common case: no headers at all, one shared empty list
        offsets = pa.repeat(pa.scalar(0, pa.int32()), len(headers) + 1)
        return pa.ListArray.from_arrays(offsets, _NO_HEADER_VALUES, type=_HEADERS_TYPE)
    if not all(type(h) is dict for h in headers):
        raise TypeError("headers must be maps")
    rows = [[{"key": k, "value": v} for k, v in h.items()] for h in headers]
    return pa.array(rows, _HEADERS_TYPE)
