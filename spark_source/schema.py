"""The rows a streamq source yields, and their Arrow encoding.

Columns follow Spark's Kafka source where the meaning is the same (key,
value, timestamp, headers); producer, endpoint and seq take the place of
topic, partition and offset.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
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

from streamq.protocol import Record

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
_NO_HEADERS: list[dict[str, bytes]] = []


def to_arrow(
    producer: str, endpoint: str, stream: str, records: Sequence[Record]
) -> pa.RecordBatch:
    """One RecordBatch of ``records``, columns built without a Python row per record."""
    count = len(records)
    seqs, timestamps, keys, values, headers = zip(*records, strict=True) if count else ((),) * 5
    header_rows = [
        [{"key": k, "value": v} for k, v in h.items()] if h else _NO_HEADERS for h in headers
    ]
    columns = [
        pa.repeat(pa.scalar(producer, pa.string()), count),
        pa.repeat(pa.scalar(endpoint, pa.string()), count),
        pa.repeat(pa.scalar(stream, pa.string()), count),
        pa.array(seqs, pa.int64()),
        pa.array(keys, pa.binary()),
        pa.array(values, pa.binary()),
        pa.array(timestamps, pa.int64())
        .cast(pa.timestamp("ms"))
        .cast(ARROW_SCHEMA.field("timestamp").type),
        pa.array(header_rows, _HEADERS_TYPE),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
