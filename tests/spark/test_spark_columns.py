"""The executors' Arrow batches, built from rows as the client decodes them (no Spark)."""

from __future__ import annotations

import datetime
import decimal
import subprocess
import sys
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.types import (
    ArrayType,
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from spark_source.schema import EVERY_COLUMN, Columns, default_schema

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)

headers = st.dictionaries(st.text(max_size=4), st.binary(max_size=4), max_size=3)


@st.composite
def rows(draw: st.DrawFn) -> list[list[Any]]:
    """Rows [seq, timestamp, key, value, headers] in increasing seq order."""
    seqs = sorted(draw(st.sets(st.integers(1, 2**40 - 1), max_size=30)))
    return [
        [
            seq,
            draw(st.integers(0, 2**45)),
            draw(st.none() | st.binary(max_size=8)),
            draw(st.binary(max_size=16)),
            draw(headers),
        ]
        for seq in seqs
    ]


@given(rows=rows(), include_headers=st.booleans())
def test_a_batch_holds_each_row_field_by_field(
    rows: list[list[Any]], include_headers: bool
) -> None:
    columns = Columns(default_schema(include_headers))
    batch = columns.batch("p1", "h:1", "orders", rows)
    assert batch.num_rows == len(rows)
    expected = [
        {
            "producer": "p1",
            "endpoint": "h:1",
            "stream": "orders",
            "seq": seq,
            "key": key,
            "value": value,
            "timestamp": EPOCH + datetime.timedelta(milliseconds=ts),
            **(
                {"headers": [{"key": k, "value": v} for k, v in row_headers.items()]}
                if include_headers
                else {}
            ),
        }
        for seq, ts, key, value, row_headers in rows
    ]
    assert batch.to_pylist() == expected


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ([[1, 0, None, b"v", {}], [2, 0, None, b"v"]], "5 fields"),  # one row short
        ([[1, 0, None, b"v", {}, "extra"]], "5 fields"),  # every row long
        ([[1, 0, None, b"v", {}], [2, 0, None, b"v", {}, "x"]], "5 fields"),  # one row long
        ([["1", 0, None, b"v", {}]], "malformed records from producer p1"),
        ([[1, 0, b"k", b"v", {"h": 5}]], "malformed records from producer p1"),
        ([[2, 0, None, b"v", {}], [1, 0, None, b"v", {}]], "increasing seq order"),
    ],
)
def test_malformed_rows_are_refused_naming_the_producer(rows: list[list[Any]], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        EVERY_COLUMN.batch("p1", "h:1", "orders", rows)


def test_no_rows_make_an_empty_batch_of_the_schema() -> None:
    batch = EVERY_COLUMN.batch("p1", "h:1", "orders", [])
    assert batch.num_rows == 0
    assert batch.schema == EVERY_COLUMN.arrow_schema


def test_change_columns_are_read_from_the_value_as_the_schema_types_them() -> None:
    row = StructType(
        [
            StructField("at", TimestampType()),
            StructField("days", ArrayType(DateType())),
            StructField("amount", DecimalType(5, 2)),
            StructField("doc", StringType()),
            StructField("gone", IntegerType()),
        ]
    )
    schema = StructType(
        [
            StructField("seq", LongType(), False),
            StructField("op", StringType(), False),
            StructField("xid", LongType()),
            StructField("new", row),
            StructField("old", StructType([StructField("id", IntegerType())])),
        ]
    )
    change = {
        "op": "update",
        "xid": 7,
        "new": {
            "at": "2026-12-01T16:00:00.250000+00:00",
            "days": ["2026-12-01", None],
            "amount": "12.50",
            "doc": {"a": [1, None]},
        },
        "old": None,
    }
    value = msgpack.packb(change, use_bin_type=True)
    batch = Columns(schema).batch("p1", "h:1", "public.orders", [[3, 0, None, value, {}]])
    at = datetime.datetime(2026, 12, 1, 16, 0, 0, 250000, tzinfo=datetime.UTC)
    assert batch.to_pylist() == [
        {
            "seq": 3,
            "op": "update",
            "xid": 7,
            "new": {
                "at": at,
                "days": [datetime.date(2026, 12, 1), None],
                "amount": decimal.Decimal("12.50"),
                "doc": '{"a":[1,null]}',
                "gone": None,  # a column the change lacks
            },
            "old": None,
        }
    ]
    with pytest.raises(ValueError, match="not a captured change"):
        Columns(schema).batch("p1", "h:1", "events", [[1, 0, None, b"plain", {}]])
    with pytest.raises(ValueError, match="struct of the table's columns"):
        Columns(StructType([StructField("new", StringType())]))


def test_importing_the_source_leaves_what_only_executors_need_out() -> None:
    """Spark starts a new Python process to plan each streaming query: importing the source
    there must not pull in pandas (pyarrow imports it on its first array built from a list)
    nor pyarrow.compute (for the executors' batches), 0.15 s and 38 ms of each start."""
    program = (
        "import sys, spark_source.datasource; "
        "print([m for m in ('pandas', 'pyarrow.compute') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
