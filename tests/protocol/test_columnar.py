"""RECORDS decoded into Arrow's column buffers (``streamq.protocol.columnar``, its C
decoder ``columnar_c.c``) against the pure-Python way (msgpack's rows, then pyarrow's
builders), driven with the same bodies: the same batch or the same error, every time.

On the compiled build the C decoder runs (``make test``); on pure Python (``make
test-pure``) every frame decodes as rows and the comparisons hold trivially."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spark_source.schema import EVERY_COLUMN, Columns, default_schema
from streamq import Client, SyncProducer, native
from streamq.errors import RemoteProtocolError
from streamq.protocol import (
    FRAME_HEADER,
    MessageType,
    RecordColumns,
    RecordRows,
    columnar,
    decode_message,
    encode_record,
    first_and_last_seq,
    records_frame,
)

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COLUMNS = RecordColumns if columnar.AVAILABLE else RecordRows

keys = st.none() | st.binary(max_size=12)
header_maps = st.dictionaries(st.text(max_size=5), st.none() | st.binary(max_size=6), max_size=3)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A RECORDS body as producers send it: records in increasing seq order, with or
    without an epoch and ``through``."""
    seqs = sorted(draw(st.sets(st.integers(1, 2**63 - 1), max_size=20)))
    records = [
        encode_record(
            seq,
            draw(st.integers(-(2**53), 2**53)),
            draw(keys),
            draw(st.binary(max_size=40)),
            draw(st.just({}) | header_maps),
        )
        for seq in seqs
    ]
    epoch = draw(st.none() | st.integers(0, 2**32))
    through = draw(st.none() | st.just(seqs[-1] if seqs else 1))
    return records_frame(records, epoch, through)[FRAME_HEADER.size :]


def outcome(body: bytes, columnar_records: bool, columns: Columns = EVERY_COLUMN) -> Any:
    """What a columnar reader makes of ``body``: its message's kind, seqs and fields after
    the records, and its batch; or the error it meets, as text."""
    try:
        message = decode_message(body, raw_records=True, columnar=columnar_records)
    except RemoteProtocolError as exc:
        return ("refused", str(exc))
    if not isinstance(message, RecordRows | RecordColumns):  # damaged into another message
        return ("another message", message)
    part = message.columns if isinstance(message, RecordColumns) else message.rows
    try:
        batch = columns.batch_of("p1", "h:1", "orders", [part])
    except ValueError as exc:
        return ("malformed", str(exc))
    head = (first_and_last_seq(message), message.epoch, message.through)
    return ("read", head, batch)


def same(a: Any, b: Any) -> bool:
    if a[0] != "read" or b[0] != "read":
        return bool(a == b)
    return bool(a[1] == b[1] and a[2].equals(b[2]))


def test_the_c_decoder_runs_exactly_on_the_compiled_path() -> None:
    assert columnar.AVAILABLE is native.build().compiled


@EXAMPLES
@given(body=bodies(), include_headers=st.booleans())
def test_records_read_as_columns_make_the_batch_rows_make(
    body: bytes, include_headers: bool
) -> None:
    message = decode_message(body, raw_records=True, columnar=True)
    assert isinstance(message, COLUMNS)
    columns = Columns(default_schema(include_headers))
    expected = outcome(body, False, columns)
    assert expected[0] == "read"
    assert same(outcome(body, True, columns), expected)


@EXAMPLES
@given(body=bodies(), data=st.data())
def test_a_damaged_body_reads_or_fails_the_same_either_way(
    body: bytes, data: st.DataObject
) -> None:
    """Bytes overwritten, cut or added anywhere: whatever the pure-Python reader makes of
    the body (a batch, or which error), the columnar one makes too."""
    broken = damaged(body, data)
    assume(broken)
    assert same(outcome(broken, True), outcome(broken, False))


def damaged(body: bytes, data: st.DataObject) -> bytes:
    """``body`` with one to three bytes overwritten, cut or added anywhere."""
    damaged = bytearray(body)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.integers(0, len(damaged)))
        how = data.draw(st.sampled_from(["overwrite", "cut", "insert"]))
        byte = data.draw(st.integers(0, 255))
        if how == "overwrite" and where < len(damaged):
            damaged[where] = byte
        elif how == "cut":
            del damaged[where:]
        else:
            damaged.insert(where, byte)
    return bytes(damaged)


def packed(records: list[list[Any]], *rest: Any) -> bytes:
    return msgpack.packb([MessageType.RECORDS, records, *rest], use_bin_type=True)


@pytest.mark.parametrize(
    ("records", "rest", "columns"),
    [
        ([[1, 5, None, b"v", {}], [2, -5, b"k", b"", {"h": None, "": b""}]], (7,), True),
        ([[1, 0, "text key", b"v", {}]], (), False),  # str for bin: msgpack and pyarrow's
        ([[1, 0, None, "text", {}]], (), False),
        ([[1, 0, None, b"v", {b"bin": b"x"}]], (), False),  # bin for str
        ([[2, 0, None, b"v", {}], [1, 0, None, b"v", {}]], (), False),  # out of order
        ([[1, 0, None, b"v", {}], [1, 0, None, b"v", {}]], (), False),  # seq twice
        ([[1, 2**62, None, b"v", {}]], (), False),  # microseconds beyond int64
        ([[1, 0, None, b"v", {}, 6]], (), False),  # 6 fields
        ([[1, 0.5, None, b"v", {}]], (), False),
        ([[1, True, None, b"v", {}]], (), False),
        ([[1, 0, None, None, {}]], (), False),
        ([[2**64 - 1, 0, None, b"v", {}]], (), False),
        ([[1, 0, None, b"v", {}]], (None, 1), True),  # epoch nil, through
        ([[1, 0, None, b"v", {}]], (None,), True),  # epoch nil, no through: refused
        ([[1, 0, None, b"v", {}]], (1, 0), True),  # through before the last seq: refused
        ([[1, 0, None, b"v", {}]], (1, 2, 3), True),  # 5 fields: refused
        ([], (), True),
    ],
)
def test_shapes_beyond_the_protocols_go_the_pure_python_way(
    records: list[list[Any]], rest: tuple[Any, ...], columns: bool
) -> None:
    """The C decoder takes the protocol's exact shapes and leaves every other to the
    pure-Python reader, which reads or refuses it with its own error, the same either way."""
    body = packed(records, *rest)
    read = outcome(body, True)
    assert same(read, outcome(body, False))
    if read[0] != "refused":
        message = decode_message(body, raw_records=True, columnar=True)
        assert isinstance(message, COLUMNS if columns else RecordRows)


def test_a_header_key_twice_in_a_map_keeps_its_last_value_either_way() -> None:
    # msgpack's packb never writes a key twice: the map is written by hand.
    record = b"\x95\x01\x00\xc0\xc4\x01v\x82\xa1h\xc4\x01a\xa1h\xc4\x01b"
    body = b"\x92\x05\x91" + record
    read = outcome(body, True)
    assert same(read, outcome(body, False))
    assert read[2].column("headers").to_pylist() == [[{"key": "h", "value": b"b"}]]


def test_a_header_key_of_invalid_utf8_is_refused_either_way() -> None:
    record = b"\x95\x01\x00\xc0\xc4\x01v\x81\xa1\xff\xc4\x01a"
    body = b"\x92\x05\x91" + record
    read = outcome(body, True)
    assert read[0] == "refused"
    assert same(read, outcome(body, False))


def test_frames_out_of_order_with_each_other_make_no_batch() -> None:
    first = packed([[5, 0, None, b"a", {}], [6, 0, None, b"b", {}]])
    second = packed([[6, 0, None, b"c", {}]])
    parts = []
    for body in (first, second):
        message = decode_message(body, raw_records=True, columnar=True)
        assert isinstance(message, COLUMNS)
        parts.append(message.columns if isinstance(message, RecordColumns) else message.rows)
    with pytest.raises(ValueError, match="increasing seq order"):
        EVERY_COLUMN.batch_of("p1", "h:1", "orders", parts)
    batch = EVERY_COLUMN.batch_of("p1", "h:1", "orders", parts[:1])
    assert batch.column("value").to_pylist() == [b"a", b"b"]


def test_a_range_read_from_a_producer_comes_as_columns(tmp_path: Path) -> None:
    """Through a real producer on loopback: each frame as Arrow's columns on the compiled
    path, into the batch rows would make."""
    values = [b"v%d" % i for i in range(10_000)]
    with SyncProducer(str(tmp_path / "p.db")) as producer:
        with producer.transaction() as tx:
            tx.publish_many("orders", values[:9_000])
            for value in values[9_000:]:
                tx.publish("orders", value, key=b"k", headers={"h": b"1"})
        with Client(producer.address) as client:
            frames = list(client.read_range_frames("orders", 1, 10_001))
            as_rows = client.read_range_frames("orders", 1, 10_001, columnar=False)
            rows = [row for frame in as_rows for row in frame.rows]
    assert len(frames) > 1
    assert {type(frame) for frame in frames} == {COLUMNS}
    parts = [f.columns if isinstance(f, RecordColumns) else f.rows for f in frames]
    batch = EVERY_COLUMN.batch_of(producer.producer_id, "h:1", "orders", parts)
    assert batch.equals(EVERY_COLUMN.batch(producer.producer_id, "h:1", "orders", rows))
    assert batch.column("value").to_pylist() == values
    assert batch.column("key").to_pylist() == [None] * 9_000 + [b"k"] * 1_000
    assert batch.column("headers").to_pylist()[8_999:9_001] == [[], [{"key": "h", "value": b"1"}]]
