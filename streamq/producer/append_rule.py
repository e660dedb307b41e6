"""The append rule, written once: which rows appending records to a stream adds.

Every path that appends follows it: a producer's transaction (``writing.Pending``), a
publish on the application's own SQLite connection (``engines/sqlite/append.py``) and
the PostgreSQL numbering of committed records (``engines/postgres/numbering.py``):

- records take the stream's next seqs, up to ``records.MAX_SEQ`` (``OverflowError``
  past it, before anything is written);
- each gives one log row, keeping its key only where the stream indexes keys;
- a record whose timestamp is larger than every earlier one of its stream gives a
  time-index row (``streamq_time``: seeks by time find the first seq at or after a
  timestamp);
- the first record appended under an epoch other than that of the stream's last
  segment starts a segment (a ``streamq_epochs`` row).

Pure: no I/O, no state; the callers hold the stream's head under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count, repeat

from ..records import MAX_SEQ
from .storage import EpochRow, LogRow, TimeRow


def check_last_seq(stream: str, last: int) -> None:
    """Records may take seqs up to ``last`` in ``stream``."""
    if last > MAX_SEQ:
        raise OverflowError(f"stream {stream!r} has reached the last seq")


def append_rows(
    rows: list[LogRow],
    times: list[TimeRow],
    stream_id: int,
    first: int,
    max_ts: int | None,
    key_index: bool,
    records: Sequence[bytes],
    timestamps: Sequence[int] | int,
    keys: Sequence[bytes | None] = (),
) -> int | None:
    """Add to ``rows`` and ``times`` those of ``records`` (encoded under seqs from
    ``first``, stamped ``timestamps``, keyed ``keys``), in a stream whose largest
    timestamp so far is ``max_ts``; returns its largest after them. One timestamp for
    all and no keys (a bulk publish) takes a path without a loop in Python."""
    if isinstance(timestamps, int):
        rows += zip(repeat(stream_id), count(first), repeat(timestamps), records, repeat(None))
        if max_ts is None or timestamps > max_ts:
            times.append((stream_id, timestamps, first))
            return timestamps
        return max_ts
    seq = first
    for record, ts, key in zip(records, timestamps, keys, strict=True):
        rows.append((stream_id, seq, ts, record, key if key_index else None))
        if max_ts is None or ts > max_ts:
            max_ts = ts
            times.append((stream_id, ts, seq))
        seq += 1
    return max_ts


def segment_row(stream_id: int, first: int, last_epoch: int | None, epoch: int) -> EpochRow | None:
    """The ``streamq_epochs`` row that appending from seq ``first`` under ``epoch`` adds
    to a stream whose last segment has ``last_epoch`` (None: none yet); None if none."""
    return None if last_epoch == epoch else (stream_id, first, epoch)
