"""A bulk publish's records encoded in C (``records_c.c``, behind ``codec.encode_values``)
against msgpack's packer, driven with the same inputs: the same bytes for every input the
C encoder takes, and None (the pure-Python way then) for every other.

On the compiled build the C encoder runs (``make test``); on pure Python (``make
test-pure``) it is never loaded, and ``encode_values`` is msgpack's packer alone."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamq import native
from streamq.protocol import codec, decode_record, encode_record, numbered
from streamq.records import encode_unnumbered

EXAMPLES = settings(max_examples=400, deadline=None)
# Each bin header's lengths at its bounds, and the ints' at theirs.
LENGTHS = st.sampled_from([0, 1, 255, 256, 65_535, 65_536]) | st.integers(0, 300)
UINTS = st.sampled_from([0, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**64 - 1])


def packed(first: int, timestamp: Any, values: Any) -> list[bytes]:
    """The pure-Python way: msgpack's packer, one record at a time (a first seq of 0: all
    unnumbered, seq 0)."""
    return [
        msgpack.packb([first + i if first else 0, timestamp, None, value, {}], use_bin_type=True)
        for i, value in enumerate(values)
    ]


def _c_encoder() -> Any:
    """The C encoder where the compiled path runs; elsewhere it is never loaded, and this
    stands for it: None for every input."""
    if not codec.ENCODES_IN_C:
        return lambda first, timestamp, values: None
    from streamq.protocol import records_c

    return records_c.encode_values


ENCODE = _c_encoder()


def test_the_build_decides_which_encoder_runs() -> None:
    assert native.build().compiled == codec.ENCODES_IN_C


@EXAMPLES
@given(
    first=st.integers(0, 2**64 - 1) | UINTS,
    timestamp=st.integers(0, 2**64 - 1) | UINTS,
    lengths=st.lists(LENGTHS, max_size=8),
    as_tuple=st.booleans(),
)
def test_the_common_shape_encodes_as_msgpack_does(
    first: int, timestamp: int, lengths: list[int], as_tuple: bool
) -> None:
    values = [bytes([n % 251]) * n for n in lengths]
    taken = ENCODE(first, timestamp, tuple(values) if as_tuple else values)
    if first and first + max(len(values) - 1, 0) > 2**64 - 1:
        assert taken is None  # a seq past uint64: msgpack's own error, in Python
        return
    expected = packed(first, timestamp, values)
    assert taken == (expected if codec.ENCODES_IN_C else None)
    assert codec.encode_values(first, timestamp, values) == expected


@pytest.mark.parametrize(
    ("first", "timestamp", "values"),
    [
        (1, -1, [b"x"]),  # a negative timestamp: msgpack's signed forms
        (1, -(2**63), [b"x"]),
        (-1, 5, [b"x"]),
        (1, True, [b"x"]),  # a bool is an int to Python, a bool to msgpack
        (True, 5, [b"x"]),
        (1, 5, [bytearray(b"x")]),  # not exact bytes
        (1, 5, [b"x", memoryview(b"y")]),
        (1, 5, [b"x", "y"]),  # msgpack packs a str as str: not a record's value
        (1, 2**64, [b"x"]),  # past uint64: msgpack refuses it
        (2**64 - 1, 5, [b"x", b"y"]),
    ],
)
def test_other_inputs_go_the_pure_python_way(first: Any, timestamp: Any, values: Any) -> None:
    """The C encoder declines; ``encode_values`` then gives msgpack's bytes, or its error."""
    assert ENCODE(first, timestamp, values) is None
    try:
        expected = packed(first, timestamp, values)
    except (OverflowError, TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            codec.encode_values(first, timestamp, values)
    else:
        assert codec.encode_values(first, timestamp, values) == expected


def test_an_iterator_is_declined_untouched() -> None:
    values = iter([b"x", b"y"])
    assert ENCODE(1, 5, values) is None
    assert list(values) == [b"x", b"y"]  # left whole for the pure-Python way


def test_a_first_seq_of_0_encodes_them_unnumbered() -> None:
    """As ``encode_unnumbered`` does, for a Spark executor's records: numbered when stored."""
    values = [b"a", b"b" * 300]
    encoded = codec.encode_values(0, 7, values)
    assert encoded == encode_unnumbered([(v, None, {}, 7) for v in values], 1 << 20)
    assert [numbered(r, seq) for seq, r in enumerate(encoded, 41)] == codec.encode_values(
        41, 7, values
    )


def test_a_record_reads_back_as_published() -> None:
    """What a consumer decodes: the seq, timestamp, no key, the value, no headers."""
    (record,) = codec.encode_values(42, 1_700_000_000_123, [b"payload"])
    assert record == encode_record(42, 1_700_000_000_123, None, b"payload", {})
    assert decode_record(record) == (42, 1_700_000_000_123, None, b"payload", {})
