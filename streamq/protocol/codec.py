"""Messages to bytes and bytes to messages: framing, msgpack, and records as stored.

Split from the events and the state machine because this is where the hot paths are
(a push frame built by concatenating stored record encodings; a consumer's frame decoded
and checked in one tight loop) and where a peer's bytes are first checked: a frame that
is not a well-formed message becomes ``RemoteProtocolError`` here. It knows the shape of
each message but not which may come when (``state.py``). No sockets, no event loop.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import reprlib
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgpack

from ..errors import ErrorCode, RemoteProtocolError
from ..filters import Filter, FilterError
from .columnar import decode_columns, decode_records
from .events import (
    FIELD_CHECKS,
    FIELD_NAMES,
    MAX_SEQ,
    MESSAGE_CLASSES,
    OPTIONAL_FIELDS,
    PROTOCOL_VERSION,
    ClientHello,
    ColumnBuffers,
    GetRange,
    ListStreams,
    Message,
    MessageType,
    Record,
    RecordColumns,
    RecordRows,
    Records,
    RecordsMessage,
    ServerHello,
    StreamInfo,
    StreamList,
    Subscribe,
    first_and_last_seq,
    is_str,
    is_uint,
    is_version,
)

DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024
# The most a client accepts when a producer announces larger frames.
MAX_ACCEPTED_FRAME_SIZE = 256 * 1024 * 1024

# "Framing": a 4-byte big-endian body length, then a msgpack array body.
FRAME_HEADER = struct.Struct(">I")
# Bytes a RECORDS frame adds around its records; a record may use the rest.
FRAME_OVERHEAD = 64


# --- Records as stored and sent ----------------------------------------------


def encode_record(
    seq: int, timestamp: int, key: bytes | None, value: bytes, headers: dict[str, bytes]
) -> bytes:
    """A record's wire encoding; producers store exactly these bytes.

    Storing the encoded form lets the server build RECORDS frames by
    concatenation, with no decode and re-encode per record.
    """
    return _packb([seq, timestamp, key, value, headers])


_packb: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack

_ENCODE_VALUES: Callable[[int, int, Sequence[bytes]], list[bytes] | None] | None
try:  # not on the pure-Python path: ``streamq.native``'s finder refuses it there
    from .records_c import encode_values as _ENCODE_VALUES
except ImportError:  # pure Python, or a build without it
    _ENCODE_VALUES = None
ENCODES_IN_C = _ENCODE_VALUES is not None


def encode_values(first_seq: int, timestamp: int, values: Sequence[bytes]) -> list[bytes]:
    """``encode_record`` of each value, with no key and no headers, under consecutive seqs
    from ``first_seq``, or all unnumbered (seq 0, ``numbered`` later) for a first seq of 0:
    a batch's records in one pass. Where the compiled path runs, in C (``records_c.c``)
    for the common shape (bytes values, seqs and timestamp from 0 to 2**64 - 1; the same
    bytes), else here."""
    if _ENCODE_VALUES is not None:
        encoded = _ENCODE_VALUES(first_seq, timestamp, values)
        if encoded is not None:
            return encoded
    pack = _packb
    seqs = itertools.count(first_seq) if first_seq else itertools.repeat(0)
    return [
        pack([seq, timestamp, None, value, {}])
        for seq, value in zip(seqs, values, strict=False)  # the seqs never end
    ]


# An unnumbered record (``encode_record`` with seq 0) starts with these two bytes: a
# 5-element array, then 0. Numbering puts the seq's encoding in place of the 0.
UNNUMBERED_PREFIX = b"\x95\x00"
# The most a seq's encoding adds to an unnumbered record (uint64: 9 bytes, not 1).
SEQ_GROWTH = 8


def numbered(unnumbered: bytes, seq: int) -> bytes:
    """An unnumbered record's encoding under ``seq``, without decoding it."""
    if not unnumbered.startswith(UNNUMBERED_PREFIX):
        raise ValueError("not an unnumbered record")
    return b"\x95" + _packb(seq) + unnumbered[2:]


def numbered_run(first: int, count: int, encoded: bytes) -> bytes:
    """``count`` records stored back to back, the first at seq ``first``, as sent:
    numbered here if they were stored unnumbered (SQLite's one-statement append stores
    them so), else as they are. A numbered record never starts as an unnumbered one: no
    record has seq 0."""
    if not encoded.startswith(UNNUMBERED_PREFIX):
        return encoded
    if count == 1:
        return numbered(encoded, first)
    return b"".join(numbered(r, seq) for seq, r in numbered_records(first, count, encoded))


def decode_record(encoded: bytes) -> Record:
    """A stored record back as a ``Record`` (the producer's own bytes: trusted)."""
    return Record._make(msgpack.unpackb(encoded, raw=False))


def split_records(encoded: bytes, count: int) -> list[bytes]:
    """``count`` records' encodings stored back to back, apart again: each one's bounds
    found by skipping it, no Python object made per field."""
    if count == 1:
        return [encoded]
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(encoded), 1))
    unpacker.feed(encoded)
    records, start = [], 0
    for _ in range(count):
        unpacker.skip()
        end = unpacker.tell()
        records.append(encoded[start:end])
        start = end
    if start != len(encoded):
        raise ValueError(f"{len(encoded) - start} bytes left after {count} records")
    return records


def numbered_records(first: int, count: int, encoded: bytes) -> Iterable[tuple[int, bytes]]:
    """(seq, encoding) of ``count`` records stored back to back, the first at seq ``first``."""
    if count == 1:
        return ((first, encoded),)
    return zip(range(first, first + count), split_records(encoded, count), strict=True)


def slice_records(encoded: bytes, count: int, skip: int, take: int) -> bytes:
    """Records ``skip`` to ``skip + take - 1`` of ``count`` stored back to back, as one
    slice: only the records before the slice's two ends are skipped over."""
    if skip == 0 and take == count:
        return encoded
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(encoded), 1))
    unpacker.feed(encoded)
    for _ in range(skip):
        unpacker.skip()
    begin = unpacker.tell()
    if skip + take == count:
        return encoded[begin:]
    for _ in range(take):
        unpacker.skip()
    return encoded[begin : unpacker.tell()]


def record_key(encoded: bytes) -> bytes | None:
    """The key of a stored record."""
    key: bytes | None = msgpack.unpackb(encoded, raw=False)[2]
    return key


# --- Encoding -----------------------------------------------------------------


def frame(body: bytes) -> bytes:
    """Prefix a body with its length."""
    return FRAME_HEADER.pack(len(body)) + body


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_RECORDS_TYPE = _packb(MessageType.RECORDS.value)
_NIL = _packb(None)
# [RECORDS, records], [RECORDS, records, epoch] and [RECORDS, records, epoch, through].
_RECORDS_PREFIXES = [bytes((0x92 + extra,)) + _RECORDS_TYPE for extra in range(3)]


def records_frame(
    encoded_records: Sequence[bytes],
    epoch: int | None = None,
    through: int | None = None,
    count: int | None = None,
) -> bytes:
    """A RECORDS frame built from records already encoded by ``encode_record``.

    With ``count``, ``encoded_records`` are parts that hold that many records in all,
    each one record or several back to back (as a producer stores them), joined as
    they are. With ``epoch``, the frame carries it after the records ("Epochs"); with
    ``through``, that comes last ("Filters"), after the epoch or nil.
    """
    if through is not None:
        tail = [_NIL if epoch is None else _packb(epoch), _packb(through)]
    else:
        tail = [] if epoch is None else [_packb(epoch)]
    body_parts = [
        _RECORDS_PREFIXES[len(tail)],
        _array_header(len(encoded_records) if count is None else count),
        *encoded_records,
        *tail,
    ]
    size = sum(map(len, body_parts))
    return FRAME_HEADER.pack(size) + b"".join(body_parts)


# LIST_STREAMS in a body of 10 bytes: an array 32 header and the type as a uint 32, formats
# every decoder accepts ("Framing"). Its length prefix ends in 0x0a, a line feed, which is
# what a service that reads lines (a web server) waits for before it answers: the probe a
# client sends a peer still silent after the CLIENT_HELLO ("Handshake").
_LIST_STREAMS = frame(b"\xdd\x00\x00\x00\x01\xce" + MessageType.LIST_STREAMS.to_bytes(4, "big"))


def encode(message: Message) -> bytes:
    """One framed message."""
    if type(message) is ListStreams:
        return _LIST_STREAMS
    if isinstance(message, Records):
        return records_frame(
            [encode_record(*r) for r in message.records], message.epoch, message.through
        )
    if isinstance(message, RecordRows):
        return records_frame([_packb(row) for row in message.rows], message.epoch, message.through)
    if isinstance(message, StreamList):
        items: list[Any] = [[s.stream, s.head, s.low] for s in message.streams]
        return frame(_packb([message.TYPE.value, items]))
    cls = type(message)
    values = [_to_wire(getattr(message, name)) for name in FIELD_NAMES[cls]]
    # Optional trailing fields left as None are not sent ("Optional fields").
    required = len(values) - OPTIONAL_FIELDS.get(cls, 0)
    while len(values) > required and values[-1] is None:
        values.pop()
    return frame(_packb([message.TYPE.value, *values]))


def _to_wire(value: Any) -> Any:
    return value.to_wire() if isinstance(value, Filter) else value


# --- Decoding -----------------------------------------------------------------


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _short(value: Any) -> str:
    """A bounded repr for error messages: peer data may be huge or deeply nested."""
    return _REPR.repr(value)


def malformed(reason: str) -> RemoteProtocolError:
    return RemoteProtocolError(reason, ErrorCode.MALFORMED_FRAME)


def _decode_records(items: Any) -> tuple[Record, ...]:
    """Validate every record, in one tight loop: this is the consumer's hot path."""
    if type(items) is not list:
        raise malformed("RECORDS must carry an array of records")
    records: list[Record] = []
    append = records.append
    make = Record._make
    previous = 0
    for item in items:
        if type(item) is not list or len(item) != 5:
            raise malformed("a record must be an array of 5 elements")
        seq, timestamp, key, value, headers = item
        if (
            type(seq) is not int
            or type(timestamp) is not int
            or type(value) is not bytes
            or (key is not None and type(key) is not bytes)
            or type(headers) is not dict
            or (
                headers and not all(type(k) is str and type(v) is bytes for k, v in headers.items())
            )
        ):
            raise malformed(f"record {_short(seq)} has a field of the wrong type")
        if seq <= previous:
            raise malformed(f"RECORDS out of order: seq {seq} after {previous}")
        previous = seq
        append(make(item))
    if previous > MAX_SEQ:
        raise malformed(f"seq {previous} is beyond the largest seq")
    return tuple(records)


def _decode_stream_list(items: Any) -> StreamList:
    if type(items) is not list:
        raise malformed("STREAM_LIST must carry an array")
    streams = []
    for item in items:
        if not (
            type(item) is list
            and len(item) == 3
            and is_str(item[0])
            and is_uint(item[1])
            and is_uint(item[2])
        ):
            raise malformed("a STREAM_LIST entry must be [name, head, low]")
        streams.append(StreamInfo(*item))
    return StreamList(tuple(streams))


def _decode_record_rows(items: Any) -> RecordRows:
    """Check only what the connection state needs: the first and last record's seq."""
    if type(items) is not list:
        raise malformed("RECORDS must carry an array of records")
    for row in (items[0], items[-1]) if items else ():
        if not (type(row) is list and len(row) == 5 and is_uint(row[0]) and row[0] >= 1):
            raise malformed("a record must be an array of 5 elements, starting with its seq")
    return RecordRows(items)


_RECORDS = MessageType.RECORDS.value
_LARGE_BODY = 16 * 1024  # decoding this many bytes makes hundreds of Python objects or more


def decode_message(body: bytes, *, raw_records: bool = False, columnar: bool = False) -> Message:
    """Parse and validate one frame body; raises ``RemoteProtocolError``.

    With ``raw_records``, RECORDS decode to ``RecordRows`` instead of ``Records``; with
    ``columnar`` too, to ``RecordColumns`` where the compiled decoder takes them.
    """
    if columnar and raw_records:
        decoded = decode_columns(body)
        if decoded is not None:
            columns, rest = decoded
            return _decode_records_message([columns, *rest], raw_records)
    elif not raw_records:
        fields = decode_records(body)
        if fields is not None:
            return _decode_records_message(fields, raw_records)
    try:
        if len(body) < _LARGE_BODY:
            return _decode_message(body, raw_records)
        with collector_paused():
            return _decode_message(body, raw_records)
    except RecursionError:  # a deeply nested value where a scalar belongs
        raise malformed("frame body is nested too deeply") from None


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, unless it was off already.

    Decoding a frame of records makes a few Python objects per record, none of which can
    be in a cycle, and the collector would scan each of them again and again while they
    are made, promoting them to older generations whose full collections then scan every
    object of the process (measured: it nearly doubled the CPU per record of a consumer,
    and of a Spark executor). Reference counting still frees what the block drops.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _decode_message(body: bytes, raw_records: bool) -> Message:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for bad input
        raise malformed(f"frame body is not valid msgpack: {exc}") from None
    if type(obj) is not list or not obj or type(obj[0]) is not int:
        raise malformed("frame body must be an array starting with a message type")
    if obj[0] == _RECORDS:  # the consumer's hot path: no enum lookup on the way
        return _decode_records_message(obj[1:], raw_records)
    try:
        cls = MESSAGE_CLASSES[MessageType(obj[0])]
    except ValueError:
        raise malformed(f"unknown message type {obj[0]}") from None
    args = obj[1:]
    if cls is StreamList:
        if len(args) != 1:
            raise malformed(f"{cls.TYPE.name} takes 1 field, got {len(args)}")
        return _decode_stream_list(args[0])
    if cls in (ClientHello, ServerHello) and args and not is_version(args[0]):
        # "Handshake", version check: anything but the integer 1 first (1.0 and true
        # too) is another version, whatever follows, since other fields may differ there.
        raise RemoteProtocolError(
            f"peer speaks protocol version {_short(args[0])}, this side speaks {PROTOCOL_VERSION}",
            ErrorCode.VERSION_MISMATCH,
        )
    checks = FIELD_CHECKS[cls]
    optional = OPTIONAL_FIELDS.get(cls, 0)
    if not len(checks) - optional <= len(args) <= len(checks):
        expected = f"{len(checks) - optional} to {len(checks)}" if optional else len(checks)
        raise malformed(f"{cls.TYPE.name} takes {expected} fields, got {len(args)}")
    for name, check, value in zip(FIELD_NAMES[cls], checks, args, strict=False):
        if not check(value):
            raise malformed(f"{cls.TYPE.name}.{name} has an invalid value: {_short(value)}")
    if cls in (Subscribe, GetRange):
        # ``seen_epoch`` may be nil only to reach the filter after it.
        if len(args) == len(checks):
            args[-1] = _decode_filter(args[-1])
        elif len(args) == len(checks) - 1 and args[-1] is None:
            raise malformed(f"{cls.TYPE.name}.seen_epoch is nil with no filter after it")
    message: Message = cls(*args)  # omitted trailing fields take their default, nil
    return message


def _decode_records_message(args: list[Any], raw_records: bool) -> RecordsMessage:
    """[records, epoch?, through?]: ``epoch`` may be nil only when ``through`` follows."""
    count = len(args)
    if not 1 <= count <= 3:
        raise malformed(f"RECORDS takes 1 to 3 fields, got {count}")
    epoch = args[1] if count >= 2 else None
    through = args[2] if count == 3 else None
    if count >= 2 and not (is_uint(epoch) or (epoch is None and count == 3)):
        raise malformed(f"RECORDS.epoch has an invalid value: {_short(epoch)}")
    if count == 3 and not is_uint(through):
        raise malformed(f"RECORDS.through has an invalid value: {_short(through)}")
    records = args[0]
    message: RecordsMessage
    if type(records) is tuple:  # checked already, by the compiled decoder
        message = Records(records, epoch, through)
    elif isinstance(records, ColumnBuffers):
        message = RecordColumns(records, epoch, through)
    elif raw_records:
        message = RecordRows(_decode_record_rows(records).rows, epoch, through)
    else:
        message = Records(_decode_records(records), epoch, through)
    if through is not None:
        seqs = first_and_last_seq(message)
        if seqs is not None and through < seqs[1]:
            raise malformed(f"RECORDS.through {through} is before the frame's last seq {seqs[1]}")
    return message


def _decode_filter(wire: Any) -> Filter:
    try:
        return Filter.from_wire(wire)
    except FilterError as exc:
        raise malformed(f"invalid filter: {exc}") from None


class FrameDecoder:
    """Splits a byte stream into frame bodies, checking each length before buffering it."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()
        self._pos = 0

    def feed(self, data: bytes | memoryview) -> None:
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as frames."""
        return len(self._buffer) - self._pos

    def next_frame(self) -> bytes | None:
        """The next complete frame body, or None until more data arrives."""
        buffer, pos = self._buffer, self._pos
        if len(buffer) - pos >= FRAME_HEADER.size:
            (size,) = FRAME_HEADER.unpack_from(buffer, pos)
            if size > self.max_frame_size:
                raise RemoteProtocolError(
                    f"frame of {size} bytes exceeds the limit of {self.max_frame_size}",
                    ErrorCode.FRAME_TOO_LARGE,
                )
            if size == 0:
                raise malformed("empty frame")
            end = pos + FRAME_HEADER.size + size
            if len(buffer) >= end:
                self._pos = end
                with memoryview(buffer) as view:  # one copy, not a slice's two
                    return view[pos + FRAME_HEADER.size : end].tobytes()
        if pos:
            del buffer[:pos]
            self._pos = 0
        return None
