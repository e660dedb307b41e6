"""A consumer's RECORDS decoded into ``Record`` tuples by the C decoder
(``columnar_c.decode_records``, behind ``decode_message``) against the pure-Python way
(msgpack's rows, checked in Python), driven with the same bodies: the same message or
the same error, every time.

On the compiled build the C decoder runs (``make test``); on pure Python (``make
test-pure``) both sides are the pure-Python decoder and the comparisons hold trivially."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from streamq import native
from streamq.errors import RemoteProtocolError
from streamq.protocol import Record, Records, codec, columnar, decode_message

from .test_columnar import EXAMPLES, bodies, damaged, packed

SHAPES = [
    [[1, 5, None, b"v", {}], [2, -5, b"k", b"", {"h": b"x", "": b""}]],
    [[1, 0, "text key", b"v", {}]],  # str for bin
    [[1, 0, None, "text", {}]],
    [[1, 0, None, b"v", {b"bin": b"x"}]],  # bin for str
    [[1, 0, None, b"v", {"h": None}]],  # a header without a value
    [[1, 0, None, b"v", {"h": "text"}]],
    [[2, 0, None, b"v", {}], [1, 0, None, b"v", {}]],  # out of order
    [[1, 0, None, b"v", {}], [1, 0, None, b"v", {}]],  # seq twice
    [[0, 0, None, b"v", {}]],
    [[-1, 0, None, b"v", {}]],
    [[1, 2**64 - 1, None, b"v", {}]],  # beyond int64: the pure-Python way takes it
    [[1, 0, None, b"v", {}, 6]],  # 6 fields
    [[1, 0.5, None, b"v", {}]],
    [[1, True, None, b"v", {}]],
    [[1, 0, None, None, {}]],
    [[2**63, 0, None, b"v", {}]],  # beyond the largest seq
    [[1, 0, None, b"v", []]],
    [],
]
TAILS = [(), (7,), (None, 1), (None,), (1, 0), (1, 2, 3), (-1,), (1.5,), (2**64 - 1,)]


def outcome(body: bytes, compiled: bool) -> Any:
    """What a consumer makes of ``body``: its message, or the error it meets, as text."""
    try:
        if compiled:
            return decode_message(body)
        return codec._decode_message(body, raw_records=False)  # the pure-Python way itself
    except RemoteProtocolError as exc:
        return ("refused", str(exc))


def test_the_c_decoder_runs_exactly_on_the_compiled_path() -> None:
    body = packed([[1, 5, None, b"v", {"h": b"x"}]])
    assert (columnar.decode_records(body) is not None) is native.build().compiled
    message = decode_message(body)
    assert message == Records((Record(1, 5, None, b"v", {"h": b"x"}),))
    # Nothing in a record can refer back to it: the collector need not scan it.
    assert gc.is_tracked(message.records[0]) is not native.build().compiled


@EXAMPLES
@given(body=bodies())
def test_records_decode_the_same_either_way(body: bytes) -> None:
    """Refused too, the same way, where a header has no value (a columnar reader takes it)."""
    assert outcome(body, True) == outcome(body, False)


@EXAMPLES
@given(body=bodies(), data=st.data())
def test_a_damaged_body_reads_or_fails_the_same_either_way(
    body: bytes, data: st.DataObject
) -> None:
    """Bytes overwritten, cut or added anywhere: whatever the pure-Python way makes of the
    body (a message, or which error), the C decoder makes too."""
    broken = damaged(body, data)
    assume(broken)
    assert outcome(broken, True) == outcome(broken, False)


@pytest.mark.parametrize("records", SHAPES)
@pytest.mark.parametrize("rest", TAILS)
def test_shapes_beyond_the_protocols_go_the_pure_python_way(
    records: list[list[Any]], rest: tuple[Any, ...]
) -> None:
    body = packed(records, *rest)
    assert outcome(body, True) == outcome(body, False)


def test_a_header_key_twice_in_a_map_keeps_its_last_value_either_way() -> None:
    # msgpack's packb never writes a key twice: the map is written by hand.
    body = b"\x92\x05\x91" + b"\x95\x01\x00\xc0\xc4\x01v\x82\xa1h\xc4\x01a\xa1h\xc4\x01b"
    read = outcome(body, True)
    assert read == outcome(body, False)
    assert isinstance(read, Records) and read.records[0].headers == {"h": b"b"}


def test_trailing_bytes_are_refused_either_way() -> None:
    body = packed([[1, 0, None, b"v", {}]], 3) + b"\x00"
    read = outcome(body, True)
    assert read[0] == "refused"
    assert read == outcome(body, False)
