"""What an application publishes, checked before it is encoded: a wrong type is a
``TypeError`` naming the field, raised in the caller's transaction before anything is
written."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import RecordTooLargeError
from .protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_OVERHEAD,
    SEQ_GROWTH,
    encode_record,
    encode_values,
)

_MAX_STREAM_NAME = 255
# The largest record a frame of the default size holds.
DEFAULT_MAX_RECORD_SIZE = DEFAULT_MAX_FRAME_SIZE - FRAME_OVERHEAD
MAX_SEQ = (1 << 40) - 1  # the largest seq either engine stores (SQLite packs it in 40 bits)

# A checked record: value, key, headers, timestamp (ms since the Unix epoch).
CheckedRecord = tuple[bytes, bytes | None, dict[str, bytes], int]


def as_bytes(value: Any, what: str) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    hint = "; encode it first, e.g. value.encode()" if isinstance(value, str) else ""
    raise TypeError(f"{what} must be bytes, not {type(value).__name__}{hint}")


def _check_headers(headers: Mapping[str, Any] | None) -> dict[str, bytes]:
    if not headers:
        return {}
    if not isinstance(headers, Mapping):
        raise TypeError(f"headers must be a mapping of str to bytes, not {type(headers).__name__}")
    checked = {}
    for name, value in headers.items():
        if not isinstance(name, str):
            raise TypeError(f"header names must be str, not {type(name).__name__}")
        checked[name] = as_bytes(value, f"header {name!r}")
    return checked


def check_stream_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"stream name must be str, not {type(name).__name__}")
    if not name or len(name) > _MAX_STREAM_NAME:
        raise ValueError(f"stream name must have 1 to {_MAX_STREAM_NAME} characters: {name!r}")
    return name


def checked_timestamp(timestamp: int | None) -> int:
    if timestamp is None:
        return int(time.time() * 1000)
    if type(timestamp) is int:
        return timestamp
    raise TypeError(f"timestamp must be int milliseconds, not {type(timestamp).__name__}")


def checked_record(
    value: Any, key: Any, headers: Mapping[str, Any] | None, timestamp: int | None
) -> CheckedRecord:
    """A record's fields as they are encoded, or a TypeError naming the bad one."""
    return (
        as_bytes(value, "value"),
        None if key is None else as_bytes(key, "key"),
        _check_headers(headers),
        checked_timestamp(timestamp),
    )


def values_only(values: Iterable[Any]) -> list[CheckedRecord]:
    """``publish_many``'s records: each value alone, no key or headers, one timestamp."""
    ts = checked_timestamp(None)
    return [(as_bytes(value, "value"), None, {}, ts) for value in values]


def encode_checked(
    seqs: Sequence[int], records: Sequence[CheckedRecord], max_record_size: int, growth: int = 0
) -> list[bytes]:
    """Each record's wire encoding under its seq; ``RecordTooLargeError`` for one that
    cannot fit in a frame (raised before anything is written), counting ``growth``
    more bytes for each."""
    encoded = [
        encode_record(seq, ts, key, value, headers)
        for seq, (value, key, headers, ts) in zip(seqs, records, strict=True)
    ]
    _check_sizes(encoded, max_record_size, growth)
    return encoded


def _check_sizes(encoded: list[bytes], max_record_size: int, growth: int) -> None:
    largest = max(map(len, encoded), default=0) + growth
    if largest > max_record_size:
        raise RecordTooLargeError(
            f"record of {largest} bytes exceeds the limit of {max_record_size} "
            "(max_frame_size minus framing)"
        )


def encode_unnumbered(records: Sequence[CheckedRecord], max_record_size: int) -> list[bytes]:
    """Each record's encoding with seq 0, numbered later (``protocol.numbered``);
    ``RecordTooLargeError`` for one that could not fit in a frame under any seq."""
    return encode_checked([0] * len(records), records, max_record_size, SEQ_GROWTH)


@dataclass(frozen=True, slots=True)
class Unnumbered:
    """Records encoded as stored before they have seqs (``encode_unnumbered``), with their
    timestamps and keys: all of an append's work that needs no database. Made where the
    records are (a Spark executor, beside the others), then appended as they are, in
    order, by either engine (``Engine.append_unnumbered``)."""

    encoded: list[bytes]
    timestamps: list[int]
    keys: list[bytes | None]

    @classmethod
    def of(cls, records: Sequence[CheckedRecord], max_record_size: int) -> Unnumbered:
        """``records`` encoded; ``RecordTooLargeError`` for one that cannot fit a frame."""
        return cls(
            encode_unnumbered(records, max_record_size),
            [record[3] for record in records],
            [record[1] for record in records],
        )

    @classmethod
    def of_values(cls, values: list[bytes], timestamp: int, max_record_size: int) -> Unnumbered:
        """``of`` for values alone, no key or headers, of one timestamp: in one pass (in C
        where the compiled path runs)."""
        encoded = encode_values(0, timestamp, values)
        _check_sizes(encoded, max_record_size, SEQ_GROWTH)
        return cls(encoded, [timestamp] * len(values), [None] * len(values))

    @classmethod
    def joined(cls, parts: Iterable[Unnumbered]) -> Unnumbered:
        """``parts`` one after the other."""
        encoded: list[bytes] = []
        timestamps: list[int] = []
        keys: list[bytes | None] = []
        for part in parts:
            encoded += part.encoded
            timestamps += part.timestamps
            keys += part.keys
        return cls(encoded, timestamps, keys)

    def __len__(self) -> int:
        return len(self.encoded)


@dataclass(frozen=True, slots=True)
class Receipt:
    """Records published where seqs are given after the commit (PostgreSQL): the
    serving producer numbers each committed transaction's records in commit order.

    They are ``count`` records that transaction ``xid`` published to ``stream`` in one
    call, the first stored as pending row ``id`` (or, through the WAL, in the message at
    LSN ``id``); they get consecutive seqs.
    ``await producer.wait_served(receipt)`` (in the serving process) returns them once
    the records are served.
    """

    stream: str
    xid: int  # the publishing transaction's id (pg_current_xact_id())
    id: int  # the first record's row in streamq_pending, or its message's LSN
    count: int


def seq_range(seqs: list[int]) -> range:
    """Consecutive seqs as a range (empty: none were appended)."""
    return range(seqs[0], seqs[-1] + 1) if seqs else range(0)
