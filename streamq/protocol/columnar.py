"""RECORDS frame bodies decoded straight into Arrow's column buffers, where the compiled
path runs.

A columnar reader (the Spark source's executors) otherwise has msgpack make Python
objects of every record's fields and pyarrow walk them again: frames of 8,192 records
of 100-byte values into Arrow batches took 1.3 µs a record that way, 0.13 with the
compiled decoder (``columnar_c.c``, ``python -m bench.tools.builds``), which writes each
column as Arrow lays it out for pyarrow to wrap without a copy.

The decoder takes only the protocol's exact shapes; a body of any other shape, and every
body on the pure-Python path, decodes as ``RecordRows`` as before, whose reader checks
and builds them with the same result or the same error. No pyarrow here: this is the
sans-IO protocol; the Spark source builds its arrays from the buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from .events import ColumnBuffers

_DECODE: Callable[[bytes], Any] | None
try:  # not on the pure-Python path: ``streamq.native``'s finder refuses it there
    from .columnar_c import decode as _DECODE
except ImportError:  # pure Python, or a build without it
    _DECODE = None
AVAILABLE = _DECODE is not None


def decode_columns(body: bytes) -> tuple[ColumnBuffers, list[Any]] | None:
    """A RECORDS body's records as column buffers, and the message's fields after them
    (epoch, through: unchecked); None if the compiled decoder does not run or does not
    take this body."""
    if _DECODE is None:
        return None
    decoded = _DECODE(body)
    if decoded is None:
        return None
    fields, tail, *buffers = decoded
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(body) - tail, 1))
    unpacker.feed(body[tail:])
    try:
        rest = [unpacker.unpack() for _ in range(fields - 2)]
    except (ValueError, msgpack.OutOfData):  # left to the pure-Python decoder to name
        return None
    if tail + unpacker.tell() != len(body):
        return None
    return ColumnBuffers(*buffers), rest
