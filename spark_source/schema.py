"""The rows a streamq source yields, and their Arrow encoding.

Columns follow Spark's Kafka source where the meaning is the same (key,
value, timestamp, headers); producer, endpoint and seq take the place of
topic, partition and offset.
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

# What Spark checks ``read()``'s batches against, exactly.
ARROW_SCHEMA: pa.Schema = to_arrow_schema(SCHEMA, timezone="UTC")
_HEADERS_TYPE = ARROW_SCHEMA.field("headers").type
_TIMESTAMP = ARROW_SCHEMA.field("timestamp").type
_MILLISECONDS = pa.timestamp("ms", tz="UTC")  # records carry milliseconds since the epoch
_NO_HEADER_VALUES = pa.array([], _HEADERS_TYPE.value_type)


def to_arrow(
    producer: str, endpoint: str, stream: str, rows: Sequence[Sequence[Any]]
) -> pa.RecordBatch:
    """One RecordBatch from rows [seq, timestamp, key, value, headers], built column by column.

    No Python object per record: Arrow checks every field's type as it builds each column,
    and seq order is checked on the column. Raises ``ValueError`` for malformed rows.
    """
    count = len(rows)
    try:
        seqs, timestamps, keys, values, headers = zip(*rows, strict=True) if count else ((),) * 5
        seq_column = pa.array(seqs, pa.int64())
        columns = [
            pa.repeat(pa.scalar(producer, pa.string()), count),
            pa.repeat(pa.scalar(endpoint, pa.string()), count),
            pa.repeat(pa.scalar(stream, pa.string()), count),
            seq_column,
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array(timestamps, pa.int64()).cast(_MILLISECONDS).cast(_TIMESTAMP),
            _headers(headers),
        ]
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise ValueError(f"malformed records from producer {producer}: {exc}") from None
    if count > 1 and not pc.all(pc.less(seq_column[:-1], seq_column[1:])).as_py():
        raise ValueError(f"records from producer {producer} are not in increasing seq order")
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


def _headers(headers: Sequence[Any]) -> pa.Array:
    if not any(headers):  # the common case: no headers at all, one shared empty list
        offsets = pa.repeat(pa.scalar(0, pa.int32()), len(headers) + 1)
        return pa.ListArray.from_arrays(offsets, _NO_HEADER_VALUES, type=_HEADERS_TYPE)
    if not all(type(h) is dict for h in headers):
        raise TypeError("headers must be maps")
    rows = [[{"key": k, "value": v} for k, v in h.items()] for h in headers]
    return pa.array(rows, _HEADERS_TYPE)
