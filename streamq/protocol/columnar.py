"""RECORDS frame bodies decoded in C where the compiled path runs: straight into Arrow's
column buffers, or into ``Record`` tuples for a consumer.

A columnar reader (the Spark source's executors) otherwise has msgpack make Python
objects of every record's fields and pyarrow walk them again: frames of 8,192 records
of 100-byte values into Arrow batches took 1.3 µs a record that way, 0.13 with the
compiled decoder (``columnar_c.c``, ``python -m bench.tools.builds``), which writes each
column as Arrow lays it out for pyarrow to wrap without a copy.

A consumer's records decoded in C (``decode_records``) skip msgpack's list per record and
the Python loop that checks it, and are made untracked by the cyclic garbage collector
(their fields cannot refer back): with 300 consumers in one process at 1,000 records/s,
the collector's passes over the records held took about 45% of the process's CPU.

The decoder takes only the protocol's exact shapes; a body of any other shape, and every
body on the pure-Python path, decodes as ``RecordRows`` as before, whose reader checks
and builds them with the same result or the same error. No pyarrow here: this is the
sans-IO protocol; the Spark source builds its arrays from the buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from .events import MAX_SEQ, ColumnBuffers, Record

_DECODE: Callable[[bytes], Any] | None
_DECODE_RECORDS: Callable[[bytes, type, int], list[Any] | None] | None
try:  # not on the pure-Python path: ``streamq.native``'s finder refuses it there
    from .columnar_c import decode as _DECODE
    from .columnar_c import decode_records as _DECODE_RECORDS
except ImportError:  # pure Python, or a build without it
    _DECODE = _DECODE_RECORDS = None
AVAILABLE = _DECODE is not None


def decode_records(body: bytes) -> list[Any] | None:
    """A RECORDS body's fields, ``[records, epoch?, through?]``, its records a tuple of
    ``Record`` (the other fields unchecked); None if the compiled decoder does not run or
    does not take this body."""
    if _DECODE_RECORDS is None:
        return None
    return _DECODE_RECORDS(body, Record, MAX_SEQ)


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
